"""The benchmarks' and tests' tooling, beside the scripts and outside the `srt` package (never in its wheel): a
load generator for OpenAI-compatible servers (`scripts/bench_serving.py`), the peer comparison
(`scripts/bench_peers.py`), the gateway benchmark, and the one server launcher (`server.py`) the tests, the
scripts and the benchmarks start servers with. A script run as `python scripts/x.py` finds it beside itself;
pytest finds it through `pythonpath` in pyproject.toml."""
