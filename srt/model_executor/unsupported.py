"""The error a checkpoint raises when it asks for something srt does not run. It sits below the layers and the
model families that raise it (rotary embeddings, activations, architectures, GGUF metadata), so no layer imports
upward for it."""


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something srt does not run (a RoPE type, an activation, an architecture). A
    ValueError, so that start-up reports it in one line as a configuration the user changes (exit 2), like a
    bad flag: the fix is another model, not a bug report."""
