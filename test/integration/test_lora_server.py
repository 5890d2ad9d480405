"""Multi-LoRA through a real server (docs/lora.md), on the tiny random Llama with PEFT-made adapters: a
request selects an adapter by `model` (ADAPTER or BASE:ADAPTER) or `/generate`'s `lora_path` and gets PEFT's
greedy tokens; `/v1/models` lists the adapters under their base; unknown adapters are 404s; adapters load and
unload while another request streams, which keeps its tokens; the LoRA metrics show the state, the token
counters still add up to the responses, and the request export names the adapter."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from srt.metrics.text_format import parse_metrics_text, select, total
from test.integration.conftest import running_server
from test.unit.lora_adapters import base_model, save_peft_adapter

pytestmark = pytest.mark.slow

NEW = 8
TIMEOUT = 120.0
PROMPT = [11, 523, 1402, 77, 900, 31, 2048, 5, 600]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("lora_server")
    return {
        n: save_peft_adapter(tiny_model_dir, out / n, rank=8, seed=i)
        for i, n in enumerate(("a", "b", "late"))
    }


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora_export")


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, export_dir):
    flags = ("--model-path", tiny_model_dir, "--quantization", "none", "--lora-paths", f"a={adapters['a']}",
             f"b={adapters['b']}", "--max-loras-per-batch", "2", "--export-metrics-to-file",
             "--export-metrics-to-file-dir", str(export_dir))  # fmt: skip
    with running_server(*flags) as handle:
        yield handle


@torch.no_grad()
def peft_greedy(model_dir: str, adapter_dir: str | None) -> list[int]:
    from peft import PeftModel

    model = base_model(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = list(PROMPT)
    for _ in range(NEW):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def generate(server, **extra) -> httpx.Response:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
    }
    return httpx.post(f"{server.base_url}/generate", json={**body, **extra}, timeout=TIMEOUT)


def completion(server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=TIMEOUT)


def served_name(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_models_lists_each_adapter_under_its_base(server):
    data = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
    base = data[0]["id"]
    assert {(m["id"], m.get("parent")) for m in data[1:]} == {("a", base), ("b", base)}


def test_each_way_of_naming_an_adapter_gets_pefts_tokens(server, tiny_model_dir, adapters):
    base = served_name(server)
    want_a = peft_greedy(tiny_model_dir, adapters["a"])
    assert generate(server, lora_path="a").json()["output_ids"] == want_a
    for model in ("a", f"{base}:a"):
        r = completion(server, model)
        assert r.status_code == 200, r.text
    assert generate(server).json()["output_ids"] == peft_greedy(tiny_model_dir, None) != want_a


@pytest.mark.parametrize("how", ["model", "base-colon", "lora_path"])
def test_an_adapter_that_is_not_served_is_a_404(server, how):
    base = served_name(server)
    if how == "lora_path":
        r = generate(server, lora_path="nope")
    else:
        r = completion(server, "nope" if how == "model" else f"{base}:nope")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_while_another_request_streams(server, tiny_model_dir, adapters):
    """A long streamed answer of adapter b keeps its tokens while `late` is loaded, used and unloaded."""
    want_b = generate(server, lora_path="b").json()["output_ids"]
    streamed: dict = {}

    def stream_b():
        body = {"input_ids": PROMPT, "lora_path": "b", "stream": True,
                "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        with httpx.stream("POST", f"{server.base_url}/generate", json=body, timeout=TIMEOUT) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed["ids"] = events[-1]["output_ids"]

    worker = threading.Thread(target=stream_b)
    worker.start()
    r = httpx.post(f"{server.base_url}/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": adapters["late"]}, timeout=TIMEOUT)  # fmt: skip
    assert r.status_code == 200, r.text
    assert generate(server, lora_path="late").json()["output_ids"] == peft_greedy(
        tiny_model_dir, adapters["late"]
    )
    r = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    worker.join(TIMEOUT)
    assert streamed["ids"] == want_b
    assert completion(server, "late").status_code == 404
    gone = httpx.post(f"{server.base_url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=TIMEOUT)
    assert gone.status_code == 404
    bad = httpx.post(f"{server.base_url}/v1/load_lora_adapter",
                     json={"lora_name": "x", "lora_path": "/no/such/dir"}, timeout=TIMEOUT)  # fmt: skip
    assert bad.status_code == 400 and "/no/such/dir" in bad.text


def test_metrics_show_the_adapters_and_the_counters_still_add_up(server, export_dir):
    before = parse_metrics_text(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
    usage = [
        completion(server, m).json()["usage"]["completion_tokens"] for m in ("a", "b", served_name(server))
    ]
    time.sleep(1.5)  # the schedulers flush their counters at least once a second
    after = parse_metrics_text(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
    name = "sglang:generation_tokens_total"
    assert total(after, name) - total(before, name) == sum(usage)
    loaded = {s.labels["adapter_name"] for s in select(after, "sglang:lora_adapter_loaded")}
    assert loaded == {"a", "b"}  # `late` was unloaded: its series went with it
    (info,) = select(after, "sglang:lora_requests_info")
    assert info.labels["running_lora_adapters"] == "" and info.labels["max_lora"] == "2"
    assert select(after, "sglang:lora_pool_slots_total")[0].value == 2
    records = [json.loads(line) for f in export_dir.glob("requests-*.jsonl") for line in f.open()]
    assert {r.get("lora_name") for r in records} >= {"a", "b", None}


@pytest.mark.parametrize("problem", ["missing-weights", "rank-too-high", "corrupt-config"])
def test_a_bad_start_up_adapter_is_a_one_line_config_error(tiny_model_dir, adapters, tmp_path, problem):
    """Exit 2 with one `start-up failed` line naming the adapter, no traceback: the flags were wrong."""
    import shutil

    from test.integration.conftest import config_error_line

    bad = tmp_path / "bad"
    shutil.copytree(adapters["a"], bad)
    flags = ["--model-path", tiny_model_dir, "--lora-paths", f"broken={bad}"]
    if problem == "missing-weights":
        next(bad.glob("*.safetensors")).unlink()
    elif problem == "rank-too-high":
        flags += ["--max-lora-rank", "4"]  # the adapter's rank is 8
    else:
        (bad / "adapter_config.json").write_text("{not json")
    assert "broken" in config_error_line(*flags)
