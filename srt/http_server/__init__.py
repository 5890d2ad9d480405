"""The HTTP process: the FastAPI routes (OpenAI and native), the TokenizerManager and per-request state."""
