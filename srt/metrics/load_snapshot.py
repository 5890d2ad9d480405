"""The schedulers' load as the main process can read it cheaply: from their gauges' files.

Each scheduler already writes `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:num_used_tokens` and
`sglang:max_total_num_tokens` into `PROMETHEUS_MULTIPROC_DIR` (livemostrecent gauge files, one per process).
Reading those few hundred bytes costs tens of microseconds and needs no message on the ZMQ ring, so this is
the source of the load reports for gateways (srt/http_server/load_report.py).

Freshness: the scheduler pushes its gauges after every prefill batch, every `--decode-log-interval` decode
steps, at least every FLUSH_PERIOD (1 s) while busy, and at once when it goes idle; on top of that this
reader reuses a snapshot for SNAPSHOT_MAX_AGE. So a report is at most about 1.1 s old, and exact once idle.
With `--dp-size N` each replica's values are kept apart (`RankLoad`, one per `dp_rank`, for SGLang's
`/v1/loads`) and summed for the whole server (`LoadSnapshot`: KV usage is total used over total capacity);
only tensor-parallel rank 0 is read.
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
THROUGHPUT, HIT_RATE = "sglang:gen_throughput", "sglang:cache_hit_rate"
_WANTED = (RUNNING, WAITING, USED, CAPACITY, THROUGHPUT, HIT_RATE)


@dataclass(frozen=True)
class LoadSnapshot:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # 0..1, as vLLM's gauge of that name


@dataclass(frozen=True)
class RankLoad:
    """One data-parallel replica's load, in absolute tokens (SGLang's `/v1/loads` entry)."""

    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    gen_throughput: float
    cache_hit_rate: float

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens > 0 else 0.0


def _read_file(path: str, key_cache: dict[str, tuple[str, int] | None]) -> dict[tuple[str, int], float]:
    """{(metric, dp_rank): value} of a gauge file's wanted metrics, tensor-parallel rank 0 only (a replica
    without a `dp_rank` label is rank 0: the label exists only with `--dp-size` > 1)."""
    from prometheus_client.mmap_dict import MmapedDict  # deferred: see srt/metrics/multiprocess.py

    values: dict[tuple[str, int], float] = {}
    for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(path):
        parsed = key_cache.get(key, False)
        if parsed is False:
            metric, _name, labels, _help = json.loads(key)
            wanted = metric in _WANTED and labels.get("tp_rank", "0") == "0"
            parsed = key_cache[key] = (metric, int(labels.get("dp_rank", "0"))) if wanted else None
        if parsed is not None:
            values[parsed] = values.get(parsed, 0.0) + value
    return values


def _rank_load(rank: int, values: dict[str, float]) -> RankLoad:
    return RankLoad(
        dp_rank=rank,
        num_running_reqs=int(values.get(RUNNING, 0)),
        num_waiting_reqs=int(values.get(WAITING, 0)),
        num_used_tokens=int(values.get(USED, 0)),
        max_total_num_tokens=int(values[CAPACITY]),
        gen_throughput=values.get(THROUGHPUT, 0.0),
        cache_hit_rate=values.get(HIT_RATE, 0.0),
    )


class SchedulerLoadReader:
    """`read()` the schedulers' current load, `read_ranks()` each replica's; None when no scheduler has
    written its gauges."""

    def __init__(self, directory: str, max_age: float = SNAPSHOT_MAX_AGE, clock=time.monotonic):
        self.directory = directory
        self.max_age = max_age
        self.clock = clock
        self._cached: list[RankLoad] | None = None
        self._cached_at = float("-inf")
        self._key_cache: dict[str, tuple[str, int] | None] = {}

    def read_ranks(self) -> list[RankLoad] | None:
        """Each replica that has written its capacity, by `dp_rank`."""
        now = self.clock()
        if now - self._cached_at < self.max_age:
            return self._cached
        per_rank: dict[int, dict[str, float]] = {}
        for path in glob.glob(os.path.join(self.directory, GAUGE_FILE_GLOB)):
            try:
                values = _read_file(path, self._key_cache)
            except (OSError, RuntimeError, ValueError):
                continue  # removed by mark_process_dead meanwhile, or being written for the first time
            for (name, rank), value in values.items():
                into = per_rank.setdefault(rank, {})
                into[name] = into.get(name, 0.0) + value
        ranks = [_rank_load(r, v) for r, v in sorted(per_rank.items()) if CAPACITY in v]
        self._cached, self._cached_at = ranks or None, now
        return self._cached

    def read(self) -> LoadSnapshot | None:
        ranks = self.read_ranks()
        if ranks is None:
            return None
        capacity = sum(r.max_total_num_tokens for r in ranks)
        return LoadSnapshot(
            num_requests_running=sum(r.num_running_reqs for r in ranks),
            num_requests_waiting=sum(r.num_waiting_reqs for r in ranks),
            kv_cache_usage_perc=sum(r.num_used_tokens for r in ranks) / capacity if capacity > 0 else 0.0,
        )
