"""The shipped Prometheus config, alert rule and Grafana dashboard are valid (PromQL itself is checked
against a real Prometheus in test/integration/test_metrics_workload.py)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool (Debian prometheus)"
)


def dashboard_exprs() -> list[str]:
    dash = json.loads((EXAMPLES / "grafana" / "srt-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_dashboard_covers_the_key_panels():
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
    assert r.returncode == 0, r.stdout + r.stderr  # the config's rule_files (alerts.yml) are checked too


def test_the_alert_rule_is_load_factor_over_0_9_sustained_for_5_minutes():
    """What the shipped rule means, exactly (promtool above checks that Prometheus accepts it)."""
    doc = yaml.safe_load((EXAMPLES / "prometheus" / "alerts.yml").read_text())
    (group,) = doc["groups"]
    assert group["name"] == "srt"
    (rule,) = group["rules"]
    assert rule["alert"] == "SrtNearSaturation"
    assert rule["expr"] == "max by (instance, model_name) (sglang:load_factor) > 0.9"
    assert rule["for"] == "5m" and rule["labels"] == {"severity": "warning"}
    assert set(rule["annotations"]) == {"summary", "description"}
