"""The schedulers' load as the main process reads it cheaply: from one small file each scheduler keeps.

Each scheduler (tensor-parallel rank 0 of each `--dp-size` replica) writes its own counts (running and
waiting requests, KV tokens in use and its capacity, generation throughput, prefix-cache hit rate) as one
JSON record, `load_<dp_rank>.json`, into the server's IPC directory: `SchedulerLoadWriter`, at the moments
its reporter pushes its gauges (srt/scheduler/step_reporter.py) and only when a figure changed. They are the
scheduler's own counts, not its metrics, so `--disable-metrics` takes nothing away from the load reports for
gateways (srt/http_server/load_report.py); `/metrics` shows the same figures as gauges. A record is
replaced atomically, so a reader sees a whole one; reading a few hundred bytes per replica costs tens of
microseconds and needs no message on the ZMQ ring.

Freshness: the scheduler writes after every prefill batch, every `--decode-log-interval` decode steps, at
least every FLUSH_PERIOD (1 s) while busy, and at once when it goes idle; on top of that this reader reuses
a snapshot for SNAPSHOT_MAX_AGE. So a report is at most about 1.1 s old, and exact once idle. With
`--dp-size N` each replica's values are kept apart (`RankLoad`, one per `dp_rank`, for SGLang's
`/v1/loads`) and summed for the whole server (`LoadSnapshot`: KV usage is total used over total capacity).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A snapshot younger than this is reused: a burst of requests reads the files once.
SNAPSHOT_MAX_AGE = 0.1
LOAD_FILE_GLOB = "load_*.json"


def load_file(directory: str, dp_rank: int) -> str:
    return os.path.join(directory, f"load_{dp_rank}.json")


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


class SchedulerLoadWriter:
    """One scheduler's record; `write` replaces it when a figure changed (a flush with nothing new writes
    nothing)."""

    def __init__(self, directory: str, dp_rank: int):
        self.path = load_file(directory, dp_rank)
        self.dp_rank = dp_rank
        self._last: RankLoad | None = None

    def write(
        self,
        *,
        running: int,
        waiting: int,
        used_tokens: int,
        capacity: int,
        gen_throughput: float = 0.0,
        cache_hit_rate: float = 0.0,
    ) -> None:
        load = RankLoad(self.dp_rank, running, waiting, used_tokens, capacity, gen_throughput, cache_hit_rate)
        if load == self._last:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(load), f)
            os.replace(tmp, self.path)
        except OSError as e:  # a full or vanished directory must not stop the scheduler
            logger.warning("could not write the load record: %s", e)
            return
        self._last = load


def _read_record(path: str) -> RankLoad | None:
    try:
        with open(path) as f:
            return RankLoad(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None  # its scheduler is gone meanwhile (the directory with it), or not one of these records


class SchedulerLoadReader:
    """`read()` the schedulers' current load, `read_ranks()` each replica's; None when no scheduler has
    written its record."""

    def __init__(self, directory: str, max_age: float = SNAPSHOT_MAX_AGE, clock=time.monotonic):
        self.directory = directory
        self.max_age = max_age
        self.clock = clock
        self._cached: list[RankLoad] | None = None
        self._cached_at = float("-inf")

    def read_ranks(self) -> list[RankLoad] | None:
        """Each replica that has written its record, by `dp_rank`."""
        now = self.clock()
        if now - self._cached_at < self.max_age:
            return self._cached
        records = (_read_record(path) for path in glob.glob(os.path.join(self.directory, LOAD_FILE_GLOB)))
        ranks = sorted((r for r in records if r is not None), key=lambda r: r.dp_rank)
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
