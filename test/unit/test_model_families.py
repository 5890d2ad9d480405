"""Every model family srt serves gives transformers' logits and greedy tokens on the same weights: tiny random
configs built from transformers' own config classes, fp32, through the model runner over the paged pool,
with a prompt longer than the sliding window so windowed layers must forget what full ones still see, and
mixture-of-experts layers whose tokens spread over several experts."""

from __future__ import annotations

import pytest
import torch

from srt.model_executor.model_runner import ModelRunner
from test.unit.model_driver import PagedDriver, same_or_diverged_at_a_near_tie

VOCAB = 512
WINDOW = 8
PROMPTS = [[(7 * i + 3) % (VOCAB - 10) + 5 for i in range(n)] for n in (29, 11)]  # 29 > WINDOW
NEW_TOKENS = 12
TIE = 1e-4
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,  # peaky logits: greedy near-ties are rare
    eos_token_id=None,
    bos_token_id=1,
    pad_token_id=0,
)


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**COMMON, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24)
    return config, Gemma2ForCausalLM


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=6,  # five local layers, then a global one
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0},
        },
    )
    return config, Gemma3ForCausalLM


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralConfig(**COMMON, num_hidden_layers=3, sliding_window=WINDOW), MistralForCausalLM


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    return config, MixtralForCausalLM


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # a dense layer between two sparse ones
    )
    return config, Qwen3MoeForCausalLM


FAMILIES = {
    "gemma2": gemma2,
    "gemma3": gemma3,
    "mistral": mistral,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model directory, transformers' model) for one family, random weights saved as fp32 safetensors."""
    config, model_class = FAMILIES[request.param]()
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation="eager").to(torch.float32).eval()
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out, safe_serialization=True)
    return str(out), model


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )
    return out[0, len(prompt) :].tolist()


def test_the_runner_gives_transformers_logits_and_greedy_tokens(family):
    model_dir, hf_model = family
    runner = ModelRunner(
        model_dir, max_total_tokens=512, quantization="none", attention_backend="torch_native"
    )
    driver = PagedDriver(runner)
    seqs = [driver.new_seq() for _ in PROMPTS]
    logits = driver.extend(seqs, PROMPTS)  # each prompt's last position
    for seq in seqs:
        driver.release(seq)
    with torch.no_grad():
        for row, prompt in zip(logits, PROMPTS, strict=True):
            want = hf_model(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)
    traces = driver.greedy(PROMPTS, NEW_TOKENS)
    exact = 0
    for prompt, trace in zip(PROMPTS, traces, strict=True):
        exact += same_or_diverged_at_a_near_tie(
            trace.tokens, hf_greedy(hf_model, prompt), trace.top2_gaps, TIE
        )
    assert exact >= 1, "every prompt diverged at a near-tie: the test compares nothing"


def test_the_window_matters_for_these_weights(family):
    """The comparison above would pass for a runner that ignored the window only if the window changed
    nothing: check that transformers itself answers differently without it."""
    model_dir, hf_model = family
    config = hf_model.config
    if not getattr(config, "sliding_window", None):
        pytest.skip("no window")
    full = type(hf_model)._from_config(
        type(config)(**{**config.to_dict(), "sliding_window": 10_000}), attn_implementation="eager"
    )
    full.load_state_dict(hf_model.state_dict())
    full.eval()
    prompt = PROMPTS[0]
    with torch.no_grad():
        windowed = hf_model(torch.tensor([prompt])).logits[0, -1]
        unwindowed = full(torch.tensor([prompt])).logits[0, -1]
    assert not torch.allclose(windowed, unwindowed, atol=1e-4)


@pytest.mark.parametrize(
    ("arch", "fields", "what"),
    [
        (
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "yarn",
        ),
        ("PhiForCausalLM", {}, "unsupported architectures"),
    ],
    ids=["rope-yarn", "architecture"],
)
def test_an_unsupported_model_is_one_line_of_configuration_error(tmp_path, arch, fields, what):
    """Start-up classifies it as a configuration the user changes (exit 2), naming what is unsupported."""
    import json

    from srt.child_startup import startup_failure
    from srt.model_executor.models import UnsupportedModelError

    config, model_class = mistral()
    model = model_class._from_config(config).to(torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**on_disk, **fields, "architectures": [arch]}))
    with pytest.raises(UnsupportedModelError, match=what) as err:
        ModelRunner(str(tmp_path), max_total_tokens=512, quantization="none")
    failure = startup_failure(err.value)
    assert failure.config_error and what in failure.message and "\n" not in failure.message
