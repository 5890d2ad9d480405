"""Weight loading and the Llama-family switches: for Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm), random
checkpoints saved by transformers give the same logits through srt as through transformers itself."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from srt.model_executor.model_loader import iter_checkpoint, load_weights, map_checkpoint_tensor
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.models.llama import LlamaForCausalLM
from srt.model_executor.models.registry import get_model_class
from test.unit.model_driver import PagedDriver

ATOL = 1e-4
PROMPT = [5, 901, 77, 3021, 14, 250, 8, 4096, 33]
SMALL = dict(
    vocab_size=5000,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,
)


def save_random(tmp_path, model_type: str, arch: str, **extra) -> str:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, architectures=[arch], **SMALL, **extra)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # random biases/norm weights are zero/one at init: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def hf_last_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def srt_prompt_then_decode(model_dir: str, ids: list[int]) -> torch.Tensor:
    """Logits after ids[:-1] as an extend step and ids[-1] as a decode step."""
    runner = ModelRunner(model_dir, max_total_tokens=256, max_running_requests=2)
    driver = PagedDriver(runner)
    seq = driver.new_seq()
    driver.extend([seq], [ids[:-1]])
    return driver.decode([seq], [ids[-1]])[0]


@pytest.mark.parametrize(
    ("model_type", "arch", "extra"),
    [
        ("llama", "LlamaForCausalLM", {"tie_word_embeddings": False}),
        ("llama", "LlamaForCausalLM", {"tie_word_embeddings": True, "attention_bias": True}),
        ("mistral", "MistralForCausalLM", {"sliding_window": None}),
        ("qwen2", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
        ("qwen3", "Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    ],
)
def test_logits_match_transformers(tmp_path, model_type, arch, extra):
    model_dir = save_random(tmp_path, model_type, arch, **extra)
    torch.testing.assert_close(
        srt_prompt_then_decode(model_dir, PROMPT), hf_last_logits(model_dir, PROMPT), atol=ATOL, rtol=0
    )


def test_a_missing_checkpoint_tensor_is_an_error(tiny_model_dir, tmp_path):
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny_model_dir}/{f}", tmp_path / f)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, "LlamaForCausalLM", 64, torch.float32, "cpu")
    model = model.to_empty(device="cpu")
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        load_weights(model, iter_checkpoint(str(tmp_path)))


def test_fused_qkv_holds_the_checkpoint_slices_in_order(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, max_total_tokens=64, max_running_requests=1)
    ckpt = dict(iter_checkpoint(tiny_model_dir))
    attn = runner.model.model.layers[0].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(q, ckpt["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(k, ckpt["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(v, ckpt["model.layers.0.self_attn.v_proj.weight"])
    gate, up = runner.model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, ckpt["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(gate, ckpt["model.layers.0.mlp.gate_proj.weight"])
    head = runner.model.lm_head  # tied: the head reads the embedding's table and holds no copy of it
    assert head.weight is None and head.dense_weight("weight") is runner.model.input_embedding.weight
    assert "lm_head.weight" not in dict(runner.model.named_parameters())


def saved_phi3(tmp_path) -> str:
    from test.model_families import phi3

    config, model_class = phi3()
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def test_a_fused_checkpoint_tensor_is_split_into_the_layers_shards_in_order(tmp_path):
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: every shard is filled from its
    rows (an unfilled shard would fail the load), in the checkpoint's order."""
    model_dir = saved_phi3(tmp_path)
    runner = ModelRunner(model_dir, max_total_tokens=64, max_running_requests=1, quantization="none")
    ckpt = dict(iter_checkpoint(model_dir))
    layer = runner.model.model.layers[1]
    assert torch.equal(layer.self_attn.qkv_proj.weight, ckpt["model.layers.1.self_attn.qkv_proj.weight"])
    assert torch.equal(layer.mlp.gate_up_proj.weight, ckpt["model.layers.1.mlp.gate_up_proj.weight"])


def test_a_fused_checkpoint_tensor_of_the_wrong_size_is_an_error(tmp_path):
    model_dir = saved_phi3(tmp_path)
    tensors = load_file(f"{model_dir}/model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]  # one head of v short
    save_file(tensors, f"{model_dir}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}: 112 rows, not the 128 of its shards \('q', 'k', 'v'\)"):
        ModelRunner(model_dir, max_total_tokens=64, max_running_requests=1, quantization="none")


def test_unknown_architecture_is_rejected():
    with pytest.raises(ValueError, match="unsupported architectures"):
        get_model_class(["GPT2LMHeadModel"])
    assert get_model_class(None)[0] == "LlamaForCausalLM"


def test_a_checkpoint_tensor_is_mapped_only_when_stored_as_the_model_holds_it(tiny_model_dir):
    name = "model.embed_tokens.weight"
    table = dict(iter_checkpoint(tiny_model_dir))[name]
    assert torch.equal(map_checkpoint_tensor(tiny_model_dir, name, table), table)
    assert map_checkpoint_tensor(tiny_model_dir, name, table.double()) is None  # another dtype
    assert map_checkpoint_tensor(tiny_model_dir, name, table[:-1]) is None  # another shape
    assert map_checkpoint_tensor(tiny_model_dir, "model.no_such.weight", table) is None
