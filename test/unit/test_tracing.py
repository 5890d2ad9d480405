"""Request tracing's pure logic (srt/tracing/, srt/scheduler/scheduler_tracing.py) against the real SDK with an
in-memory exporter: level parsing, the clock conversion, the exporter configuration, context propagation
between processes, the scheduler's spans built from a request's stamps, the main process's root and choice
spans, and that nothing imports the SDK while tracing is off."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from srt.child_startup import ConfigError
from srt.http_server.req_state import ReqState
from srt.io_struct import BatchTokenIDOut, FinishReason, TokenizedGenerateReqInput, TraceContext
from srt.metrics.request_stats import FinishedRequestStats
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.schedule_batch import Req
from srt.scheduler.scheduler_tracing import SchedulerTracing
from srt.server_args import ServerArgs
from srt.tracing.common import (
    PROTOCOL_ENV,
    SpanAttributes,
    WallClock,
    exporter_endpoint,
    exporter_protocol,
    parse_trace_level,
)
from srt.tracing.http import RECEIVED_TS_KEY
from srt.tracing.otel import Tracer
from srt.tracing.request_tracer import RequestTracer

A = SpanAttributes
CALLER_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"
CALLER_HEADERS = {"traceparent": f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01", "tracestate": "caller=1"}


def memory_tracer(component: str) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracer(component, processor=SimpleSpanProcessor(exporter)), exporter


# ---- levels, clock, configuration ----
@pytest.mark.parametrize("text, level", [("0", 0), ("1", 1), ("2", 2), ("3", 3), (" 2 ", 2)])
def test_trace_level_parses(text, level):
    assert parse_trace_level(text) == level


@pytest.mark.parametrize("text", [None, "", "4", "-1", "1.5", "two", "²", "10", "+1"])
def test_bad_trace_level_is_refused(text):
    with pytest.raises(ValueError, match="integer from 0 to 3"):
        parse_trace_level(text)


def test_wall_clock_keeps_monotonic_durations_and_tracks_epoch():
    clock = WallClock.now()
    mono = time.monotonic()
    assert abs(clock.wall_ns(mono) - time.time_ns()) < 50_000_000  # the same moment, within 50 ms
    a, b = 1000.123456789, 1003.5
    assert clock.wall_ns(b) - clock.wall_ns(a) == pytest.approx((b - a) * 1e9, abs=2)
    shifted = WallClock(clock.offset_ns + 7_000_000_000)  # a wall-clock step moves times, not durations
    assert shifted.wall_ns(b) - shifted.wall_ns(a) == clock.wall_ns(b) - clock.wall_ns(a)


def test_exporter_configuration(monkeypatch):
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    assert exporter_protocol() == "grpc"
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    assert exporter_protocol() == "http/protobuf"
    monkeypatch.setenv(PROTOCOL_ENV, "thrift")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        exporter_protocol()
    assert exporter_endpoint("localhost:4317", "grpc") == "http://localhost:4317"
    assert exporter_endpoint("https://collector:4317", "grpc") == "https://collector:4317"
    assert exporter_endpoint("127.0.0.1:4318", "http/protobuf") == "http://127.0.0.1:4318/v1/traces"
    assert exporter_endpoint("http://c:4318/custom", "http/protobuf") == "http://c:4318/custom"
    with pytest.raises(ConfigError):
        exporter_endpoint(" ", "grpc")


# ---- propagation ----
def test_context_crosses_processes_and_continues_the_callers_trace():
    main, main_spans = memory_tracer("tokenizer")
    child, child_spans = memory_tracer("scheduler")
    root = main.start("llm_request", main.extract(CALLER_HEADERS), time.time_ns(), server=True)
    ctx = main.carry(root, 3)
    msg = pickle.loads(pickle.dumps(TokenizedGenerateReqInput("r", [1], SamplingParams(), trace=ctx)))
    assert msg.trace == ctx and msg.trace.level == 3
    now = time.time_ns()
    child.span("queue", Tracer.parent_of(msg.trace), now, now + 1000)
    root.end()
    (r,), (q,) = main_spans.get_finished_spans(), child_spans.get_finished_spans()
    assert format(r.context.trace_id, "032x") == CALLER_TRACE_ID
    assert format(r.parent.span_id, "016x") == CALLER_SPAN_ID
    assert q.context.trace_id == r.context.trace_id and q.parent.span_id == r.context.span_id
    assert q.context.trace_state.get("caller") == "1"
    assert r.resource.attributes["srt.component"] == "tokenizer"
    assert q.resource.attributes["srt.component"] == "scheduler"


def test_unsampled_caller_trace_sends_no_context():
    main, spans = memory_tracer("tokenizer")
    headers = {"traceparent": f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-00"}
    root = main.start("llm_request", main.extract(headers), time.time_ns())
    assert main.carry(root, 2) is None
    root.end()
    assert spans.get_finished_spans() == ()


# ---- scheduler ----
def _traced_req(tracing: SchedulerTracing, level: int) -> Req:
    req = Req("r1", list(range(10, 40)), SamplingParams(max_new_tokens=8))
    root = Tracer("tokenizer", processor=SimpleSpanProcessor(InMemorySpanExporter()))
    parent = root.start("llm_request", None, time.time_ns())
    tracing.attach(req, root.carry(parent, level))
    return req


def test_scheduler_spans_from_request_stamps():
    tracer, exporter = memory_tracer("scheduler")
    tracing = SchedulerTracing(tracer)
    req = _traced_req(tracing, level=3)
    t0 = req.queued_ts
    req.scheduled_ts = t0 + 0.010
    for k, (start, end) in enumerate([(0.010, 0.020), (0.021, 0.030)]):  # two chunks of 15 tokens
        req.kv_len, req.extend_len = 15 * k, 15
        tracing.on_prefill_step([req], t0 + start, t0 + end)
    req.first_token_ts = t0 + 0.031
    req.output_ids = [5, 6]
    tracing.on_retraction(req)
    req.trace.retractions[-1] = (t0 + 0.040, 2)  # a fixed time for the assertion below
    req.kv_len, req.extend_len = 0, 31
    tracing.on_prefill_step([req], t0 + 0.050, t0 + 0.060)  # the re-prefill after the retraction
    req.last_token_ts = t0 + 0.080
    req.finished_reason = FinishReason("length")

    first = BatchTokenIDOut(**{f: [] for f in ("rids", "output_ids", "finished_reasons", "prompt_tokens",
                                               "completion_tokens", "cached_tokens", "queued_ts",
                                               "scheduled_ts", "first_token_ts", "token_ts",
                                               "num_retractions")})  # fmt: skip
    context = req.trace.context
    tracing.on_output(first, [req])
    assert first.trace_contexts == [context] and tracing.undelivered == 0
    assert req.trace is None  # finished: its spans are built and the stamps dropped

    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "prefill_chunk"}
    chunks = sorted((s for s in exporter.get_finished_spans() if s.name == "prefill_chunk"),
                    key=lambda s: s.start_time)  # fmt: skip
    assert set(spans) == {"queue", "prefill", "decode"} and len(chunks) == 3
    clock_ms = 1e6

    def ms(span):
        return round((span.end_time - span.start_time) / clock_ms, 3)

    assert (ms(spans["queue"]), ms(spans["prefill"]), ms(spans["decode"])) == (10.0, 21.0, 49.0)
    assert spans["queue"].end_time == spans["prefill"].start_time
    assert spans["prefill"].end_time == spans["decode"].start_time
    assert [c.parent.span_id for c in chunks] == [spans["prefill"].context.span_id] * 2 + [
        spans["decode"].context.span_id
    ]
    assert [(c.attributes[A.CHUNK_START], c.attributes[A.CHUNK_TOKENS]) for c in chunks] == [
        (0, 15), (15, 15), (0, 31)
    ]  # fmt: skip
    (event,) = spans["decode"].events
    assert event.name == "retraction" and event.attributes[A.OUTPUT_TOKENS] == 2
    assert event.timestamp - spans["decode"].start_time == pytest.approx(9 * clock_ms, abs=2)


def test_scheduler_level_2_records_no_chunks_and_tracing_off_records_nothing():
    tracer, exporter = memory_tracer("scheduler")
    tracing = SchedulerTracing(tracer)
    req = _traced_req(tracing, level=2)
    req.scheduled_ts = req.queued_ts + 0.001
    tracing.on_prefill_step([req], req.scheduled_ts, req.scheduled_ts + 0.001)
    assert req.trace.chunks == []
    off = SchedulerTracing()
    plain = Req("r2", [1, 2], SamplingParams())
    off.attach(plain, TraceContext("00-ab-cd-01"))
    assert plain.trace is None  # tracing off: a context is ignored, nothing is stamped


def test_aborted_while_queued_gets_a_queue_span_only():
    tracer, exporter = memory_tracer("scheduler")
    tracing = SchedulerTracing(tracer)
    req = _traced_req(tracing, level=2)
    req.finished_reason = FinishReason("abort")
    out = SimpleNamespace(trace_contexts=None)
    tracing.on_output(out, [req])
    assert [s.name for s in exporter.get_finished_spans()] == ["queue"]


# ---- main process ----
class FakeRequest:
    def __init__(self, headers: dict, received: float):
        self.headers = headers
        self.scope = {RECEIVED_TS_KEY: received}


def _finish(tracer: RequestTracer, st: ReqState, completion: int, cached: int, reason: str, now: float):
    stats = FinishedRequestStats(
        prompt_tokens=st.prompt_tokens, generation_tokens=completion, cached_tokens=cached,
        finished_reason=reason, arrival_ts=st.arrival_ts, first_token_recv_ts=st.arrival_ts + 0.05,
        finish_recv_ts=now, queued_ts=100.0, scheduled_ts=100.5, first_token_ts=101.0, last_token_ts=102.0,
    )  # fmt: skip
    tracer.on_finish(st, stats, FinishReason(reason))


def test_request_with_two_choices_has_one_root_summing_usage():
    otel, exporter = memory_tracer("tokenizer")
    tracer = RequestTracer(ServerArgs(served_model_name="m"), otel)
    tracer.level = 2
    arrival = time.monotonic()
    obj = SimpleNamespace(n=2, arrival_ts=arrival, lora_name="sql-lora")
    params = SamplingParams(max_new_tokens=9, temperature=0.5, top_p=0.9)
    contexts = tracer.begin(obj, params, "g", ["g-0", "g-1"], FakeRequest(CALLER_HEADERS, arrival - 0.01))
    assert len(contexts) == 2 and all(c.level == 2 for c in contexts)
    queue: asyncio.Queue = asyncio.Queue()
    states = [ReqState(f"g-{i}", i, queue, arrival, 7, 9, 2, "g") for i in range(2)]
    _finish(tracer, states[1], 4, 6, "stop", arrival + 0.2)
    assert {s.name for s in exporter.get_finished_spans()} == {"tokenize", "choice"}
    _finish(tracer, states[0], 9, 6, "length", arrival + 0.3)
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "llm_request")
    choices = sorted((s for s in spans if s.name == "choice"), key=lambda s: s.attributes[A.CHOICE_INDEX])
    assert format(root.context.trace_id, "032x") == CALLER_TRACE_ID
    assert root.attributes[A.RESPONSE_FINISH_REASONS] == ("length", "stop")
    assert (root.attributes[A.USAGE_PROMPT_TOKENS], root.attributes[A.USAGE_COMPLETION_TOKENS],
            root.attributes[A.USAGE_CACHED_TOKENS]) == (7, 13, 6)  # fmt: skip
    assert root.attributes[A.REQUEST_N] == 2 and root.attributes[A.RESPONSE_MODEL] == "m"
    assert root.attributes[A.LORA_ADAPTER] == "sql-lora"  # the request's LoRA adapter
    assert root.attributes[A.REQUEST_TEMPERATURE] == 0.5 and root.attributes[A.REQUEST_MAX_TOKENS] == 9
    assert root.attributes[A.LATENCY_E2E] == pytest.approx(0.3)
    assert root.attributes[A.LATENCY_TIME_TO_FIRST_TOKEN] == pytest.approx(0.05)
    assert [c.attributes[A.REQUEST_ID] for c in choices] == ["g-0", "g-1"]
    assert choices[1].attributes[A.USAGE_COMPLETION_TOKENS] == 4
    assert choices[0].attributes[A.LATENCY_TIME_IN_QUEUE] == pytest.approx(0.5)
    assert choices[0].attributes[A.LATENCY_TIME_IN_MODEL_DECODE] == pytest.approx(1.0)
    assert all(c.parent.span_id == root.context.span_id for c in choices)
    assert (root.end_time - root.start_time) / 1e9 == pytest.approx(0.31, abs=1e-6)  # received .. finish
    assert contexts[0].traceparent.split("-")[2] == format(choices[0].context.span_id, "016x")


def test_levels_1_and_0_in_the_main_process():
    otel, exporter = memory_tracer("tokenizer")
    tracer = RequestTracer(ServerArgs(), otel)
    arrival = time.monotonic()
    obj = SimpleNamespace(n=1, arrival_ts=arrival, lora_name=None)
    assert tracer.begin(obj, SamplingParams(), "a", ["a"], FakeRequest({}, arrival)) is None  # level 1
    st = ReqState("a", 0, asyncio.Queue(), arrival, 3, 16, 1, "a")
    _finish(tracer, st, 2, 0, "stop", arrival + 0.1)
    (root,) = exporter.get_finished_spans()
    assert root.attributes[A.LATENCY_TIME_IN_MODEL_PREFILL] == pytest.approx(0.5)
    assert root.attributes[A.RESPONSE_FINISH_REASONS] == ("stop",)
    tracer.level = 0
    assert tracer.begin(obj, SamplingParams(), "b", ["b"], FakeRequest({}, arrival)) is None
    tracer.fail_all("the scheduler died", time.monotonic())
    assert len(exporter.get_finished_spans()) == 1


def test_child_death_ends_open_spans_with_an_error():
    otel, exporter = memory_tracer("tokenizer")
    tracer = RequestTracer(ServerArgs(), otel)
    arrival = time.monotonic()
    tracer.begin(SimpleNamespace(n=2, arrival_ts=arrival, lora_name=None), SamplingParams(), "g", ["g-0", "g-1"],
                 FakeRequest({}, arrival))  # fmt: skip
    tracer.fail_all("the scheduler died", arrival + 1)
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == ["choice", "choice", "llm_request"]
    assert all(not s.status.is_ok and s.status.description == "the scheduler died" for s in spans)


def test_nothing_imports_the_sdk_while_tracing_is_off():
    code = (
        "import sys\n"
        "import srt.http_server.app, srt.detokenizer.detokenizer_manager, srt.scheduler.scheduler_process\n"
        "bad = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', 'grpc'))]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


# ---- the route ----
@pytest.fixture(scope="module")
def trace_route(embedded_model_dir):
    """GET /set_trace_level on the real app, with tracing off and on (its exporter points nowhere; nothing
    is sent because no request is traced)."""
    import shutil

    from fastapi.testclient import TestClient

    from srt.http_server.app import create_app
    from srt.http_server.tokenizer_manager import TokenizerManager
    from srt.io_struct import SchedulerReady
    from srt.port_args import PortArgs

    clients, dirs = {}, []
    for on in (False, True):
        args = ServerArgs(disable_metrics=True, enable_trace=on, otlp_traces_endpoint="127.0.0.1:9")
        ports = PortArgs.create()
        dirs.append(ports.ipc_dir)
        tm = TokenizerManager(args, ports, embedded_model_dir)
        tm.set_ready(SchedulerReady(4096, 2047, 2048, 8, "torch_native"))
        clients[on] = TestClient(create_app(tm, args)).__enter__()
    yield clients
    for c in clients.values():
        c.__exit__(None, None, None)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def test_set_trace_level_route(trace_route):
    off, on = trace_route[False], trace_route[True]
    r = off.get("/set_trace_level", params={"level": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "tracing_disabled"
    r = on.get("/set_trace_level", params={"level": 3})
    assert r.status_code == 200 and r.json() == {"success": True, "level": 3}
    for bad in ({"level": 4}, {"level": "x"}, {}):
        r = on.get("/set_trace_level", params=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    assert on.post("/set_trace_level?level=0").json()["level"] == 0
