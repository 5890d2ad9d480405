"""Real servers on GGUF files served from their own blocks (`--quantization gguf`, a GGUF's CPU default).

- A tiny random Llama whose layers hold every block type the kernels run (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  Q4_K, Q5_K, Q6_K, F16; an untied Q6_K head) answers greedily with transformers' top token on the file's dequantized
  fp32 weights (the converter's checkpoint), teacher-forced on the server's own tokens, or a near-tie.
- The embedded SmolLM2's start never makes an fp32 copy of the model, on its blocks or on int8 made from
  them (its default): the scheduler's peak resident memory stays below the fp32 weights' size (the
  converted checkpoint's), and the cache gains nothing but kernels.
- Two tensor-parallel ranks on the blocks answer as one.
- A file with a type the kernels cannot run (Q3_K), by default, exits with code 2 and one
  start-up line naming the tensor and the type.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from gguf import GGMLQuantizationType as T

from srt.child_startup import EXIT_CONFIG_ERROR
from srt.model_executor.gguf_convert import convert
from srt.model_source import cache_root, default_gguf_path
from test.integration.conftest import launch_server, running_server
from test.unit.gguf_files import write_random_llama

pytestmark = pytest.mark.slow

EVERY_TYPE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16]
PROMPTS = ["The history of the printing press begins", "Once upon a time", "1, 2, 3, 4,"]
NEW_TOKENS = 16
# The reference's top token may lead the server's by less than this (activations are quantized per block
# of 32 to int8 by the kernels): the random model's logits span ~2.6 and moved by at most 0.035 against exact
# activations (gguf_files.WEIGHT_STD), while a wrong block decode moves them by the whole range.
NEAR_TIE = 0.1
# Its logits are flat (a random model: top-2 gaps of a few hundredths), so flips at such leads are common
# (measured: 4 of 48 steps, at leads 0.0002-0.0067); the lead bound is the check, the count a sanity cap.
MAX_FLIPS = len(PROMPTS) * NEW_TOKENS // 4
KIB = 1024
KERNELS = "kernels"  # the kernel libraries' folder in srt's cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """(the tiny GGUF, its fp32 conversion by transformers: the reference)."""
    root = tmp_path_factory.mktemp("gguf_server")
    path = write_random_llama(root / "every-type.gguf", default_gguf_path(), EVERY_TYPE, seed=7)
    convert(path, str(root / "converted"))
    return path, str(root / "converted")


@pytest.fixture(scope="module")
def tiny_server(tiny):
    with running_server("--model-path", tiny[0], "--max-total-tokens", "4096") as handle:
        yield handle


def generate(server, ids: list[int]) -> list[int]:
    r = httpx.post(
        f"{server.base_url}/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        },
        headers=server.headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_every_block_type_answers_as_the_dequantized_reference(tiny, tiny_server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    server = tiny_server
    assert "quantization gguf" in server.logs()
    tok = AutoTokenizer.from_pretrained(tiny[1])
    reference = AutoModelForCausalLM.from_pretrained(tiny[1], dtype=torch.float32).eval()
    flips = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        got = generate(server, ids)
        assert len(got) == NEW_TOKENS
        with torch.no_grad():
            logits = reference(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1]
        for step, (token, row) in enumerate(zip(got, logits, strict=True)):
            lead = float(row.max() - row[token])
            assert lead < NEAR_TIE, f"{prompt!r} step {step}: token {token} is {lead:.3f} below the top"
            if lead > 0:
                flips.append((prompt, step, round(lead, 4)))
    assert len(flips) <= MAX_FLIPS, flips


def test_two_tensor_parallel_ranks_answer_as_one(tmp_path):
    """Each rank takes its rows (q/k/v, gate/up) or whole blocks of its columns (o, down) as views of the
    file: two ranks answer with one rank's tokens (the row-parallel sums only change the fp32 summation
    order)."""
    path = write_random_llama(tmp_path / "tp.gguf", default_gguf_path(), [T.Q8_0, T.Q4_0, T.Q5_1], seed=3)
    ids = [1, 504, 1463, 282, 260]
    answers = {}
    for tp in (1, 2):
        flags = ("--quantization", "gguf", "--tp-size", str(tp), "--max-total-tokens", "2048")
        with running_server("--model-path", path, *flags) as s:
            answers[tp] = generate(s, ids)
    assert answers[1] == answers[2]


def test_a_type_the_kernels_cannot_run_exits_2_naming_it(tmp_path):
    path = write_random_llama(tmp_path / "q3_k.gguf", default_gguf_path(), [T.Q8_0, T.Q3_K], head_type=None)
    handle = launch_server("--model-path", path, wait=False)  # the CPU's default for a GGUF: its blocks
    try:
        code = handle.proc.wait(300)
        logs = handle.logs()
    finally:
        handle.stop()
    assert code == EXIT_CONFIG_ERROR, logs[-3000:]
    failed = [line for line in logs.splitlines() if "start-up failed" in line]
    assert len(failed) == 1 and "blk.1.attn_q.weight is stored as Q3_K" in failed[0], logs[-3000:]
    assert "Traceback" not in logs


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


# What a scheduler holds before any model: torch, srt's modules and the compiled kernels (its VmHWM)
RUNTIME_PROBE = (
    "import torch, srt.model_executor.model_runner, srt.scheduler.scheduler;"
    "from srt.model_executor.layers.gguf_linear import kernels; kernels();"
    "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])"
)


@pytest.mark.parametrize("quantization", ["gguf_int8", "gguf"])
def test_the_embedded_model_starts_without_an_fp32_copy(embedded_model_dir, tmp_path, quantization):
    """The scheduler's peak resident memory (VmHWM) above the runtime's own (torch, srt, the kernels: a
    probe process's) holds the touched pages of the GGUF's map, the KV pool's touched pages and buffers
    (and under gguf_int8, the embedded SmolLM2's default, the int8 weights made from the blocks): less than
    the fp32 weights alone, which the old start held (and wrote to disk). The cache gains only the compiled
    kernels."""
    fp32_bytes = sum(
        os.path.getsize(os.path.join(embedded_model_dir, n))
        for n in os.listdir(embedded_model_dir)
        if n.endswith(".safetensors")
    )
    cache = tmp_path / "cache"
    # The kernels srt's own cache already holds (the module's first server built them): without them this
    # start and the probe build both libraries again (tens of seconds on 2 cores). The cache must gain
    # nothing else: the start writes no converted or calibrated copy.
    own = os.path.join(cache_root(), KERNELS)
    if os.path.isdir(own):
        shutil.copytree(own, cache / KERNELS, ignore=shutil.ignore_patterns("*.lock"))
    seeded = {p for p in cache.rglob("*") if p.is_file()}
    flags = () if quantization == "gguf_int8" else ("--quantization", quantization)  # the default, or forced
    handle = launch_server("--max-total-tokens", "4096", *flags, env={"SRT_CACHE_DIR": str(cache)})
    try:
        assert f"quantization {quantization}," in handle.logs()
        r = httpx.post(
            f"{handle.base_url}/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        pid = handle.child_pids().get("srt-scheduler")
        if pid is None:
            pytest.skip("the scheduler process is not visible under /proc")
        peak = status_kib(pid, "VmHWM") * KIB
    finally:
        handle.stop()
    probe = subprocess.run(
        [sys.executable, "-c", RUNTIME_PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, "SRT_CACHE_DIR": str(cache)},
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    runtime = int(probe.stdout.split()[-1]) * KIB
    held = peak - runtime
    assert held < fp32_bytes, (
        f"scheduler peak {peak / 2**20:.0f} MiB, runtime {runtime / 2**20:.0f} MiB: the model held "
        f"{held / 2**20:.0f} MiB, not less than its fp32 weights' {fp32_bytes / 2**20:.0f} MiB"
    )
    gained = {p.relative_to(cache).parts[0] for p in cache.rglob("*") if p.is_file() and p not in seeded}
    assert gained <= {KERNELS}, gained
