"""guidellm, the client, run against a server the way the client tests need it: synchronous, a fixed number
of requests, synthetic prompts from a tokenizer directory, no hub. Returns its one benchmark's report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

GUIDELLM_TIMEOUT_SECONDS = 300


def guidellm_binary() -> str | None:
    path = Path(sys.executable).parent / "guidellm"
    return str(path) if path.exists() else None


def run_guidellm(
    base_url: str,
    tokenizer: str,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    report: Path,
    backend_extras: str = "",
) -> dict:
    """The benchmark guidellm reports after `requests` requests; `backend_extras` is appended to its
    backend argument (e.g. `,extras.body.regex=...`: guidellm splits that argument on commas)."""
    cmd = [
        guidellm_binary(), "run",
        "--backend", f"kind=openai_http,target={base_url}{backend_extras}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",  # its synthetic prompts need one; no hub here
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=GUIDELLM_TIMEOUT_SECONDS, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    return bench
