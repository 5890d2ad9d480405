"""Adapters under tensor parallelism (two CPU ranks, gloo): each rank holds its slice of every adapter (B's rows
of a column-parallel layer's outputs, A's columns of a row-parallel layer's inputs, whose partial deltas the
layer's own all-reduce sums), and a batch mixing the base and two adapters gives transformers + PEFT's
logits on every rank."""

from __future__ import annotations

import pytest
import torch

from srt.lora.manager import LoRAConfig
from srt.model_executor.model_runner import ModelRunner
from test.unit.lora_adapters import peft_logits, save_peft_adapter
from test.unit.model_driver import PagedDriver
from test.unit.tp_ranks import run_ranks

TP = 2
ATOL = 1e-4  # fp32: the all-reduce only changes the summation order
NAMES = [None, "r8", "r16", "r8"]
PROMPTS = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26], [31, 32, 33], [41, 42, 43, 44, 45]]
FED = [[51, 52], [61, 62], [71, 72], [81, 82]]  # tokens fed by two decode steps


def rank_logits_of(tp_rank: int, model_dir: str, init: str, adapters: dict) -> dict:
    runner = ModelRunner(
        model_dir,
        max_total_tokens=512,
        max_running_requests=4,
        tp_rank=tp_rank,
        tp_size=TP,
        dist_init_method=init,
        device="cpu",
        quantization="none",
        lora=LoRAConfig(max_loras_per_batch=2, max_lora_rank=16),
    )
    for name, path in adapters.items():
        runner.lora.load(name, path)
    driver = PagedDriver(runner)
    seqs = [driver.new_seq(name) for name in NAMES]
    steps = [driver.extend(seqs, PROMPTS)]
    for j in range(len(FED[0])):
        steps.append(driver.decode(seqs, [fed[j] for fed in FED]))
    runner.tp.destroy()
    return {"logits": torch.stack(steps, dim=1)}  # [seq, step, vocab]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("lora_tp")
    return {
        "r8": save_peft_adapter(tiny_model_dir, out / "r8", rank=8, seed=11),
        "r16": save_peft_adapter(tiny_model_dir, out / "r16", rank=16, seed=12, alpha=16, use_rslora=True),
    }


@pytest.fixture(scope="module")
def rank_logits(tiny_model_dir, adapters, tmp_path_factory) -> dict[int, torch.Tensor]:
    init = f"file://{tmp_path_factory.mktemp('lora_tp_init') / 'init'}"
    reports = run_ranks(rank_logits_of, TP, tiny_model_dir, init, adapters)
    return {rank: report["logits"] for rank, report in reports.items()}


def test_sharded_adapters_give_peft_logits_on_every_rank(tiny_model_dir, adapters, rank_logits):
    for i, name in enumerate(NAMES):
        ids = PROMPTS[i] + FED[i]
        want = peft_logits(tiny_model_dir, adapters.get(name), ids)[len(PROMPTS[i]) - 1 : len(ids)]
        for r in range(TP):
            torch.testing.assert_close(rank_logits[r][i], want, atol=ATOL, rtol=0)
    assert torch.equal(rank_logits[0], rank_logits[1])  # the all-reduce leaves the same bytes everywhere
