"""An embedding server (--is-embedding) through the real `openai` client: vectors equal transformers' pooled
hidden states on the same weights, in both encodings; docs/api.md's "Parameters of /v1/embeddings" table
holds cell by cell; the counters count each input as a finished request with prompt tokens and none generated;
SGLang's `/encode` answers the same vectors in SGLang's shape; the generation routes are a 400; gateways
read `is_embedding`. One server (the tiny random Llama, default
pooling and quantization) serves every case."""

from __future__ import annotations

import base64
import inspect
import re
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from openai.resources.embeddings import Embeddings as EmbeddingsResource

from srt.http_server.openai.serving_embedding import GENERATION_PATHS, EmbeddingRequest
from srt.metrics.text_format import parse_metrics_text, total
from srt_bench.gateway import ROUND_ROBIN, running_gateway, smg_problem
from test.integration.conftest import REPO_ROOT, running_server

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4  # fp32 on both sides (the embedding server's default quantization is none)
TIMEOUT = 60.0
TEXTS = ["Hello world", "An embedding server pools the final hidden states of a prompt.", "x"]
IDS = [[5, 17, 99, 300], [42]]
# The client's own arguments, not request parameters.
CLIENT_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
# A valid value of every parameter, sent where the table says refused or ignored.
SAMPLE = {"input": "hi", "model": None, "encoding_format": "float", "dimensions": 16, "user": "u"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server("--model-path", tiny_model_dir, "--is-embedding") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """transformers' base model on the same weights: each input's last token's `last_hidden_state`,
    normalized (the server's default --pooling-type last)."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def embed(value: str | list[int]) -> np.ndarray:
        ids = tokenizer(value).input_ids if isinstance(value, str) else value
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()

    return embed


@pytest.mark.parametrize(
    "encoding_format", ["float", "base64", None], ids=["float", "base64", "client-default"]
)
@pytest.mark.parametrize("inputs", [TEXTS, IDS, TEXTS[0], IDS[0]], ids=["texts", "id-lists", "text", "ids"])
def test_vectors_equal_transformers(client, model_name, reference, inputs, encoding_format):
    """Every input form and encoding through `client.embeddings.create` (which asks for base64 by default
    and decodes it itself); the raw base64 decodes as little-endian float32 to the same vector."""
    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    result = client.embeddings.create(model=model_name, input=inputs, **kwargs)
    expected_inputs = inputs if isinstance(inputs, list) and not isinstance(inputs[0], int) else [inputs]
    assert [d.index for d in result.data] == list(range(len(expected_inputs)))
    for d, value in zip(result.data, expected_inputs, strict=True):
        got = (
            np.frombuffer(base64.b64decode(d.embedding), "<f4")
            if encoding_format == "base64"
            else d.embedding
        )
        np.testing.assert_allclose(np.asarray(got, dtype=np.float64), reference(value), atol=TOLERANCE)
    assert result.model == model_name
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0


# ---------------------------------------------------------------- the documented table
def documented_table() -> dict[str, str]:
    """{parameter: status} from docs/api.md's "Parameters of /v1/embeddings" table."""
    lines = (REPO_ROOT / "docs" / "api.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| parameter | embeddings |"))
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] in {"honoured", "refused", "ignored"}, line
        for name in re.findall(r"`([^`]+)`", cells[0]):
            table[name] = cells[1]
    return table


TABLE = documented_table()


def test_the_table_lists_the_request_model_and_the_clients_parameters():
    assert set(TABLE) == set(EmbeddingRequest.model_fields) | set(EmbeddingRequest.refused)
    client_params = set(inspect.signature(EmbeddingsResource.create).parameters) - CLIENT_ONLY
    assert client_params <= set(TABLE), client_params - set(TABLE)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.openai_base_url}/embeddings", json=body, timeout=TIMEOUT)


@pytest.mark.parametrize("name, status", sorted(TABLE.items()))
def test_each_cell_holds(server, name, status):
    """refused: a 400 naming it (null is "not used"); ignored: the same vector as without it; honoured:
    checked by the vector tests above, and here that a valid value is accepted."""
    plain = post(server, {"input": "hi"})
    assert plain.status_code == 200
    r = post(server, {"input": "hi", name: SAMPLE[name]})
    if status == "refused":
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
        assert post(server, {"input": "hi", name: None}).status_code == 200
        return
    assert r.status_code == 200, r.text
    if status == "ignored":
        assert r.json()["data"] == plain.json()["data"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[]]}, "input"),
        ({"input": [10**9]}, "input"),  # outside the vocabulary
        ({"input": "hi", "temperature": 0}, "temperature"),
        ({"input": "hi", "model": "other"}, "model"),
    ],
    ids=["format", "empty-ids", "vocabulary", "unknown", "model"],
)
def test_bad_input_names_its_field_and_the_server_keeps_serving(server, body, param):
    r = post(server, body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert post(server, {"input": "still serving"}).status_code == 200


# ---------------------------------------------------------------- SGLang's /encode
def encode(server, body: dict, method: str = "POST") -> httpx.Response:
    return httpx.request(method, f"{server.base_url}/encode", json=body, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "body, values, batched",
    [
        ({"text": TEXTS[0]}, [TEXTS[0]], False),
        ({"text": TEXTS}, TEXTS, True),
        ({"text": TEXTS[:1]}, TEXTS[:1], True),  # a list in is a list out, whatever its length
        ({"input_ids": IDS[0]}, [IDS[0]], False),
        ({"input_ids": IDS}, IDS, True),
    ],
    ids=["text", "texts", "one-text-list", "ids", "id-lists"],
)
def test_encode_answers_sglangs_shape_with_the_same_vectors(server, reference, body, values, batched):
    """SGLang's native route: `{"embedding": [floats], "meta_info": {...}}` per input (a list for a list),
    the vector /v1/embeddings answers; its meta_info names the request and counts its prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.flags[server.flags.index("--model-path") + 1])
    r = encode(server, {**body, "rid": "enc"})
    assert r.status_code == 200, r.text
    results = r.json() if batched else [r.json()]
    assert isinstance(r.json(), list) == batched
    rids = ["enc"] if len(values) == 1 else [f"enc-{i}" for i in range(len(values))]
    for result, value, rid in zip(results, values, rids, strict=True):
        np.testing.assert_allclose(result["embedding"], reference(value), atol=TOLERANCE)
        meta = result["meta_info"]
        tokens = len(tokenizer(value).input_ids) if isinstance(value, str) else len(value)
        assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"]) == (rid, tokens, 0)
        assert meta["finish_reason"]["type"] == "stop" and meta["e2e_latency"] > 0


def test_encode_takes_put_as_sglang_does(server):
    assert (
        encode(server, {"text": "hi"}, "PUT").json()["embedding"]
        == encode(server, {"text": "hi"}).json()["embedding"]
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": "hi", "input_ids": [1]}, "text"),
        ({}, "text"),
        ({"input_ids": [10**9]}, "input_ids"),  # outside the vocabulary
        ({"input_ids": [[]]}, "input_ids"),
        ({"text": "hi", "sampling_params": {}}, "sampling_params"),  # /generate's, not /encode's
        ({"text": "hi", "dimensions": 8}, "dimensions"),
        ({"text": "hi", "lora_path": "none-such"}, "model"),
    ],
    ids=["both", "neither", "vocabulary", "empty-ids", "unknown", "dimensions", "adapter"],
)
def test_bad_encode_input_names_its_field_and_the_server_keeps_serving(server, body, param):
    r = encode(server, body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert encode(server, {"text": "still serving"}).status_code == 200


# ---------------------------------------------------------------- the server's kind
@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_generation_routes_are_refused(server, path):
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "text": "hi", "input": "hi"}
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert "--is-embedding" in r.json()["error"]["message"]


def test_openai_client_gets_a_bad_request_for_completions(client, model_name):
    with pytest.raises(openai.BadRequestError, match="embeddings"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=2)


def test_gateways_read_is_embedding(server):
    info = httpx.get(f"{server.base_url}/server_info", timeout=TIMEOUT).json()
    assert info["is_embedding"] is True and info["pooling_type"] == "last" and info["quantization"] == "none"
    assert httpx.get(f"{server.base_url}/model_info", timeout=TIMEOUT).json()["is_generation"] is False
    assert httpx.get(f"{server.base_url}/health_generate", timeout=TIMEOUT).status_code == 200


@pytest.mark.skipif(smg_problem() is not None, reason=str(smg_problem()))
def test_behind_the_shepherd_model_gateway(server, client, model_name):
    """SMG reads the worker as an SGLang embedding worker (`is_embedding` from /server_info) and proxies
    /v1/embeddings: the `openai` client gets through it the vectors srt answers directly."""
    direct = client.embeddings.create(model=model_name, input=TEXTS)
    with running_gateway([server.base_url], ROUND_ROBIN) as gw:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # the gateway reads its workers' labels once it has started
            listed = httpx.get(f"{gw.base_url}/workers", timeout=TIMEOUT).json()["workers"]
            if listed and "labels" in listed[0]:
                break
            time.sleep(0.2)
        (worker,) = listed
        assert worker["runtime_type"] == "sglang" and worker["labels"]["is_embedding"] == "true"
        via = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        result = via.embeddings.create(model=model_name, input=TEXTS)
    # the same vectors up to float32 rounding: the server batches what arrives together, and a batch of another
    # composition sums in another order (neither SGLang nor vLLM promises batch invariance)
    assert [d.index for d in result.data] == [d.index for d in direct.data]
    for got, want in zip(result.data, direct.data, strict=True):
        np.testing.assert_allclose(got.embedding, want.embedding, rtol=0, atol=1e-5)
    assert result.usage == direct.usage


# ---------------------------------------------------------------- counted truthfully
def scrape(server) -> list:
    return parse_metrics_text(httpx.get(f"{server.base_url}/metrics", timeout=TIMEOUT).text)


def test_each_input_counts_as_a_request_with_prompt_tokens_and_none_generated(server, client, model_name):
    before = scrape(server)
    result = client.embeddings.create(model=model_name, input=TEXTS)
    after = scrape(server)

    def delta(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("sglang:num_requests_total") == len(TEXTS)
    assert delta("sglang:request_success_total", finished_reason="stop") == len(TEXTS)
    assert delta("sglang:prompt_tokens_total") == result.usage.prompt_tokens
    assert delta("sglang:generation_tokens_total") == 0
