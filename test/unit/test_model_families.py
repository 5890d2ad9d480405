"""Every model family srt serves gives transformers' logits and greedy tokens on the same weights: tiny random
configs built from transformers' own config classes (test/model_families.py), fp32, through the model runner
over the paged pool, with a prompt longer than the sliding window so windowed layers must forget what full
ones still see, mixture-of-experts layers whose tokens spread over several experts, a checkpoint with fused
q/k/v and gate/up tensors (Phi-3) and scaled RoPE (Phi-3's LongRoPE, Llama's YaRN)."""

from __future__ import annotations

import os

import pytest
import torch

from srt.model_executor.layers.moe import FusedMoE
from srt.model_executor.model_runner import ModelRunner
from test.model_families import FAMILIES, ORIGINAL_CONTEXT, VOCAB, WINDOW, mistral
from test.unit.model_driver import PagedDriver, same_or_diverged_at_a_near_tie

PROMPTS = [[(7 * i + 3) % (VOCAB - 10) + 5 for i in range(n)] for n in (29, 11)]
NEW_TOKENS = 12
TIE = 1e-4
# transformers' LongRoPE switches a whole sequence to its long factors past the original context, srt only
# the positions past it (rotary_embedding.py): the comparison holds within it
assert len(PROMPTS[0]) > WINDOW and max(map(len, PROMPTS)) + NEW_TOKENS <= ORIGINAL_CONTEXT
SCALED_ROPE_TYPES = ("yarn", "longrope")


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
    # a GPU runner would record decode graphs of every family but the mixtures of experts, whose token
    # counts per expert are read on the host (here the CPU backend refuses graphs for every family)
    is_moe = any(isinstance(m, FusedMoE) for m in runner.model.modules())
    assert ("experts" in runner.decode_graph_refusal()) == is_moe
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


def logits_as_configured_and_changed(hf_model, **fields) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' last-position logits for the first prompt, with the model's config and with `fields`
    changed in it (same weights)."""
    config = hf_model.config
    changed = type(hf_model)._from_config(
        type(config)(**{**config.to_dict(), **fields}), attn_implementation="eager"
    )
    changed.load_state_dict(hf_model.state_dict())
    changed.eval()
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        return hf_model(prompt).logits[0, -1], changed(prompt).logits[0, -1]


def test_the_window_matters_for_these_weights(family):
    """The comparison above would pass for a runner that ignored the window only if the window changed
    nothing: check that transformers itself answers differently without it."""
    model_dir, hf_model = family
    if not getattr(hf_model.config, "sliding_window", None):
        pytest.skip("no window")
    windowed, unwindowed = logits_as_configured_and_changed(hf_model, sliding_window=10_000)
    assert not torch.allclose(windowed, unwindowed, atol=1e-4)


def test_the_rope_scaling_matters_for_these_weights(family):
    """As the window above: transformers answers differently with plain RoPE, so the comparison covers the
    scaled frequencies and the attention factor."""
    model_dir, hf_model = family
    rope = hf_model.config.rope_parameters
    if rope.get("rope_type") not in SCALED_ROPE_TYPES:
        pytest.skip("no YaRN or LongRoPE")
    plain = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    scaled, unscaled = logits_as_configured_and_changed(hf_model, rope_parameters=plain)
    assert not torch.allclose(scaled, unscaled, atol=1e-4)


@pytest.mark.parametrize(
    ("arch", "fields", "what"),
    [
        (
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
            "rope type 'dynamic'",
        ),
        ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ("PhiForCausalLM", {}, "unsupported architectures"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
    ids=["rope-dynamic", "partial-rotary", "architecture", "activation"],
)
def test_an_unsupported_model_is_one_line_of_configuration_error(tmp_path, arch, fields, what):
    """Start-up classifies it as a configuration the user changes (exit 2), naming what is unsupported."""
    import json

    from srt.child_startup import startup_failure
    from srt.model_executor.unsupported import UnsupportedModelError

    config, model_class = mistral()
    model = model_class._from_config(config).to(torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**on_disk, **fields, "architectures": [arch]}))
    with pytest.raises(UnsupportedModelError, match=what) as err:
        ModelRunner(str(tmp_path), max_total_tokens=512, quantization="none")
    failure = startup_failure(err.value)
    assert failure.config_error and what in failure.message and "\n" not in failure.message


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_gpu_every_family_gives_transformers_greedy_tokens(family, dtype):
    """The GPU path (Triton attention with each layer's window and cap, decode CUDA graphs, the experts on
    the device) against transformers on the same GPU and dtype; bf16 ties are wider, so a divergence at a
    near-tie of the top two logits is allowed there as in fp32 (test_cuda_model.py's rule). What must agree
    is at least a prompt's worth of tokens before any such flip (on an H200 both of Qwen3-MoE's prompts
    flipped in bf16, at gaps of 0.03 and 0.09, after 6 and 10 equal tokens; the CPU's bf16 does the same)."""
    model_dir, hf_model = family
    torch_dtype = getattr(torch, dtype)
    runner = ModelRunner(
        model_dir,
        device="cuda",
        dtype=dtype,
        max_total_tokens=2048,
        max_running_requests=4,
        cuda_graph_max_bs=4,
    )
    reference = type(hf_model)._from_config(hf_model.config, attn_implementation="eager")
    reference.load_state_dict(hf_model.state_dict())
    reference = reference.to(device="cuda", dtype=torch_dtype).eval()
    traces = PagedDriver(runner).greedy(PROMPTS, NEW_TOKENS)
    agreed = 0
    for prompt, trace in zip(PROMPTS, traces, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        want = out[0, len(prompt) :].tolist()
        same_or_diverged_at_a_near_tie(
            trace.tokens, want, trace.top2_gaps, TIE if dtype == "float32" else 0.1
        )
        agreed += len(os.path.commonprefix([trace.tokens, want]))
    assert agreed >= NEW_TOKENS, (
        f"only {agreed} tokens agreed before near-tie flips: the test compares little"
    )
