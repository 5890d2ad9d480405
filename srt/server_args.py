"""`ServerArgs`: the only source of defaults. Every CLI flag is generated from a field of it, validated once,
and never mutated after start-up. Its validation rules live in `server_args_check.py`, the flags' parser is
built from its fields in `server_args_cli.py`, the IPC endpoints in `port_args.py`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from srt.constrained import DEFAULT_GRAMMAR_BACKEND, DEFAULT_GRAMMAR_COMPILE_TIMEOUT, GRAMMAR_BACKENDS
from srt.engine_options import (
    ATTENTION_BACKENDS,
    AUTO,
    DIST_TIMEOUT_SECONDS,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
)
from srt.function_call import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS
from srt.lora.config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS_PER_BATCH,
    LORA_BACKENDS,
    LORA_TARGET_MODULES,
)
from srt.model_source import EMBEDDED_MODELS, embedded_model_name
from srt.reasoning.parser import REASONING_FIELD_BOTH, REASONING_FIELDS, REASONING_FORMATS
from srt.server_args_check import problems
from srt.server_args_cli import add_flags, from_namespace, parse_flags
from srt.speculative.defaults import (
    NGRAM_MAX_MATCH_WINDOW_SIZE,
    NGRAM_MIN_MATCH_WINDOW_SIZE,
    NUM_DRAFT_TOKENS,
    PER_REQUEST_SPEC_METRICS,
    SPECULATIVE_ALGORITHMS,
    drafts_per_step,
)

SCHEDULE_POLICIES = ("fcfs", "lpm")
# --pooling-type: an embedding server's vector is its prompt's last token's final hidden state (vLLM's default
# for decoder checkpoints, what gte-Qwen2 and e5-mistral were trained with) or the mean over every prompt token
POOLING_LAST, POOLING_MEAN = "last", "mean"
POOLING_TYPES = (POOLING_LAST, POOLING_MEAN)
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
LOG_LEVELS = ("debug", "info", "warning", "error")
DTYPES = (AUTO, *DTYPE_NAMES)
MIB = 1 << 20


def _f(default, help: str, **meta):
    """A dataclass field whose metadata becomes the argparse help (and choices, when given)."""
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class ServerArgs:
    # Model
    model_path: str | None = _f(
        None,
        "HF model directory, .gguf file or embedded model name (smollm2-135m-instruct, gemma3-270m); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    tokenizer_path: str | None = _f(None, "tokenizer directory; default: the model's")
    served_model_name: str | None = _f(None, "name reported in /v1/models and the model_name metric label")
    dtype: str = _f(
        "auto", "weight/activation dtype; auto = float32 on CPU, bfloat16 on CUDA", choices=DTYPES
    )
    context_length: int | None = _f(None, "override the model's maximum context length")
    device: str = _f("auto", "cpu, cuda or auto")
    random_seed: int = _f(0, "seed for sampling of requests without their own seed")
    # Embeddings (docs/embeddings.md)
    is_embedding: bool = _f(
        False,
        "serve the checkpoint as an embedding model: POST /v1/embeddings answers, the generation routes are "
        "a 400; quantization defaults to none",
    )
    pooling_type: str = _f(
        POOLING_LAST,
        "with --is-embedding, how a prompt's final hidden states become its vector: the last token's, or the "
        "mean of all; L2-normalized either way",
        choices=POOLING_TYPES,
    )
    # HTTP
    host: str = _f("127.0.0.1", "address the HTTP server binds")
    port: int = _f(30000, "HTTP port")
    api_key: str | None = _f(
        None, "require 'Authorization: Bearer <key>' on every route but /health and /metrics"
    )
    # A body is parsed and validated on the event loop (JSON decoding holds the GIL, so no thread helps):
    # about 0.1-0.2 s per MiB of token ids here, a stall every other request shares. 8 MiB still takes a whole
    # 1M-token context as JSON token ids (~8 bytes per token); raise it only for longer contexts.
    max_request_bytes: int = _f(8 * MIB, "largest request body accepted; larger ones get 413")
    # Each in-flight request holds a connection (a file descriptor) and its per-request state; 4,096 is 16x
    # the default number of requests the scheduler runs at once, so queueing still absorbs bursts.
    max_concurrent_requests: int = _f(
        4096, "most HTTP requests in flight; more get 503 (/health and /metrics always answer)"
    )
    # Kubernetes SIGKILLs a pod 30 s after SIGTERM by default: 20 s of draining leaves time to fail the rest
    # cleanly and stop the children before that.
    graceful_shutdown_timeout: float = _f(
        20.0, "seconds in-flight requests may run on after SIGTERM/SIGINT before they are failed (503)"
    )
    # Scheduling and memory
    max_running_requests: int | None = _f(
        None, "most requests decoded at once; default derived from the KV pool"
    )
    max_total_tokens: int | None = _f(
        None, "KV pool capacity in tokens; default derived from --mem-fraction-static"
    )
    mem_fraction_static: float | None = _f(
        None,
        "fraction of the memory free after loading the weights given to the KV pool when --max-total-tokens "
        "is unset; default 0.1 of MemAvailable on CPU, 0.8 of free GPU memory on CUDA",
    )
    max_prefill_tokens: int = _f(8192, "token budget of one prefill batch")
    chunked_prefill_size: int = _f(2048, "longest prompt piece prefilled in one step; -1 disables chunking")
    schedule_policy: str = _f("fcfs", "order of the waiting queue", choices=SCHEDULE_POLICIES)
    disable_radix_cache: bool = _f(False, "never share prompt prefixes between requests")
    stream_interval: int = _f(
        1, "send streamed tokens every N decode steps (the first token is always sent at once)"
    )
    attention_backend: str | None = _f(
        None,
        "default: triton on CUDA, else torch_native (flashinfer: opt-in, bf16/fp16, no decode graphs)",
        choices=ATTENTION_BACKENDS,
    )
    tp_size: int = _f(1, "tensor parallel ranks")
    dp_size: int = _f(1, "data parallel scheduler replicas")
    load_balance_method: str = _f(
        "round_robin", "how requests are routed to data parallel replicas", choices=LOAD_BALANCE_METHODS
    )
    # Multi-node tensor parallelism (docs/multinode.md): every node runs the same command but --node-rank
    nnodes: int = _f(1, "machines the --tp-size ranks span (each hosts tp-size / nnodes of them)")
    node_rank: int = _f(
        0,
        "this machine's index in 0..nnodes-1: node 0 serves the HTTP API; the others run their ranks "
        "headless and serve only /health and /metrics on --port",
    )
    dist_init_addr: str | None = _f(
        None,
        "HOST:PORT of node 0's tensor-parallel rendezvous, reachable from every node (--nnodes > 1); "
        "data-parallel replica d meets at PORT + d",
    )
    dist_timeout: float = _f(
        DIST_TIMEOUT_SECONDS,
        "seconds a rank waits for the others: for every node to join at start, and in any collective while "
        "serving; past it the node that did not answer ends the server",
    )
    grammar_backend: str = _f(
        DEFAULT_GRAMMAR_BACKEND,
        "structured-output library (response_format, regex, ebnf); none refuses constrained requests",
        choices=GRAMMAR_BACKENDS,
    )
    grammar_compile_timeout: float = _f(
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
        "seconds a constraint (response_format, json_schema, regex, ebnf, a forced tool choice) may take to be "
        "compiled and its first token mask computed, in the HTTP process's grammar judge; longer is a 400",
    )
    tool_call_parser: str = _f(
        DEFAULT_TOOL_CALL_PARSER,
        "format of the model's tool calls in /v1/chat/completions: smollm2 (the embedded model's; also reads "
        "hermes blocks), hermes / qwen25 / qwen (Hermes, Qwen 2.5 and Qwen 3)",
        choices=tuple(TOOL_CALL_PARSERS),
    )
    # Reasoning models (docs/reasoning.md)
    reasoning_parser: str | None = _f(
        None,
        "separate a reasoning model's thinking from its answer, by the model's format: qwen3 (the model opens "
        "<think> itself), qwen3-thinking and deepseek-r1 (the chat template opens it in the prompt); default: "
        "the output is all answer",
        choices=tuple(REASONING_FORMATS),
    )
    reasoning_field: str = _f(
        REASONING_FIELD_BOTH,
        "the field(s) chat answers carry the thinking in: both (reasoning_content, as SGLang and DeepSeek name "
        "it, and reasoning, as vLLM and OpenAI's guidance name it), or one of them for clients that refuse "
        "unknown fields",
        choices=REASONING_FIELDS,
    )
    # CPU execution (docs/cpu_execution.md)
    quantization: str | None = _f(
        None,
        "gguf runs a .gguf file's own quantized blocks, nothing converted or calibrated; gguf_int8 runs int8 "
        "weights made from those blocks at load (round-to-nearest per output row, no calibration: faster on "
        "small models); unset, a GGUF on the CPU runs gguf_int8 if it is small and its weights quantized "
        "(the embedded models; the measured rule is in docs/cpu_execution.md), else gguf; w8a8_int8 runs "
        "every linear layer in int8 (per-channel GPTQ "
        "weights, two-level per-token activations; the CPU default for a Hugging Face directory: it passed "
        "the quality gate of scripts/eval_quality.py, see docs/cpu_execution.md); none keeps fp32 (the GPU "
        "default, a GGUF converted once, and the reference srt is tested against transformers with)",
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = _f(
        "auto",
        "dtype of the KV cache; auto = float16 with srt's CPU int8 kernels (half the memory and bandwidth, as "
        "llama.cpp's default), else the model's dtype. float16 with the fp32 model is CPU-only",
        choices=KV_CACHE_DTYPES,
    )
    enable_mixed_chunk: bool = _f(
        False,
        "run a prefill chunk and the running requests' decode tokens in one forward step "
        "(the default on CPU, where scripts/bench_mixed_chunk.py measured it better; off elsewhere)",
    )
    disable_mixed_chunk: bool = _f(False, "never mix prefill and decode in one step (the CPU default mixes)")
    # GPU execution (docs/gpu_execution.md)
    # 160 is SGLang's default on most GPUs: larger decode batches are long enough that launch overhead, what
    # a graph saves, is a small share of the step.
    cuda_graph_max_bs: int = _f(
        160, "largest decode batch replayed from a captured CUDA graph (larger ones run eagerly)"
    )
    disable_cuda_graph: bool = _f(False, "run every decode step eagerly (no CUDA graph capture at start)")
    # Speculative decoding (docs/speculative_decoding.md)
    speculative_algorithm: str | None = _f(
        None,
        "NGRAM drafts each running request's next tokens from its own prompt and output (prompt lookup); "
        "STANDALONE drafts them with a smaller model (--speculative-draft-model-path); default: no speculation",
        choices=SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int | None = _f(
        None,
        "positions a verify step feeds per request, the verified token included (N proposes N - 1 drafts); "
        f"default: {NUM_DRAFT_TOKENS} (SGLang's: the max match window; fewer measured faster on the CPU)",
    )
    speculative_draft_model_path: str | None = _f(
        None,
        "STANDALONE's draft model (a directory, .gguf or embedded model name) sharing the served model's "
        "tokenizer; it runs greedily on its own KV pool in the scheduler process",
    )
    speculative_ngram_min_match_window_size: int = _f(
        NGRAM_MIN_MATCH_WINDOW_SIZE, "shortest suffix of a request's tokens that may anchor an NGRAM lookup"
    )
    speculative_ngram_max_match_window_size: int = _f(
        NGRAM_MAX_MATCH_WINDOW_SIZE, "longest suffix of a request's tokens an NGRAM lookup compares"
    )
    per_request_spec_decode_metrics: str | None = _f(
        None,
        "vLLM's flag: 'summary' adds a top-level `metrics.speculative_decoding` object to each OpenAI "
        "response (acceptance length and rate, histogram, steps, drafted and accepted tokens)",
        choices=PER_REQUEST_SPEC_METRICS,
    )
    # Multi-LoRA (docs/lora.md)
    enable_lora: bool = _f(False, "serve LoRA adapters (implied by --lora-paths / --lora-modules)")
    lora_paths: list[str] | None = _f(
        None,
        'adapters loaded at start: NAME=PATH, PATH (named by its path) or JSON {"lora_name": ..., '
        '"lora_path": ..., "pinned": false}; more later with POST /load_lora_adapter',
        nargs="+",
    )
    lora_modules: list[str] | None = _f(None, "vLLM's name for --lora-paths (NAME=PATH or JSON)", nargs="+")
    max_loras_per_batch: int = _f(
        DEFAULT_MAX_LORAS_PER_BATCH, "adapter slots: the most distinct adapters one forward step serves"
    )
    max_loras: int | None = _f(None, "vLLM's name for --max-loras-per-batch")
    max_loaded_loras: int | None = _f(
        None, "the most adapters held in memory at once (loading one more is refused); default: no limit"
    )
    max_lora_rank: int | None = _f(
        None, f"the largest adapter rank the slots take; default: the start-up adapters' largest, at least "
        f"{DEFAULT_MAX_LORA_RANK}",
    )  # fmt: skip
    lora_target_modules: list[str] | None = _f(
        None,
        f"modules adapters may adapt (of {', '.join(LORA_TARGET_MODULES)}, or all); default: all",
        nargs="+",
    )
    lora_allowed_dirs: list[str] | None = _f(
        None,
        "directories POST /load_lora_adapter may read adapters under (symlinks and .. resolved first); "
        "default: the parent directories of the --lora-paths adapters; none given: runtime loads refused",
        nargs="*",
    )
    lora_backend: str = _f(
        LORA_BACKENDS[0],
        "how adapter products run: torch_native (PyTorch segment matmuls grouped by adapter; srt's C kernel "
        "on the int8 CPU base) or triton (srt's Triton shrink / expand kernels: CUDA, or TRITON_INTERPRET=1)",
        choices=LORA_BACKENDS,
    )  # fmt: skip
    # Observability beyond metrics: request traces, KV cache events, per-request export, custom labels
    enable_trace: bool = _f(False, "export OpenTelemetry request traces (OTLP) at trace level 1")
    otlp_traces_endpoint: str = _f(
        "localhost:4317",
        "OTLP collector host:port; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc (default) or http/protobuf",
    )
    kv_events_config: str | None = _f(
        None,
        'publish KV cache events: JSON such as {"publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv"}',
    )
    export_metrics_to_file: bool = _f(False, "write one JSON line per finished request (hourly files)")
    export_metrics_to_file_dir: str | None = _f(None, "directory of --export-metrics-to-file's files")
    tokenizer_metrics_custom_labels_header: str = _f(
        "x-custom-labels", "request header whose JSON object adds labels to the request-level metrics"
    )
    tokenizer_metrics_allowed_custom_labels: list[str] | None = _f(
        None,
        "label names (and name=value pairs) a custom-labels header may set; others are dropped",
        nargs="+",
    )
    return_timing: bool = _f(
        False, "add per-request timings to every OpenAI response (else only when a body asks: return_timing)"
    )
    # Logging
    log_level: str = _f("info", "logging level", choices=LOG_LEVELS)
    decode_log_interval: int = _f(40, "write a 'Decode batch' log line every N decode steps")
    log_stats_interval: float = _f(10.0, "seconds between summary log lines while not idle")
    # Metrics (on by default: a metric that must be switched on is rarely there when it is needed)
    enable_metrics: bool = _f(
        False, "accepted for SGLang command lines; metrics are on unless --disable-metrics"
    )
    disable_metrics: bool = _f(False, "record nothing; /metrics answers 404")
    bucket_time_to_first_token: list[float] | None = _f(None, "TTFT histogram buckets (seconds)", nargs="+")
    bucket_inter_token_latency: list[float] | None = _f(
        None, "inter-token latency histogram buckets (seconds)", nargs="+"
    )
    bucket_e2e_request_latency: list[float] | None = _f(
        None, "end-to-end latency histogram buckets (seconds)", nargs="+"
    )
    kv_cache_metrics: bool = _f(False, "track KV residency histograms of a sample of radix-cache nodes")
    kv_cache_metrics_sample: float = _f(0.01, "fraction of radix-cache nodes tracked by --kv-cache-metrics")

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Fail at start with one clear line for any combination that cannot work (see `server_args_check`)."""
        found = problems(self)
        if found:
            raise ValueError("; ".join(found))

    @property
    def tp_ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_tp_ranks(self) -> range:
        """The global tensor-parallel ranks this node hosts (node r: r * per-node ... as SGLang lays them)."""
        per_node = self.tp_ranks_per_node
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def headless(self) -> bool:
        """A node other than 0 of a multi-node server: its ranks only, no HTTP API."""
        return self.node_rank > 0

    @property
    def speculative_drafts_per_step(self) -> int:
        """Most drafts a verify step gives one request (0: speculation off)."""
        if self.speculative_algorithm is None:
            return 0
        n = self.speculative_num_draft_tokens or NUM_DRAFT_TOKENS
        return drafts_per_step(n)

    @property
    def quantization_or_default(self) -> str | None:
        """--quantization, else none on an embedding server, else None (the device's default). An embedding is
        compared against the checkpoint's own hidden states: the CPU's int8 default passed a gate on generated
        text (docs/cpu_execution.md), never one on vectors."""
        if self.quantization is None and self.is_embedding:
            return "none"
        return self.quantization

    @property
    def metrics_enabled(self) -> bool:
        return not self.disable_metrics

    @property
    def model_name(self) -> str:
        """The served name: the flag, else the embedded model's name, else the model file or directory name."""
        if self.served_model_name:
            return self.served_model_name
        embedded = embedded_model_name(self.model_path)
        if embedded is not None:
            return EMBEDDED_MODELS[embedded].served_name
        base = os.path.basename(os.path.normpath(self.model_path))
        return base[: -len(".gguf")] if base.endswith(".gguf") else base

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- CLI (built from the fields by server_args_cli) ----
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(cls, parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return from_namespace(cls, args)

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> ServerArgs:
        """The server's command line; a bad flag or combination is argparse's one error line, exit 2."""
        return parse_flags(cls, argv)
