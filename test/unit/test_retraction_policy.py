"""Which running requests a full KV pool sends back to the queue (schedule_policy.retract_until_decode_fits):
the least work lost first, no more than needed, and a request that cannot fit even alone is reported."""

from __future__ import annotations

from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.schedule_batch import Req
from srt.scheduler.schedule_policy import retract_until_decode_fits


def running_req(rid: str, prompt_len: int, output_len: int, kv_slots: int) -> Req:
    req = Req(rid, list(range(prompt_len)), SamplingParams(max_new_tokens=100))
    req.output_ids = list(range(output_len))
    req.kv_slots = kv_slots  # what releasing it gives back, in this test's model of the pool
    return req


class Pool:
    """Free slots, and the releases seen, in the order they happened."""

    def __init__(self, free: int):
        self.free = free
        self.released: list[str] = []

    def room(self) -> int:
        return self.free

    def release(self, req: Req) -> None:
        self.free += req.kv_slots
        self.released.append(req.rid)


def test_nothing_is_retracted_while_every_request_has_a_slot():
    running = [running_req("a", 10, 3, 13), running_req("b", 10, 5, 15)]
    pool = Pool(free=2)
    assert retract_until_decode_fits(running, pool.room, pool.release) == ([], None)
    assert [r.rid for r in running] == ["a", "b"] and pool.released == []


def test_least_output_goes_first_and_longest_prompt_breaks_ties_and_no_more_than_needed():
    running = [
        running_req("most-output", 10, 9, 19),
        running_req("short-prompt", 5, 2, 7),
        running_req("long-prompt", 20, 2, 22),
        running_req("middle", 10, 4, 14),
    ]
    pool = Pool(free=0)  # 4 decode slots needed; the first release (22) covers the 3 left
    retracted, too_large = retract_until_decode_fits(running, pool.room, pool.release)
    assert [r.rid for r in retracted] == ["long-prompt"] and too_large is None
    assert pool.released == ["long-prompt"]
    assert {r.rid for r in running} == {"most-output", "short-prompt", "middle"}


def test_releases_continue_until_the_rest_fit():
    running = [running_req(f"r{i}", 10, i, 1) for i in range(5)]
    pool = Pool(free=0)  # each release frees 1 slot: 5 > 0, 4 > 1, 3 > 2, then 2 <= 3
    retracted, too_large = retract_until_decode_fits(running, pool.room, pool.release)
    assert [r.rid for r in retracted] == ["r0", "r1", "r2"] and too_large is None
    assert [r.rid for r in running] == ["r4", "r3"]


def test_a_request_larger_than_the_whole_pool_is_reported_not_retracted():
    running = [running_req("huge", 10, 1, 0), running_req("small", 10, 0, 0)]
    pool = Pool(free=0)  # releasing frees nothing: even one request cannot decode
    retracted, too_large = retract_until_decode_fits(running, pool.room, pool.release)
    assert [r.rid for r in retracted] == ["small"]
    assert too_large is not None and too_large.rid == "huge"
    assert running == [] and pool.released == ["small", "huge"]
