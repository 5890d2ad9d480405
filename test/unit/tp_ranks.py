"""Running a test's work on several tensor-parallel ranks: one spawned process per rank, each reporting a
picklable dict (or the traceback it died with)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import traceback
from collections.abc import Callable

import pytest

# spawning, importing torch and loading on a busy 2-core machine
RANK_TIMEOUT_SECONDS = 240


def report_rank(work: Callable[..., dict], tp_rank: int, args: tuple, results: mp.Queue) -> None:
    """A rank's process: `work(tp_rank, *args)`'s report, or the error, put on `results`."""
    try:
        report = {"rank": tp_rank, **work(tp_rank, *args)}
    except BaseException:
        report = {"rank": tp_rank, "error": traceback.format_exc()}
    # plain pickle copies tensor data (a Queue would share it through this soon-gone process)
    results.put(pickle.dumps(report))


def run_ranks(work: Callable[..., dict], tp_size: int, *args) -> dict[int, dict]:
    """Each rank's report of `work(tp_rank, *args)` (a module-level function: spawned processes import it),
    failing the test on a rank's error or when the ranks do not finish in RANK_TIMEOUT_SECONDS."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=report_rank, args=(work, r, args, results)) for r in range(tp_size)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(tp_size):
            report = pickle.loads(results.get(timeout=RANK_TIMEOUT_SECONDS))
            assert "error" not in report, f"rank {report['rank']} failed:\n{report['error']}"
            reports[report["rank"]] = report
    except queue.Empty:
        pytest.fail(f"tensor-parallel ranks did not finish in {RANK_TIMEOUT_SECONDS} s")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return reports
