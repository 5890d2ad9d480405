"""KV residency sampling and arithmetic (`--kv-cache-metrics`)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
    import json, os
    from prometheus_client import generate_latest
    from srt.metrics.collector import make_metrics_registry
    from srt.metrics.kv_residency import KVResidencyObserver, is_sampled
    from srt.metrics.text_format import parse_metrics_text, total
    full = KVResidencyObserver({"model_name": "m"}, sample_fraction=1.0)
    full.node_created(7, now=100.0)
    full.node_hit(7, now=102.0)
    full.node_hit(7, now=105.0)
    full.node_evicted(7, now=110.0)
    full.node_hit(8, now=111.0)      # never created: ignored
    full.node_evicted(8, now=112.0)
    s = parse_metrics_text(generate_latest(make_metrics_registry()).decode())
    t = lambda n: total(s, "sglang:" + n)
    threshold = int(0.25 * (1 << 32))
    picked = [i for i in range(20000) if is_sampled(i, threshold)]
    print(json.dumps({
        "lifetime": [t("kv_block_lifetime_seconds_count"), t("kv_block_lifetime_seconds_sum")],
        "idle": [t("kv_block_idle_before_evict_seconds_count"), t("kv_block_idle_before_evict_seconds_sum")],
        "reuse": [t("kv_block_reuse_gap_seconds_count"), t("kv_block_reuse_gap_seconds_sum")],
        "buckets": len([x for x in s if x.name == "sglang:kv_block_lifetime_seconds_bucket"]),
        "tracked_after": full.num_tracked,
        "picked_fraction": len(picked) / 20000,
        "deterministic": picked == [i for i in range(20000) if is_sampled(i, threshold)],
    }))
"""


def test_residency_intervals_and_sampling(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["lifetime"] == [1, 10.0]
    assert out["idle"] == [1, 5.0]
    assert out["reuse"] == [2, 5.0]  # gaps 2 s and 3 s
    assert out["buckets"] == 21 + 1  # 21 bounds and +Inf
    assert out["tracked_after"] == 0, "evicted nodes are forgotten: memory stays bounded"
    assert out["picked_fraction"] == pytest.approx(0.25, abs=0.02)
    assert out["deterministic"]
