"""The interval arithmetic of docs/metrics.md, "Per-request intervals", on synthetic event sequences."""

import pytest

from srt.metrics.request_stats import FinishedRequestStats, inter_token_latencies

# Two unrelated clocks: the main process's stamps near 1000, the scheduler's near 50. Any formula that mixed
# them would be off by ~950 s.
MAIN = 1000.0
SCHED = 50.0


def stats(**overrides) -> FinishedRequestStats:
    base = dict(
        prompt_tokens=10,
        generation_tokens=5,
        cached_tokens=0,
        finished_reason="length",
        arrival_ts=MAIN,
        first_token_recv_ts=MAIN + 0.30,
        finish_recv_ts=MAIN + 0.75,
        queued_ts=SCHED,
        scheduled_ts=SCHED + 0.10,
        first_token_ts=SCHED + 0.25,
        last_token_ts=SCHED + 0.65,
        num_retractions=0,
        max_tokens_param=5,
        n_param=1,
    )
    base.update(overrides)
    return FinishedRequestStats(**base)


def test_common_case_intervals_follow_the_table():
    s = stats()
    assert s.queue_time == pytest.approx(0.10)
    assert s.prefill_time == pytest.approx(0.15)
    assert s.decode_time == pytest.approx(0.40)
    assert s.inference_time == pytest.approx(0.55)
    assert s.tpot == pytest.approx(0.40 / 4)
    assert s.ttft == pytest.approx(0.30)
    assert s.e2e == pytest.approx(0.75)
    assert s.inference_time == pytest.approx(s.prefill_time + s.decode_time)


def test_preemption_during_prefill_counts_into_prefill_not_queue():
    # Scheduled at +0.10, preempted before its first token, rescheduled at +1.10: scheduled_ts stays.
    s = stats(first_token_ts=SCHED + 1.25, last_token_ts=SCHED + 1.65, num_retractions=1,
              first_token_recv_ts=MAIN + 1.30, finish_recv_ts=MAIN + 1.75)  # fmt: skip
    assert s.queue_time == pytest.approx(0.10)
    assert s.prefill_time == pytest.approx(1.15)
    assert s.decode_time == pytest.approx(0.40)
    assert s.ttft == pytest.approx(1.30)


def test_preemption_during_decode_counts_into_decode_inference_and_one_itl():
    token_stamps = [
        SCHED + 0.25,
        SCHED + 0.35,
        SCHED + 1.45,
        SCHED + 1.55,
        SCHED + 1.65,
    ]  # 1 s lost after token 2
    s = stats(last_token_ts=token_stamps[-1], num_retractions=1)
    assert s.prefill_time == pytest.approx(0.15)
    assert s.decode_time == pytest.approx(1.40)
    assert s.inference_time == pytest.approx(1.55)
    itl = inter_token_latencies(None, token_stamps)
    assert itl == pytest.approx([0.10, 1.10, 0.10, 0.10])
    assert sum(itl) == pytest.approx(s.decode_time)


def test_single_token_output_has_tpot_zero_and_no_decode():
    s = stats(generation_tokens=1, last_token_ts=SCHED + 0.25)
    assert s.decode_time == 0.0
    assert s.tpot == 0.0
    assert inter_token_latencies(None, [SCHED + 0.25]) == []


def test_abort_before_scheduling_has_only_e2e():
    s = stats(generation_tokens=0, finished_reason="abort", first_token_recv_ts=None, scheduled_ts=None,
              first_token_ts=None, last_token_ts=None)  # fmt: skip
    assert s.e2e == pytest.approx(0.75)
    for interval in (s.ttft, s.queue_time, s.prefill_time, s.decode_time, s.inference_time, s.tpot):
        assert interval is None


def test_abort_after_scheduling_before_first_token_has_queue_but_no_prefill():
    s = stats(generation_tokens=0, finished_reason="abort", first_token_recv_ts=None, first_token_ts=None,
              last_token_ts=None)  # fmt: skip
    assert s.queue_time == pytest.approx(0.10)
    assert s.prefill_time is None and s.inference_time is None and s.tpot is None


def test_itl_across_streamed_chunks_gives_one_value_per_token_after_the_first():
    stamps = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
    first = inter_token_latencies(None, stamps[:1])
    second = inter_token_latencies(stamps[0], stamps[1:4])  # --stream-interval batches three tokens
    third = inter_token_latencies(stamps[3], stamps[4:])
    values = first + second + third
    assert len(values) == len(stamps) - 1
    assert values == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
