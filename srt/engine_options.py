"""The names of the engine's options, torch-free, read both by the CLI (`server_args.py`, in the HTTP
process, which never loads torch) and by the model runner that acts on them: each is defined here once.

The runner maps each name to what it means (a torch dtype, a backend class, a weight format); the CLI offers
the names as flag choices.
"""

from __future__ import annotations

# --dtype, besides "auto" (float32 on a CPU, bfloat16 on CUDA): torch dtype names
DTYPE_NAMES = ("float32", "bfloat16", "float16")
AUTO = "auto"
# --kv-cache-dtype: "auto" is float16 for the int8 model on srt's CPU kernels, else the model's dtype
KV_CACHE_DTYPES = (AUTO, "float32", "float16")
# --quantization: "none" serves the checkpoint's weights; w8a8_int8 is the CPU default (quantization.py)
QUANTIZATIONS = ("none", "w8a8_int8")
# --attention-backend: each name's class is in srt/model_executor/attention/registry.py
ATTENTION_BACKENDS = ("torch_native", "flashinfer", "triton")
# The smallest KV pool (tokens) a server can run with: --max-total-tokens below it is a flag error
MIN_KV_TOKENS = 16
