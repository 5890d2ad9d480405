"""The servers a user could run instead of srt, how to start each on the embedded SmolLM2 weights, and the
comparison table.

Every server is started as its own process group so that stopping it also stops its children (srt's
scheduler and detokenizer), and is ready when a real one-token request succeeds: `/health` means different
things on each server, and `transformers serve` fails `/v1/models` offline.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from srt.bench.backends import Target
from srt.bench.dataset import BenchRequest
from srt.bench.runner import RunResult, warmup

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
READY_TIMEOUT_S = 900.0
READY_POLL_S = 2.0
STOP_GRACE_S = 20.0
LLAMA_CPP_CONTEXT = 2048
PROBE_REQUEST = BenchRequest(prompt="Hello", prompt_len=1, output_len=1)


@dataclass
class Peer:
    """One server under test: how to start it and how to talk to it."""

    name: str
    command: list[str]
    target: Target
    missing: str | None = None  # why it cannot run here (not installed), or None
    env: dict[str, str] = field(default_factory=dict)


def _missing_modules(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def srt_peer(port: int, model_dir: str, *flags: str, name: str = "srt") -> Peer:
    cmd = [sys.executable, "-m", "srt.launch_server", "--model-path", model_dir]
    cmd += ["--host", HOST, "--port", str(port), *flags]
    target = Target(f"http://{HOST}:{port}", backend="openai", endpoint="chat", fixed_output="ignore_eos")
    return Peer(name, cmd, target)


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
    return Peer("transformers", cmd, target, missing)


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
    return Peer("llama.cpp", cmd, target, missing)


class RunningServer:
    """A started peer; use as a context manager so it is always stopped, even when the benchmark fails."""

    def __init__(self, peer: Peer, log_path: str):
        self.peer = peer
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.peak_rss = 0

    def __enter__(self) -> RunningServer:
        log = open(self.log_path, "w")
        env = {**os.environ, **self.peer.env}
        logger.info("starting %s: %s (log: %s)", self.peer.name, " ".join(self.peer.command), self.log_path)
        self.proc = subprocess.Popen(
            self.peer.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.peak_rss = peak_rss_bytes(self.proc.pid)  # before the processes (and their counters) go
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0f s; killing it", self.peer.name, STOP_GRACE_S)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    async def wait_ready(self, count_tokens) -> float:
        """Seconds until a one-token request succeeds; raises if the process exits or time runs out."""
        start = time.monotonic()
        last_error = ""
        while time.monotonic() - start < READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.peer.name} exited with {self.proc.returncode}; see {self.log_path}"
                )
            result = await warmup(self.peer.target, PROBE_REQUEST, count_tokens)
            if result.success:
                return time.monotonic() - start
            last_error = result.error
            await asyncio.sleep(READY_POLL_S)
        raise TimeoutError(f"{self.peer.name} not ready after {READY_TIMEOUT_S:.0f} s: {last_error}")


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
