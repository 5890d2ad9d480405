"""Multi-LoRA through a real server (docs/lora.md), on the tiny random Llama with PEFT-made adapters: a
request selects an adapter by `model` (ADAPTER or BASE:ADAPTER) or `/generate`'s `lora_path` and gets PEFT's
greedy tokens; `/v1/models` lists the adapters under their base; unknown adapters are 404s; adapters load and
unload while another request streams, which keeps its tokens; the LoRA metrics show the state, the token
counters still add up to the responses, and the request export names the adapter. Hostile loads (a pin
while streams hold every slot, paths outside the allowed directories, names with control or look-alike
characters, configs nested too deep or with a 5 KB field) are 400s that leave the same children serving."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from srt.lora.adapter import CONFIG_FILE
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


@pytest.mark.parametrize("problem", ["missing-weights", "rank-too-high", "corrupt-config", "deep-config"])
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
    elif problem == "corrupt-config":
        (bad / CONFIG_FILE).write_text("{not json")
    else:  # past the JSON parser's recursion limit: once a RecursionError and exit 1
        (bad / CONFIG_FILE).write_text(deep_config())
    assert "broken" in config_error_line(*flags)


# ---- hostile loads: each a 400 (param, words), after which the same children serve and /health is 200 ----
STREAM_TOKENS = 1500  # streams that outlast the load that arrives while they run (closed right after it)
DEEP = 100_000
MAX_MESSAGE_CHARS = 400  # a refusal repeats at most a capped part of what it was given


def deep_config() -> str:
    return '{"r": 8, "x": ' + "[" * DEEP + "]" * DEEP + "}"


@pytest.fixture(scope="module")
def hostile(adapters, tmp_path_factory) -> dict[str, str]:
    """Paths for the hostile loads. The start-up adapters' directory is the allowed one (the default); beside
    it, a valid adapter outside it, a link from inside to it, and adapters with a deep or a huge config."""
    allowed = Path(adapters["a"]).parent
    outside = tmp_path_factory.mktemp("lora_outside")
    shutil.copytree(adapters["late"], outside / "valid")
    os.symlink(outside / "valid", allowed / "link-out")
    for name in ("deep", "huge"):
        shutil.copytree(adapters["late"], allowed / name)
    (allowed / "deep" / CONFIG_FILE).write_text(deep_config())
    config = json.loads((allowed / "huge" / CONFIG_FILE).read_text())
    (allowed / "huge" / CONFIG_FILE).write_text(json.dumps({**config, "peft_type": "P" * 5000}))
    return {
        "missing": str(allowed / "missing"),
        "outside": str(outside / "valid"),
        "dot-dot": f"{allowed}/../{outside.name}/valid",
        "link-out": str(allowed / "link-out"),
        "deep": str(allowed / "deep"),
        "huge": str(allowed / "huge"),
        "valid": adapters["late"],
    }


@pytest.fixture(scope="module")
def children(server) -> dict[str, int]:
    pids = server.child_pids()
    assert "srt-scheduler" in pids, pids
    return pids


def load(server, name: str, path: str, pinned: bool = False) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path, "pinned": pinned}
    return httpx.post(f"{server.base_url}/load_lora_adapter", json=body, timeout=TIMEOUT)


def pin_while_both_slots_run(server, paths) -> httpx.Response:
    """Streams of a and b hold both slots (--max-loras-per-batch 2); a pinned load then would leave them one
    slot: refused, and the streams keep running until closed."""
    started = [threading.Event(), threading.Event()]
    done = threading.Event()
    received = [0, 0]

    def stream(i: int, adapter: str) -> None:
        body = {"model": adapter, "prompt": PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    received[i] += 1
                    started[i].set()
                if done.is_set():
                    return  # closing the stream aborts the request

    workers = [threading.Thread(target=stream, args=(i, n)) for i, n in enumerate("ab")]
    for w in workers:
        w.start()
    try:
        assert all(e.wait(TIMEOUT) for e in started)
        r = load(server, "p1", paths["valid"], pinned=True)
        seen = list(received)
    finally:
        done.set()
        for w in workers:
            w.join(TIMEOUT)
    assert min(seen) < STREAM_TOKENS  # both were still streaming when the pin was refused
    return r


# (the request, its param, words of its message)
HOSTILE = {
    "pin while both slots run": (pin_while_both_slots_run, "pinned", "pinned: the running requests"),
    "missing path": (lambda s, p: load(s, "x", p["missing"]), "lora_path", "not an adapter directory"),
    "path outside": (lambda s, p: load(s, "x", p["outside"]), "lora_path", "not an adapter directory"),
    "path out by ..": (lambda s, p: load(s, "x", p["dot-dot"]), "lora_path", "not an adapter directory"),
    "path out by a link": (lambda s, p: load(s, "x", p["link-out"]), "lora_path", "not an adapter directory"),
    "NUL in the name": (lambda s, p: load(s, "x\x00y", p["valid"]), "lora_name", "may not contain"),
    "DEL in the name": (lambda s, p: load(s, "x\x7fy", p["valid"]), "lora_name", "may not contain"),
    "zero-width space in the name": (lambda s, p: load(s, "x\u200by", p["valid"]), "lora_name", "may not contain"),
    "comma in the name": (lambda s, p: load(s, "x,y", p["valid"]), "lora_name", "may not contain"),
    "a look-alike of a loaded name": (lambda s, p: load(s, "\uff41", p["valid"]), "lora_name", "Unicode normalization"),
    "config nested too deep": (lambda s, p: load(s, "deep", p["deep"]), "lora_path", "nested too deeply"),
    "5 KB peft_type": (lambda s, p: load(s, "huge", p["huge"]), "lora_path", "characters) is not LORA"),
}  # fmt: skip


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_loads_are_400s_and_the_same_children_serve(server, hostile, children, case):
    send, param, words = case
    r = send(server, hostile)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(error["message"]) <= MAX_MESSAGE_CHARS
    assert server.child_pids() == children
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert {m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][1:]} == {
        "a",
        "b",
    }


def test_a_missing_path_and_a_forbidden_one_get_the_same_answer(server, hostile):
    messages = {
        load(server, "x", hostile[k]).json()["error"]["message"].replace(repr(hostile[k]), "PATH")
        for k in ("missing", "outside", "dot-dot", "link-out")
    }
    assert len(messages) == 1, messages


def test_a_refused_pin_is_honoured_once_the_slots_free(server, hostile):
    """After the streams of the pin case closed (their aborts reach the scheduler soon after), the same pin
    succeeds; unloaded again, the server is as the other tests expect."""
    deadline = time.monotonic() + TIMEOUT
    while (r := load(server, "p1", hostile["valid"], pinned=True)).status_code == 400:
        assert "pinned" in r.text and time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert httpx.post(
        f"{server.base_url}/unload_lora_adapter", json={"lora_name": "p1"}, timeout=TIMEOUT
    ).is_success
