"""Serving benchmark: a load generator for OpenAI-compatible servers (`scripts/bench_serving.py`) and a peer
comparison (`scripts/bench_peers.py`). Kept inside the package so the pure parts are importable by tests."""
