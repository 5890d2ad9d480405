"""The LoRA metrics (docs/metrics.md, "LoRA"): /metrics shows exactly each scheduler's current LoRA state:
one lora_requests_info series per scheduler however often the adapter lists change, a loaded-adapter series
per loaded adapter that goes away on unload, and the pool's slots."""

from __future__ import annotations

from prometheus_client import generate_latest

from srt.metrics.http import make_metrics_registry
from srt.metrics.lora_state import LoRAStateWriter
from srt.metrics.text_format import parse_metrics_text, select

LABELS = {"model_name": "m", "tp_rank": "0"}


def scrape(directory) -> list:
    return parse_metrics_text(generate_latest(make_metrics_registry(str(directory))).decode())


def test_the_current_state_and_nothing_else_is_exported(tmp_path):
    writer = LoRAStateWriter(str(tmp_path), LABELS, max_lora=4)
    loaded = [("a", False), ("b", True), ("c", False)]
    for running, waiting in ((["a"], []), (["a", "b"], ["c"]), (["b"], []), ([], [])):
        writer.write(running, waiting, len(running), 4, loaded)
    writer.write([], [], 1, 4, [("b", True)])  # a and c unloaded
    samples = scrape(tmp_path)
    (info,) = select(samples, "sglang:lora_requests_info")  # one series, not one per list ever seen
    assert info.labels["running_lora_adapters"] == info.labels["waiting_lora_adapters"] == ""
    assert info.labels["max_lora"] == "4" and info.value > 1.7e9  # vLLM's rule: the state's wall-clock time
    assert [
        (s.labels["adapter_name"], s.labels["pinned"]) for s in select(samples, "sglang:lora_adapter_loaded")
    ] == [("b", "true")]
    assert select(samples, "sglang:lora_pool_slots_used")[0].value == 1
    assert select(samples, "sglang:lora_pool_slots_total")[0].value == 4
    assert select(samples, "sglang:lora_pool_utilization")[0].value == 0.25


def test_lists_are_sorted_and_each_scheduler_has_its_own_series(tmp_path):
    for rank, running in (("0", ["zeta", "alpha"]), ("1", ["beta"])):
        writer = LoRAStateWriter(str(tmp_path), {**LABELS, "dp_rank": rank}, max_lora=2)
        writer.write(sorted(running), ["gamma"], len(running), 2, [(n, False) for n in running])
    infos = {s.labels["dp_rank"]: s.labels for s in select(scrape(tmp_path), "sglang:lora_requests_info")}
    assert (
        infos["0"]["running_lora_adapters"] == "alpha,zeta" and infos["1"]["running_lora_adapters"] == "beta"
    )
    assert infos["0"]["waiting_lora_adapters"] == "gamma"


def test_without_lora_nothing_is_exported(tmp_path):
    assert not [s for s in scrape(tmp_path) if "lora" in s.name]
