"""`--quantization w8a8_int8` on a mixture-of-experts model: every expert's projections get int8 weights
through the same linear method as a dense layer, calibrated on the tokens routed to that expert, and the
int8 model passes the quality gate of scripts/eval_quality.py against its own fp32 weights (perplexity within
2 %, top-1 agreement at least 90 %) on text it was not calibrated on."""

from __future__ import annotations

import math

import pytest
import torch

from srt.model_executor.layers.moe import FusedMoE
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.quantization import input_second_moments, quantizable_weights
from test.conftest import assets_config, save_random_model

EXPERTS = 4
GATE_PERPLEXITY = 0.02
GATE_TOP1 = 0.90
TEXT = (
    "The river rose through the night, and by morning the low fields were under water. Farmers moved "
    "their animals to the ridge, counted them twice, and waited for the rain to stop. "
) * 6


@pytest.fixture(scope="module")
def moe_model_dir(model_assets_dir, tmp_path_factory) -> str:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=assets_config(model_assets_dir)["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=True,
        architectures=["Qwen3MoeForCausalLM"],
    )
    return save_random_model(tmp_path_factory.mktemp("moe"), model_assets_dir, 7, config)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SRT_CACHE_DIR", str(tmp_path))


def teacher_forced(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return torch.cat([logits for logits, _ in runner.forward_windows(ids, 128)])


def test_every_expert_runs_int8_and_the_model_passes_the_quality_gate(moe_model_dir, private_cache):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(moe_model_dir)(TEXT)["input_ids"]
    fp32 = ModelRunner(moe_model_dir, max_total_tokens=512, quantization="none")
    int8 = ModelRunner(moe_model_dir, max_total_tokens=512, quantization="w8a8_int8")
    moes = [m for m in int8.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2
    for moe in moes:
        assert moe.w13 is None and moe.w2 is None  # the fp32 experts are dropped
        assert all(moe.method.int8_weight(key) is not None for key in moe.weight_keys())
    reference, quantized = teacher_forced(fp32, ids), teacher_forced(int8, ids)
    assert not torch.equal(reference, quantized)  # really computed in int8
    targets = torch.tensor(ids[1:])
    nll = [torch.nn.functional.cross_entropy(x[:-1], targets).item() for x in (reference, quantized)]
    ppl_ratio = math.exp(nll[1] - nll[0])
    top1 = (reference.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    print(f"int8 MoE: perplexity ratio {ppl_ratio:.4f}, top-1 agreement {top1:.3f}")
    assert abs(ppl_ratio - 1) <= GATE_PERPLEXITY, ppl_ratio
    assert top1 >= GATE_TOP1, top1


def test_an_expert_is_calibrated_on_the_tokens_routed_to_it(moe_model_dir):
    """Each token reaches top_k = 2 experts, so the traces of the experts' input moments (sums of squared
    input rows) add up to twice the trace over every row that entered the layer."""
    from transformers import AutoTokenizer

    runner = ModelRunner(moe_model_dir, max_total_tokens=512, quantization="none")
    ids = AutoTokenizer.from_pretrained(moe_model_dir)(TEXT)["input_ids"][:100]
    moe = next(m for m in runner.model.modules() if isinstance(m, FusedMoE))
    entered = []
    hook = moe.register_forward_pre_hook(lambda _m, inp: entered.append(inp[0].detach().clone()))
    try:
        moments = input_second_moments(runner.model, runner.forward_windows(ids, 128))
    finally:
        hook.remove()
    names = {name for name, _, _ in quantizable_weights(runner.model)}
    assert set(moments) <= names and sum(".w13." in n for n in names) == 2 * EXPERTS
    rows = torch.cat(entered)
    experts = [
        moments[f"model.layers.0.mlp.w13.{e}"]
        for e in range(EXPERTS)
        if f"model.layers.0.mlp.w13.{e}" in moments
    ]
    assert len(experts) >= 2  # the router spread the tokens
    routed = sum(m.trace() for m in experts)
    assert torch.isclose(routed, 2 * rows.pow(2).sum(), rtol=1e-4)
