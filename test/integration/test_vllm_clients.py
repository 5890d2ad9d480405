"""Clients of the vLLM ecosystem, unchanged, against a real srt server (both are test dependencies; a test is
skipped, with the reason, where its client cannot be imported or run):

- guidellm 0.8.1 streams chat with vLLM's `stream_options.continuous_usage_stats` and reads the usage in
  every chunk: a short synchronous run completes every request, none errored, each with the output tokens
  it asked for.
- lm-evaluation-harness's API model finds srt's `/tokenizer_info` by itself (`tokenizer_backend` left to
  auto-detection picks `remote`), tokenizes through `/tokenize` as the local tokenizer does, and scores.
"""

from __future__ import annotations

import json

import httpx
import pytest

from srt.tokenizer_loading import load_tokenizer
from test.integration.conftest import ServerHandle
from test.integration.guidellm_client import guidellm_binary, run_guidellm

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
GUIDELLM_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 3, 32, 8


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server


@pytest.mark.skipif(
    guidellm_binary() is None, reason="guidellm is not installed (pip install guidellm==0.8.1)"
)
def test_guidellm_completes_every_request(server: ServerHandle, tmp_path):
    tokenizer_path = httpx.get(f"{server.base_url}/model_info", timeout=10).json()["tokenizer_path"]
    tokenizer_dir = tokenizer_path
    if tokenizer_path.endswith(".gguf"):  # AutoTokenizer reads a directory: the one srt builds from the file
        tokenizer_dir = str(tmp_path / "tokenizer")
        load_tokenizer(tokenizer_path).save_pretrained(tokenizer_dir)
    bench = run_guidellm(
        server.base_url,
        tokenizer_dir,
        GUIDELLM_REQUESTS,
        PROMPT_TOKENS,
        OUTPUT_TOKENS,
        tmp_path / "guidellm.json",
    )
    state, done = bench["scheduler_state"], bench["requests"]["successful"]
    counts = {k: v for k, v in state.items() if k.endswith("_requests")}
    assert state["successful_requests"] == GUIDELLM_REQUESTS and state["errored_requests"] == 0, counts
    assert [r["output_tokens"] for r in done] == [OUTPUT_TOKENS] * GUIDELLM_REQUESTS
    assert all(
        json.loads(r["request_args"])["body"]["stream_options"]["continuous_usage_stats"] for r in done
    )


def test_lm_eval_uses_the_servers_tokenizer_remotely(server: ServerHandle, model_assets_dir):
    api_models = pytest.importorskip(
        "lm_eval.models.openai_completions", reason="lm-eval is not installed (pip install 'lm_eval[api]')"
    )
    from lm_eval.api.instance import Instance

    lm = api_models.LocalCompletionsAPI(
        base_url=f"{server.openai_base_url}/completions", model=MODEL, num_concurrent=1, max_retries=1
    )
    assert lm.tokenizer_backend == "remote"  # auto-detected from /tokenizer_info
    local = load_tokenizer(model_assets_dir)
    text = "The quick brown fox jumps over the lazy dog."
    assert lm.tok_encode(text) == local.encode(text, add_special_tokens=False)
    assert lm.eot_token_id == local.eos_token_id
    context = "The capital of France is"
    paris, banana = lm.loglikelihood(
        [
            Instance(request_type="loglikelihood", doc={}, arguments=(context, c), idx=i)
            for i, c in enumerate((" Paris", " banana"))
        ]
    )
    assert paris[0] > banana[0] and paris[1] is True
