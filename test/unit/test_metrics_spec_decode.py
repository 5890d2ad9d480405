"""The speculative decoding collectors in a real multiprocess directory (docs/metrics.md, "Speculative
decoding"): the counters are the sums of the finished requests' final figures (cut to their completions),
every position child exists from start, the scheduler's gauges describe the verify steps since its previous
flush, and nothing of the scheduler's reaches prometheus before a flush."""

import json

import pytest

from srt.metrics.text_format import parse_metrics_text, select, total
from test.unit.test_metrics_collectors import READER, run

MAX_DRAFTS = 5

WRITER = """
    import json
    from prometheus_client import generate_latest
    from srt.metrics.collector import make_metrics_registry
    from srt.metrics.spec_collector import SpecDecodeMetricsCollector, SpecRequestMetricsCollector
    from srt.metrics.text_format import parse_metrics_text, total
    from srt.speculative.stats import SpecRequestStats, SpecStep, SpecStepStats

    def figures(steps, from_prediction=False, cut=None):
        stats, position = SpecRequestStats(), 1
        for k, a in steps:
            stats.record(SpecStep(position, k, a, from_prediction), may_be_cut=True)
            position += a + 1
        if cut is not None:
            stats.truncate(cut)
        return stats

    requests = SpecRequestMetricsCollector({"model_name": "m"}, MAX_DRAFTS)
    requests.on_request(figures([(1, 1), (1, 0)]))
    requests.on_request(figures([(4, 4), (4, 2)]))
    requests.on_request(figures([(5, 5), (2, 1)], from_prediction=True))  # a prediction, one rejection
    # a prediction whose output a stop string ended after position 3: only drafts 1 and 2 of its first step
    # count, the second step not at all
    requests.on_request(figures([(5, 5), (3, 0)], from_prediction=True, cut=3))
    requests.on_request(figures([(7, 7)]))  # more drafts than the children made at start
    scheduler = SpecDecodeMetricsCollector({"model_name": "m", "tp_rank": "0"}, MAX_DRAFTS)
    scheduler.on_verify(SpecStepStats.from_steps([SpecStep(1, 1, 1), None]))
    read = lambda: parse_metrics_text(generate_latest(make_metrics_registry()).decode())
    before = total(read(), "sglang:spec_verify_calls_total")
    scheduler.flush()
    scheduler.on_verify(SpecStepStats.from_steps([SpecStep(1, 4, 4), SpecStep(1, 2, 1), SpecStep(1, 3, 0)]))
    scheduler.on_verify(SpecStepStats.from_steps([SpecStep(1, 4, 2)]))
    scheduler.flush()
    scheduler.draft_budget = 2  # the batch grew: 2 drafts a request
    scheduler.flush()  # nothing verified since: the gauges keep the last interval's values
    print(json.dumps({"before_flush": before}))
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mp"))
    out = run(WRITER, d, MAX_DRAFTS=str(MAX_DRAFTS))
    return out, parse_metrics_text(run(READER, d))


def test_counters_are_the_sums_of_the_requests_final_figures(written):
    out, samples = written
    c = lambda name: total(samples, f"sglang:{name}")  # noqa: E731
    assert c("spec_decode_num_drafts_total") == 2 + 2 + 2 + 1 + 1
    assert c("spec_decode_num_draft_tokens_total") == 2 + 8 + 7 + 2 + 7
    assert c("spec_decode_num_accepted_tokens_total") == 1 + 6 + 6 + 2 + 7
    assert json.loads(out)["before_flush"] == 0
    assert c("spec_verify_calls_total") == 3  # forward steps, counted by the scheduler


def test_prediction_counters_count_completion_positions_of_predictions_only(written):
    """Accepted: the positions holding an accepted prediction token (5 + 1, and 2 of the cut request);
    rejected: those where the model's token replaced the prediction's (1; the cut request's rejection lay
    past its stop)."""
    _, samples = written
    assert total(samples, "sglang:accepted_prediction_tokens_total") == 8
    assert total(samples, "sglang:rejected_prediction_tokens_total") == 1


def test_every_position_exists_and_counts_never_increase_with_it(written):
    _, samples = written
    by_pos = {
        int(s.labels["position"]): s.value
        for s in select(samples, "sglang:spec_decode_num_accepted_tokens_per_pos_total")
    }
    assert by_pos == {0: 7, 1: 5, 2: 3, 3: 3, 4: 2, 5: 1, 6: 1}
    assert sum(by_pos.values()) == total(samples, "sglang:spec_decode_num_accepted_tokens_total")


def test_gauges_describe_the_last_interval_with_verify_steps(written):
    _, samples = written
    g = lambda name: select(samples, f"sglang:{name}")[0].value  # noqa: E731
    assert g("spec_accept_length") == pytest.approx(1 + 7 / 4)  # 7 accepted over 4 requests' spec steps
    assert g("spec_accept_rate") == pytest.approx(7 / 13)


def test_the_draft_budget_gauge_shows_the_k_in_effect_at_the_latest_flush(written):
    _, samples = written
    assert select(samples, "sglang:spec_draft_tokens_per_request")[0].value == 2
