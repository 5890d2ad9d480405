"""Embeddings (--is-embedding; docs/embeddings.md): pooling, the vector's wire format, the request model, and
the scheduler's pooled prefill against transformers' hidden states on the same weights."""

from __future__ import annotations

import base64
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from srt.http_server.openai.serving_embedding import (
    EMBEDDING_PATHS,
    GENERATION_PATHS,
    EmbeddingRequest,
    EncodeRequest,
    RouteKindMiddleware,
    encode_embedding,
)
from srt.http_server.request_types import MAX_PROMPTS
from srt.io_struct import BatchTokenIDOut, FinishReason, TokenizedGenerateReqInput
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.pooling import add_chunk, finish_embedding, needs_every_token, pool_rows
from srt.scheduler.runner_builder import build_runner
from srt.scheduler.scheduler import Scheduler
from srt.server_args import POOLING_LAST, POOLING_MEAN, POOLING_TYPES, ServerArgs

# fp32 end to end: srt's attention and kernels against transformers' eager ones.
TOLERANCE = 1e-4
VOCAB_LOW, VOCAB_HIGH = 10, 200  # synthetic prompts' token ids (no special tokens)


def vector(raw: bytes) -> np.ndarray:
    """A vector off the wire, decoded as OpenAI's client decodes base64 (little-endian float32)."""
    return np.frombuffer(raw, dtype="<f4")


# ---------------------------------------------------------------- pooling
def test_pool_rows_takes_each_requests_last_row_or_the_sum_of_its_rows():
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # rows 0..5: requests of 1, 3 and 2 rows
    counts = [1, 3, 2]
    assert pool_rows(hidden, counts, POOLING_LAST).tolist() == [[0, 1], [6, 7], [10, 11]]
    assert pool_rows(hidden, counts, POOLING_MEAN).tolist() == [[0, 1], [2 + 4 + 6, 3 + 5 + 7], [18, 20]]


def test_chunks_add_up_to_the_whole_prompts_pooling():
    hidden = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    for pooling in POOLING_TYPES:
        whole = finish_embedding(pool_rows(hidden, [7], pooling)[0], 7, pooling)
        pooled = None
        for rows in (hidden[:3], hidden[3:4], hidden[4:]):
            pooled = add_chunk(pooled, pool_rows(rows, [len(rows)], pooling)[0], pooling)
        np.testing.assert_allclose(vector(finish_embedding(pooled, 7, pooling)), vector(whole), atol=1e-6)


def test_the_vector_is_l2_normalized_little_endian_float32():
    pooled = torch.tensor([3.0, 4.0])
    raw = finish_embedding(pooled, 1, POOLING_LAST)
    assert raw == np.array([0.6, 0.8], dtype="<f4").tobytes()
    mean = vector(finish_embedding(torch.tensor([6.0, 8.0]), 2, POOLING_MEAN))
    np.testing.assert_allclose(mean, [0.6, 0.8], rtol=1e-6)  # normalizing makes the mean's scale moot
    assert needs_every_token(POOLING_MEAN) and not needs_every_token(POOLING_LAST)


def test_encoding_formats_float_and_base64_decode_to_the_same_vector():
    raw = np.array([0.25, -1.5, 3.0e-7], dtype="<f4").tobytes()
    floats = encode_embedding(raw, "float")
    assert floats == [0.25, -1.5, float(np.float32(3.0e-7))]
    text = encode_embedding(raw, "base64")
    assert isinstance(text, str)
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(text), dtype="float32"), floats)


# ---------------------------------------------------------------- the request model
@pytest.mark.parametrize(
    "value, prompts",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
    ],
    ids=["string", "strings", "token-ids", "token-id-lists"],
)
def test_input_takes_openais_four_forms(value, prompts):
    assert EmbeddingRequest.model_validate({"input": value}).input == prompts


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "dimensions": 32}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a", [1]]}, "input"),
        ({"input": ["a"] * (MAX_PROMPTS + 1)}, "input"),
        ({"input": "x", "temperature": 0.5}, "temperature"),
        ({}, "input"),
    ],
    ids=["dimensions", "format", "empty", "empty-ids", "mixture", "too-many", "unknown", "missing"],
)
def test_bad_requests_name_the_field(body, param):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        EmbeddingRequest.model_validate(body)
    assert param in str(info.value)


def test_dimensions_null_is_not_used():
    assert EmbeddingRequest.model_validate({"input": "x", "dimensions": None}).input == ["x"]


def test_an_embedding_server_defaults_to_unquantized_weights():
    """The CPU's int8 default was gated on generated text; an embedding server's vectors must match fp32."""
    assert ServerArgs(is_embedding=True).quantization_or_default == "none"
    assert ServerArgs(is_embedding=True, quantization="w8a8_int8").quantization_or_default == "w8a8_int8"
    assert ServerArgs().quantization_or_default is None  # the device's default


def test_the_flags_parse_and_are_documented():
    args = ServerArgs.parse(["--is-embedding", "--pooling-type", "mean"])
    assert args.is_embedding and args.pooling_type == POOLING_MEAN
    assert ServerArgs.parse([]).pooling_type == POOLING_LAST
    with pytest.raises(SystemExit):
        ServerArgs.parse(["--pooling-type", "cls"])
    doc = (Path(__file__).resolve().parents[2] / "docs" / "embeddings.md").read_text()
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in doc.splitlines()
        if line.startswith("| `--")
    }
    assert rows["`--is-embedding`"] == "off"
    assert rows["`--pooling-type`"] == f"`{POOLING_LAST}`"
    assert all(f"`{p}`" in doc for p in POOLING_TYPES)


# ---------------------------------------------------------------- the scheduler against transformers
@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """transformers' final hidden states (the base model's `last_hidden_state`) of a prompt, fp32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def embed(ids: list[int], pooling: str) -> np.ndarray:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        pooled = hidden[-1] if pooling == POOLING_LAST else hidden.mean(0)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()

    return embed


def embedding_scheduler(model_dir: str, **flags) -> Scheduler:
    """An embedding server's scheduler, its runner built from the flags as the server builds it (so with the
    embedding server's default quantization)."""
    args = ServerArgs(
        is_embedding=True, dtype="float32", max_total_tokens=4096, max_running_requests=16, **flags
    )
    return Scheduler(args, build_runner(args, model_dir))


def run(sched: Scheduler, prompts: list[list[int]]) -> list[BatchTokenIDOut]:
    for i, ids in enumerate(prompts):
        sched.add_request(TokenizedGenerateReqInput(f"e{i}", ids, SamplingParams(max_new_tokens=0)))
    outs = []
    for _ in range(100):
        out = sched.step()
        if out is not None:
            outs.append(out)
        if sched.is_idle:
            return outs
    raise AssertionError("the scheduler did not finish the embeddings")


def finals(outs: list[BatchTokenIDOut]) -> dict[str, tuple]:
    """rid -> (vector, finish reason, prompt tokens, completion tokens, cached tokens) of its final entry."""
    got = {}
    for out in outs:
        for i, rid in enumerate(out.rids):
            if out.finished_reasons[i] is not None:
                raw = out.embeddings[i] if out.embeddings is not None else None
                got[rid] = (
                    raw,
                    out.finished_reasons[i],
                    out.prompt_tokens[i],
                    out.completion_tokens[i],
                    out.cached_tokens[i],
                )
    return got


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("pooling", POOLING_TYPES)
@pytest.mark.parametrize("chunk", [2048, 7], ids=["whole", "chunked"])
def test_embeddings_equal_transformers_pooled_hidden_states(tiny_model_dir, reference, pooling, chunk):
    """A batch of prompts of several lengths, prefilled whole or in chunks of 7 tokens (a long prompt spans
    several steps, sharing some with shorter ones): each vector equals transformers' pooled, normalized
    hidden states to 1e-4, and each request is a finished one with its prompt tokens and none generated."""
    sched = embedding_scheduler(tiny_model_dir, pooling_type=pooling, chunked_prefill_size=chunk)
    assert sched.runner.quantization == "none"
    prompts = prompts_of([1, 5, 23, 40])
    got = finals(run(sched, prompts))
    assert set(got) == {f"e{i}" for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        raw, reason, prompt_tokens, completion_tokens, _ = got[f"e{i}"]
        assert reason == FinishReason("stop")
        assert (prompt_tokens, completion_tokens) == (len(ids), 0)
        np.testing.assert_allclose(vector(raw), reference(ids, pooling), atol=TOLERANCE)
        assert abs(np.linalg.norm(vector(raw)) - 1.0) < 1e-5


# docs/embeddings.md, "Quantized embeddings": the least cosine to fp32 an int8 embedding server promises.
# Measured: 0.99972 (last) and 0.99983 (mean) on the tiny Llama, 0.99944 on SmolLM2-135M.
INT8_MIN_COSINE = 0.999


@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_int8_vectors_keep_the_documented_cosine_to_fp32(tiny_model_dir, reference, pooling):
    """`--quantization w8a8_int8` (the CPU's generating default for a Hugging Face directory, which an
    embedding server takes only when asked): each vector's cosine to transformers' fp32 one is at least
    the documented bound, and the vectors are not the fp32 ones (the int8 path ran)."""
    sched = embedding_scheduler(tiny_model_dir, pooling_type=pooling, quantization="w8a8_int8")
    assert sched.runner.quantization == "w8a8_int8"
    prompts = prompts_of([1, 5, 23, 40], seed=5)
    got = finals(run(sched, prompts))
    cosines = [float(vector(got[f"e{i}"][0]) @ reference(ids, pooling)) for i, ids in enumerate(prompts)]
    assert min(cosines) >= INT8_MIN_COSINE, cosines
    assert min(cosines) < 1 - 1e-6, cosines


@pytest.mark.parametrize("pooling", POOLING_TYPES)
def test_a_repeated_prompt_gets_the_same_vector_and_mean_never_reads_the_cache(tiny_model_dir, pooling):
    """Last pooling may serve a repeated prompt's prefix from the radix cache (only the last token's state is
    read); mean pooling reads every token's, so its server has no prefix cache at all."""
    sched = embedding_scheduler(tiny_model_dir, pooling_type=pooling)
    ids = prompts_of([30], seed=3)[0]
    first = finals(run(sched, [ids]))["e0"]
    again = finals(run(sched, [ids]))["e0"]
    np.testing.assert_allclose(vector(again[0]), vector(first[0]), atol=1e-6)
    assert again[4] == (len(ids) - 1 if pooling == POOLING_LAST else 0)


def test_nothing_decodes_and_the_kv_is_returned(tiny_model_dir):
    sched = embedding_scheduler(tiny_model_dir, disable_radix_cache=True)
    free = sched.allocator.available_size()
    run(sched, prompts_of([12, 9]))
    assert not sched.running and sched.allocator.available_size() == free


# ---------------------------------------------------------------- the server's kind
@pytest.mark.parametrize("is_embedding", [False, True], ids=["generating", "embedding"])
def test_each_kind_of_server_refuses_the_others_routes(is_embedding):
    """A 400 naming the flag, before the body is read; the server's own routes pass through."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    for path in (*EMBEDDING_PATHS, *GENERATION_PATHS):
        app.post(path)(lambda: {"ok": True})
    app.add_middleware(RouteKindMiddleware, is_embedding=is_embedding)
    client = TestClient(app)
    own, other = (
        (GENERATION_PATHS, EMBEDDING_PATHS) if not is_embedding else (EMBEDDING_PATHS, GENERATION_PATHS)
    )
    for path in other:
        r = client.post(path, content=b"not even json")
        assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"], path
        assert r.json()["error"]["code"] == "unsupported_route"
    for path in own:
        assert client.post(path).json() == {"ok": True}, path


# ---------------------------------------------------------------- SGLang's /encode body
@pytest.mark.parametrize(
    "body, inputs, field, batched",
    [
        ({"text": "hi"}, ["hi"], "text", False),
        ({"text": ["a"]}, ["a"], "text", True),  # a list in: a list out, whatever its length
        ({"input_ids": [1, 2]}, [[1, 2]], "input_ids", False),
        ({"input_ids": [[1], [2, 3]]}, [[1], [2, 3]], "input_ids", True),
    ],
)
def test_encode_body_keeps_the_shape_it_came_in(body, inputs, field, batched):
    req = EncodeRequest.model_validate(body)
    assert req.inputs == (inputs, field) and req.batched is batched


@pytest.mark.parametrize(
    "body, needle",
    [
        ({}, "exactly one of `text` and `input_ids`"),
        ({"text": "a", "input_ids": [1]}, "exactly one of `text` and `input_ids`"),
        ({"text": [1, 2]}, "`text` must be a string or a list of strings"),
        ({"input_ids": "a"}, "`input_ids` must be token ids"),
        ({"text": "a", "dimensions": 8}, "Matryoshka"),
        ({"text": "a", "sampling_params": {}}, "sampling_params"),
    ],
)
def test_encode_body_refuses_naming_the_problem(body, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        EncodeRequest.model_validate(body)
