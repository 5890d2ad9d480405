"""Prompt logprobs in a prefill step: which rows of the step's token array the model runner scores, and handing
the scores back to the requests that asked (`logprob_start_len`).

Only requests with prompt logprobs pending add rows; a step without any runs the plain forward. A request's
rows are its positions p in this step from `logprob_first_row` on, each scoring prompt token p + 1; a prompt
split over chunked-prefill steps gathers its logprobs step by step (Req.add_prompt_logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.model_executor.forward_batch_info import PromptLogprobs
from srt.scheduler.schedule_batch import Req


@dataclass
class PromptLogprobPlan:
    reqs: list[Req]  # the requests with prompt logprobs pending in this step
    counts: list[int]  # rows of each of them
    rows: list[int]
    targets: list[int]
    top_k: int

    def batch_fields(self) -> dict:
        """The ForwardBatch fields asking the runner for these rows."""
        return {
            "logprob_rows": torch.tensor(self.rows, dtype=torch.int64),
            "logprob_targets": torch.tensor(self.targets, dtype=torch.int64),
            "logprob_top_k": self.top_k,
        }

    def deliver(self, scores: PromptLogprobs) -> None:
        values = scores.token_logprobs.tolist()
        top_values = scores.top_values.tolist() if scores.top_values is not None else None
        top_indices = scores.top_indices.tolist() if scores.top_indices is not None else None
        start = 0
        for req, count in zip(self.reqs, self.counts, strict=True):
            k = req.sampling_params.logprobs or 0
            block = range(start, start + count)
            tops = [list(zip(top_indices[r][:k], top_values[r][:k], strict=True)) if k else [] for r in block]
            req.add_prompt_logprobs(values[start : start + count], tops)
            start += count


def plan_prompt_logprobs(reqs: list[Req]) -> PromptLogprobPlan | None:
    """The rows to score for the requests of a prefill step (planned: `kv_len`/`extend_len` set), or None."""
    plan = PromptLogprobPlan([], [], [], [], 0)
    offset = 0
    for req in reqs:
        if req.prompt_logprobs_pending:
            positions = req.prompt_logprob_positions()
            plan.reqs.append(req)
            plan.counts.append(len(positions))
            plan.rows.extend(
                range(offset + positions.start - req.kv_len, offset + positions.stop - req.kv_len)
            )
            plan.targets.extend(req.origin_input_ids[positions.start + 1 : positions.stop + 1])
            plan.top_k = max(plan.top_k, req.sampling_params.logprobs or 0)
        offset += req.extend_len
    return plan if plan.reqs else None
