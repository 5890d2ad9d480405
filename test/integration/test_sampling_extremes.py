"""Extreme but valid sampling parameters through the real server: answered with what they mean in the limit,
never a 500 or a garbage token. A vanishing temperature or top_p is greedy decoding (they once sampled
token 0 from NaN probabilities, and failed with an index error, respectively)."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.openai_base_url, api_key=default_server.api_key)


def complete(client, **params) -> str:
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, **params)
    return reply.choices[0].text


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e-40},
        {"temperature": 5e-324},
        {"temperature": 1.0, "top_p": 1e-300, "seed": 1},
        {"temperature": 0.8, "seed": 2, "extra_body": {"min_p": 1.0}},
        {"temperature": 1e-300, "n": 3},
    ],
    ids=["temperature-1e-40", "temperature-denormal", "top_p-1e-300", "min_p-1", "n3-temperature-1e-300"],
)
def test_vanishing_randomness_is_greedy(client, params):
    """(min_p 1 keeps only the best token: greedy too.)"""
    greedy = complete(client, temperature=0.0)
    assert greedy.strip(), "the greedy continuation is text"
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, **params)
    assert [c.text for c in reply.choices] == [greedy] * params.get("n", 1)


def test_an_overflowing_repetition_penalty_is_answered(client):
    reply = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.7,
        seed=3,
        extra_body={"repetition_penalty": 1e-300},
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6


@pytest.mark.parametrize("temperature", [3.5e38, 1e300])
def test_a_temperature_past_float32_with_a_grammar_is_answered(client, temperature):
    """Once a 500: the grammar's masked tokens became NaN and the sampler drew a token the grammar forbids."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a number"}],
        max_tokens=4,
        temperature=temperature,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].message.content.startswith("{")
