"""Completions `echo` + `logprobs` on a prompt of a few thousand tokens, through a real server: its prefill
spans two chunked-prefill steps and each step's positions go through the LM head in many blocks
(PROMPT_LOGPROB_BLOCK_ROWS), and every prompt token's logprob still equals a teacher-forced transformers
forward, with its best alternatives."""

from __future__ import annotations

import pytest

from srt.model_executor.model_runner import PROMPT_LOGPROB_BLOCK_ROWS
from srt.server_args import ServerArgs

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4  # fp32 server against fp32 transformers, as test_openai_logprobs_and_bias
TOP = 5
PROMPT_TOKENS_AT_LEAST = 3000
SENTENCE = (
    "Item {i}: the {i}th crate of apples left the harbour on a grey morning and reached the market late."
)


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # fp32, the default chunked prefill


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> tuple[str, list[int]]:
    sentences, ids = [], []
    while len(ids) < PROMPT_TOKENS_AT_LEAST:
        sentences.append(SENTENCE.format(i=len(sentences)))
        ids = tokenizer(" ".join(sentences)).input_ids
    return " ".join(sentences), ids


@pytest.fixture(scope="module")
def reference(long_prompt):
    """log_softmax of transformers' logits at every prompt position (row i scores token i + 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    from srt.model_source import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([long_prompt[1]])).logits[0].float(), dim=-1)


def test_the_setting_spans_chunks_and_blocks(long_prompt):
    chunk = ServerArgs().chunked_prefill_size
    assert chunk < len(long_prompt[1]) and PROMPT_LOGPROB_BLOCK_ROWS < chunk


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_echo_logprobs_of_a_long_prompt_equal_transformers(
    server, tokenizer, long_prompt, reference, max_tokens
):
    text, ids = long_prompt
    client = server.openai_client(timeout=600)
    r = client.completions.create(
        model=MODEL, prompt=text, echo=True, logprobs=TOP, max_tokens=max_tokens, temperature=0
    )
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    got = lp.token_logprobs[1 : len(ids)]
    want = [reference[pos - 1, ids[pos]].item() for pos in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOLERANCE
    for pos, top in enumerate(lp.top_logprobs[1 : len(ids)], start=1):
        best = reference[pos - 1].topk(TOP).values  # (ids that decode alike share one key of `top`)
        assert max(top.values()) == pytest.approx(best[0].item(), abs=TOLERANCE), pos
        assert all((best - value).abs().min() < TOLERANCE for value in top.values()), pos
