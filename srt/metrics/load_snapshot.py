"""The schedulers' load as the main process can read it cheaply: from their gauges' files.

Each scheduler already writes `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:num_used_tokens` and
`sglang:max_total_num_tokens` into `PROMETHEUS_MULTIPROC_DIR` (livemostrecent gauge files, one per process).
Reading those few hundred bytes costs tens of microseconds and needs no message on the ZMQ ring, so this is
the source of the load reports for gateways (srt/http_server/load_report.py).

Freshness: the scheduler pushes its gauges after every prefill batch, every `--decode-log-interval` decode
steps, at least every FLUSH_PERIOD (1 s) while busy, and at once when it goes idle; on top of that this
reader reuses a snapshot for SNAPSHOT_MAX_AGE. So a report is at most about 1.1 s old, and exact once idle.
With `--dp-size N` the N schedulers' values are summed (KV usage is total used over total capacity); only
tensor-parallel rank 0 is read.
"""

from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass

# A snapshot younger than this is reused: a burst of requests reads the files once.
SNAPSHOT_MAX_AGE = 0.1
GAUGE_FILE_GLOB = "gauge_livemostrecent_*.db"
RUNNING, WAITING = "sglang:num_running_reqs", "sglang:num_queue_reqs"
USED, CAPACITY = "sglang:num_used_tokens", "sglang:max_total_num_tokens"
_WANTED = (RUNNING, WAITING, USED, CAPACITY)


@dataclass(frozen=True)
class LoadSnapshot:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # 0..1, as vLLM's gauge of that name


def _read_file(path: str, key_cache: dict[str, tuple[str, str] | None]) -> dict[str, float]:
    from prometheus_client.mmap_dict import MmapedDict  # deferred: see srt/metrics/multiprocess.py

    values: dict[str, float] = {}
    for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(path):
        parsed = key_cache.get(key, False)
        if parsed is False:
            metric, _name, labels, _help = json.loads(key)
            rank = labels.get("tp_rank", "0")
            parsed = key_cache[key] = (metric, rank) if metric in _WANTED else None
        if parsed is not None and parsed[1] == "0":
            values[parsed[0]] = values.get(parsed[0], 0.0) + value
    return values


class SchedulerLoadReader:
    """`read()` the schedulers' current load; None when no scheduler has written its gauges."""

    def __init__(self, directory: str, max_age: float = SNAPSHOT_MAX_AGE, clock=time.monotonic):
        self.directory = directory
        self.max_age = max_age
        self.clock = clock
        self._cached: LoadSnapshot | None = None
        self._cached_at = float("-inf")
        self._key_cache: dict[str, tuple[str, str] | None] = {}

    def read(self) -> LoadSnapshot | None:
        now = self.clock()
        if now - self._cached_at < self.max_age:
            return self._cached
        totals = dict.fromkeys(_WANTED, 0.0)
        found = False
        for path in glob.glob(os.path.join(self.directory, GAUGE_FILE_GLOB)):
            try:
                values = _read_file(path, self._key_cache)
            except (OSError, RuntimeError, ValueError):
                continue  # removed by mark_process_dead meanwhile, or being written for the first time
            if CAPACITY in values:
                found = True
                for name, value in values.items():
                    totals[name] += value
        snapshot = None
        if found:
            capacity = totals[CAPACITY]
            snapshot = LoadSnapshot(
                num_requests_running=int(totals[RUNNING]),
                num_requests_waiting=int(totals[WAITING]),
                kv_cache_usage_perc=totals[USED] / capacity if capacity > 0 else 0.0,
            )
        self._cached, self._cached_at = snapshot, now
        return snapshot
