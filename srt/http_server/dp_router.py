"""Routes requests over `--dp-size` scheduler replicas from the main process.

Each replica is a full scheduler with its own model copy and KV pool; the router only picks one per
request: `round_robin`, or `shortest_queue` (fewest requests routed there and not yet finished — the main
process sees every finish, so it needs no load report from the schedulers), unless the request names its
replica (`data_parallel_rank`, as a gateway routing over replicas does). Aborts go to the replica that owns
the request, or to all of them for `rid=""`.
"""

from __future__ import annotations

import itertools

ROUND_ROBIN, SHORTEST_QUEUE = "round_robin", "shortest_queue"


class DataParallelRouter:
    def __init__(self, dp_size: int, method: str = ROUND_ROBIN):
        if method not in (ROUND_ROBIN, SHORTEST_QUEUE):
            raise ValueError(f"unknown load balance method {method!r}")
        self.dp_size = dp_size
        self.method = method
        self._cycle = itertools.cycle(range(dp_size))
        self._owner: dict[str, int] = {}
        self._load = [0] * dp_size

    def route(self, rid: str, rank: int | None = None) -> int:
        """The replica of request `rid`: `rank` if given (the caller checked it is in range), else the
        method's choice."""
        if rank is not None:
            pass
        elif self.method == SHORTEST_QUEUE:
            rank = min(range(self.dp_size), key=self._load.__getitem__)
        else:
            rank = next(self._cycle)
        self._owner[rid] = rank
        self._load[rank] += 1
        return rank

    def ranks_for_abort(self, rid: str) -> list[int]:
        if rid == "":
            return list(range(self.dp_size))
        rank = self._owner.get(rid)
        return [] if rank is None else [rank]

    def finished(self, rid: str) -> None:
        rank = self._owner.pop(rid, None)
        if rank is not None:
            self._load[rank] -= 1

    @property
    def load(self) -> list[int]:
        return list(self._load)
