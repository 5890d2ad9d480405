"""Drives a `Scheduler` in-process, step by step, and collects what it would have sent downstream."""

from __future__ import annotations

from dataclasses import dataclass, field

from srt.io_struct import TokenizedGenerateReqInput
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler

MAX_STEPS = 10_000


@dataclass
class Collected:
    output_ids: list[int] = field(default_factory=list)
    finish: object = None
    messages: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    token_ts: list[float] = field(default_factory=list)
    spec_stats: object = None  # its speculative figures (SpecRequestStats), with its final message
    token_logprobs: list[float] = field(default_factory=list)  # when it asks for logprobs
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kw)


def request(
    rid: str, input_ids: list[int], params: SamplingParams, stream: bool = False
) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=list(input_ids), sampling_params=params, stream=stream
    )


def drive(
    sched: Scheduler,
    arrivals: dict[int, list[TokenizedGenerateReqInput]],
    on_step=None,
) -> dict[str, Collected]:
    """Add `arrivals[k]` before step k, step until every request has finished, return per-rid results."""
    results: dict[str, Collected] = {}
    expected = {r.rid for reqs in arrivals.values() for r in reqs}
    step = 0
    while True:
        for recv in arrivals.get(step, []):
            sched.add_request(recv)
        out = sched.step()
        if on_step is not None:
            on_step(step, sched)
        if out is not None:
            for i, rid in enumerate(out.rids):
                c = results.setdefault(rid, Collected())
                c.output_ids.extend(out.output_ids[i])
                c.messages += 1
                c.cached_tokens = out.cached_tokens[i]
                c.num_retractions = out.num_retractions[i]
                c.queued_ts, c.scheduled_ts = out.queued_ts[i], out.scheduled_ts[i]
                c.first_token_ts = out.first_token_ts[i]
                c.token_ts.extend(out.token_ts[i])
                assert len(out.token_ts[i]) == len(out.output_ids[i])
                assert c.finish is None, f"{rid} reported after it finished"
                c.finish = out.finished_reasons[i]
                if out.spec_stats is not None:
                    c.spec_stats = out.spec_stats[i]
                if out.output_token_logprobs is not None:
                    c.token_logprobs.extend(out.output_token_logprobs[i])
                    c.top_logprobs.extend(out.output_top_logprobs[i])
        step += 1
        done = all(results.get(rid) is not None and results[rid].finish is not None for rid in expected)
        if done and step > max(arrivals, default=0):
            return results
        assert step < MAX_STEPS, "scheduler did not finish the workload"
