"""Which adapter a request selects, and loading/unloading across every data-parallel scheduler, as the HTTP
process sees it (srt/http_server/lora_registry.py; the schedulers are stood in for by their replies)."""

from __future__ import annotations

import asyncio

import pytest

from srt.http_server.lora_registry import AdapterNotFound, AdapterRequestError, LoRARegistry
from srt.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.lora.specs import AdapterSpec

BASE = "SmolLM2"


def registry(ranks=2, answer=lambda msg, rank: True):
    """A registry whose `ranks` schedulers answer every message at once (`answer` says success)."""
    sent = []
    holder = {}

    def send(msg):
        sent.append(msg)
        loop = asyncio.get_running_loop()
        for rank in range(ranks):
            ok = answer(msg, rank)
            reply = LoRAAdapterReqOutput(msg.request_id, ok, "" if ok else f"rank {rank} says no")
            loop.call_soon(holder["reg"].on_reply, reply)

    reg = LoRARegistry(BASE, [AdapterSpec("sql", "/a/sql")], send, ranks)
    holder["reg"] = reg
    return reg, sent


def test_a_request_selects_an_adapter_by_model_base_colon_adapter_or_lora_path():
    reg, _ = registry()
    assert reg.resolve(None) is None and reg.resolve(BASE) is None
    assert reg.resolve("sql") == reg.resolve(f"{BASE}:sql") == reg.resolve(BASE, lora_path="sql") == "sql"
    for model in ("other", f"{BASE}:other", "other:sql", f"{BASE}:"):
        with pytest.raises(AdapterNotFound):
            reg.resolve(model)
    with pytest.raises(AdapterNotFound):
        reg.resolve(None, lora_path="other")


def test_load_serves_the_name_once_every_scheduler_added_it(tmp_path):
    reg, sent = registry()
    asyncio.run(reg.load("chat", str(tmp_path), True))
    assert reg.resolve("chat") == "chat" and [a.name for a in reg.served()] == ["chat", "sql"]
    assert isinstance(sent[0], LoadLoRAAdapterReq) and sent[0].pinned


def test_a_load_one_replica_refuses_is_taken_back_out_of_the_others(tmp_path):
    reg, sent = registry(answer=lambda msg, rank: isinstance(msg, UnloadLoRAAdapterReq) or rank == 0)
    with pytest.raises(AdapterRequestError, match="rank 1 says no"):
        asyncio.run(reg.load("chat", str(tmp_path)))
    assert [type(m) for m in sent] == [LoadLoRAAdapterReq, UnloadLoRAAdapterReq]
    with pytest.raises(AdapterNotFound):
        reg.resolve("chat")


@pytest.mark.parametrize(
    "name, path, pinned, words",
    [
        ("", ".", False, "non-empty"),
        ("a:b", ".", False, "':'"),
        (3, ".", False, "non-empty string"),
        ("x", "/no/such/dir", False, "not a directory"),
        ("x", ".", "yes", "pinned"),
        ("sql", ".", False, "already loaded"),
        (BASE, ".", False, "base model"),
    ],
)
def test_bad_loads_are_refused_before_any_scheduler_hears_of_them(name, path, pinned, words):
    reg, sent = registry()
    with pytest.raises(AdapterRequestError, match=words):
        asyncio.run(reg.load(name, path, pinned))
    assert sent == []


def test_unload_stops_serving_the_name_at_once_and_an_unknown_one_is_not_found():
    reg, sent = registry()
    asyncio.run(reg.unload("sql"))
    assert isinstance(sent[0], UnloadLoRAAdapterReq) and reg.served() == []
    with pytest.raises(AdapterRequestError) as e:
        asyncio.run(reg.unload("sql"))
    assert e.value.not_found
