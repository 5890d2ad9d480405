"""The speculative decoding collector in a real multiprocess directory (docs/metrics.md, "Speculative
decoding"): the counters are the sums of the verify steps' totals, every position child exists from start,
the gauges describe the steps since the previous flush, and nothing reaches prometheus before a flush."""

import json

import pytest

from srt.metrics.text_format import parse_metrics_text, select, total
from test.unit.test_metrics_collectors import READER, run

MAX_DRAFTS = 5

WRITER = """
    import json
    from prometheus_client import generate_latest
    from srt.metrics.collector import make_metrics_registry
    from srt.metrics.spec_collector import SpecDecodeMetricsCollector
    from srt.metrics.text_format import parse_metrics_text, total
    from srt.speculative.stats import SpecStepStats
    c = SpecDecodeMetricsCollector({"model_name": "m", "tp_rank": "0"}, MAX_DRAFTS)
    c.on_verify(SpecStepStats.from_counts([1, 0], [1, 0]))
    c.on_verify(SpecStepStats.from_counts([1], [0]))
    read = lambda: parse_metrics_text(generate_latest(make_metrics_registry()).decode())
    before = total(read(), "sglang:spec_decode_num_draft_tokens_total")
    c.flush()
    c.on_verify(SpecStepStats.from_counts([4, 2, 3], [4, 1, 0]))
    c.on_verify(SpecStepStats.from_counts([4], [2]))
    c.on_verify(SpecStepStats.from_counts([5, 3, 2], [5, 1, 1], [True, False, True]))  # two predictions
    c.flush()
    c.draft_budget = 2  # the batch grew: 2 drafts a request
    c.flush()  # nothing verified since: the gauges keep the last interval's values
    print(json.dumps({"before_flush": before}))
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mp"))
    out = run(WRITER, d, MAX_DRAFTS=str(MAX_DRAFTS))
    return out, parse_metrics_text(run(READER, d))


def test_counters_are_the_sums_of_the_verify_steps(written):
    out, samples = written
    assert json.loads(out)["before_flush"] == 0
    c = lambda name: total(samples, f"sglang:{name}")  # noqa: E731
    assert c("spec_verify_calls_total") == 5
    assert c("spec_decode_num_drafts_total") == 1 + 1 + 3 + 1 + 3  # requests with a draft, per step
    assert c("spec_decode_num_draft_tokens_total") == 1 + 1 + 9 + 4 + 10
    assert c("spec_decode_num_accepted_tokens_total") == 1 + 0 + 5 + 2 + 7


def test_prediction_counters_sum_only_the_drafts_that_came_from_predictions(written):
    """OpenAI's usage fields, summed: drafts of the two requests with a prediction (5 + 2 drafted, 5 + 1
    accepted), not the third request's n-gram drafts."""
    _, samples = written
    assert total(samples, "sglang:accepted_prediction_tokens_total") == 6
    assert total(samples, "sglang:rejected_prediction_tokens_total") == 1


def test_every_position_exists_and_counts_never_increase_with_it(written):
    _, samples = written
    by_pos = {
        int(s.labels["position"]): s.value
        for s in select(samples, "sglang:spec_decode_num_accepted_tokens_per_pos_total")
    }
    assert by_pos == {0: 7, 1: 3, 2: 2, 3: 2, 4: 1}
    assert sum(by_pos.values()) == total(samples, "sglang:spec_decode_num_accepted_tokens_total")


def test_gauges_describe_the_last_interval_with_verify_steps(written):
    _, samples = written
    g = lambda name: select(samples, f"sglang:{name}")[0].value  # noqa: E731
    assert g("spec_accept_length") == pytest.approx(1 + 14 / 7)  # 14 accepted over 7 requests' spec steps
    assert g("spec_accept_rate") == pytest.approx(14 / 23)


def test_the_draft_budget_gauge_shows_the_k_in_effect_at_the_latest_flush(written):
    _, samples = written
    assert select(samples, "sglang:spec_draft_tokens_per_request")[0].value == 2
