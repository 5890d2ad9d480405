"""The LoRA metrics (docs/metrics.md, "LoRA"): which adapters are loaded, running and waiting, and the pool's
slots, as state rather than as counters.

Why not prometheus_client gauges like the rest: these metrics name adapters in their labels, and a
multiprocess gauge child, once written, stays in its process's file for good. vLLM's
`vllm:lora_requests_info` shows what that does: every distinct list of running adapters becomes a series of
its own that never goes away, and an unloaded adapter would linger forever. So each scheduler writes its
current LoRA state (`LoRALoad`) as one small JSON file into PROMETHEUS_MULTIPROC_DIR when it changes (an
atomic replace, at the reporter's flushes; nothing travels over ZMQ), and `/metrics` turns the files into
exactly the current series (`LoRAStateCollector`):

- `sglang:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`: one series per
  scheduler, its value the wall-clock time of the state (vLLM's rule); the lists are sorted, comma-joined
  names of loaded adapters, an adapter listed under running only while a request of it runs;
- `sglang:lora_pool_slots_used`, `sglang:lora_pool_slots_total`, `sglang:lora_pool_utilization` (SGLang's);
- `sglang:lora_adapter_loaded{adapter_name, pinned}` = 1 for every loaded adapter, idle or not; its series
  goes away when the adapter is unloaded.

Bound: at any moment at most one `lora_requests_info` series per scheduler and one `lora_adapter_loaded`
series per loaded adapter (at most --max-loaded-loras); label values come only from names the operator
loaded.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

STATE_FILE_GLOB = "lora_state_*.json"


class LoRAStateWriter:
    """One scheduler's writer. `labels`: its label set (model name, TP rank, DP rank with --dp-size)."""

    def __init__(self, directory: str, labels: dict[str, str], max_lora: int):
        rank = labels.get("dp_rank", "0")
        self.path = os.path.join(directory, f"lora_state_{rank}.json")
        self.labels = labels
        self.max_lora = max_lora
        self._last: tuple | None = None

    def write(self, running, waiting, slots_used: int, slots_total: int, loaded) -> None:
        """Replace the state file when the state changed (a flush with nothing new writes nothing)."""
        state = (tuple(running), tuple(waiting), slots_used, slots_total, tuple(loaded))
        if state == self._last:
            return
        body = {
            "labels": self.labels,
            "time": time.time(),
            "max_lora": self.max_lora,
            "running": list(running),
            "waiting": list(waiting),
            "slots_used": slots_used,
            "slots_total": slots_total,
            "loaded": [[name, pinned] for name, pinned in loaded],
        }
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(body, f)
            os.replace(tmp, self.path)
        except OSError as e:  # a full or vanished directory must not stop the scheduler
            logger.warning("could not write the LoRA metrics state: %s", e)
            return
        self._last = state


class LoRAStateCollector(Collector):
    """Reads every scheduler's state file at each scrape (a few hundred bytes each)."""

    def __init__(self, directory: str):
        self.directory = directory

    def collect(self) -> Iterator[GaugeMetricFamily]:
        states = []
        for path in sorted(glob.glob(os.path.join(self.directory, STATE_FILE_GLOB))):
            try:
                with open(path) as f:
                    states.append(json.load(f))
            except (OSError, ValueError):
                continue  # replaced between the glob and the read: the next scrape reads it
        if not states:
            return
        names = sorted(states[0]["labels"])
        info = GaugeMetricFamily(
            "sglang:lora_requests_info",
            "Running and waiting LoRA adapters (sorted, comma-joined); the value is the state's wall-clock time.",
            labels=[*names, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        used = GaugeMetricFamily(
            "sglang:lora_pool_slots_used", "LoRA slots holding an adapter.", labels=names
        )
        total = GaugeMetricFamily(
            "sglang:lora_pool_slots_total", "LoRA slots in the weight pool.", labels=names
        )
        utilization = GaugeMetricFamily(
            "sglang:lora_pool_utilization", "Used / total LoRA slots.", labels=names
        )
        loaded = GaugeMetricFamily(
            "sglang:lora_adapter_loaded",
            "1 for every loaded LoRA adapter, idle or not (the series goes away on unload).",
            labels=[*names, "adapter_name", "pinned"],
        )
        for s in states:
            base = [str(s["labels"].get(n, "")) for n in names]
            extra = [str(s["max_lora"]), ",".join(s["running"]), ",".join(s["waiting"])]
            info.add_metric([*base, *extra], s["time"])
            used.add_metric(base, s["slots_used"])
            total.add_metric(base, s["slots_total"])
            utilization.add_metric(base, s["slots_used"] / s["slots_total"] if s["slots_total"] else 0.0)
            for name, pinned in s["loaded"]:
                loaded.add_metric([*base, name, "true" if pinned else "false"], 1.0)
        yield from (info, used, total, utilization, loaded)
