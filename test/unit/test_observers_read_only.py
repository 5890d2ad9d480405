"""Observers read what they report on and never write it: the scheduler's reporter receives frozen
snapshots of the scheduler's load (never the `Scheduler` or a request), and the request metrics recorder
keeps its own stamps instead of writing the HTTP process's per-request state."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from srt.http_server.req_state import ReqState
from srt.http_server.request_metrics import RequestMetricsRecorder
from srt.io_struct import BatchStrOut, FinishReason
from srt.scheduler.step_hooks import SchedulerLoad, StepReporter
from srt.server_args import ServerArgs
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import make_scheduler, prompts


class RecordingReporter(StepReporter):
    """Keeps every argument of every hook call."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: self.calls.append((name, args, kwargs))
        return super().__getattribute__(name)


def test_the_reporter_is_handed_frozen_load_snapshots_and_plain_numbers(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, max_total_tokens=256)
    reporter = RecordingReporter()
    sched.reporter = reporter
    ps = prompts(3, low=20, high=30, seed=3)
    drive(
        sched,
        {
            0: [request("a", ps[0], greedy(8)), request("b", ps[1], greedy(8))],
            2: [request("c", ps[2], greedy(3))],
        },
    )

    names = {name for name, _, _ in reporter.calls}
    assert {"on_prefill", "on_decode", "on_finished"} <= names
    for name, args, kwargs in reporter.calls:
        for value in (*args, *kwargs.values()):
            assert isinstance(value, (int, float, SchedulerLoad)), (name, type(value))
    finished = [args for name, args, _ in reporter.calls if name == "on_finished"]
    assert sorted(out for _, out, _ in finished) == [3, 8, 8]  # (prompt, output, cached) tokens per request
    load = next(args[0] for name, args, _ in reporter.calls if name == "on_decode")
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.running = 0
    # the first decode step ran with both a and b, and their KV in use
    assert load.running == 2 and load.used_tokens > 0 and not load.idle
    assert load.used_tokens + load.headroom_tokens == sched.allocator.size


def test_the_scheduler_snapshot_agrees_with_the_scheduler(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir)
    sched.add_request(request("a", prompts(1)[0], greedy(4)))
    waiting = sched.load()
    assert (waiting.running, waiting.waiting, waiting.idle, waiting.used_tokens) == (0, 1, False, 0)
    sched.step()
    after = sched.load()
    assert (after.running, after.waiting) == (1, 0)
    assert after.used_tokens == sched.num_used_tokens > 0
    assert after.running_with_chunked == 1


class FrozenReqState(ReqState):
    """A ReqState that refuses every write once built."""

    def __setattr__(self, name, value):
        if getattr(self, "_built", False):
            raise AssertionError(f"an observer wrote ReqState.{name}")
        super().__setattr__(name, value)


def test_the_request_metrics_recorder_never_writes_the_request_state():
    recorder = RequestMetricsRecorder(ServerArgs(disable_metrics=True), context_len=2048)
    st = FrozenReqState(
        "r", 0, asyncio.Queue(), arrival_ts=10.0, prompt_tokens=5, max_new_tokens=4, n=1, group="r"
    )
    object.__setattr__(st, "_built", True)

    recorder.on_tokens(st, [100.0], has_tokens=True, now=10.5)  # first token: TTFT 0.5 s
    recorder.on_tokens(st, [100.2, 100.3], has_tokens=True, now=10.8)
    out = BatchStrOut(
        rids=["r"], output_ids=[[]], finished_reasons=[FinishReason("length")], prompt_tokens=[5],
        completion_tokens=[3], cached_tokens=[0], queued_ts=[99.0], scheduled_ts=[99.5], first_token_ts=[100.0],
        token_ts=[[]], num_retractions=[0], output_strs=[""],
    )  # fmt: skip
    stats = recorder.finished_stats(st, out, 0, FinishReason("length"), now=11.0)
    recorder.on_finish(st, stats)
    assert stats.first_token_recv_ts == 10.5  # the first arrival, not a later one
    assert stats.last_token_ts == 100.3
    assert stats.ttft == pytest.approx(0.5)
