"""Which adapter a request selects, and loading/unloading across every data-parallel scheduler, as the HTTP
process sees it (srt/http_server/lora_registry.py; the schedulers are stood in for by their replies). A load
is untrusted input: its path must resolve under the allowed directories, and a missing path gets the same
answer as a forbidden one; its name passes the start-up adapters' rule."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from srt.http_server.lora_registry import AdapterNotFound, AdapterRequestError, LoRARegistry
from srt.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.lora.specs import AdapterSpec

BASE = "SmolLM2"


def registry(ranks=2, answer=lambda msg, rank: True, allowed: tuple[str, ...] = ()):
    """A registry whose `ranks` schedulers answer every message at once (`answer` says success), loading
    under `allowed`."""
    sent = []
    holder = {}

    def send(msg):
        sent.append(msg)
        loop = asyncio.get_running_loop()
        for rank in range(ranks):
            ok = answer(msg, rank)
            reply = LoRAAdapterReqOutput(msg.request_id, ok, "" if ok else f"rank {rank} says no", "pinned")
            loop.call_soon(holder["reg"].on_reply, reply)

    reg = LoRARegistry(BASE, [AdapterSpec("sql", "/a/sql")], send, ranks, allowed)
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


@pytest.fixture
def root(tmp_path) -> Path:
    """An allowed directory holding adapter `chat`, next to a forbidden one holding `secret`, and a link
    from inside the allowed one to the forbidden one."""
    for d in ("allowed/chat", "forbidden/secret"):
        (tmp_path / d).mkdir(parents=True)
    os.symlink(tmp_path / "forbidden/secret", tmp_path / "allowed/link")
    return tmp_path


def test_load_serves_the_name_once_every_scheduler_added_it(root):
    allowed = str(root / "allowed")
    reg, sent = registry(allowed=(allowed,))
    asyncio.run(reg.load("chat", f"{allowed}/../allowed/chat", True))
    assert reg.resolve("chat") == "chat" and [a.name for a in reg.served()] == ["chat", "sql"]
    assert isinstance(sent[0], LoadLoRAAdapterReq) and sent[0].pinned
    assert sent[0].lora_path == f"{allowed}/chat"  # the schedulers read the resolved path


def test_a_load_one_replica_refuses_is_taken_back_out_of_the_others(root):
    reg, sent = registry(
        answer=lambda msg, rank: isinstance(msg, UnloadLoRAAdapterReq) or rank == 0, allowed=(str(root),)
    )
    with pytest.raises(AdapterRequestError, match="rank 1 says no") as e:
        asyncio.run(reg.load("chat", str(root / "allowed/chat")))
    assert e.value.param == "pinned"  # the scheduler's reply says which field the failure is about
    assert [type(m) for m in sent] == [LoadLoRAAdapterReq, UnloadLoRAAdapterReq]
    with pytest.raises(AdapterNotFound):
        reg.resolve("chat")


# (name, path under the test's root, pinned, words of the message, its param)
BAD_LOADS = [
    ("", "allowed/chat", False, "non-empty", "lora_name"),
    ("a:b", "allowed/chat", False, "':'", "lora_name"),
    ("a,b", "allowed/chat", False, "','", "lora_name"),
    (3, "allowed/chat", False, "non-empty string", "lora_name"),
    ("x" * 300, "allowed/chat", False, "at most 256", "lora_name"),
    ("x", "allowed/chat", "yes", "pinned", "pinned"),
    ("sql", "allowed/chat", False, "already loaded", "lora_name"),
    ("ｓｑｌ", "allowed/chat", False, "only by Unicode normalization", "lora_name"),  # fullwidth letters
    (BASE, "allowed/chat", False, "base model", "lora_name"),
    ("x", "", False, "non-empty string", "lora_path"),
]
# names with a character of every refused kind: NUL, DEL and other controls, format (zero-width space,
# right-to-left override, byte-order mark), invisible letters and marks (Hangul filler, variation
# selector), whitespace, private use, and one whose NFKC form holds a colon (fullwidth colon)
REFUSED_CHARS = ["\x00", "\x7f", "\x1b", "\x85", "\u200b", "\u202e", "\ufeff", "\u3164", "\ufe0f", "\u00a0",
                 "\ue000", "\uff1a"]  # fmt: skip
# paths that must all get one and the same answer: missing, outside, out by "..", out by a symlink
HIDDEN_PATHS = ["allowed/missing", "forbidden/secret", "allowed/../forbidden/secret", "allowed/link", "/etc"]


@pytest.mark.parametrize("name, path, pinned, words, param", BAD_LOADS)
def test_bad_loads_are_refused_before_any_scheduler_hears_of_them(root, name, path, pinned, words, param):
    reg, sent = registry(allowed=(str(root / "allowed"),))
    with pytest.raises(AdapterRequestError, match=words) as e:
        asyncio.run(reg.load(name, path and str(root / path), pinned))
    assert e.value.param == param and "\n" not in str(e.value)
    assert sent == []


@pytest.mark.parametrize("char", REFUSED_CHARS, ids=[f"U+{ord(c):04X}" for c in REFUSED_CHARS])
def test_names_with_control_format_or_invisible_characters_are_refused(root, char):
    reg, sent = registry(allowed=(str(root / "allowed"),))
    with pytest.raises(AdapterRequestError, match="may not contain") as e:
        asyncio.run(reg.load(f"ad{char}apter", str(root / "allowed/chat")))
    assert char not in str(e.value)  # echoed escaped
    assert sent == []


def test_a_missing_path_and_a_forbidden_one_get_the_same_answer(root):
    """No file-system oracle: what the 400 says depends on the path the caller wrote, never on what exists."""
    reg, sent = registry(allowed=(str(root / "allowed"),))
    answers = set()
    for path in HIDDEN_PATHS:
        with pytest.raises(AdapterRequestError) as e:
            asyncio.run(reg.load("x", str(root / path)))
        assert e.value.param == "lora_path"
        answers.add(str(e.value).replace(repr(str(root / path)), "PATH"))
    assert answers == {
        "lora_path PATH is not an adapter directory this server may load (see --lora-allowed-dirs)"
    }
    assert sent == []


def test_without_allowed_directories_no_path_loads(root):
    reg, sent = registry()
    with pytest.raises(AdapterRequestError, match="not an adapter directory this server may load"):
        asyncio.run(reg.load("chat", str(root / "allowed/chat")))
    assert sent == []


def test_an_echoed_path_is_capped():
    reg, _ = registry(allowed=("/nowhere",))
    with pytest.raises(AdapterRequestError) as e:
        asyncio.run(reg.load("x", "/" + "p" * 5000))
    assert len(str(e.value)) < 300 and "characters)" in str(e.value)


def test_unload_stops_serving_the_name_at_once_and_an_unknown_one_is_not_found():
    reg, sent = registry()
    asyncio.run(reg.unload("sql"))
    assert isinstance(sent[0], UnloadLoRAAdapterReq) and reg.served() == []
    with pytest.raises(AdapterRequestError) as e:
        asyncio.run(reg.unload("sql"))
    assert e.value.not_found
