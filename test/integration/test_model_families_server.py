"""Every model family srt serves, through a real server: the tiny random configs of test/model_families.py
(with SmolLM2's tokenizer and its vocabulary) served by `python -m srt.launch_server --quantization none`,
one server per family in turn, answer token-id prompts longer than the sliding window with transformers'
greedy tokens (a divergence is accepted only at a near-tie, and not for every prompt). The unit test compares the model runner; this one adds the server's own path (the tokenizer
manager, the scheduler's prefill and decode steps, the detokenizer) for each family's config."""

from __future__ import annotations

import httpx
import pytest
import torch

from test.conftest import assets_config, save_random_model
from test.integration.conftest import running_server
from test.model_families import FAMILIES, ORIGINAL_CONTEXT, WINDOW
from test.unit.model_driver import same_or_diverged_at_a_near_tie

pytestmark = pytest.mark.slow

SEED = 7
# ids valid in any vocabulary of 500 or more, both prompts longer than the window
PROMPTS = [[(7 * i + 3) % 490 + 5 for i in range(n)] for n in (29, 17)]
MAX_TOKENS = 8
TIE = 1e-4
TIMEOUT = 120.0
# as the unit test's prompts: past the window, within LongRoPE's original context
assert all(WINDOW < len(p) and len(p) + MAX_TOKENS <= ORIGINAL_CONTEXT for p in PROMPTS)


def hf_greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the top-1 minus top-2 logit gap at each step."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top2 = [s[0].topk(2).values for s in out.scores]
    return out.sequences[0, len(ids) :].tolist(), [float(v[0] - v[1]) for v in top2]


def srt_greedy(server, ids: list[int]) -> list[int]:
    sampling = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(
        f"{server.base_url}/generate", json={"input_ids": ids, "sampling_params": sampling}, timeout=TIMEOUT
    )
    r.raise_for_status()
    return r.json()["output_ids"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_server_gives_transformers_greedy_tokens(name, model_assets_dir, tmp_path):
    config, model_class = FAMILIES[name]()
    config.architectures = [model_class.__name__]
    config.vocab_size = assets_config(model_assets_dir)["vocab_size"]  # the tokenizer's ids
    model_dir = save_random_model(tmp_path, model_assets_dir, SEED, config)
    hf_model = model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    hf_model.eval()
    with running_server("--model-path", model_dir, "--quantization", "none") as server:
        answers = [srt_greedy(server, prompt) for prompt in PROMPTS]
    exact = 0
    for prompt, got in zip(PROMPTS, answers, strict=True):
        assert len(got) == MAX_TOKENS
        exact += same_or_diverged_at_a_near_tie(got, *hf_greedy(hf_model, prompt), TIE)
    assert exact >= 1, "every prompt diverged at a near-tie: the test compares nothing"
