"""What the scheduler tells the outside world about its steps: the log lines and the system-level metrics.

The scheduler calls one hook per step with plain numbers; everything costlier than a few integer updates
(formatting, prometheus writes) happens at the log cadence or when the scheduler goes idle, not per step.
`NullReporter` lets tests drive the scheduler without either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.scheduler.schedule_batch import Req
    from srt.scheduler.scheduler import Scheduler


class StepReporter:
    """Interface: every hook is optional to override."""

    residency_observer = None
    grammar_metrics = None  # structured-output metrics (srt/metrics/grammar_collector.py), if on

    def on_prefill(
        self,
        sched: Scheduler,
        *,
        new_seqs: int,
        new_tokens: int,
        cached_tokens: int,
        prefix_queries: int,
        prefix_hits: int,
        forward_seconds: float,
    ) -> None: ...

    def on_decode(self, sched: Scheduler, *, num_tokens: int, forward_seconds: float) -> None: ...

    def on_mixed(
        self,
        sched: Scheduler,
        *,
        new_seqs: int,
        new_tokens: int,
        cached_tokens: int,
        prefix_queries: int,
        prefix_hits: int,
        decode_tokens: int,
        forward_seconds: float,
    ) -> None:
        """A mixed step: a prefill of `new_tokens` and `decode_tokens` decoded tokens in one forward."""

    def on_retraction(self, sched: Scheduler, n: int) -> None: ...

    def on_finished(self, req: Req) -> None: ...

    def on_idle(self, sched: Scheduler) -> None: ...

    def on_tick(self, sched: Scheduler) -> None: ...


class NullReporter(StepReporter):
    pass
