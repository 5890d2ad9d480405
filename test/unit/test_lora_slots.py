"""The weight pool's slots: free slots first, then the least recently used unpinned adapter that the step does
not use is evicted; pinned adapters keep their slot; a step never needs more slots than there are. Through the
runner: an evicted and reloaded adapter computes what it computed before, unloading frees and zeroes its
slot, and the host holds at most `max_loaded_loras` adapters."""

from __future__ import annotations

import pytest
import torch

from srt.lora.adapter import AdapterError
from srt.lora.manager import LoRAConfig
from srt.lora.slots import SlotTable
from srt.model_executor.forward_batch_info import NO_ADAPTER
from srt.model_executor.model_runner import ModelRunner
from test.unit.lora_adapters import write_adapter
from test.unit.model_driver import PagedDriver

SLOTS = 2
MAX_LOADED = 4
PROMPT = [101, 202, 303, 404, 505, 606]


# ---- the slot table alone ----
def placed(table: SlotTable, names: list[str]) -> dict[str, tuple[int, str | None]]:
    return {name: (slot, evicted) for name, slot, evicted in table.place(names)}


def test_free_slots_go_first_then_the_least_recently_used_adapter_is_evicted():
    table = SlotTable(2)
    assert placed(table, ["a"]) == {"a": (0, None)}
    assert placed(table, ["b"]) == {"b": (1, None)}
    assert placed(table, ["a"]) == {}  # resident: nothing to write; a is now the most recent
    assert placed(table, ["c"]) == {"c": (1, "b")}
    assert table.slot_of == {"a": 0, "c": 1}


def test_an_adapter_of_the_same_step_is_never_evicted():
    table = SlotTable(2)
    table.place(["a", "b"])
    table.place(["b"])  # a is now the least recent, but the next step uses it
    assert placed(table, ["a", "c"]) == {"c": (1, "b")}


def test_a_pinned_adapter_keeps_its_slot_and_one_slot_stays_unpinned():
    table = SlotTable(3)
    table.place(["a"])
    assert table.pin("p") == (1, None)
    assert table.can_pin()
    table.pin("q")
    assert not table.can_pin()  # a third pin would leave unpinned adapters no slot
    for name in ["x", "y", "z", "a"]:
        table.place([name, "p"])
    assert table.slot_of["p"] == 1 and table.slot_of["q"] == 2


def test_a_pin_never_takes_a_slot_the_running_adapters_need():
    """With a and b running in both slots, pinning would leave them one unpinned slot: refused. With only a
    running, the pin takes b's slot (b is idle), never a's, and a still fits."""
    table = SlotTable(2)
    table.place(["a", "b"])
    assert not table.can_pin(["a", "b"])
    table.place(["b"])  # a is now the least recently used, but it is running
    assert table.can_pin(["a"])
    assert table.pin("p", ["a"]) == (1, "b")
    assert table.fits(["a", "p"]) and not table.fits(["a", "b"])


def test_a_step_fits_when_its_unpinned_adapters_fit_the_unpinned_slots():
    table = SlotTable(3)
    table.pin("p")
    assert table.fits(["p", "a", "b"])
    assert not table.fits(["a", "b", "c"])
    with pytest.raises(ValueError, match="does not fit 3 slots"):
        table.place(["a", "b", "c"])


def test_releasing_an_adapter_frees_its_slot():
    table = SlotTable(2)
    table.place(["a", "b"])
    assert table.release("a") == 0 and table.used == 1
    assert placed(table, ["c"]) == {"c": (0, None)}


# ---- through the runner ----
@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    config = LoRAConfig(max_loras_per_batch=SLOTS, max_loaded_loras=MAX_LOADED, max_lora_rank=8)
    return ModelRunner(
        tiny_model_dir,
        max_total_tokens=512,
        max_running_requests=4,
        device="cpu",
        quantization="none",
        lora=config,
    )


@pytest.fixture(scope="module")
def adapters(runner, tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("lora_slots")
    names = ["x", "y", "z"]
    for i, name in enumerate(names):
        torch.manual_seed(i)
        runner.lora.load(name, str(write_adapter(out / name, runner.lora.shapes, rank=4 + 2 * i)))
    return names


def alone(runner: ModelRunner, adapter: str | None) -> torch.Tensor:
    driver = PagedDriver.on_empty_pools(runner)
    return driver.extend([driver.new_seq(adapter)], [PROMPT])[0]


def test_an_evicted_adapter_computes_the_same_once_back_in_a_slot(runner, adapters):
    first = alone(runner, "x")
    alone(runner, "y")
    alone(runner, "z")  # x was the least recently used: evicted
    assert "x" not in runner.lora.slots.slot_of
    torch.testing.assert_close(alone(runner, "x"), first, atol=1e-6, rtol=0)
    assert not torch.allclose(alone(runner, "z"), first, atol=0.5)  # another adapter: other logits


def stream(runner: ModelRunner, churn) -> list[torch.Tensor]:
    """A sequence of adapter x decoding, with `churn(step, driver)` run between its steps: its logits."""
    driver = PagedDriver.on_empty_pools(runner)
    seq = driver.new_seq("x")
    steps = [driver.extend([seq], [PROMPT])]
    for step in range(4):
        churn(step, driver)
        steps.append(driver.decode([seq], [int(steps[-1].argmax())]))
    return steps


def test_loading_unloading_and_evicting_between_steps_leave_a_stream_intact(runner, adapters, tmp_path):
    quiet = stream(runner, lambda step, driver: None)
    path = str(write_adapter(tmp_path / "extra", runner.lora.shapes))

    def churn(step: int, driver: PagedDriver) -> None:
        if step == 0:
            runner.lora.load("extra", path)
        others = [driver.new_seq("y"), driver.new_seq("extra" if step < 2 else "z")]
        driver.extend(others, [[7, 8, 9], [10, 11]])  # fills both slots
        assert "x" not in runner.lora.slots.slot_of  # evicted: the stream's next step writes it again
        for other in others:
            driver.release(other)
        if step == 2:
            runner.lora.unload("extra")

    busy = stream(runner, churn)
    assert all(torch.equal(a, b) for a, b in zip(busy, quiet, strict=True))


def test_prepare_step_gives_each_request_its_slot_and_refuses_what_cannot_run(runner, adapters):
    slots = runner.lora.prepare_step([None, "y", "x", "y"])
    assert slots[0] == NO_ADAPTER and slots[1] == slots[3] == runner.lora.slots.slot_of["y"] != slots[2]
    assert runner.lora.fits(["x", None, "y"]) and not runner.lora.fits(["x", "y", "z"])
    with pytest.raises(ValueError, match="does not fit"):
        runner.lora.prepare_step(["x", "y", "z"])
    with pytest.raises(KeyError, match="'nope' is not loaded"):
        runner.lora.prepare_step(["nope"])


def test_the_host_holds_at_most_max_loaded_loras_and_unloading_frees_the_slot(runner, adapters, tmp_path):
    runner.lora.load("w", str(write_adapter(tmp_path / "w", runner.lora.shapes)), pinned=True)
    try:
        assert len(runner.lora.loaded) == MAX_LOADED and runner.lora.is_pinned("w")
        pool = runner.lora.snapshot()
        assert pool.slots_total == SLOTS and 1 <= pool.slots_used <= SLOTS
        assert pool.adapters == (("x", False), ("y", False), ("z", False), ("w", True))
        with pytest.raises(AdapterError, match=f"{MAX_LOADED} adapters are loaded"):
            runner.lora.load("v", str(tmp_path / "w"))
        runner.lora.unload("x")  # room on the host, but a second pin would leave no slot to the others
        with pytest.raises(AdapterError, match="pinning it would leave none"):
            runner.lora.load("x2", str(tmp_path / "w"), pinned=True)
        slot = runner.lora.slots.slot_of["w"]
        for name in ["y", "z", "y"]:  # unpinned adapters cycle through the one unpinned slot
            runner.lora.prepare_step([name, "w"])
            assert runner.lora.slots.slot_of["w"] == slot
    finally:
        runner.lora.unload("w")
    assert "w" not in runner.lora.slots.slot_of
    assert all(not layer.a[slot].any() and not layer.b[slot].any() for layer in runner.lora.layers)
