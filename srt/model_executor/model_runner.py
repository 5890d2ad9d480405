"""ModelRunner: loads the weights, sizes and allocates the KV pools, and runs one forward step.

It does not know who schedules it (no imports from srt.scheduler): the caller builds a `ForwardBatch`, having
already written this step's KV slots into `req_to_token`, and gets back fp32 logits of the last new token
of each sequence (or of the rows `ForwardBatch.logit_rows` names: a speculative verify step's every row).

With tensor parallelism each rank runs its own ModelRunner over its share of the heads and of the MLP; its
KV pool holds only its KV heads. Every rank must be given the same batches in the same order (the
collectives inside `forward` pair up across ranks), and all ranks agree on one KV capacity, so the same
scheduling decisions fit on every rank.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from srt.engine_options import MIN_KV_TOKENS
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from srt.model_executor.attention.base import KVLayout
from srt.model_executor.attention.registry import backend_class, resolve_backend_name
from srt.model_executor.cuda_graph_runner import CudaGraphRunner
from srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    FreshTensors,
    PromptLogprobs,
    last_token_rows,
    lay_out,
)
from srt.model_executor.int8_startup import Int8Startup
from srt.model_executor.layers.linear_method import CPU_KERNEL_QUANTIZATIONS, LayerMethods
from srt.model_executor.model_loader import open_checkpoint
from srt.model_executor.models.cpu_decode import EXTEND_MAX_TOKENS
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.runner_config import RunnerConfig
from srt.model_executor.runner_setup import (
    available_memory_bytes,
    check_tp_divides,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from srt.model_source import resolve_model_path

logger = logging.getLogger(__name__)

# Largest decode batch by default: beyond this the CPU's step time grows linearly with the batch, so more
# concurrent requests only add latency; on a GPU it bounds the req_to_token table (rows x context_len).
DEFAULT_MAX_RUNNING_REQUESTS = 256
# Every running request holds at least two KV slots (one prompt token and one generated token), so more
# running requests than capacity / 2 could never be resident at once.
MIN_KV_SLOTS_PER_REQUEST = 2
# Extra req_to_token rows beyond max_running_requests: a chunked-prefill request and requests finishing in
# the same step hold a row while the running batch is full.
REQ_POOL_HEADROOM = 4
# The KV pool never exceeds this many full-length contexts: a memory fraction of a large host would
# otherwise allocate (and zero) gigabytes no batch this runner serves can fill.
MAX_CONTEXTS_IN_KV_POOL = 64
# Prompt-logprob rows go through the LM head this many at a time, so a step's transient memory for them does
# not grow with the prompt or the number of requests asking. A block's fp32 scores are 64 x vocab x 4 bytes;
# the int8 head's integer products and the log-softmax hold at most five such tensors at once: 1,280 x vocab
# bytes, 60 MiB for SmolLM2's 49,152 tokens (157 MiB for Llama 3's 128,256). The scheduler's heap, which keeps
# what it frees, grew by 77-110 MiB scoring 2,048 rows at 64 a block (255-299 MiB at 256, 1,167 MiB at once).
# On the 2-core CPU the int8 head is faster at 64 rows than at 256 (1.7 vs 2.3 s for 2,048 rows); the fp32
# head, which rereads its weight for each block, is slower (4.6 vs 2.9 s).
PROMPT_LOGPROB_BLOCK_ROWS = 64
# Default --mem-fraction-static by device type: a CPU host's memory is shared with everything else on it; a
# GPU's free memory is this server's, less room for activations, logits and the decode CUDA graphs.
DEFAULT_MEM_FRACTION_STATIC = {"cpu": 0.1, "cuda": 0.8}


class ModelRunner:
    """One rank's model, KV pools and attention backend, built from a RunnerConfig in stages (`__init__`)."""

    def __init__(self, config: RunnerConfig | str, **fields):
        """`ModelRunner(path, **fields)` is short for `ModelRunner(RunnerConfig(path, **fields))`, the tests'
        and scripts' spelling; a server maps its flags once (`runner_builder.runner_config`). The stages run
        in order, each reading the config and what the stages before it set."""
        base = config if isinstance(config, RunnerConfig) else RunnerConfig(model_dir=config)
        self.config = replace(base, **fields)
        checkpoint = self._open_checkpoint()
        int8 = self._load_model(checkpoint)
        self._allocate_pools()
        self._attach_attention_backend()
        self.cuda_graph = self._capture_cuda_graphs(self.config.cuda_graph_max_bs)
        if int8 is not None:
            int8.install(self.model)
        self.model.ready()
        self._log_ready()

    def _open_checkpoint(self):
        """Seed and threads, the device and dtype, the checkpoint with the quantization it runs under, and the
        tensor-parallel group (after checking this model splits over it)."""
        config = self.config
        torch.manual_seed(config.random_seed)
        # on a CPU this machine's ranks share its cores: oversubscribed threads would only contend
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // config.local_tp_size))
        path = resolve_model_path(config.model_dir)
        self.device = resolve_device(
            config.device, config.local_tp_rank, config.local_tp_size, config.dp_rank
        )
        self.dtype = resolve_dtype(config.dtype, self.device)
        checkpoint, self.quantization = open_checkpoint(path, config.quantization, self.device)
        self.model_dir = checkpoint.path
        self.hf_config = checkpoint.hf_config
        check_tp_divides(self.hf_config, config.tp_size)
        self.tp = TensorParallelGroup.create(
            config.tp_rank,
            config.tp_size,
            config.dist_init_method,
            self.device,
            config.dist_timeout,
            ranks_per_node=config.local_tp_size,
        )
        self.context_len = config.context_length or self.hf_config.max_position_embeddings
        self.vocab_size = self.hf_config.vocab_size
        self.eos_token_ids = checkpoint.eos_token_ids
        return checkpoint

    def _load_model(self, checkpoint) -> Int8Startup | None:
        """The model with its weights, its layers' methods wrapped for LoRA; under w8a8_int8 the int8 start
        (`Int8Startup`), whose cached weights spare reading the fp32 ones, for installing once the pools exist."""
        start = time.monotonic()
        max_positions = max(self.context_len, self.hf_config.max_position_embeddings)
        if self.quantization in CPU_KERNEL_QUANTIZATIONS and self.dtype != torch.float32:
            raise ValueError(f"--quantization {self.quantization} needs --dtype float32 (auto on the CPU)")
        self.layer_methods = LayerMethods.for_run(self.quantization, self.device)
        int8 = Int8Startup(self.model_dir, self.device, self.tp) if self.quantization == "w8a8_int8" else None
        self.model = checkpoint.load_model(
            max_positions,
            self.dtype,
            self.device,
            self.tp,
            self.layer_methods,
            skip=None if int8 is None else int8.skip_cached,
        )
        if int8 is not None:
            int8.after_load(self.model)
        self.load_weights_seconds = time.monotonic() - start
        # wraps the layers' methods before int8 installs its weights through them
        lora = self.config.lora
        self.lora = None if lora is None else lora.build(self.model, self.tp, self.dtype, self.device)
        return int8

    def _allocate_pools(self) -> None:
        """The KV capacity every rank agrees on, the running-request bound, the request-to-token table and
        the KV pool."""
        config, layout = self.config, self.model.kv_layout
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.quantization, self.device, self.dtype
        )
        self.max_total_num_tokens = self.tp.min_across_ranks(
            self._kv_capacity(layout, config.max_total_tokens, config.mem_fraction_static)
        )
        self.max_running_requests = config.max_running_requests or min(
            DEFAULT_MAX_RUNNING_REQUESTS, max(1, self.max_total_num_tokens // MIN_KV_SLOTS_PER_REQUEST)
        )
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + REQ_POOL_HEADROOM, self.context_len, device=self.device
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            self.max_total_num_tokens, device=self.device
        )
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens,
            self.kv_cache_dtype,
            layout.num_kv_heads,
            layout.head_dim,
            layout.num_layers,
            device=self.device,
        )

    def _attach_attention_backend(self) -> None:
        """The attention backend over the pools, refused in one line if it cannot run a layer of this model."""
        layout = self.model.kv_layout
        self.attention_backend_name = resolve_backend_name(self.config.attention_backend, self.device)
        self.model.attn_backend = backend_class(self.attention_backend_name)(
            self.req_to_token_pool,
            self.token_to_kv_pool,
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
            self.device,
            cpu_kernels=self.layer_methods.cpu_kernels,
        )
        for layer in self.model.attention_layers():
            reason = self.model.attn_backend.unsupported(layer)
            if reason is not None:
                raise ValueError(
                    f"attention backend {self.attention_backend_name!r} cannot run layer {layer.layer_id} of this "
                    f"model ({reason}); choose another --attention-backend"
                )

    def _log_ready(self) -> None:
        cpu_kernels = self.layer_methods.cpu_kernels
        logger.info(
            "model ready: %s (tp rank %d of %d) on %s/%s in %.2f s; KV capacity %d tokens, "
            "max running requests %d, context %d, attention %s, quantization %s, KV cache %s, "
            "fused CPU kernels %s, decode CUDA graphs %s",
            self.hf_config.architectures,
            self.tp.rank,
            self.tp.size,
            self.device,
            self.dtype,
            self.load_weights_seconds,
            self.max_total_num_tokens,
            self.max_running_requests,
            self.context_len,
            self.attention_backend_name,
            self.quantization,
            str(self.kv_cache_dtype).removeprefix("torch."),
            "off" if cpu_kernels is None else cpu_kernels.isa,
            f"up to batch {self.decode_graph_max_bs}" if self.decode_graph_max_bs else "off",
        )

    def _capture_cuda_graphs(self, max_bs: int) -> CudaGraphRunner | None:
        if max_bs <= 0 or not self.device.startswith("cuda"):
            return None
        refusal = self.decode_graph_refusal()
        if refusal is not None:
            logger.info("decode CUDA graphs are off: %s", refusal)
            return None
        return CudaGraphRunner(self._forward_eager, self.device, min(max_bs, self.max_running_requests))

    @property
    def decode_graph_max_bs(self) -> int:
        """The largest decode batch replayed from a CUDA graph (0: every step runs eagerly)."""
        return self.cuda_graph.max_bs if self.cuda_graph is not None else 0

    @property
    def verify_max_tokens(self) -> int:
        """The most tokens one step may feed at about a decode step's cost (0: no bound of its own, an eager
        GPU step): what the fused CPU step takes, or the largest decode graph, whose replay a speculative
        verify step's rows take. The scheduler's verify budget reads it (`spec_step.verify_step_tokens`)."""
        return EXTEND_MAX_TOKENS if self.device.startswith("cpu") else self.decode_graph_max_bs

    def decode_graph_refusal(self) -> str | None:
        """Why this runner's decode steps cannot be recorded in CUDA graphs, whatever its device (None: they
        can). A layer that reads device data on the host says why in its `HOST_SYNC_REASON`."""
        if self.tp.size > 1:
            return "tensor parallelism (capturing its all-reduces is untested)"
        host_syncs = sorted(
            {m.HOST_SYNC_REASON for m in self.model.modules() if hasattr(m, "HOST_SYNC_REASON")}
        )
        if host_syncs:
            return "; ".join(host_syncs)
        if not getattr(self.model.attn_backend, "cuda_graph_safe_decode", False):
            return f"attention backend {self.attention_backend_name} reads host data in decode"
        return None

    def _kv_capacity(self, layout: KVLayout, max_total_tokens: int | None, mem_fraction_static: float) -> int:
        if max_total_tokens is not None:
            return max_total_tokens
        per_token = MHATokenToKVPool.bytes_per_token(
            self.kv_cache_dtype, layout.num_kv_heads, layout.head_dim, layout.num_layers
        )
        if mem_fraction_static is None:
            device_type = torch.device(self.device).type
            mem_fraction_static = DEFAULT_MEM_FRACTION_STATIC.get(
                device_type, DEFAULT_MEM_FRACTION_STATIC["cpu"]
            )
        budget = int(available_memory_bytes(self.device) * mem_fraction_static)
        if not self.device.startswith("cuda"):
            budget //= self.tp.size  # the ranks share the host's memory; each GPU rank has its own
        capacity = min(budget // per_token, MAX_CONTEXTS_IN_KV_POOL * self.context_len)
        if capacity < MIN_KV_TOKENS:
            raise RuntimeError(
                f"KV pool would hold only {capacity} tokens ({budget} bytes at {per_token} bytes/token); "
                "raise --mem-fraction-static or set --max-total-tokens"
            )
        return capacity

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [batch_size, vocab] of each sequence's last token in this step, or [rows, vocab] of
        the rows `batch.logit_rows` names. Returns once the step has run on the device, so the caller's
        clock around it measures the step (the metrics' forward time), not the launch."""
        if self.cuda_graph is not None and not batch.has_adapters and self.cuda_graph.can_run(batch):
            logits = self.cuda_graph.replay(batch)
        else:
            logits = self._forward_eager(batch)
        self.synchronize()
        return logits

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """The step itself, launched kernel by kernel (also what the decode CUDA graphs record)."""
        self._begin_step(batch)
        if batch.logit_rows is None:
            return self.model(batch.input_ids, batch.positions, batch)
        hidden = self.model.hidden_states(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[batch.logit_rows])

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """An extend step's final hidden states [tokens, hidden] (fp32, after the final norm) instead of logits:
        an embedding server (--is-embedding) pools them, and its head never runs."""
        self._begin_step(batch)
        hidden = self.model.hidden_states(batch.input_ids, batch.positions, batch)
        hidden = self.model.final_hidden_states(hidden)
        self.synchronize()
        return hidden

    def _begin_step(self, batch: ForwardBatch) -> None:
        """What the attention backend and the adapted layers derive from the batch, once per step."""
        self.model.attn_backend.init_forward_metadata(batch)
        if self.lora is not None:
            self.lora.begin_step(batch)

    def synchronize(self) -> None:
        """Wait for the device's queued work (a no-op on the CPU, whose kernels run as they are called)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward_windows(
        self, ids: list[int], window: int, adapter: str | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Teacher-forced forward over a long token list (int8 calibration, scripts/eval_quality.py): (fp32
        logits at every position, the window's token ids) for consecutive windows of `ids`, each run as a
        fresh sequence (one extend step, nothing cached) through the runner's own pools; with `adapter`, a
        loaded LoRA adapter's name, through it."""
        model = self.model
        for start in range(0, len(ids), window):
            chunk = ids[start : start + window]
            n = len(chunk)
            slots = self.token_to_kv_pool_allocator.alloc(n)
            rows = self.req_to_token_pool.alloc(1)
            if slots is None or rows is None:
                raise RuntimeError(f"the KV pool cannot hold a {n}-token window")
            row = rows[0]
            try:
                batch = lay_out(
                    ForwardMode.EXTEND,
                    self.req_to_token_pool,
                    [row],
                    [0],
                    chunk,
                    [n],
                    slots,
                    FreshTensors(self.device),
                    lora_slots=None if adapter is None else self.lora.prepare_step([adapter]),
                )
                self._begin_step(batch)
                hidden = model.hidden_states(batch.input_ids, batch.positions, batch)
                yield model.compute_logits(hidden), torch.tensor(chunk, dtype=torch.int64)
            finally:
                self.token_to_kv_pool_allocator.free(slots)
                self.req_to_token_pool.free(row)

    def forward_with_prompt_logprobs(self, batch: ForwardBatch) -> tuple[torch.Tensor, PromptLogprobs]:
        """`forward`'s logits plus the log-probabilities at `batch.logprob_rows` (an extend batch whose
        sequences ask for prompt logprobs; the model's raw distribution, before any sampling parameter).
        The rows are scored PROMPT_LOGPROB_BLOCK_ROWS at a time and only each block's chosen-token and top-k
        values kept, so however long the prompt, one block's full-vocabulary scores are alive at a time."""
        self._begin_step(batch)
        hidden = self.model.hidden_states(batch.input_ids, batch.positions, batch)
        logits = self.model.compute_logits(hidden[last_token_rows(batch.new_token_counts(), hidden.device)])
        rows, k = batch.logprob_rows.to(hidden.device), batch.logprob_top_k
        targets = batch.logprob_targets.to(hidden.device).unsqueeze(1)
        n, device = rows.numel(), hidden.device
        # Allocated before the blocks and filled in place: results appended block by block settle in the holes
        # the freed blocks leave, and the scheduler's heap, which never shrinks (CHILD_MALLOC_ENV), grew with
        # the number of blocks (282-789 MiB over 32 blocks of 64 rows, against 89-101 MiB filled in place).
        scores = PromptLogprobs(
            torch.empty(n, dtype=torch.float32, device=device),
            torch.empty((n, k), dtype=torch.float32, device=device) if k > 0 else None,
            torch.empty((n, k), dtype=torch.int64, device=device) if k > 0 else None,
        )
        for start in range(0, n, PROMPT_LOGPROB_BLOCK_ROWS):
            block = slice(start, start + PROMPT_LOGPROB_BLOCK_ROWS)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows[block]]), dim=-1)
            torch.gather(logprobs, 1, targets[block], out=scores.token_logprobs[block].unsqueeze(1))
            if k > 0:
                torch.topk(logprobs, k, dim=-1, out=(scores.top_values[block], scores.top_indices[block]))
            del logprobs  # before the next block's head call, not after it
        self.synchronize()
        return logits, scores
