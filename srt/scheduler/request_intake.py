"""Request intake: a `TokenizedGenerateReqInput` from the HTTP process becomes the `Req` the scheduler queues,
or one already finished.

Every way a new request can end before it runs is decided here, once, in this order: a rid that is not a
string (dropped: nothing downstream could route an answer to it), the scheduler's own checks
(`request_checks.refusal`: duplicate rid, bad prompt, bad parameters, nothing to compute), an adapter that
is not served (or LoRA off), and a failure while building it (fault isolation: that request finishes with
`error`, never the process). A request that passes gets its sampling generator: its own when it has a seed,
else the scheduler's shared one. Where it then waits (the queue, or its grammar first) is the scheduler's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from srt.io_struct import FinishReason, TokenizedGenerateReqInput
from srt.sampling.sampler import make_generator
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.fault_isolation import PROCESS_FATAL_ERRORS, fail_request
from srt.scheduler.request_checks import refusal
from srt.scheduler.schedule_batch import Req
from srt.scheduler.scheduler_lora import SchedulerLoRA
from srt.scheduler.scheduler_tracing import SchedulerTracing

logger = logging.getLogger(__name__)


@dataclass
class RequestIntake:
    max_req_input_len: int
    vocab_size: int
    is_embedding: bool
    default_generator: torch.Generator  # shared by every request without a seed
    lora: SchedulerLoRA | None  # None: LoRA is off, and a request naming an adapter is refused
    tracing: SchedulerTracing

    def new_req(self, recv: TokenizedGenerateReqInput, live: dict[str, Req]) -> Req | None:
        """The request `recv` asks for, ready to queue, or finished at once: refused (`error`), nothing to
        generate (`length`), or failing to admit (its parameters make a check or its generator raise:
        `error`); None when it cannot be answered at all. `live`: the requests held now, by rid."""
        if not isinstance(recv.rid, str):
            logger.error("Dropping a request whose rid is not a string: %r", recv.rid)
            return None
        params = recv.sampling_params
        try:
            req = Req(recv.rid, recv.input_ids, params, recv.stream)
            req.prediction_ids = recv.prediction_ids
            req.lora_name = recv.lora_name
            req.think_end_id = recv.think_end_id
            req.stop_after_reasoning = recv.stop_after_reasoning
            self.tracing.attach(req, recv.trace)
            req.finished_reason = refusal(
                req, live, self.max_req_input_len, self.vocab_size, self.is_embedding
            )
            if not req.finished and req.lora_name is not None:
                req.finished_reason = (
                    self.lora.refusal(req.lora_name)
                    if self.lora is not None
                    else FinishReason("error", message="LoRA is off on this server", param="model")
                )
            if not req.finished:
                req.generator = make_generator(params.seed, self.default_generator)
            elif req.finished_reason.type == "error":  # the HTTP layer should have refused it already
                logger.error("Request %s refused: %s", req.rid, req.finished_reason.message)
        except PROCESS_FATAL_ERRORS:
            raise
        except Exception as e:
            # the report to the detokenizer reads the parameters: keep them only if they are parameters
            req = Req(recv.rid, [], params if isinstance(params, SamplingParams) else SamplingParams())
            fail_request(req, "admitting the request", e)
        return req
