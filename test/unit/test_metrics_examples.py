"""The shipped Prometheus config, alert rule and Grafana dashboard are valid (PromQL itself is checked
against a real Prometheus in test/integration/test_metrics_format.py)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool (Debian prometheus)"
)


def dashboard_exprs() -> list[str]:
    dash = json.loads((EXAMPLES / "grafana" / "srt-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_dashboard_covers_the_issue_panels():
    text = "\n".join(dashboard_exprs())
    for needle in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "generation_tokens_total", "num_running_reqs",
                   "num_queue_reqs", "token_usage", "prefix_cache_hits_total", "num_retracted_requests_total",
                   "load_factor", "max_concurrency_estimate"):  # fmt: skip
        assert f"sglang:{needle}" in text, needle


@needs_promtool
def test_prometheus_config_and_alert_rule_are_valid():
    r = subprocess.run(["promtool", "check", "config", str(EXAMPLES / "prometheus" / "prometheus.yml")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rules = (EXAMPLES / "prometheus" / "alerts.yml").read_text()
    assert "sglang:load_factor" in rules and "> 0.9" in rules and "for: 5m" in rules
