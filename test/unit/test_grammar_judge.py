"""Specification of the constraint judge: what admits no complete output is found statically, what the library
cannot enforce is found by compiling and walking the first masks, and the HTTP process's judge runs all of it
in a child process that is killed past the time budget, remembering every verdict."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from srt.constrained import GrammarError, GrammarKey, create_grammar_backend
from srt.constrained.bitmask import forbidden_tokens
from srt.constrained.grammar_manager import GrammarManager, GrammarMismatch
from srt.constrained.judge import GrammarJudge, judge_in_process
from srt.constrained.satisfiable import (
    MAX_JSON_NESTING,
    check_json_nesting,
    json_nesting_depth,
    unproductive_gbnf,
    unproductive_schema,
)

CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
DOUBLING_EBNF = (
    "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} r{i + 1}\n" for i in range(20)) + 'r20 ::= "a"\n'
)


@pytest.mark.parametrize(
    "schema",
    [
        CYCLE,
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {"allOf": [{"$ref": "#/$defs/b"}], "$defs": {"b": {"anyOf": [{"$ref": "#/$defs/b"}]}}},
        False,
    ],
)
def test_a_schema_with_no_finite_instance_is_unproductive(schema):
    assert unproductive_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # `a` may be left out
        {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # null ends it
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {
            "$defs": {
                "node": {
                    "anyOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "properties": {"next": {"$ref": "#/$defs/node"}},
                            "required": ["next"],
                        },
                    ]
                }
            },
            "$ref": "#/$defs/node",
        },
        # chains of refs, found round by round (a chain was once refused: refs found late went unevaluated)
        {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"},
        {
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"type": "integer"}},
            "$ref": "#/$defs/a",
        },
        {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"$ref": "#/$defs/y"}},
            "required": ["a", "b"],
            "$defs": {"x": {"$ref": "#/$defs/z"}, "z": {"type": "null"}, "y": {"$ref": "#/$defs/w"}, "w": {}},
        },
        {"$ref": "https://example.com/remote.json"},  # not modelled: the library decides
        {"type": "object"},
        True,
    ],
)
def test_a_schema_with_a_way_out_is_productive(schema):
    assert unproductive_schema(schema) is None


@pytest.mark.parametrize(
    "grammar, productive",
    [
        ('root ::= ("a" | "b") root', False),
        ('root ::= "a" x\nx ::= "b" x', False),
        ('root ::= [a-z]{3,5} y\ny ::= y{1,} "z"', False),
        ('root ::= "a"', True),
        ('root ::= "(" root ")" | "x"', True),
        ('root ::= x*\nx ::= "a" x', True),  # zero repetitions end it
        ('root ::= x?\nx ::= x "a"', True),
        ('root ::= x{0,3}\nx ::= x "a"', True),
        (DOUBLING_EBNF, True),  # finite, if 2^20 characters long: the library's limits refuse it
        ("root ::= @@@", True),  # not understood: the library decides
    ],
)
def test_gbnf_productivity(grammar, productive):
    assert (unproductive_gbnf(grammar) is None) == productive


def test_nesting_depth_ignores_brackets_inside_strings_and_is_bounded():
    assert json_nesting_depth('{"a": [{"b": "[[[[{{"}]}') == 3
    deep = "[" * (MAX_JSON_NESTING + 1) + "]" * (MAX_JSON_NESTING + 1)
    with pytest.raises(ValueError, match="nests"):
        check_json_nesting(deep)
    check_json_nesting("[" * MAX_JSON_NESTING + "]" * MAX_JSON_NESTING)
    assert json_nesting_depth("[" * 100_000) == 100_000  # no recursion, however deep


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def llguidance(tokenizer):
    return create_grammar_backend("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize(
    "key, words",
    [
        (GrammarKey("json_schema", json.dumps(CYCLE)), "no complete output"),
        (GrammarKey("ebnf", 'root ::= ("a" | "b") root'), "no complete output"),
        (GrammarKey("regex", "(x{1000}){1000}"), "limits"),
        (GrammarKey("ebnf", DOUBLING_EBNF), "limits"),
        (GrammarKey("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}'), "minimum"),
        (GrammarKey("regex", "[^\\s\\S]"), "regex"),
        (GrammarKey("json_schema", "[" * 200 + "]" * 200), "nests"),
    ],
)
def test_the_judge_refuses_what_would_fail_later_naming_the_kind(llguidance, key, words):
    message = judge_in_process(llguidance, key)
    assert message is not None and words in message and key.kind in message
    assert "\n" not in message


def test_the_judge_passes_enforceable_constraints_quickly(llguidance):
    from srt.function_call.tool_schema import tool_call_schema

    tools = [
        (f"f{i}", {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
        for i in range(128)
    ]
    for key in (
        GrammarKey("regex", "[0-9]{3}"),
        GrammarKey("json_schema", '{"type": "object"}'),
        GrammarKey("json_schema", tool_call_schema(tools, True)),
        GrammarKey("ebnf", 'root ::= "a"*'),
    ):
        t0 = time.perf_counter()
        assert judge_in_process(llguidance, key) is None
        assert time.perf_counter() - t0 < 2.0


# ---- the judge process ----


def make_judge(tokenizer, timeout: float) -> GrammarJudge:
    from srt.model_source import resolve_model_dir

    return GrammarJudge(
        "llguidance", resolve_model_dir(None), len(tokenizer), [tokenizer.eos_token_id], timeout
    )


def test_the_judge_process_answers_caches_verdicts_and_times_out(tokenizer):
    judge = make_judge(tokenizer, timeout=20.0)

    async def scenario():
        await judge.check(GrammarKey("regex", "[0-9]{3}"))
        with pytest.raises(GrammarError) as err:
            await judge.check(GrammarKey("json_schema", json.dumps(CYCLE)))
        assert err.value.kind == "json_schema"
        judged = judge.num_judged
        with pytest.raises(GrammarError):  # a failure is remembered: not judged again
            await judge.check(GrammarKey("json_schema", json.dumps(CYCLE)))
        await asyncio.gather(*(judge.check(GrammarKey("regex", "[a-z]{2}")) for _ in range(5)))
        assert judge.num_judged == judged + 1  # concurrent checks of one constraint share one judgement
        judge.timeout = 0.05  # (x{1000}){1000} takes seconds to fail: over this budget it is killed
        with pytest.raises(GrammarError, match="--grammar-compile-timeout"):
            await judge.check(GrammarKey("regex", "(x{1000}){1000}"))
        assert judge.num_timeouts == 1
        judge.timeout = 20.0
        await judge.check(GrammarKey("regex", "[0-9]{4}"))  # a fresh child took over

    try:
        asyncio.run(scenario())
    finally:
        judge.close()


def test_a_disabled_backend_refuses_without_a_process(tokenizer):
    judge = GrammarJudge("none", "unused", 10, [0], 1.0)
    with pytest.raises(GrammarError, match="disabled"):
        asyncio.run(judge.check(GrammarKey("regex", "a")))
    assert judge._child is None


# ---- the scheduler's side: a mask the library flagged is never trusted ----


class Req:
    def __init__(self, rid):
        self.rid = rid
        self.grammar = None


def test_a_mismatch_fails_the_request_and_drops_the_grammar_from_the_cache(tokenizer, llguidance):
    manager = GrammarManager(
        "llguidance", lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], synchronous=True
    )
    key = GrammarKey("regex", "(x{1000}){1000}")  # compiles; its masks hit the lexer's limit at once
    req = Req("r")
    manager.submit(req, key)
    ready, failed = manager.pop_ready()
    assert ready == [req] and not failed and len(manager.cache) == 1
    mask = manager.fill_mask([req])
    token = int((~forbidden_tokens(mask.bitmask, len(tokenizer))[0]).nonzero()[0])
    with pytest.raises(GrammarMismatch):
        manager.advance(req, token)
    assert len(manager.cache) == 0  # the next request compiles afresh


def test_an_errored_matcher_never_ends_as_a_complete_match(tokenizer, llguidance):
    """llguidance's mask for a grammar it finds unsatisfiable allows only the stop token, and accepting it
    'stops' the matcher: that must be an error, not `stop` with empty output."""
    manager = GrammarManager(
        "llguidance", lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], synchronous=True
    )
    req = Req("r")
    manager.submit(req, GrammarKey("json_schema", json.dumps(CYCLE)))
    [ready], _ = manager.pop_ready()
    manager.fill_mask([req])
    with pytest.raises(GrammarMismatch):
        manager.advance(req, tokenizer.eos_token_id)


# ---- a forced tool choice's schema keeps each tool's own `$ref`s meaningful ----

ITEMS = {
    "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
        "const_data": {"const": {"$ref": "#"}},
    },
    "required": ["items"],
}


@pytest.mark.parametrize("num_tools", [1, 3])
def test_tool_parameters_with_defs_compile_inside_the_calls_schema(llguidance, num_tools):
    from srt.function_call.tool_schema import tool_call_schema

    tools = [(f"f{i}", ITEMS) for i in range(num_tools)]
    schema = tool_call_schema(tools, parallel=True)
    assert judge_in_process(llguidance, GrammarKey("json_schema", schema)) is None
    items = json.loads(schema)["items"]
    call = items if num_tools == 1 else items["anyOf"][num_tools - 1]
    arguments = call["properties"]["arguments"]
    base = (
        "#/items/properties/arguments"
        if num_tools == 1
        else f"#/items/anyOf/{num_tools - 1}/properties/arguments"
    )
    assert arguments["properties"]["items"]["items"] == {"$ref": f"{base}/$defs/Item"}
    assert arguments["properties"]["const_data"] == {"const": {"$ref": "#"}}  # data, not a reference


def test_a_judge_that_cannot_start_is_unavailable_not_a_verdict(tmp_path):
    """A tokenizer the child cannot load is the server's trouble (a 503), not the constraint's (a 400)."""
    from srt.constrained.judge import JudgeUnavailable

    judge = GrammarJudge("llguidance", str(tmp_path / "no-such-tokenizer"), 100, [0], 5.0)
    try:
        with pytest.raises(JudgeUnavailable):
            asyncio.run(judge.check(GrammarKey("regex", "[0-9]")))
    finally:
        judge.close()


def test_the_judge_is_rebuilt_when_the_scheduler_says_another_vocabulary(tokenizer):
    """The server starts the judge on the tokenizer's vocabulary while the scheduler loads the model; the
    scheduler's own vocabulary size and end-of-sequence ids, once ready, replace a child built for others."""
    judge = make_judge(tokenizer, timeout=20.0)
    try:
        judge.start()
        assert judge.wait_started(60.0)
        first = judge._child
        assert first.model == (len(tokenizer), [tokenizer.eos_token_id])
        judge.bind(len(tokenizer), [tokenizer.eos_token_id])  # the same: kept
        judge.start()
        assert judge.wait_started(60.0) and judge._child is first
        judge.bind(len(tokenizer) + 64, [tokenizer.eos_token_id, 0])  # a padded vocabulary: rebuilt
        judge.start()
        assert judge.wait_started(60.0)
        assert judge._child is not first and not first.alive
        assert judge._child.model == (len(tokenizer) + 64, [tokenizer.eos_token_id, 0])
        asyncio.run(judge.check(GrammarKey("regex", "[0-9]{3}")))
    finally:
        judge.close()


def test_a_judge_closed_while_its_child_starts_stops_it_cleanly(tokenizer):
    """The server can stop while the judge's child is still loading: the child is killed at once and its pipe
    closed on the judge's thread, which reads it (closed from the stopping thread, the two closes raced:
    EBADF at a test server's shutdown)."""
    judge = make_judge(tokenizer, timeout=20.0)
    judge.start()
    deadline = time.monotonic() + 30
    while judge._child is None and time.monotonic() < deadline:  # spawned, still loading its tokenizer
        time.sleep(0.01)
    child = judge._child
    assert child is not None and child.model is None
    judge.close()
    judge.close()  # twice: nothing more
    judge._thread.shutdown(wait=True)
    assert judge._started.exception() is not None  # the start it cut short: unavailable, not a verdict
    assert not child.alive and child.conn.closed and judge._child is None
