"""The load generator against a tiny fake OpenAI server whose timing is known: what the client measures,
how it limits concurrency, what it sends for fixed output lengths, and how it reads `/metrics`."""

import asyncio
import json
import math
import statistics

import pytest
from aiohttp import web

from srt_bench.backends import Target, build_request
from srt_bench.dataset import BenchRequest
from srt_bench.report import format_server_comparison, format_summary, format_sweep
from srt_bench.runner import arrival_gaps, run_benchmark

FIRST_TOKEN_DELAY = 0.05
TOKEN_GAP = 0.02
# asyncio timers may fire up to a clock tick early; latencies are checked as lower bounds with this slack
CLOCK_SLACK = 0.005
SERVER_TTFT = 0.01  # what the fake server claims in /metrics for every request


class FakeServer:
    """Streams `max_tokens` one-word chunks; counts requests in flight; exposes SGLang-style counters."""

    def __init__(self, reject_field: str | None = None, with_metrics: bool = True):
        self.reject_field = reject_field
        self.with_metrics = with_metrics
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.finished = 0
        self.generated = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.reject_field and self.reject_field in body:
            return web.json_response({"detail": f"unknown field {self.reject_field}"}, status=422)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj):
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await send({"choices": [{"delta": {"role": "assistant"}}]})
        await asyncio.sleep(FIRST_TOKEN_DELAY)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                await asyncio.sleep(TOKEN_GAP)
            await send({"choices": [{"delta": {"content": f" w{i}"}}]})
        await send({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": n}})
        await resp.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        self.finished += 1
        self.generated += n
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.with_metrics:
            return web.Response(status=404)
        text = (
            "# TYPE sglang:time_to_first_token_seconds histogram\n"
            f"sglang:time_to_first_token_seconds_sum {self.finished * SERVER_TTFT}\n"
            f"sglang:time_to_first_token_seconds_count {self.finished}\n"
            "# TYPE sglang:generation_tokens_total counter\n"
            f"sglang:generation_tokens_total {self.generated}\n"
        )
        return web.Response(text=text, content_type="text/plain")


def run_against(server: FakeServer, coro_factory):
    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", server.chat)
        app.router.add_get("/metrics", server.metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            return await coro_factory(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def requests(n, output_len=4):
    return [BenchRequest(prompt=f"prompt {i}", prompt_len=40, output_len=output_len) for i in range(n)]


def chat_target(url, **kw):
    return Target(url, backend="openai", endpoint="chat", **kw)


def count_words(text):
    return len(text.split())


def test_client_measures_ttft_and_itl_from_the_stream_and_takes_counts_from_usage():
    server = FakeServer()
    run = run_against(
        server,
        lambda url: run_benchmark(chat_target(url), requests(3, 5), count_words, show_progress=False),
    )
    assert run.summary.completed == 3 and run.summary.failed == 0
    for r in run.results:
        # the role-only chunk arrives at once but is not a token: TTFT waits for the first content
        assert r.ttft >= FIRST_TOKEN_DELAY - CLOCK_SLACK
        assert len(r.itl) == 4 and min(r.itl) >= TOKEN_GAP - CLOCK_SLACK
        assert r.e2e >= r.ttft + sum(r.itl) - CLOCK_SLACK
        assert (r.prompt_len, r.output_len) == (40, 5)
        assert r.generated_text == " w0 w1 w2 w3 w4"
    assert run.summary.total_output_tokens == 15


def test_max_concurrency_caps_requests_in_flight():
    server = FakeServer()
    run_against(
        server,
        lambda url: run_benchmark(
            chat_target(url), requests(6), count_words, max_concurrency=2, show_progress=False
        ),
    )
    assert server.max_in_flight == 2


def test_unlimited_rate_and_concurrency_sends_everything_at_once():
    server = FakeServer()
    run_against(
        server, lambda url: run_benchmark(chat_target(url), requests(6), count_words, show_progress=False)
    )
    assert server.max_in_flight == 6


def test_rejected_request_is_a_failed_result_with_the_servers_reason():
    server = FakeServer(reject_field="ignore_eos")
    run = run_against(
        server,
        lambda url: run_benchmark(
            chat_target(url, fixed_output="ignore_eos"), requests(2), count_words, show_progress=False
        ),
    )
    assert run.summary.completed == 0 and run.summary.failed == 2
    assert run.results[0].error.startswith("HTTP 422") and "ignore_eos" in run.results[0].error


def test_server_metrics_are_scraped_around_the_run_and_printed_beside_the_client_view():
    server = FakeServer()
    run = run_against(
        server, lambda url: run_benchmark(chat_target(url), requests(4), count_words, show_progress=False)
    )
    assert run.server is not None
    assert run.server.ttft_mean == pytest.approx(SERVER_TTFT)
    assert run.server.generation_tokens == 16
    text = format_server_comparison(run)
    assert "What the server says" in text
    assert f"{SERVER_TTFT * 1000:.2f}" in text


def test_server_without_metrics_is_reported_as_such():
    server = FakeServer(with_metrics=False)
    run = run_against(
        server, lambda url: run_benchmark(chat_target(url), requests(1), count_words, show_progress=False)
    )
    assert run.server is None
    assert "no Prometheus /metrics" in format_server_comparison(run)


def test_summary_has_sglang_bench_serving_lines():
    server = FakeServer()
    run = run_against(
        server,
        lambda url: run_benchmark(
            chat_target(url), requests(2), count_words, max_concurrency=1, show_progress=False
        ),
    )
    text = format_summary(run, "openai")
    for label in (
        "Successful requests:",
        "Benchmark duration (s):",
        "Request throughput (req/s):",
        "Input token throughput (tok/s):",
        "Output token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "P99 ITL (ms):",
        "Median E2E Latency (ms):",
    ):
        assert label in text
    assert format_sweep([run]).splitlines()[1].split()[0] == "1"


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("ignore_eos", {"ignore_eos": True}),
        ("min_tokens", {"min_tokens": 64}),
        ("generation_config", {"generation_config": '{"eos_token_id": -1}'}),
        ("none", {}),
    ],
)
def test_fixed_output_length_fields_per_server_kind(mode, expected):
    url, body = build_request(
        Target("http://h:1/", backend="openai", endpoint="chat", fixed_output=mode),
        BenchRequest("p", 3, 64),
    )
    assert url == "http://h:1/v1/chat/completions"
    assert body["max_tokens"] == 64 and body["stream"] and body["temperature"] == 0.0
    assert "model" not in body  # transformers serve wants it omitted unless it matches
    for field in ("ignore_eos", "min_tokens", "generation_config"):
        assert body.get(field) == expected.get(field)


def test_native_srt_backend_uses_generate_with_sampling_params():
    url, body = build_request(Target("http://h:1", backend="srt"), BenchRequest("p", 3, 16))
    assert url == "http://h:1/generate"
    assert body["text"] == "p" and body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def test_completions_endpoint_sends_a_prompt_and_extra_body_wins():
    target = Target(
        "http://h:1", backend="openai", endpoint="completions", model="m", extra_body={"top_k": 1}
    )
    url, body = build_request(target, BenchRequest("p", 3, 16))
    assert url.endswith("/v1/completions") and body["prompt"] == "p" and body["model"] == "m"
    assert body["top_k"] == 1


def test_poisson_gaps_average_one_over_the_rate_and_are_reproducible():
    gaps = arrival_gaps(4000, request_rate=8.0, seed=3)
    assert statistics.mean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps == arrival_gaps(4000, request_rate=8.0, seed=3)
    assert arrival_gaps(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_gaps(1, 0.0, 0)
