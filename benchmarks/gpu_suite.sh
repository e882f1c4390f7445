#!/usr/bin/env bash
# Everything to run on a lent GPU in one call: GPU tests, kernel benchmark, bench.py variants.
#   bash benchmarks/gpu_suite.sh [tests|kernels|bench|sampling|all]...   logs go to $OUT (default /tmp/nanovllm-gpu)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nanovllm-gpu}
mkdir -p "$OUT"
steps=${*:-all}
has() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
summary=()
if has tests; then
  python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  summary+=("gpu tests: $(tail -1 "$OUT/gpu_tests.log")")
fi
if has kernels; then
  python3 benchmarks/attention_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -40
fi
if has bench; then
  python3 bench.py --profile --no-tqdm 2>&1 | tee "$OUT/bench.log" | grep -v Warning
  summary+=("bench (graphs): $(grep '^nanovllm:' "$OUT/bench.log")")
  python3 bench.py --enforce-eager --no-tqdm 2>&1 | tee "$OUT/bench_eager.log" | grep -E '^nanovllm:'
  summary+=("bench (eager):  $(grep '^nanovllm:' "$OUT/bench_eager.log")")
fi
if has sampling; then
  python3 benchmarks/sampling.py 2>&1 | tee "$OUT/sampling.log" | tail -10
fi
printf '\n== summary ==\n'
printf '%s\n' "${summary[@]}"
