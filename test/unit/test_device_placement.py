"""Every tensor of a step lives on the runner's device: one prefill, one mixed and one decode step of the
tiny model, built by the scheduler's `StepBuilder`, run with the runner on the `meta` device up to the
logits. A tensor left on the CPU fails here as it would on CUDA, without a GPU.

`meta` alone is laxer than CUDA (its kernels accept CPU index tensors), so the steps run under
`SameDeviceMode`, which refuses any operation whose tensor arguments sit on two devices. Copies between
devices are the one exception (they are how data gets there); 0-dim CPU tensors are scalars, which CUDA
kernels take too. Also: which GPU each data- and tensor-parallel rank takes, and `--device cuda` without
CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from srt.mem_cache.chunk_cache import ChunkCache
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.schedule_batch import Req
from srt.scheduler.step_builder import StepBuilder
from test.model_families import FAMILIES, VOCAB, WINDOW

aten = torch.ops.aten
CROSS_DEVICE_COPIES = {aten._to_copy, aten.copy_, aten.lift_fresh, aten._local_scalar_dense}


class SameDeviceMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in CROSS_DEVICE_COPIES:
            devices = {
                t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0
            }
            if len(devices) > 1:
                raise AssertionError(f"{func} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def test_same_device_mode_refuses_what_cuda_refuses():
    """The checker itself: meta takes a CPU index tensor; under the mode it is refused, a copy is not."""
    table = torch.zeros(8, 4, device="meta")
    cpu_rows = torch.tensor([1, 2])
    assert table[cpu_rows].device.type == "meta"  # what the mode exists for
    with SameDeviceMode():
        with pytest.raises(AssertionError, match="mixes devices"):
            table[cpu_rows]
        assert table[cpu_rows.to("meta")].shape == (2, 4)
        table[1:3] = torch.ones(2, 4)  # a copy into the device


@pytest.fixture(scope="module")
def meta_runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(
        tiny_model_dir, device="meta", dtype="float32", max_total_tokens=256, max_running_requests=4
    )


def planned(rid: str, ids: list[int]) -> Req:
    """A request as the scheduler plans its first prefill: no cached prefix, the whole prompt to extend."""
    req = Req(rid, ids, SamplingParams(max_new_tokens=4))
    req.fill_ids = list(ids)
    req.extend_len = len(ids)
    return req


def run_prefill_mixed_and_decode(runner: ModelRunner, prompts: tuple[list[int], list[int]]) -> None:
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    builder = StepBuilder(
        runner.req_to_token_pool,
        runner.token_to_kv_pool_allocator,
        ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator),
    )
    first, second = planned("a", prompts[0]), planned("b", prompts[1])
    with SameDeviceMode():
        batch = builder.extend([first], [])
        assert {t.device.type for t in (batch.input_ids, batch.positions, batch.seq_lens)} == {"meta"}
        logits = runner.forward(batch)
        assert logits.device.type == "meta" and logits.shape == (1, runner.vocab_size)
        first.kv_len, first.extend_len = len(prompts[0]), 0
        first.output_ids.append(30)

        batch = builder.extend([second], [first])  # mixed: a prefill and a decode token in one step
        assert batch.is_mixed and batch.req_pool_indices.device.type == "meta"
        assert runner.forward(batch).shape == (2, runner.vocab_size)
        first.kv_len += 1
        second.kv_len, second.extend_len = len(prompts[1]), 0
        first.output_ids.append(31)
        second.output_ids.append(40)

        batch = builder.decode([first, second])
        assert batch.is_decode and batch.seq_lens_cpu == [len(prompts[0]) + 2, len(prompts[1]) + 1]
        assert runner.forward(batch).shape == (2, runner.vocab_size)
        first.kv_len += 1
        second.kv_len += 1
        first.output_ids.append(32)
        second.output_ids.append(41)

        # a speculative verify step: the first feeds its newest token and 3 drafts, the second decodes
        batch = builder.verify([first], [[50, 51, 52]], [second])
        assert batch.logit_rows.device.type == "meta" and batch.out_cache_loc.device.type == "meta"
        assert runner.forward(batch).shape == (5, runner.vocab_size)


def test_prefill_mixed_decode_and_verify_steps_stay_on_the_device(meta_runner):
    run_prefill_mixed_and_decode(meta_runner, ([11, 12, 13, 14, 15], [21, 22, 23]))


# FusedMoE reads its per-expert token counts on the host to slice each expert's rows (a sync on a GPU, and
# impossible on `meta`): the mixture-of-experts families are left to the `cuda` tests
HOST_READING_FAMILIES = {"mixtral", "qwen3_moe"}


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - HOST_READING_FAMILIES))
def test_every_family_keeps_its_steps_on_the_device(name, tmp_path):
    """Windows, soft-caps, per-layer RoPE tables, LongRoPE and YaRN tables, Gemma's embedding scale: each
    family's own tensors must follow the model to its device, with prompts longer than the window."""
    config, model_class = FAMILIES[name]()
    config.architectures = [model_class.__name__]
    model_class._from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    runner = ModelRunner(
        str(tmp_path), device="meta", dtype="float32", max_total_tokens=256, max_running_requests=4
    )
    long_prompt = [(5 * i + 7) % (VOCAB - 10) + 5 for i in range(3 * WINDOW)]
    run_prefill_mixed_and_decode(runner, (long_prompt, long_prompt[: WINDOW + 3]))


def test_prompt_logprob_step_stays_on_the_device(meta_runner):
    runner = meta_runner
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    builder = StepBuilder(
        runner.req_to_token_pool,
        runner.token_to_kv_pool_allocator,
        ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator),
    )
    req = planned("c", [5, 6, 7, 8])
    rows, targets = [0, 1, 2], [6, 7, 8]
    with SameDeviceMode():
        batch = builder.extend(
            [req],
            [],
            logprob_rows=torch.tensor(rows),
            logprob_targets=torch.tensor(targets),
            logprob_top_k=2,
        )
        logits, scores = runner.forward_with_prompt_logprobs(batch)
    assert logits.shape == (1, runner.vocab_size)
    assert scores.token_logprobs.shape == (3,) and scores.top_indices.shape == (3, 2)


def test_each_gpu_rank_takes_its_own_gpu(monkeypatch):
    """Replica r's tensor-parallel rank t runs on GPU r * tp_size + t; too few GPUs is a clear error."""
    from srt.model_executor.runner_setup import resolve_device

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    assert resolve_device("cuda") == "cuda" and picked == []
    assert resolve_device("cuda", tp_rank=1, tp_size=2) == "cuda:1"
    assert resolve_device("cuda", tp_rank=1, tp_size=2, dp_rank=1) == "cuda:3"
    assert resolve_device("cuda", dp_rank=2) == "cuda:2"
    assert picked == ["cuda:1", "cuda:3", "cuda:2"]
    with pytest.raises(ValueError, match="needs GPU 4, but 4 GPUs are visible"):
        resolve_device("cuda", tp_size=2, dp_rank=2)
    assert resolve_device("cpu", tp_rank=1, tp_size=2, dp_rank=1) == "cpu"


def test_asking_for_cuda_without_it_is_a_flag_error(monkeypatch):
    from srt.model_executor.runner_setup import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="--device cuda: .*use --device cpu"):
        resolve_device("cuda")
