"""Multi-LoRA admission in the scheduler without a model (docs/lora.md, "Loading and unloading while serving"):
a real `Scheduler`, `SchedulerLoRA`, `LoRAManager` and slot table over a stand-in runner whose forward pass
returns zero logits and whose adapters are weightless. Every way loads, pins and unloads interleave with
running requests (slots full, the pinned maximum, the loaded maximum, unloads during streams, a prompt
mid-chunk) keeps the invariant of srt/lora/slots.py: no step is ever asked to serve more adapters than its
slots allow (the slot table would raise, and before this rule it did: a pin while two streams held both
slots killed the scheduler). A pin that cannot be honoured now is refused naming `pinned`; admission holds
requests back; every request that was not refused gets all its tokens."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from srt.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.lora.adapter import LoRAAdapter
from srt.lora.manager import LoRAConfig, LoRAManager
from srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs
from test.unit.scheduler_driver import MAX_STEPS, greedy, request

SLOTS = 2  # the server: --max-loras-per-batch 2 --max-loaded-loras 4, adapters a and b at start
MAX_LOADED = 4
STREAM_TOKENS = 12  # a "stream": long enough that every event of a case happens while it runs
SHORT_TOKENS = 3
PROMPT = [5, 6, 7, 8]
LONG_PROMPT = [1 + i % 30 for i in range(64)]  # four chunks of CHUNK tokens
CHUNK = 16


class StandInRunner:
    """What the scheduler reads of a `ModelRunner`, without a model: the KV pools, the LoRA manager (its
    pool has no layers, so an adapter is only a name in the slot table) and a forward pass of zero logits."""

    vocab_size = 32
    eos_token_ids = [0]
    device = "cpu"
    context_len = 256
    max_running_requests = 8
    max_total_num_tokens = 4096
    decode_graph_max_bs = 0
    verify_max_tokens = 0
    model_dir = ""
    kv_cache_dtype = torch.float32
    attention_backend_name = "none"
    load_weights_seconds = 0.0

    def __init__(self, slots: int, max_loaded: int | None):
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, self.context_len)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.max_total_num_tokens)
        config = LoRAConfig(max_loras_per_batch=slots, max_loaded_loras=max_loaded)
        self.lora = LoRAManager(nn.Module(), config, TensorParallelGroup(), torch.float32, self.device)
        self.lora.read = lambda name, path: LoRAAdapter(name, path, rank=1, scaling=1.0, weights={})

    def forward(self, batch) -> torch.Tensor:
        self.lora.begin_step(batch)
        rows = batch.batch_size if batch.logit_rows is None else len(batch.logit_rows)
        return torch.zeros(rows, self.vocab_size)


def make(slots: int = SLOTS, max_loaded: int | None = MAX_LOADED, pinned: tuple[str, ...] = ()) -> Scheduler:
    """A scheduler serving adapters a and b (and `pinned`, pinned) from the start, reading loads in its loop
    (as with tensor parallelism): each load is added at the next step's start, the same in every run."""
    runner = StandInRunner(slots, max_loaded)
    for name in ("a", "b", *pinned):
        runner.lora.load(name, f"/adapters/{name}", pinned=name in pinned)
    args = ServerArgs(
        enable_lora=True, max_loras_per_batch=slots, max_total_tokens=runner.max_total_num_tokens,
        quantization="none", chunked_prefill_size=CHUNK, disable_radix_cache=True,
    )  # fmt: skip
    sched = Scheduler(args, runner)
    sched.lora._reader = None
    return sched


# ---- events ----
@dataclass(frozen=True)
class Req:
    rid: str
    adapter: str | None
    tokens: int = STREAM_TOKENS
    prompt: tuple[int, ...] = tuple(PROMPT)


@dataclass(frozen=True)
class Load:
    name: str
    pinned: bool = False


@dataclass(frozen=True)
class Unload:
    name: str


@dataclass
class Run:
    """What a workload did: each request's tokens and finish, each control message's reply, and every forward
    step's adapters with the pinned ones of that moment."""

    tokens: dict[str, int] = field(default_factory=dict)
    finish: dict[str, object] = field(default_factory=dict)
    replies: dict[str, LoRAAdapterReqOutput] = field(default_factory=dict)
    steps: list[tuple[frozenset, frozenset]] = field(default_factory=list)
    states: list[tuple[frozenset, object]] = field(default_factory=list)  # running adapters, chunked req


def key(event) -> str:
    """A control message's request id, and how a case names its reply."""
    return f"{type(event).__name__.lower()} {event.name}{' pinned' * getattr(event, 'pinned', False)}"


def run(sched: Scheduler, events: dict[int, list], after_step=None, asked: tuple[str, ...] = ()) -> Run:
    """Apply `events[k]` before step k (and `after_step(step, sched)`'s messages, whose replies are
    `asked`); step until every request has finished and every reply is in."""
    out = Run()
    slots = sched.builder.adapter_slots

    def recording(reqs):
        pinned = frozenset(sched.runner.lora.slots.pinned)
        out.steps.append((frozenset(r.lora_name for r in reqs) - {None}, pinned))
        return slots(reqs)

    sched.builder.adapter_slots = recording
    rids = {e.rid for es in events.values() for e in es if isinstance(e, Req)}
    asked = {*asked, *(key(e) for es in events.values() for e in es if not isinstance(e, Req))}
    for step in range(MAX_STEPS):
        for event in events.get(step, []):
            if isinstance(event, Req):
                msg = request(event.rid, list(event.prompt), greedy(event.tokens), stream=True)
                msg.lora_name = event.adapter
                sched.add_request(msg)
            elif isinstance(event, Load):
                sched.handle(
                    LoadLoRAAdapterReq(key(event), event.name, f"/adapters/{event.name}", event.pinned)
                )
            else:
                sched.handle(UnloadLoRAAdapterReq(key(event), event.name))
        result = sched.step()
        running = frozenset(r.lora_name for r in sched.running) - {None}
        out.states.append((running, sched.chunked_req.rid if sched.chunked_req is not None else None))
        if after_step is not None:
            after_step(step, sched)
        if result is not None:
            for i, rid in enumerate(result.rids):
                out.tokens[rid] = out.tokens.get(rid, 0) + len(result.output_ids[i])
                if result.finished_reasons[i] is not None:
                    out.finish[rid] = result.finished_reasons[i]
        out.replies.update((r.request_id, r) for r in sched.take_replies())
        if step >= max(events, default=0) and set(out.finish) >= rids and set(out.replies) >= asked:
            return out
    raise AssertionError("the workload did not finish")


def assert_every_step_fit(sched: Scheduler, out: Run) -> None:
    """The invariant: a step's unpinned adapters fit the slots the pinned ones leave."""
    total = sched.runner.lora.slots.num_slots
    for adapters, pinned in out.steps:
        assert len(adapters - pinned) <= total - len(pinned), (adapters, pinned)


# ---- the table ----
STREAMS = [Req("sa", "a"), Req("sb", "b")]  # both slots held while they run


@dataclass(frozen=True)
class Case:
    events: dict[int, list]
    replies: dict[str, str | None]  # reply key -> None (success) or words of the failure
    loaded: set[str]  # adapters loaded at the end; `*` marks a pinned one
    refused: tuple[str, ...] = ()  # requests answered with an error instead of tokens
    slots: int = SLOTS
    pinned: tuple[str, ...] = ()  # pinned at start
    never_together: tuple[frozenset, ...] = ()  # adapter sets no step may hold


CASES = {
    # the case: two streams hold both slots; a pin would leave one unpinned slot for two adapters
    "pin while both slots run": Case(
        {0: STREAMS, 3: [Load("p1", pinned=True)]},
        {"load p1 pinned": "pinned: the running requests' adapters hold the slots"},
        {"a", "b"},
    ),
    "unpinned load while both slots run": Case(
        {0: STREAMS, 3: [Load("c")], 5: [Req("rc", "c", SHORT_TOKENS)]},
        {"load c": None},
        {"a", "b", "c"},
        never_together=(frozenset("abc"),),
    ),
    "pin beside one running adapter, then the other waits": Case(
        {0: [Req("sa", "a")], 3: [Load("p1", pinned=True)], 5: [Req("rb", "b", SHORT_TOKENS)]},
        {"load p1 pinned": None},
        {"a", "b", "p1*"},
        never_together=(frozenset("ab"),),
    ),
    "a pin and waiting requests in one step: the pin first, admission holds one back": Case(
        {0: [Load("p1", pinned=True), Req("ra", "a"), Req("rb", "b")], 1: [Req("rp", "p1")]},
        {"load p1 pinned": None},
        {"a", "b", "p1*"},
        never_together=(frozenset("ab"),),
    ),
    "pin refused, then honoured once a stream finished": Case(
        {
            0: [Req("sa", "a", SHORT_TOKENS), Req("sb", "b")],
            2: [Load("p1", pinned=True)],
            9: [Load("p2", pinned=True)],
        },  # fmt: skip
        {"load p1 pinned": "pinned", "load p2 pinned": None},
        {"a", "b", "p2*"},
    ),
    "the pinned maximum: one slot stays unpinned": Case(
        {0: [Load("p1", pinned=True)], 2: [Load("p2", pinned=True)], 3: [Req("ra", "a", SHORT_TOKENS)]},
        {"load p1 pinned": None, "load p2 pinned": "pinned: pinning it would leave none of the 2 slots"},
        {"a", "b", "p1*"},
    ),
    "one slot: nothing can be pinned": Case(
        {0: [Req("sa", "a")], 2: [Load("p1", pinned=True)], 3: [Req("rb", "b", SHORT_TOKENS)]},
        {"load p1 pinned": "pinned: pinning it would leave none of the 1 slots"},
        {"a", "b"},
        slots=1,
        never_together=(frozenset("ab"),),
    ),
    "pinned at start: requests of three adapters share one unpinned slot": Case(
        {0: [Req("ra", "a"), Req("rb", "b"), Req("rp", "p0")]},
        {},
        {"a", "b", "p0*"},
        slots=2,
        pinned=("p0",),
        never_together=(frozenset("ab"),),
    ),
    "the loaded maximum, while both slots run": Case(
        {0: STREAMS, 2: [Load("c")], 3: [Load("d", pinned=True)], 4: [Load("e")]},
        {"load c": None, "load d pinned": "pinned", "load e": None},
        {"a", "b", "c", "e"},
    ),
    "past the loaded maximum": Case(
        {0: STREAMS, 2: [Load("c"), Load("d")], 4: [Load("e")]},
        {"load c": None, "load d": None, "load e": "4 adapters are loaded"},
        {"a", "b", "c", "d"},
    ),
    "unload during its stream: drains, then later requests are refused": Case(
        {0: STREAMS, 3: [Unload("a")], 5: [Req("late", "a", SHORT_TOKENS)]},
        {"unload a": None},
        {"b"},
        refused=("late",),
    ),
    "unload during its stream frees a slot for a pin afterwards": Case(
        {
            0: [Req("sa", "a", SHORT_TOKENS), Req("sb", "b")],
            1: [Unload("a")],
            2: [Load("p1", pinned=True)],
            10: [Load("p2", pinned=True)],
        },  # fmt: skip
        {"unload a": None, "load p1 pinned": "pinned", "load p2 pinned": None},
        {"b", "p2*"},
    ),
    # p0 keeps its pin while it drains: with p1 pinned too, a and b share the one unpinned slot left
    "unload a pinned adapter during its stream, then pin another": Case(
        {
            0: [Req("sp", "p0"), Req("sa", "a")],
            3: [Unload("p0")],
            4: [Load("p1", pinned=True)],
            5: [Req("rb", "b", SHORT_TOKENS)],
        },  # fmt: skip
        {"unload p0": None, "load p1 pinned": None},
        {"a", "b", "p1*"},
        pinned=("p0",),
        slots=3,
        never_together=(frozenset("ab"),),
    ),
    "a load of a name that is draining": Case(
        {0: STREAMS, 2: [Unload("a")], 3: [Load("a")]},
        {"unload a": None, "load a": "already loaded"},
        {"b"},
    ),
    "unload of a name that is not loaded, and a second unload while it drains": Case(
        {0: STREAMS, 2: [Unload("zz")], 3: [Unload("b")]},
        {"unload zz": "not loaded", "unload b": None},
        {"a"},
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_loads_pins_and_unloads_beside_running_requests(case: Case):
    sched = make(case.slots, pinned=case.pinned)
    out = run(sched, case.events)
    for name, words in case.replies.items():
        reply = out.replies[name]
        assert reply.success == (words is None), (name, reply.message)
        if words is not None:
            assert words in reply.message and "\n" not in reply.message
            assert reply.param == ("pinned" if "pinned" in words else "lora_name")
    assert_every_step_fit(sched, out)
    for together in case.never_together:
        assert not any(together <= adapters for adapters, _ in out.steps), together
    requests = [e for es in case.events.values() for e in es if isinstance(e, Req)]
    for req in requests:
        if req.rid in case.refused:
            assert out.finish[req.rid].type == "error" and "not loaded" in out.finish[req.rid].message
        else:
            assert out.finish[req.rid].type == "length" and out.tokens[req.rid] == req.tokens, req.rid
    manager = sched.runner.lora
    assert {n + "*" * manager.is_pinned(n) for n in manager.loaded} == case.loaded
    assert not sched.lora.busy and sched.is_idle


def test_a_pin_while_a_prompt_is_mid_chunk_counts_its_adapter():
    """A prompt prefilled in chunks holds its adapter's slot between steps: with `a` decoding and `b`'s long
    prompt mid-chunk, both slots are in use and the pin is refused; the chunks and the stream complete."""
    sched = make()
    pin = Load("p1", pinned=True)
    seen = []

    def pin_once_mid_chunk(step, s):
        if s.chunked_req is not None and not seen:
            seen.append(([r.lora_name for r in s.running], s.chunked_req.lora_name))
            s.handle(LoadLoRAAdapterReq(key(pin), pin.name, "/adapters/p1", pinned=True))

    events = {0: [Req("sa", "a")], 2: [Req("long", "b", SHORT_TOKENS, tuple(LONG_PROMPT))]}
    out = run(sched, events, pin_once_mid_chunk, asked=(key(pin),))
    assert seen == [(["a"], "b")]
    assert not out.replies[key(pin)].success and out.replies[key(pin)].param == "pinned"
    assert_every_step_fit(sched, out)
    assert out.tokens == {"sa": STREAM_TOKENS, "long": SHORT_TOKENS}


# every order of these operations, one per step, while streams of a and b run
OPERATIONS = [
    Load("p1", pinned=True),
    Load("c"),
    Unload("a"),
    Req("rc", "c", SHORT_TOKENS),
    Load("p2", pinned=True),
]


@pytest.mark.parametrize("gap", [1, 4], ids=["each-step", "every-4-steps"])
def test_every_order_of_loads_pins_unloads_and_requests_keeps_each_step_within_its_slots(gap):
    """No outcome is fixed here (whether a pin is honoured depends on what runs then): the invariant is. Every
    step fits, every message gets one reply, a refused pin says `pinned`, and each request either gets all
    its tokens or (its adapter not loaded when it arrived) is refused."""
    for order in itertools.permutations(OPERATIONS):
        sched = make(max_loaded=None)  # the loaded maximum's interleavings are cases of the table
        events = {0: [Req("sa", "a", 2 * STREAM_TOKENS), Req("sb", "b", 2 * STREAM_TOKENS)]}
        events.update({1 + gap * i: [op] for i, op in enumerate(order)})
        out = run(sched, events)
        assert_every_step_fit(sched, out)
        for op in order:
            if isinstance(op, Req):
                finish = out.finish[op.rid]
                assert finish.type == "length" or "not loaded" in finish.message, (order, finish)
            elif isinstance(op, Load) and op.pinned and not out.replies[key(op)].success:
                assert out.replies[key(op)].param == "pinned", (order, out.replies[key(op)])
            else:
                assert out.replies[key(op)].success, (order, out.replies[key(op)])
        assert out.tokens["sa"] == out.tokens["sb"] == 2 * STREAM_TOKENS
        assert not sched.lora.busy and sched.is_idle
