"""The servers a user could run instead of srt, how to start each on the embedded SmolLM2 weights, and the
comparison table.

Every server is started by the one launcher (`srt_bench.server`: its own session, so that stopping it also
stops its children, srt's scheduler and detokenizer), and is ready when a real one-token request succeeds:
`/health` means different things on each server, and `transformers serve` fails `/v1/models` offline.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import platform
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from srt_bench.backends import Target
from srt_bench.dataset import BenchRequest
from srt_bench.runner import RunResult, warmup
from srt_bench.server import HOST, ServerHandle, srt_command, start_server

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
LLAMA_CPP_CONTEXT = 2048
PROBE_REQUEST = BenchRequest(prompt="Hello", prompt_len=1, output_len=1)


@dataclass
class Peer:
    """One server under test: how to start it and how to talk to it."""

    name: str
    port: int
    command: list[str]
    target: Target
    missing: str | None = None  # why it cannot run here (not installed), or None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None  # the tree it runs from (None: this one)


def _missing_modules(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def srt_peer(port: int, model_dir: str, *flags: str, name: str = "srt") -> Peer:
    cmd = srt_command(port, "--model-path", model_dir, "--host", HOST, *flags)
    target = Target(f"http://{HOST}:{port}", backend="openai", endpoint="chat", fixed_output="ignore_eos")
    return Peer(name, port, cmd, target)


def srt_before_peer(port: int, model_dir: str, tree: str) -> Peer:
    """srt with default flags, run from another checkout `tree` (an earlier commit's `git worktree`): "srt"
    and "srt-before" taking turns in one run compare two versions on the same machine under the same load.
    Its own cache directory (`SRT_CACHE_DIR`) keeps the two versions' kernels and calibrations apart."""
    peer = srt_peer(port, model_dir, name="srt-before")
    peer.cwd = os.path.abspath(tree)
    peer.env = {"SRT_CACHE_DIR": os.path.join(peer.cwd, ".srt-cache")}
    if not os.path.isdir(os.path.join(peer.cwd, "srt")):
        peer.missing = f"--before-tree {tree} holds no srt package"
    return peer


def srt_fp32_peer(port: int, model_dir: str) -> Peer:
    """srt in fp32 (`--quantization none`, the correctness reference)."""
    return srt_peer(port, model_dir, "--quantization", "none", name="srt-fp32")


def peak_rss_bytes(root_pid: int) -> int:
    """Sum of the peak resident sizes (VmHWM) of a server's processes: its session, children included. An
    upper bound of the peak of the sum (the processes need not peak at once); 0 if /proc is unreadable."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != root_pid:
                continue
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def transformers_peer(port: int, model_dir: str) -> Peer:
    """`transformers serve` in fp32 with continuous batching; answers 422 to `ignore_eos`, so fixed lengths
    use a per-request generation config; `model` is omitted (it wants none or exactly its own)."""
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    cmd = [cli, "serve", model_dir, "--continuous-batching", "--dtype", "float32", "--device", "cpu"]
    cmd += ["--host", HOST, "--port", str(port)]
    target = Target(
        f"http://{HOST}:{port}", backend="openai", endpoint="chat", fixed_output="generation_config"
    )
    gone = _missing_modules("fastapi", "uvicorn", "openai")
    missing = None
    if gone or not os.path.exists(cli):
        missing = "transformers serve is not installed: pip install 'transformers[serving]' (or '.[peers]')"
    return Peer("transformers", port, cmd, target, missing)


def llama_cpp_peer(port: int, gguf_path: str) -> Peer:
    """llama.cpp's server from llama-cpp-python on the GGUF itself. Without `--interrupt_requests False` a
    new request cancels the running stream; it honours `min_tokens` and sends no usage while streaming."""
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf_path,
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    cmd += ["--interrupt_requests", "False", "--n_ctx", str(LLAMA_CPP_CONTEXT)]
    threads = str(os.cpu_count() or 1)
    cmd += ["--n_threads", threads, "--n_threads_batch", threads]
    target = Target(f"http://{HOST}:{port}", backend="openai", endpoint="chat", fixed_output="min_tokens")
    missing = None
    if _missing_modules("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"):
        missing = (
            "llama.cpp's server is not installed, skipping it: "
            "CMAKE_ARGS='-DGGML_NATIVE=ON' pip install 'llama-cpp-python[server]' (compiles ~12 min; on a CPU "
            "with AMX, whose native kernels crash, use CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON "
            "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON' instead)"
        )
    return Peer("llama.cpp", port, cmd, target, missing)


def start_peer(peer: Peer, log_path: str) -> ServerHandle:
    """Start `peer` with the one launcher (`srt_bench.server`): its own session, its log in `log_path`."""
    return start_server(
        peer.command, peer.port, name=peer.name, log_path=log_path, env=peer.env, cwd=peer.cwd
    )


@contextlib.contextmanager
def running_peer(peer: Peer, log_path: str) -> Iterator[ServerHandle]:
    """`start_peer` for a `with` block (or an ExitStack): stopped at its end."""
    server = start_peer(peer, log_path)
    try:
        yield server
    finally:
        server.stop()


def stop_peer(server: ServerHandle) -> int:
    """Stop a peer; returns its peak RSS in bytes (`peak_rss_bytes`, read before its processes go)."""
    rss = peak_rss_bytes(server.proc.pid)
    server.stop()
    return rss


async def wait_peer_ready(server: ServerHandle, peer: Peer, count_tokens) -> float:
    """Seconds until a one-token request through the benchmark's own client succeeds; raises (the server
    killed) if it exits or time runs out."""

    async def one_token() -> str | None:
        result = await warmup(peer.target, PROBE_REQUEST, count_tokens)
        return None if result.success else result.error

    return await server.wait_ready_async(one_token, READY_TIMEOUT_S)


def machine_description() -> str:
    """CPU model and core count, for the table's caption: numbers mean little without the machine."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


COLUMNS = (
    ("output tok/s", lambda s: s.output_throughput, "{:.1f}"),
    ("TTFT p50 (s)", lambda s: s.ttft.median_ms / 1000, "{:.2f}"),
    ("TTFT p99 (s)", lambda s: s.ttft.p99_ms / 1000, "{:.2f}"),
    ("ITL p50 (ms)", lambda s: s.itl.median_ms, "{:.0f}"),
    ("ITL p99 (ms)", lambda s: s.itl.p99_ms, "{:.0f}"),
    ("E2E p50 (s)", lambda s: s.e2e.median_ms / 1000, "{:.2f}"),
)
REFERENCE = "srt"


def _cell(fmt: str, value: float) -> str:
    return "-" if value is None or math.isnan(value) else fmt.format(value)


def _ratio(a: float, b: float) -> str:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def comparison_table(results: dict[str, list[RunResult]]) -> str:
    """A Markdown table: one row per (server, concurrency), then srt ÷ peer rows for every column
    (above 1 is better for tok/s, below 1 is better for latencies)."""
    head = "| server | concurrency | " + " | ".join(name for name, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for server, runs in results.items():
        for run in runs:
            cells = [_cell(fmt, get(run.summary)) for _, get, fmt in COLUMNS]
            lines.append(f"| {server} | {run.max_concurrency} | " + " | ".join(cells) + " |")
    reference = {run.max_concurrency: run for run in results.get(REFERENCE, [])}
    for server, runs in results.items():
        if server == REFERENCE:
            continue
        for run in runs:
            ours = reference.get(run.max_concurrency)
            if ours is None:
                continue
            cells = [_ratio(get(ours.summary), get(run.summary)) for _, get, _ in COLUMNS]
            lines.append(f"| srt ÷ {server} | {run.max_concurrency} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_runs(rounds: list[dict[str, list[RunResult]]]) -> dict[str, list[RunResult]]:
    """Per server and concurrency, the run of median output tok/s across rounds (the lower middle one of an
    even count): one whole run each, so a table of them compares figures measured together."""
    by_level: dict[str, dict[int, list[RunResult]]] = {}
    for results in rounds:
        for server, runs in results.items():
            for run in runs:
                by_level.setdefault(server, {}).setdefault(run.max_concurrency, []).append(run)
    return {
        server: [
            sorted(runs, key=lambda r: r.summary.output_throughput)[(len(runs) - 1) // 2]
            for runs in levels.values()
        ]
        for server, levels in by_level.items()
    }


def rounds_table(rounds: list[dict[str, list[RunResult]]]) -> str:
    """Output tok/s of every round per (server, concurrency), then srt ÷ peer within each round and of the
    two medians: how far the figure of one run can be trusted on a noisy machine. A server or level missing
    from a round is '-'."""

    def tok_s(results: dict[str, list[RunResult]], server: str, level: int) -> float | None:
        run = next((r for r in results.get(server, []) if r.max_concurrency == level), None)
        return None if run is None else run.summary.output_throughput

    medians = median_runs(rounds)
    head = "| server | concurrency | " + " | ".join(f"round {i + 1}" for i in range(len(rounds)))
    lines = [head + " | median |", "|" + "---|" * (len(rounds) + 3)]
    for server, runs in medians.items():
        for run in runs:
            level = run.max_concurrency
            cells = [_cell("{:.1f}", tok_s(r, server, level)) for r in rounds]
            median = _cell("{:.1f}", run.summary.output_throughput)
            lines.append(f"| {server} | {level} | " + " | ".join(cells) + f" | {median} |")
    for server, runs in medians.items():
        if server == REFERENCE or REFERENCE not in medians:
            continue
        for run in runs:
            level = run.max_concurrency
            cells = [_ratio(tok_s(r, REFERENCE, level), tok_s(r, server, level)) for r in rounds]
            ours = tok_s(medians, REFERENCE, level)
            median = _ratio(ours, run.summary.output_throughput)
            lines.append(f"| srt ÷ {server} | {level} | " + " | ".join(cells) + f" | {median} |")
    return "\n".join(lines)
