"""Log-probabilities and logit bias on a real server through the real `openai` client: `logit_bias` changes greedy
output, completions `echo` + `logprobs` (also with `max_tokens=0`, as lm-evaluation-harness scores) returns
the prompt's log-probabilities equal to a teacher-forced transformers forward, after a prefix-cache hit and
over chunked prefill too, and `usage` never counts more cached than prompt tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from test.integration.conftest import running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# Small enough that LONG_PROMPT is prefilled in several chunks.
CHUNKED_PREFILL_SIZE = 64
TOLERANCE = 1e-4
PROMPT = "The capital of France is Paris. The capital of Germany is"
LONG_PROMPT = " ".join(f"Step {i}: add {i} apples to the basket and count them again." for i in range(12))
QUESTION = [{"role": "user", "content": "Name one colour of the rainbow."}]


@pytest.fixture(scope="module")
def server():
    # fp32: logprobs are compared with transformers' within 1e-4
    with running_server(
        "--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE), "--quantization", "none"
    ) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def teacher_forced():
    """Prompt ids -> per position i >= 1, log p(token i | tokens < i) under transformers on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from srt.model_source import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32).eval()

    def score(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]

    return score


def greedy_first_token(server, ids: list[int]) -> int:
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["output_ids"][0]


def chat_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


# ---- logit_bias ----------------------------------------------------------------------------------------
def test_logit_bias_bans_and_forces_tokens_in_chat(server, client, tokenizer):
    top = greedy_first_token(server, chat_ids(tokenizer))
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=1)
    assert plain.choices[0].message.content == tokenizer.decode([top])
    banned = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=1, logit_bias={str(top): -100}
    )
    assert banned.choices[0].message.content != plain.choices[0].message.content
    forced_id = tokenizer(" zebra", add_special_tokens=False).input_ids[0]
    forced = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=1, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].message.content == tokenizer.decode([forced_id])


def test_logit_bias_bans_the_greedy_token_in_completions(server, client, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    top = greedy_first_token(server, ids)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3)
    banned = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3, logit_bias={str(top): -100}
    )
    assert plain.choices[0].text.startswith(tokenizer.decode([top]))
    assert banned.choices[0].text != plain.choices[0].text


def test_logit_bias_outside_the_vocabulary_is_a_400(server, tokenizer):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "logit_bias": {str(len(tokenizer)): 1}}),
        ("/v1/chat/completions", {"messages": QUESTION, "logit_bias": {"x": 1}}),
        ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 101}}),
    ):
        r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


# ---- prompt logprobs -----------------------------------------------------------------------------------
def echo_scores(client, prompt: str, max_tokens: int = 0, logprobs: int = 1):
    r = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=logprobs, max_tokens=max_tokens, temperature=0
    )
    return r, r.choices[0]


def assert_prompt_logprobs(choice, ids: list[int], ref: list[float], tokenizer) -> None:
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.text_offset[0] == 0
    got = lp.token_logprobs[1 : len(ids)]
    assert len(got) == len(ref)
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < TOLERANCE
    for value, top in zip(got, lp.top_logprobs[1 : len(ids)], strict=True):
        assert max(top.values()) >= value - TOLERANCE  # the best alternative is at least as likely


def test_echo_with_zero_tokens_returns_the_prompt_and_its_logprobs(client, tokenizer, teacher_forced):
    ids = tokenizer(PROMPT).input_ids
    r, choice = echo_scores(client, PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert_prompt_logprobs(choice, ids, teacher_forced(ids), tokenizer)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0


def test_echo_logprobs_after_a_prefix_cache_hit(client, tokenizer, teacher_forced):
    prompt = PROMPT + " Berlin, and the capital of Italy is"
    ids = tokenizer(prompt).input_ids
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)  # now cached
    warm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    _, choice = echo_scores(client, prompt)
    assert_prompt_logprobs(choice, ids, teacher_forced(ids), tokenizer)


def test_echo_logprobs_over_chunked_prefill(client, tokenizer, teacher_forced):
    ids = tokenizer(LONG_PROMPT).input_ids
    assert len(ids) > 2 * CHUNKED_PREFILL_SIZE
    _, choice = echo_scores(client, LONG_PROMPT)
    assert_prompt_logprobs(choice, ids, teacher_forced(ids), tokenizer)


def test_echo_logprobs_are_followed_by_the_completions(client, tokenizer, teacher_forced):
    ids = tokenizer(PROMPT).input_ids
    _, choice = echo_scores(client, PROMPT, max_tokens=3, logprobs=2)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 3
    assert choice.text == PROMPT + "".join(lp.tokens[len(ids) :])
    assert lp.text_offset[len(ids)] == len(PROMPT)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert_prompt_logprobs(choice, ids, teacher_forced(ids), tokenizer)


def test_zero_tokens_without_echo_returns_empty_text(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0


def test_streamed_echo_carries_the_prompt_logprobs(server, tokenizer, teacher_forced):
    ids = tokenizer(PROMPT).input_ids
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True}
    values: list = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                values += logprobs["token_logprobs"] if logprobs else []
    assert values[0] is None and len(values) == len(ids) + 2
    ref = teacher_forced(ids)
    assert max(abs(a - b) for a, b in zip(values[1 : len(ids)], ref, strict=True)) < TOLERANCE


def test_native_generate_returns_input_logprobs_in_sglang_shape(server, tokenizer, teacher_forced):
    ids = tokenizer(PROMPT).input_ids
    ref = teacher_forced(ids)
    for start in (0, 4):
        r = httpx.post(
            f"{server.base_url}/generate",
            json={
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": start,
                "top_logprobs_num": 2,
            },
            timeout=120,
        )
        meta = r.json()["meta_info"]
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == ids[start:] and all(e[2] is None for e in entries)
        got = [e[0] for e in entries]
        if start == 0:
            assert got[0] is None and meta["input_top_logprobs"][0] is None
            got = got[1:]
        assert max(abs(a - b) for a, b in zip(got, ref[max(start, 1) - 1 :], strict=True)) < TOLERANCE
        assert all(len(row) == 2 for row in meta["input_top_logprobs"][1:])
    bad = httpx.post(
        f"{server.base_url}/generate",
        json={"input_ids": ids, "return_logprob": True, "logprob_start_len": len(ids)},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len"


# ---- usage ---------------------------------------------------------------------------------------------
def token_counters(server) -> tuple[float, float]:
    from srt.metrics.text_format import parse_metrics_text, total

    samples = parse_metrics_text(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
    return total(samples, "sglang:prompt_tokens_total"), total(samples, "sglang:cached_tokens_total")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_cached_tokens_never_exceed_prompt_tokens(server, client, n):
    """Each prompt counts once in `usage` however many samples it has, cached tokens likewise, and
    `/metrics`' counters follow the same rule: they grow by exactly what the responses report."""
    prompt = f"Usage check {n}: " + LONG_PROMPT[:200]
    messages = [{"role": "user", "content": prompt}]
    before = token_counters(server)
    usages = []
    for _ in range(2):  # the second time the prompt is a prefix-cache hit
        cmpl = client.completions.create(model=MODEL, prompt=prompt, n=n, max_tokens=2, temperature=0.8)
        chat = client.chat.completions.create(
            model=MODEL, messages=messages, n=n, max_tokens=2, temperature=0.8
        )
        usages += [cmpl.usage, chat.usage]
    for usage in usages:
        assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    assert cmpl.usage.prompt_tokens_details.cached_tokens > 0
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    after = token_counters(server)
    assert after[0] - before[0] == sum(u.prompt_tokens for u in usages)
    assert after[1] - before[1] == sum(u.prompt_tokens_details.cached_tokens for u in usages)
