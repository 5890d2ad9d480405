"""What the scheduler tells the outside world about its steps: the log lines and the system-level metrics.

The scheduler calls one hook per step with plain numbers and a `SchedulerLoad`, a frozen snapshot it builds
of what it holds after the step; a reporter never sees the `Scheduler` itself, so it cannot change what it
reports on. Everything costlier than a few integer updates (formatting, prometheus writes) happens at the
log cadence or when the scheduler goes idle, not per step. `NullReporter` lets tests drive the scheduler
without either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from srt.scheduler.scheduler_lora import LoRALoad
    from srt.speculative.stats import SpecStepStats


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    """The scheduler's queues and KV memory at one moment."""

    running: int  # requests in the decode batch
    chunked: bool  # a long prompt is part-way through its chunked prefill
    waiting: int
    used_tokens: int  # KV slots held by requests (evictable cache slots count as free)
    headroom_tokens: int  # free KV slots plus evictable ones
    new_token_ratio: float
    idle: bool
    lora: LoRALoad | None = None  # adapters running and waiting, and the pool (multi-LoRA on)

    @property
    def running_with_chunked(self) -> int:
        """SGLang's `num_running_reqs`: the request being prefilled in chunks counts as running."""
        return self.running + self.chunked


class StepReporter:
    """Interface: every hook is optional to override."""

    residency_observer = None
    grammar_metrics = None  # structured-output metrics (srt/metrics/grammar_collector.py), if on

    def on_prefill(
        self,
        load: SchedulerLoad,
        *,
        new_seqs: int,
        new_tokens: int,
        cached_tokens: int,
        prefix_queries: int,
        prefix_hits: int,
        decode_tokens: int,
        forward_seconds: float,
    ) -> None:
        """A prefill step of `new_tokens`; a mixed one when `decode_tokens` rows decoded in the same forward."""

    def on_decode(self, load: SchedulerLoad, *, num_tokens: int, forward_seconds: float) -> None: ...

    def on_verify(self, step: SpecStepStats) -> None:
        """A speculative verify step's draft and acceptance totals (called before its `on_decode`)."""

    def on_draft_budget(self, drafts_per_request: int) -> None:
        """The drafts a request may take at this decode step's batch size (speculation on)."""

    def on_retraction(self, n: int) -> None: ...

    def on_finished(self, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> None: ...

    def on_idle(self, load: SchedulerLoad) -> None: ...

    def on_tick(self, load: SchedulerLoad) -> None: ...


class NullReporter(StepReporter):
    pass
