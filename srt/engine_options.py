"""The names of the engine's options, torch-free, read both by the CLI (`server_args.py`, in the HTTP
process, which never loads torch) and by the model runner that acts on them: each is defined here once.

The runner maps each name to what it means (a torch dtype, a backend class, a weight format); the CLI offers
the names as flag choices.
"""

from __future__ import annotations

from urllib.parse import urlsplit

# --dtype, besides "auto" (float32 on a CPU, bfloat16 on CUDA): torch dtype names
DTYPE_NAMES = ("float32", "bfloat16", "float16")
AUTO = "auto"
# --kv-cache-dtype: "auto" is float16 for the int8 model on srt's CPU kernels, else the model's dtype
KV_CACHE_DTYPES = (AUTO, "float32", "float16")
# --quantization: "none" serves the checkpoint's weights; w8a8_int8 is the CPU default for a Hugging Face
# checkpoint; a GGUF runs gguf (the file's own blocks) or gguf_int8 (int8 weights made from its blocks at
# load), chosen by the file's size unless given (quantization.py, gguf_int8.py)
QUANTIZATIONS = ("none", "w8a8_int8", "gguf", "gguf_int8")
# --attention-backend: each name's class is in srt/model_executor/attention/registry.py
ATTENTION_BACKENDS = ("torch_native", "flashinfer", "triton")
# The smallest KV pool (tokens) a server can run with: --max-total-tokens below it is a flag error
MIN_KV_TOKENS = 16
# Longest one tensor-parallel rank waits for the others in a collective, the start-up rendezvous included
# (--dist-timeout's default, SGLang's name). The ranks step in lockstep and rank 0 sends an idle heartbeat
# every second, so a healthy wait is a loading-time skew or one step's skew; past this a rank (or a whole
# node) is gone, and failing beats waiting for ever.
DIST_TIMEOUT_SECONDS = 120


def tcp_host_port(address: str) -> tuple[str, int]:
    """(host, port) of `HOST:PORT` or `tcp://HOST:PORT` (an IPv6 host in brackets); ValueError otherwise."""
    url = urlsplit(address if "://" in address else f"tcp://{address}")
    if url.scheme != "tcp" or not url.hostname or url.path or url.query or not url.port:  # .port may raise
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {address!r}")
    return url.hostname, url.port
