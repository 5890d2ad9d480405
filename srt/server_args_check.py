"""What is wrong with a set of server flags, one line per problem. Apart from `server_args.py` so that the
field list and CLI generation read there and the rules (ranges, contradictions, multi-node layout, speculative
decoding) read here as one list; `ServerArgs.check` raises with what `problems` finds.

The functions read a `ServerArgs` by attribute without importing it: `server_args` imports this module, and
the import back would be a cycle. Torch-free, as `server_args` is: both run in the HTTP process."""

from __future__ import annotations

import os

from srt.engine_options import MIN_KV_TOKENS, tcp_host_port
from srt.kv_events.config import parse_kv_events_config
from srt.lora.specs import lora_flag_problems
from srt.metrics.custom_labels import parse_allowed_custom_labels
from srt.model_source import EMBEDDED_MODELS, embedded_model_name
from srt.speculative.defaults import DRAFT_MODEL_ALGORITHM, PER_REQUEST_SPEC_METRICS, SPECULATIVE_ALGORITHMS


def problems(args) -> list[str]:
    """Every combination of `args` (a `ServerArgs`) that cannot work, one clear line each; empty when fine."""
    found = []
    if not (0 < args.port < 65536):
        found.append(f"--port must be in 1..65535, got {args.port}")
    if args.max_request_bytes < 1:
        found.append("--max-request-bytes must be >= 1")
    if args.max_concurrent_requests < 1:
        found.append("--max-concurrent-requests must be >= 1")
    if args.graceful_shutdown_timeout < 0:
        found.append("--graceful-shutdown-timeout must be >= 0 seconds")
    if args.tp_size < 1 or args.dp_size < 1:
        found.append("--tp-size and --dp-size must be >= 1")
    found.extend(multinode_problems(args))
    if args.max_running_requests is not None and args.max_running_requests < 1:
        found.append("--max-running-requests must be >= 1")
    if args.max_total_tokens is not None and args.max_total_tokens < MIN_KV_TOKENS:
        found.append(f"--max-total-tokens must be >= {MIN_KV_TOKENS}")
    if args.mem_fraction_static is not None and not (0 < args.mem_fraction_static < 1):
        found.append("--mem-fraction-static must be in (0, 1)")
    if args.max_prefill_tokens < 1:
        found.append("--max-prefill-tokens must be >= 1")
    if args.cuda_graph_max_bs < 1:
        found.append("--cuda-graph-max-bs must be >= 1")
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        found.append("--chunked-prefill-size must be positive or -1 (disabled)")
    if args.stream_interval < 1 or args.decode_log_interval < 1:
        found.append("--stream-interval and --decode-log-interval must be >= 1")
    if not (args.grammar_compile_timeout > 0):
        found.append("--grammar-compile-timeout must be > 0 seconds")
    if args.log_stats_interval <= 0:
        found.append("--log-stats-interval must be > 0")
    if args.enable_metrics and args.disable_metrics:
        found.append("--enable-metrics and --disable-metrics contradict each other")
    if args.enable_mixed_chunk and args.disable_mixed_chunk:
        found.append("--enable-mixed-chunk and --disable-mixed-chunk contradict each other")
    if not (0 < args.kv_cache_metrics_sample <= 1):
        found.append("--kv-cache-metrics-sample must be in (0, 1]")
    for name in (
        "bucket_time_to_first_token",
        "bucket_inter_token_latency",
        "bucket_e2e_request_latency",
    ):
        buckets = getattr(args, name)
        if buckets is not None and (not buckets or sorted(buckets) != list(buckets) or buckets[0] < 0):
            found.append(f"--{name.replace('_', '-')} must be a non-empty ascending list of seconds >= 0")
    if args.export_metrics_to_file and not args.export_metrics_to_file_dir:
        found.append("--export-metrics-to-file needs --export-metrics-to-file-dir (where to write)")
    try:
        parse_allowed_custom_labels(args.tokenizer_metrics_allowed_custom_labels)
    except ValueError as e:
        found.append(str(e))
    if not args.tokenizer_metrics_custom_labels_header.strip():
        found.append("--tokenizer-metrics-custom-labels-header must name a header")
    if args.kv_events_config is not None:
        try:
            parse_kv_events_config(args.kv_events_config, args.dp_size)
        except ValueError as e:
            found.append(str(e))
    found.extend(speculative_problems(args))
    found.extend(lora_flag_problems(args))
    if embedded_model_name(args.model_path) is None and not os.path.exists(args.model_path):
        found.append(
            f"--model-path {args.model_path!r} does not exist: pass a Hugging Face model directory, a "
            f".gguf file or an embedded model's name ({', '.join(EMBEDDED_MODELS)}), or leave it out "
            "to serve the default embedded model"
        )
    return found


def multinode_problems(args) -> list[str]:
    """--nnodes, --node-rank, --dist-init-addr, --dist-timeout."""
    if args.nnodes < 1:
        return [f"--nnodes must be >= 1, got {args.nnodes}"]
    found = []
    if not 0 <= args.node_rank < args.nnodes:
        found.append(
            f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got {args.node_rank}"
        )
    if not args.dist_timeout > 0:
        found.append(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")
    if args.nnodes == 1:
        return found
    if args.dist_init_addr is None:
        found.append(f"--nnodes {args.nnodes} needs --dist-init-addr HOST:PORT (node 0's address)")
    else:
        try:
            tcp_host_port(args.dist_init_addr)
        except ValueError:
            found.append(
                f"--dist-init-addr must be HOST:PORT with a port in 1..65535, got {args.dist_init_addr!r}"
            )
    if args.tp_size % args.nnodes:
        found.append(
            f"--tp-size {args.tp_size} must be a multiple of --nnodes {args.nnodes} (ranks per node)"
        )
    return found


def speculative_problems(args) -> list[str]:
    """`--speculative-*`: an algorithm srt runs, integers (a bool is not one) within their ranges."""
    found = []
    algorithm = args.speculative_algorithm
    wants_draft = algorithm == DRAFT_MODEL_ALGORITHM
    if wants_draft and not args.speculative_draft_model_path:
        found.append(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path")
    draft = args.speculative_draft_model_path
    if draft and embedded_model_name(draft) is None and not os.path.exists(draft):
        found.append(
            f"--speculative-draft-model-path {draft!r} does not exist: pass a Hugging Face model directory, "
            f"a .gguf file or an embedded model's name ({', '.join(EMBEDDED_MODELS)})"
        )
    block = args.per_request_spec_decode_metrics
    if block is not None and block not in PER_REQUEST_SPEC_METRICS:
        found.append(
            f"--per-request-spec-decode-metrics must be one of {', '.join(PER_REQUEST_SPEC_METRICS)}, "
            f"got {block!r}"
        )
    if args.speculative_draft_model_path and not wants_draft:
        found.append(
            f"--speculative-draft-model-path is read only with --speculative-algorithm {DRAFT_MODEL_ALGORITHM}"
        )
    if algorithm not in (None, *SPECULATIVE_ALGORITHMS):
        choices = ", ".join(SPECULATIVE_ALGORITHMS)
        found.append(f"--speculative-algorithm must be one of {choices}, got {algorithm!r}")
    counted = " (it counts the verified token: N proposes N - 1 drafts)"
    for name, low, why in (
        ("speculative_num_draft_tokens", 2, counted),
        ("speculative_ngram_min_match_window_size", 1, ""),
        ("speculative_ngram_max_match_window_size", 1, ""),
    ):
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is None and name == "speculative_num_draft_tokens":  # unset: the max match window
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            found.append(f"{flag} must be an integer, got {value!r}")
        elif value < low:
            found.append(f"{flag} must be >= {low}{why}, got {value}")
    min_n, max_n = (
        args.speculative_ngram_min_match_window_size,
        args.speculative_ngram_max_match_window_size,
    )
    if not found and min_n > max_n:
        found.append(
            f"--speculative-ngram-min-match-window-size ({min_n}) must not exceed "
            f"--speculative-ngram-max-match-window-size ({max_n})"
        )
    return found
