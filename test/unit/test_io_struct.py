"""Every message that crosses a process boundary survives the ring's serializer unchanged."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest
import zmq

from srt import io_struct
from srt.io_struct import (
    AbortReq,
    BatchStrOut,
    BatchTokenIDOut,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    LoadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
    TraceContext,
    UnloadLoRAAdapterReq,
)
from srt.sampling.sampling_params import SamplingParams
from srt.speculative.stats import SpecRequestStats


def _meta(**extra):
    return dict(
        rids=["a", "b"],
        output_ids=[[1, 2], [3]],
        finished_reasons=[None, FinishReason("stop", matched="</s>")],
        prompt_tokens=[10, 20],
        completion_tokens=[2, 7],
        cached_tokens=[0, 16],
        queued_ts=[1.5, 1.25],
        scheduled_ts=[2.0, 1.75],
        first_token_ts=[3.0, 2.5],
        token_ts=[[3.0, 3.1], [3.1]],
        num_retractions=[0, 1],
        output_token_logprobs=[[-0.1, -0.2], [-1.0]],
        output_top_logprobs=[[[(1, -0.1)], [(2, -0.2)]], [[(3, -1.0), (4, -2.0)]]],
        **extra,
    )


MESSAGES = [
    TokenizedGenerateReqInput(
        "rid-1", [1, 2, 3], SamplingParams(max_new_tokens=7, stop=["\n"], seed=3, logprobs=2), True, "hé 🎉"
    ),
    TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "srt=1", 3),
    TokenizedGenerateReqInput("rid-2", [4], SamplingParams(), trace=TraceContext("00-ab-cd-01")),
    TokenizedGenerateReqInput("rid-3", [5], SamplingParams(), prediction_ids=[5, 6], lora_name="sql-lora"),
    LoadLoRAAdapterReq("load-1", "sql-lora", "/adapters/sql", pinned=True),
    UnloadLoRAAdapterReq("unload-1", "sql-lora"),
    LoRAAdapterReqOutput("load-1", False, "LoRA adapter 'sql-lora': rank 64 exceeds --max-lora-rank 16"),
    AbortReq("rid-1", silent=True),
    AbortReq(""),
    FlushCacheReq(),
    FlushCacheReqOutput(False, "requests running"),
    SchedulerReady(1024, 1000, 2048, 32, "torch_native"),
    FinishReason("error", message="boom"),
    BatchTokenIDOut(**_meta(), skip_special_tokens=[True, False], stop_strs=[["x"], []]),
    BatchTokenIDOut(**_meta(), trace_contexts=[TraceContext("00-ab-cd-01", level=2), None]),
    BatchStrOut(**_meta(), output_strs=["hé", "🎉"]),
    BatchStrOut(**_meta(spec_stats=[None, SpecRequestStats(2, 6, 5, [0, 0, 1, 1])]), output_strs=["a", "b"]),
    BatchTokenIDOut(**_meta(embeddings=[None, b"\x00\x00\x80?\x00\x00\x00\x80"])),  # [1.0, -0.0]
    BatchStrOut(**_meta(embeddings=[b"\x00\x00\x80?", None]), output_strs=["", ""]),
]


def test_every_message_class_is_covered():
    defined = {
        obj
        for _, obj in inspect.getmembers(io_struct, inspect.isclass)
        if dataclasses.is_dataclass(obj) and obj.__module__ == io_struct.__name__
    }
    covered = {type(m) for m in MESSAGES}
    # BatchOutMeta is only a base class; it never travels on its own.
    assert defined - covered == {io_struct.BatchOutMeta}


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_pickle_round_trip(msg):
    back = pickle.loads(pickle.dumps(msg))
    assert type(back) is type(msg)
    assert back == msg


def test_round_trip_over_a_zmq_ipc_socket(tmp_path):
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/sock"
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    try:
        for msg in MESSAGES:
            push.send_pyobj(msg)
        received = [pull.recv_pyobj() for _ in MESSAGES]
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    assert received == MESSAGES
