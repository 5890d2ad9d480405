"""Model families over the paged KV pool (`llama.py`, `gemma.py`, `phi3.py`), looked up by architecture in `registry.py`."""
