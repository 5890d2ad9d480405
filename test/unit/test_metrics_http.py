"""`/metrics` under FastAPI answers directly (no redirect) with the classic text content type, and the HTTP
metrics of prometheus_fastapi_instrumentator land in the multiprocess directory, without /metrics and /health."""

import json
import os
import subprocess
import sys
import textwrap

APP = """
    import json, os
    from srt.metrics.multiprocess import setup_multiprocess_dir, cleanup_multiprocess_dir
    d = setup_multiprocess_dir()
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from srt.metrics.collector import instrument_http_app, make_metrics_asgi_app
    from srt.metrics.text_format import parse_metrics_text, select
    app = FastAPI()
    @app.get("/health")
    def health():
        return {}
    @app.get("/v1/models")
    def models():
        return {"data": []}
    instrument_http_app(app, {"model_name": "m"})
    app.add_route("/metrics", make_metrics_asgi_app())
    with TestClient(app) as client:
        for path in ("/health", "/v1/models", "/v1/models", "/metrics"):
            client.get(path)
        r = client.get("/metrics", follow_redirects=False)
        files = sorted(os.listdir(d))
    samples = parse_metrics_text(r.text)
    handlers = sorted({s.labels.get("handler") for s in select(samples, "http_requests_total")})
    total = sum(s.value for s in select(samples, "http_requests_total"))
    labels_ok = all(s.labels.get("model_name") == "m" for s in select(samples, "http_requests_total"))
    cleanup_multiprocess_dir()
    print(json.dumps({"status": r.status_code, "content_type": r.headers["content-type"], "handlers": handlers,
                      "requests": total, "labels_ok": labels_ok, "files": files}))
"""


def test_metrics_route_and_http_metrics():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(APP)], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == 200
    assert out["content_type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert out["handlers"] == ["/v1/models"], "/metrics and /health are excluded"
    assert out["requests"] == 2
    assert out["labels_ok"]
    assert any(f.startswith("counter_") for f in out["files"]), (
        "HTTP metrics are written to the shared directory"
    )
