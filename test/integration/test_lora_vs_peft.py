"""The reference check for adapters: on the embedded SmolLM2 in fp32, one batch of the base and two random
adapters (ranks 8 and 16 on all seven target modules, made by PEFT) decodes greedily exactly the tokens
transformers + PEFT's `generate` decodes for each alone, with each token's log-probability within 1e-3."""

from __future__ import annotations

import pytest
import torch

from srt.lora.manager import LoRAConfig
from srt.model_executor.model_runner import ModelRunner
from test.unit.lora_adapters import base_model, save_peft_adapter
from test.unit.model_driver import PagedDriver, same_or_diverged_at_a_near_tie

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
NEAR_TIE = 1e-3  # top-1 minus top-2 logit below this: fp32 summation order may pick either
LOGPROB_TOLERANCE = 1e-3
# an adapter must move the first step's log-probabilities by far more than the tolerance, or agreeing says little
MIN_ADAPTER_EFFECT = 0.1
# SmolLM2's projections are wider than the tiny model's: a smaller spread keeps an adapter's change to the
# outputs substantial without drowning the base model
ADAPTER_STD = 0.02
PROMPTS = ["The history of the printing press begins", "A recipe for bread: first,"]
ADAPTERS = {"r8": dict(rank=8, seed=1), "r16": dict(rank=16, seed=2, alpha=16)}


@pytest.fixture(scope="module")
def prompts(embedded_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    return [tok(text)["input_ids"] for text in PROMPTS]


@pytest.fixture(scope="module")
def adapter_dirs(embedded_model_dir, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("smollm2_lora")
    return {
        name: save_peft_adapter(embedded_model_dir, out / name, std=ADAPTER_STD, **spec)
        for name, spec in ADAPTERS.items()
    }


@torch.no_grad()
def peft_greedy(model_dir: str, adapter_dir: str | None, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """PEFT's greedy tokens and the log-probabilities of every step ([NEW_TOKENS, vocab])."""
    from peft import PeftModel

    model = base_model(model_dir)
    model.generation_config.eos_token_id = None
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(ids) :].tolist(), torch.log_softmax(torch.cat(out.scores).float(), dim=-1)


def srt_greedy(runner: ModelRunner, prompts: list[list[int]], names: list[str | None]) -> list[torch.Tensor]:
    """Every step's log-probabilities [sequence, vocab] of one greedy batch, each sequence with its adapter."""
    driver = PagedDriver.on_empty_pools(runner)
    seqs = [driver.new_seq(name) for name in names]
    steps = [torch.log_softmax(driver.extend(seqs, prompts), dim=-1)]
    while len(steps) < NEW_TOKENS:
        steps.append(torch.log_softmax(driver.decode(seqs, steps[-1].argmax(-1).tolist()), dim=-1))
    return steps


def test_a_batch_of_the_base_and_two_adapters_decodes_peft_tokens_and_logprobs(
    embedded_model_dir, prompts, adapter_dirs
):
    runner = ModelRunner(
        embedded_model_dir,
        max_total_tokens=2048,
        max_running_requests=8,
        device="cpu",
        quantization="none",
        lora=LoRAConfig(max_loras_per_batch=2, max_lora_rank=16),
    )
    for name, path in adapter_dirs.items():
        runner.lora.load(name, path)
    names = [name for name in (None, *ADAPTERS) for _ in prompts]
    batch_prompts = prompts * (1 + len(ADAPTERS))
    steps = torch.stack(srt_greedy(runner, batch_prompts, names), dim=1)  # [sequence, step, vocab]
    exact = 0
    for row, (ids, name) in enumerate(zip(batch_prompts, names, strict=True)):
        want_tokens, want_logprobs = peft_greedy(embedded_model_dir, adapter_dirs.get(name), ids)
        got_tokens = steps[row].argmax(-1).tolist()
        top2 = want_logprobs.topk(2, dim=-1).values
        same = same_or_diverged_at_a_near_tie(
            got_tokens, want_tokens, (top2[:, 0] - top2[:, 1]).tolist(), NEAR_TIE
        )
        exact += same
        agree = next(
            (i for i, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=True)) if a != b), NEW_TOKENS
        )
        picked = torch.tensor(want_tokens[:agree]).unsqueeze(1)
        torch.testing.assert_close(
            steps[row, :agree].gather(1, picked),
            want_logprobs[:agree].gather(1, picked),
            atol=LOGPROB_TOLERANCE,
            rtol=0,
        )
    assert exact >= len(names) - 1, "near-ties are rare: more than one divergent sequence is suspicious"
    base_first_step = steps[: len(prompts), 0]
    for adapted in range(len(prompts), len(names), len(prompts)):
        effect = (steps[adapted : adapted + len(prompts), 0] - base_first_step).abs().amax(dim=-1)
        assert (effect > MIN_ADAPTER_EFFECT).all(), f"{names[adapted]} barely moves the logprobs: {effect}"
