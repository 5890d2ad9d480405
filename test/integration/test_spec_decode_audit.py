"""The speculative decoding figures reconciled through a real server (docs/speculative_decoding.md,
docs/metrics.md): after a mixed workload (greedy and sampled requests, n = 1 and n > 1, predictions, clients
that disconnect mid-answer, a KV pool small enough that decoding retracts requests, and predictions whose
answers a stop string, a stop token id, EOS or max_tokens cuts inside accepted runs) the per-request figures
(the request export, which holds every finished request, aborted ones too; the responses' own blocks) add up
to the counters exactly, count only what the completion holds, and the metrics audit of every request holds
with speculation on. A stop string also stops the work: a request it ends decodes only a few steps past the
match, streamed or not, where it used to decode on to max_tokens when not streamed."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from srt.metrics.text_format import Sample, parse_metrics_text, select, total
from srt.speculative.defaults import most_drafts_per_step
from test.integration.conftest import ServerHandle, launch_server

pytestmark = pytest.mark.slow

TIMEOUT = 600.0  # per request: the workload takes minutes on a 2-core machine shared with other work
# small enough that the concurrent answers below outgrow it and decoding retracts some of them
KV_TOKENS = 1000
PASSAGE = (
    "The river bends twice before it reaches the mill, and the old stone bridge stands where the second "
    "bend meets the road. Travellers rest there in summer, watching the water turn the wheel."
)
REPEAT = {"role": "user", "content": f"Repeat this text exactly, twice:\n\n{PASSAGE}"}
EDIT = PASSAGE.replace("twice", "three times").replace("summer", "winter")
PREDICTED = {"type": "content", "content": f"{PASSAGE}\n\n{PASSAGE}"}
# Answers cut inside the runs an exact prediction's verify steps accept (up to 7 drafts a step): by the
# detokenizer (a stop string, streamed or not) or by the scheduler (a stop token id, EOS, max_tokens).
# `stop_token`: the text whose last token is the stop token id; `finish`: the finish reason the cut gives.
CUT_CASES = {
    "stop-string": ({"stop": ["mill"]}, "stop"),
    "stop-string-streamed": ({"stop": ["mill"], "stream": True}, "stop"),
    "stop-string-n2": ({"stop": ["bridge"], "n": 2}, "stop"),
    "stop-token-id": ({"stop_token": " mill"}, "stop"),
    "eos": ({"ignore_eos": False, "max_tokens": 160}, None),
    "max-tokens": ({"max_tokens": 9}, "length"),
}
# A lone request (the passage repeated, no prediction) whose stop string matches about 20 tokens in: how many
# tokens it decoded past the match. The ring is asynchronous (the abort comes back through the detokenizer and
# the HTTP process), so on a loaded 2-core machine the abort may take a few steps; the scheduler-level test
# (test/unit/test_stop_string_ring.py) holds the two-step rule. Without it the request decoded to max_tokens.
LONE_STOP = {
    "messages": [REPEAT],
    "stop": ["bridge"],
    "ignore_eos": True,
    "max_tokens": 400,
    "temperature": 0,
}
STEPS_PAST_A_STOP = 8


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spec-export")


@pytest.fixture(scope="module")
def server(export_dir):
    flags = ("--speculative-algorithm", "NGRAM", "--per-request-spec-decode-metrics", "summary",
             "--export-metrics-to-file", "--export-metrics-to-file-dir", str(export_dir),
             "--max-total-tokens", str(KV_TOKENS), "--disable-radix-cache")  # fmt: skip
    handle = launch_server(*flags, timeout=TIMEOUT)
    yield handle
    handle.stop()
    handle.log_path.unlink(missing_ok=True)


def scrape(server: ServerHandle) -> list[Sample]:
    return parse_metrics_text(httpx.get(f"{server.base_url}/metrics", timeout=10).text)


def exported(export_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(export_dir.glob("requests-*.jsonl")) for line in f.open()]


def disconnect_midway(server: ServerHandle) -> None:
    """A streamed answer whose client leaves after a few chunks: the server aborts it."""
    body = {"messages": [REPEAT], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as r:  # fmt: skip
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
                if seen >= 6:
                    break


def streamed(http: httpx.Client, body: dict) -> dict:
    """A streamed chat answer with `include_usage`, in the shape of a whole one (id, choices with their
    finish reasons, usage, vLLM's block from the closing chunk)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    answer: dict = {"choices": {}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            answer["id"] = chunk["id"]
            for c in chunk["choices"]:
                choice = answer["choices"].setdefault(c["index"], {"index": c["index"], "content": ""})
                choice["content"] += c["delta"].get("content") or ""
                choice["finish_reason"] = c.get("finish_reason") or choice.get("finish_reason")
            if chunk.get("usage"):
                answer["usage"] = chunk["usage"]
            if chunk.get("metrics"):
                answer["metrics"] = chunk["metrics"]
    answer["choices"] = [answer["choices"][i] for i in sorted(answer["choices"])]
    return answer


@pytest.fixture(scope="module")
def children(server) -> dict[str, int]:
    pids = server.child_pids()
    assert "srt-scheduler" in pids and "srt-detokenizer" in pids, pids
    return pids


@pytest.fixture(scope="module")
def run(server, export_dir, children):
    http = httpx.Client(base_url=server.base_url, timeout=TIMEOUT)

    def chat(**body) -> dict:
        body = {"messages": [REPEAT], "max_tokens": 80, "ignore_eos": True, **body}
        if body.pop("stream", False):
            return streamed(http, body)
        r = http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()

    def cut_case(name: str) -> dict:
        body = dict(CUT_CASES[name][0])
        stop_token = body.pop("stop_token", None)
        if stop_token is not None:
            tokens = http.post("/tokenize", json={"prompt": stop_token, "add_special_tokens": False})
            body["stop_token_ids"] = [tokens.json()["tokens"][-1]]
        return {"case": name, **chat(temperature=0, prediction=PREDICTED, **body)}

    jobs = [
        *(lambda: chat(temperature=0) for _ in range(4)),
        lambda: chat(temperature=0.8, n=3),
        lambda: chat(temperature=0.5, seed=3),
        lambda: chat(temperature=0, prediction={"type": "content", "content": f"{PASSAGE}\n\n{PASSAGE}"}),
        lambda: chat(temperature=0, n=2, prediction={"type": "content", "content": f"{EDIT}\n\n{EDIT}"}),
        lambda: disconnect_midway(server),
        lambda: disconnect_midway(server),
    ]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        answers = [r for r in pool.map(lambda job: job(), jobs) if r is not None]
        # then the cut answers together (short, but beside the workload above they would queue for the small
        # KV pool and double its time)
        answers += pool.map(cut_case, CUT_CASES)
    sequences = sum(len(a["choices"]) for a in answers) + 2  # and the two aborted ones
    deadline = time.monotonic() + 60
    while len(exported(export_dir)) < sequences or total(scrape(server), "sglang:num_running_reqs") > 0:
        assert time.monotonic() < deadline, "the server did not finish the workload"
        time.sleep(0.2)
    time.sleep(1.5)  # the scheduler flushes its counters at least once a second
    cases = {a.pop("case"): a for a in answers if "case" in a}
    return {"answers": answers, "records": exported(export_dir), "samples": scrape(server), "cases": cases}


def test_the_workload_retracted_aborted_and_speculated(run):
    """The audit has power: the server retracted requests, aborted two, and verified drafts."""
    s, records = run["samples"], run["records"]
    assert total(s, "sglang:num_retracted_requests_total") > 0
    assert sum(r["finish_reason"] == "abort" for r in records) == 2
    assert total(s, "sglang:spec_decode_num_accepted_tokens_total") > 0


def test_the_exported_figures_of_every_request_add_up_to_the_counters(run):
    """Every finished request, aborted and retracted ones included, is in the export with its figures."""
    s = run["samples"]
    blocks = [r["spec_decoding"] for r in run["records"] if "spec_decoding" in r]
    assert sum(b["num_spec_steps"] for b in blocks) == total(s, "sglang:spec_decode_num_drafts_total")
    assert sum(b["num_draft_tokens"] for b in blocks) == total(s, "sglang:spec_decode_num_draft_tokens_total")
    accepted = total(s, "sglang:spec_decode_num_accepted_tokens_total")
    assert sum(b["num_accepted_draft_tokens"] for b in blocks) == accepted
    assert all(b["num_accepted_draft_tokens"] <= b["num_draft_tokens"] for b in blocks)
    assert all(sum(b["acceptance_histogram"]) == b["num_spec_steps"] for b in blocks)


def test_per_position_counts_never_increase_and_sum_to_the_accepted_drafts(run):
    s = run["samples"]
    by_pos = {
        int(x.labels["position"]): x.value
        for x in select(s, "sglang:spec_decode_num_accepted_tokens_per_pos_total")
    }
    counts = [by_pos[j] for j in sorted(by_pos)]
    assert counts == sorted(counts, reverse=True)
    assert sum(counts) == total(s, "sglang:spec_decode_num_accepted_tokens_total")
    assert counts[0] <= total(s, "sglang:spec_decode_num_drafts_total")


def test_each_response_block_is_the_sum_of_its_choices_exports(run):
    """vLLM's per-response block, and for predictions OpenAI's usage details, are the exported figures of
    the response's choices added up (the prediction's own counts: a request with a prediction also drafts
    from its own tokens where the prediction has nothing); the prediction counters are the usage details
    summed."""
    by_rid = {r["rid"]: r for r in run["records"]}
    predicted_usage = {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    for answer in run["answers"]:
        group = answer["id"].removeprefix("chatcmpl-")
        n = len(answer["choices"])
        rids = [group] if n == 1 else [f"{group}-{i}" for i in range(n)]
        blocks = [by_rid[rid].get("spec_decoding") for rid in rids]
        block = answer["metrics"]["speculative_decoding"]
        for key in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"):
            assert block[key] == sum(b[key] for b in blocks if b), key
        details = answer["usage"].get("completion_tokens_details")
        if details is not None:
            exported = [by_rid[rid].get("prediction") for rid in rids]
            for key in predicted_usage:
                assert details[key] == sum(p[key] for p in exported if p), key
                predicted_usage[key] += details[key]
            # the prediction's drafts are some of the response's drafts (the rest: its own tokens')
            spent = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
            assert details["accepted_prediction_tokens"] <= block["num_accepted_draft_tokens"]
            assert spent <= block["num_draft_tokens"]
    s = run["samples"]
    assert predicted_usage["accepted_prediction_tokens"] > 0
    assert (
        total(s, "sglang:accepted_prediction_tokens_total") == predicted_usage["accepted_prediction_tokens"]
    )
    assert (
        total(s, "sglang:rejected_prediction_tokens_total") == predicted_usage["rejected_prediction_tokens"]
    )


def test_the_metrics_audit_holds_with_speculation(run):
    """Exact token counts, one observation per request in each request histogram, and the documented ITL
    rule: one inter-token latency per output token after the first (tokens of one verify step share its
    stamp, so their latencies after the first are 0)."""
    s, records = run["samples"], run["records"]
    assert total(s, "sglang:generation_tokens_total") == sum(r["completion_tokens"] for r in records)
    assert total(s, "sglang:num_requests_total") == len(records)
    assert total(s, "sglang:e2e_request_latency_seconds_count") == len(records)
    itl = total(s, "sglang:inter_token_latency_seconds_count")
    assert itl == sum(max(r["completion_tokens"] - 1, 0) for r in records)
    answered = [r for r in records if r["finish_reason"] != "abort"]
    assert sum(r["completion_tokens"] for r in answered) == sum(
        a["usage"]["completion_tokens"] for a in run["answers"]
    )


@pytest.mark.parametrize("name", list(CUT_CASES))
def test_a_cut_answer_counts_only_what_its_completion_holds(run, server, children, name):
    """Each choice's accepted drafts fit in its completion less the prefill's token; the prediction's
    accepted and rejected tokens are completion positions, so they never exceed the completion tokens; the
    export agrees with the response. The server keeps its children and stays healthy."""
    answer, finish = run["cases"][name], CUT_CASES[name][1]
    by_rid = {r["rid"]: r for r in run["records"]}
    group = answer["id"].removeprefix("chatcmpl-")
    n = len(answer["choices"])
    rids = [group] if n == 1 else [f"{group}-{i}" for i in range(n)]
    if finish is not None:
        assert all(c["finish_reason"] == finish for c in answer["choices"]), answer["choices"]
    for rid in rids:
        record = by_rid[rid]
        block = record.get("spec_decoding")
        assert block is not None and block["num_spec_steps"] > 0, rid
        assert block["num_accepted_draft_tokens"] <= record["completion_tokens"] - 1, rid
        assert block["num_accepted_draft_tokens"] <= block["num_draft_tokens"]
        prediction = record.get("prediction", {})
        assert sum(prediction.values()) <= record["completion_tokens"] - 1, rid
    usage = answer["usage"]
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert sum(details.values()) <= usage["completion_tokens"] - n
    assert usage["completion_tokens"] == sum(by_rid[rid]["completion_tokens"] for rid in rids)
    assert server.child_pids() == children
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def decoded_tokens(server: ServerHandle) -> float:
    return sum(
        x.value
        for x in select(scrape(server), "sglang:realtime_tokens_total")
        if x.labels["mode"] == "decode"
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_stops_the_work_streamed_or_not(run, server, children, stream):
    """Alone on the server (after the workload), a request its stop string ends early decodes at most a few
    steps' tokens past its answer, not on to max_tokens."""
    http = httpx.Client(base_url=server.base_url, timeout=TIMEOUT)
    before = decoded_tokens(server)
    answer = streamed(http, LONE_STOP) if stream else http.post("/v1/chat/completions", json=LONE_STOP).json()
    completion, finish = answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
    assert finish == "stop" and completion < LONE_STOP["max_tokens"] // 4
    time.sleep(1.5)  # the scheduler flushes its counters at least once a second, and at once when idle
    past = decoded_tokens(server) - before - completion
    step_tokens = 1 + most_drafts_per_step(server_drafts_per_step())
    assert past <= STEPS_PAST_A_STOP * step_tokens, (past, completion)
    assert server.child_pids() == children
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def server_drafts_per_step() -> int:
    """The NGRAM server's drafts per step (its default `--speculative-num-draft-tokens`)."""
    from srt.server_args import ServerArgs

    return ServerArgs(speculative_algorithm="NGRAM").speculative_drafts_per_step
