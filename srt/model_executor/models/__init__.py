"""Model families over the paged KV pool (`llama.py`, `gemma.py`, `phi3.py`), looked up by architecture in `registry.py`."""


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something srt does not run (a RoPE type, an activation, an architecture). A
    ValueError, so that start-up reports it in one line as a configuration the user changes (exit 2), like a
    bad flag: the fix is another model, not a bug report."""
