"""RunnerConfig: everything a ModelRunner is built from, in one frozen record.

A server builds it once per rank from its flags (`srt.scheduler.runner_builder.runner_config`); a speculative
draft model, the tests and the scripts build theirs directly. The runner reads its construction inputs from
this record and nowhere else, so a new input is one field here and one line where the flags map onto it.
Torch-free: the launcher that maps the flags need not load the runtime to do it.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.engine_options import DIST_TIMEOUT_SECONDS
from srt.model_executor.adapters import AdapterPoolConfig


@dataclass(frozen=True)
class RunnerConfig:
    """`model_dir`: a local checkpoint or a source `srt.model_source` resolves. `dtype`, `device`,
    `kv_cache_dtype`: "auto" lets the device decide (`runner_setup`). `max_total_tokens`: the KV capacity in
    tokens (None: from `mem_fraction_static` of the free memory, None: the device's default fraction).
    `max_running_requests` (None: from the capacity), `context_length` (None: the model's), `attention_backend`
    (None: the device's default). `quantization`: a linear method's name, None for the device's default.
    `cuda_graph_max_bs`: record decode CUDA graphs up to this batch size (0: none; CUDA only, with a backend
    whose decode is graph-safe, without tensor parallelism). `lora`: serve LoRA adapters (a `LoRAConfig`;
    None: the base model alone). `tp_rank` of `tp_size` ranks over `nnodes` machines, each hosting
    tp_size / nnodes consecutive ranks, meeting at `dist_init_method`; `dist_timeout` bounds the rendezvous
    and every collective.
    `dp_rank`: the data-parallel replica, which picks the GPU."""

    model_dir: str
    dtype: str = "auto"
    device: str = "auto"
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    context_length: int | None = None
    attention_backend: str | None = None
    random_seed: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    dist_init_method: str | None = None
    quantization: str | None = "none"
    kv_cache_dtype: str = "auto"
    cuda_graph_max_bs: int = 0
    dp_rank: int = 0
    lora: AdapterPoolConfig | None = None
    nnodes: int = 1
    dist_timeout: float = DIST_TIMEOUT_SECONDS

    @property
    def local_tp_size(self) -> int:
        """The tensor-parallel ranks on this machine."""
        return self.tp_size // self.nnodes

    @property
    def local_tp_rank(self) -> int:
        """This rank's index among the ranks on its machine (which of its GPUs it takes)."""
        return self.tp_rank % self.local_tp_size
