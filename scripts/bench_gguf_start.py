"""How long a GGUF takes to serve its first answer, and the memory its start needs: a cold start with an
empty srt cache (`SRT_CACHE_DIR` a new directory: the C kernels compile), then a restart on that cache.

For each start: seconds from `python -m srt.launch_server` to the first completion's answer, the peak of all
srt processes' resident memory together (sampled every SAMPLE_SECONDS; file-backed pages of the GGUF's map
count, as they are resident), each process's own peak (VmHWM), and what the cache gained. A benchmark, not a
test: the machine's other work moves the figures.

    python scripts/bench_gguf_start.py                          # the embedded SmolLM2 (Q4_1)
    python scripts/bench_gguf_start.py --model-path model.gguf --restarts 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass

import httpx

from srt.process_control import descendant_pids, process_name
from srt_bench.server import launch_server

SAMPLE_SECONDS = 0.1
START_TIMEOUT_SECONDS = 900.0
PROMPT = "The capital of France is"
ANSWER_TOKENS = 8
KIB = 1024
PROCESSES_SHOWN = 4  # the largest peaks (the scheduler, the HTTP process, the detokenizer, a compiler)


@dataclass
class StartFigures:
    label: str
    first_answer_s: float
    peak_rss_mib: float  # all processes together
    peaks_mib: dict[str, float]  # the largest processes' own peaks (VmHWM), by name[pid]
    cache_files: list[str]


def status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cache_files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)


def one_start(label: str, model_path: str | None, cache_dir: str, extra: list[str]) -> StartFigures:
    flags = [*extra, *(("--model-path", model_path) if model_path else ())]
    start = time.monotonic()
    # its own wait: the figures are taken while it starts (the time to the first answer, the memory peak)
    server = launch_server(*flags, wait=False, env={"SRT_CACHE_DIR": cache_dir})
    proc, log = server.proc, server.log_path
    peak, hwm, names = 0, {}, {}
    body = {"prompt": PROMPT, "max_tokens": ANSWER_TOKENS, "temperature": 0}
    answered = None
    try:
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=1.0)) as client:
            while answered is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}; log: {log}")
                if time.monotonic() - start > START_TIMEOUT_SECONDS:
                    raise RuntimeError(f"no answer in {START_TIMEOUT_SECONDS:.0f} s; log: {log}")
                pids = [proc.pid, *descendant_pids(proc.pid)]
                peak = max(peak, sum(status_kib(p, "VmRSS") for p in pids))
                for p in pids:
                    hwm[p] = max(hwm.get(p, 0), status_kib(p, "VmHWM"))
                    names[p] = process_name(p) or names.get(p) or "?"  # a spawned child renames itself
                try:
                    r = client.post(f"{server.base_url}/v1/completions", json=body)
                    if r.status_code == 200 and r.json().get("choices"):
                        answered = time.monotonic() - start
                except httpx.HTTPError:
                    time.sleep(SAMPLE_SECONDS)
    finally:
        server.stop()
    return StartFigures(
        label,
        answered,
        peak / KIB,
        {
            f"{names[p]}[{p}]": v / KIB
            for p, v in sorted(hwm.items(), key=lambda kv: -kv[1])[:PROCESSES_SHOWN]
        },
        cache_files(cache_dir),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="a .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--restarts", type=int, default=1, help="starts on the warm cache after the cold one")
    ap.add_argument("--server-args", default="", help="more launch_server flags, one string")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="srt-cache-bench-")
    extra = args.server_args.split()
    runs = [one_start("cold (empty cache)", args.model_path, cache, extra)]
    runs += [one_start(f"restart {i + 1}", args.model_path, cache, extra) for i in range(args.restarts)]
    size = os.path.getsize(args.model_path) if args.model_path else None
    print(
        f"model: {args.model_path or '(embedded SmolLM2)'}"
        + (f", {size / KIB / KIB:.0f} MiB" if size else "")
    )
    print(f"{'start':<20} {'first answer s':>15} {'peak RSS MiB (all)':>19}  per-process peak MiB")
    for r in runs:
        per = ", ".join(f"{n} {v:.0f}" for n, v in r.peaks_mib.items())
        print(f"{r.label:<20} {r.first_answer_s:>15.1f} {r.peak_rss_mib:>19.0f}  {per}")
    print(f"cache after the cold start ({cache}): {runs[0].cache_files}")


if __name__ == "__main__":
    main()
