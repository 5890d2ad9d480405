"""srt: an SGLang-style LLM serving runtime whose metrics tell the truth."""

__version__ = "0.1.0"
