"""`--quantization gguf_int8 --tp-size 2` on a tiny random GGUF (the loader's slicing, then `int8_from_blocks`
on each rank's slice): two ranks, each holding its int8 rows or columns and their scales, compute the
logits one rank computes.

- Column-parallel layers (q/k/v, gate/up): a rank's int8 weight and its scales are, to the bit, its rows of
  every part of the one-rank weight (each row is rounded at its own scale, so taking rows commutes with
  rounding).
- Row-parallel layers (o, down): a rank's int8 weight is its input columns rounded at the scale of its own
  slice of each row, as `w8a8_int8` ranks quantize their own shards: never coarser than the whole row's,
  and dequantized within half a level of each side of the one-rank weight.
- The sums of the ranks' partial products then give the one-rank logits within int8 error (the row-parallel
  layers' per-rank scales and per-rank activation rounding), and the all-reduce leaves identical bytes on
  every rank.
The blocks are 32 values wide (Q8_0, Q4_0, Q5_1), so that the 256-wide inputs of o split into whole blocks."""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import pytest
import torch
from gguf import GGMLQuantizationType as T

from srt.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from srt.model_executor.layers.linear_method import WEIGHT, W8A8Int8LinearMethod
from srt.model_executor.model_runner import ModelRunner
from test.unit.gguf_files import write_random_llama
from test.unit.model_driver import PagedDriver
from test.unit.test_gguf_loader import SMOLLM2, embedded
from test.unit.tp_ranks import run_ranks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")

TP = 2
KV_TOKENS = 512
LAYER_TYPES = [T.Q8_0, T.Q4_0, T.Q5_1]
# Teacher-forced steps (the same tokens on every run, so rows compare one to one): a batched extend, decode
# steps, and an extend after a cached prefix.
PROMPTS = [[1, 504, 1463, 282, 260], list(range(100, 123)), [(7 * i) % 180 + 10 for i in range(41)]]
DECODE_TOKENS = [[30, 31, 32], [40, 41, 42], [50, 51, 52]]
# Relative error (Frobenius norm) of the two-rank logits against one rank's: measured 0.0116 on this file,
# half of one rank's own int8 error against the blocks (0.0235); bound with room for another CPU's kernels.
MAX_RELATIVE_ERROR = 0.03
# fp32 rounding of a dequantized level (level * scale) on top of the half levels the bound allows
DEQUANTIZE_EPS = 1e-6


def teacher_forced_logits(runner: ModelRunner) -> torch.Tensor:
    driver = PagedDriver.on_empty_pools(runner)
    seqs = [driver.new_seq() for _ in PROMPTS]
    rows = [driver.extend(seqs, PROMPTS)]
    for tokens in DECODE_TOKENS:
        rows.append(driver.decode(seqs, tokens))
    rows.append(driver.extend(seqs[:1], [[21, 22, 23]]))
    return torch.cat(rows)


@contextmanager
def recorded_int8_weights():
    """The int8 weight and scales each layer is given (`W8A8Int8LinearMethod.install`, keyed by the layer's
    id), copied before `install` prepares them for the kernels here (which may drop the plain weight)."""
    given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    install = W8A8Int8LinearMethod.install

    def recording_install(self, layer, weights):
        given[id(layer)] = (weights[WEIGHT].weight.clone(), weights[WEIGHT].scale.clone())
        install(self, layer, weights)

    W8A8Int8LinearMethod.install = recording_install
    try:
        yield given
    finally:
        W8A8Int8LinearMethod.install = install


def int8_weights(runner: ModelRunner, given: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict]:
    """Every parallel linear layer's int8 weight and scales, with what a test needs to slice the whole."""
    weights = {}
    for name, layer in runner.model.named_modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            weight, scale = given[id(layer)]
            weights[name] = {
                "weight": weight,
                "scale": scale,
                "row_parallel": isinstance(layer, RowParallelLinear),
                "shards": dict(getattr(layer, "shard_offsets", {})),
            }
    return weights


def make_runner(path: str, tp_rank: int = 0, tp_size: int = 1, init: str | None = None) -> ModelRunner:
    return ModelRunner(
        path,
        max_total_tokens=KV_TOKENS,
        max_running_requests=4,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dist_init_method=init,
        quantization="gguf_int8",
    )


def rank_report(tp_rank: int, path: str, init: str) -> dict:
    with recorded_int8_weights() as given:
        runner = make_runner(path, tp_rank, TP, init)
    report = {
        "quantization": runner.quantization,
        "weights": int8_weights(runner, given),
        "logits": teacher_forced_logits(runner),
    }
    runner.tp.destroy()
    return report


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp_gguf_int8") / "tiny.gguf"
    return write_random_llama(path, embedded(SMOLLM2), LAYER_TYPES, seed=5)


@pytest.fixture(scope="module")
def rank_reports(gguf_path, tmp_path_factory) -> dict[int, dict]:
    init = f"file://{tmp_path_factory.mktemp('tp') / 'init'}"
    return run_ranks(rank_report, TP, gguf_path, init)


@pytest.fixture(scope="module")
def single_rank(gguf_path) -> dict:
    with recorded_int8_weights() as given:
        runner = make_runner(gguf_path)
    return {"weights": int8_weights(runner, given), "logits": teacher_forced_logits(runner)}


def test_column_parallel_ranks_hold_their_rows_of_every_part_and_their_scales(rank_reports, single_rank):
    whole = single_rank["weights"]
    checked = 0
    for r in range(TP):
        assert rank_reports[r]["quantization"] == "gguf_int8"
        for name, got in rank_reports[r]["weights"].items():
            if got["row_parallel"]:
                continue
            rows = torch.cat(
                [
                    torch.arange(offset * TP + r * size, offset * TP + (r + 1) * size)
                    for offset, size in got["shards"].values()
                ]
            )
            assert torch.equal(got["weight"], whole[name]["weight"][rows]), name
            assert torch.equal(got["scale"], whole[name]["scale"][rows]), name
            checked += 1
    assert checked == TP * 2 * len(LAYER_TYPES)  # qkv and gate_up of every layer


def test_row_parallel_ranks_hold_their_columns_at_their_slices_scales(rank_reports, single_rank):
    whole = single_rank["weights"]
    checked = 0
    for r in range(TP):
        for name, got in rank_reports[r]["weights"].items():
            if not got["row_parallel"]:
                continue
            ref = whole[name]
            width = got["weight"].shape[1]
            assert width * TP == ref["weight"].shape[1] and got["scale"].shape == ref["scale"].shape, name
            assert bool((got["scale"] <= ref["scale"]).all()), name  # a slice's absmax: never above the row's
            columns = slice(r * width, (r + 1) * width)
            ours = got["weight"].float() * got["scale"].unsqueeze(1)
            theirs = ref["weight"][:, columns].float() * ref["scale"].unsqueeze(1)
            bound = 0.5 * (got["scale"] + ref["scale"]).unsqueeze(1) + DEQUANTIZE_EPS
            assert bool(((ours - theirs).abs() <= bound).all()), name
            checked += 1
    assert checked == TP * 2 * len(LAYER_TYPES)  # o and down of every layer


def test_two_gguf_int8_ranks_give_the_logits_of_one(rank_reports, single_rank):
    reference = single_rank["logits"]
    got = rank_reports[0]["logits"]
    assert got.shape == reference.shape
    error = ((got - reference).norm() / reference.norm()).item()
    assert error < MAX_RELATIVE_ERROR, f"relative error {error:.4f}"
    assert torch.equal(rank_reports[0]["logits"], rank_reports[1]["logits"])
