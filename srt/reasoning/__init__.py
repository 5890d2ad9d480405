"""Reasoning models: the thinking before the answer, separated from it (`--reasoning-parser`).

`parser.py` holds the formats (SGLang's names, `REASONING_FORMATS`) and the incremental reader each request's
output goes through in the HTTP process.
"""
