#!/usr/bin/env bash
# Everything to run on a lent GPU in one call; every step has a time limit and its full log goes to $OUT.
#   bash benchmarks/gpu_suite.sh [tests|kernels|bench|fp8|eager|sampling|rl|structured|tp_check|tp_tests|tp_bench]...
# One device call runs at most 10 minutes: pass the steps of one call (tests; bench; kernels sampling; ...).
# (no argument: the single-GPU steps). The tp_* steps need 2 GPUs (nvidia-h200-x2).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nanovllm-gpu}
mkdir -p "$OUT"
steps=${*:-tests kernels bench sampling}
has() { [[ " $steps " == *" $1 "* ]]; }
summary=()
# step NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, print the log's last lines
step() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -i warn "$OUT/$name.log" | tail -"${TAIL:-12}"
  summary+=("$name: rc=$rc$([[ $rc == 124 ]] && echo ' (TIMED OUT)') $(grep -E '^nanovllm:|^constrained /|passed|failed' "$OUT/$name.log" | tail -1)")
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if has tests; then
  step gpu_tests 420 python3 -m pytest -q -m gpu tests/ --deselect tests/test_tensor_parallel.py
fi
if has kernels; then
  TAIL=25 step kernels 240 python3 benchmarks/attention_kernels.py
fi
if has bench; then
  step bench 240 python3 bench.py --profile --no-tqdm  # async scheduling, the default on one GPU
  step bench_plain 240 python3 bench.py --no-async-scheduling --profile --no-tqdm
fi
if has fp8; then
  step bench_fp8 240 python3 bench.py --kv-cache-dtype fp8 --profile --no-tqdm
  TAIL=14 step kernels_fp8 240 python3 benchmarks/attention_kernels.py --quick --kv-cache-dtype fp8
fi
if has eager; then
  step bench_eager 240 python3 bench.py --enforce-eager --no-tqdm
fi
if has rl; then
  TAIL=8 step rl_eval 420 python3 benchmarks/rl_eval.py
fi
if has structured; then  # needs xgrammar, and a tokenizer directory (benchmarks/structured.py --save-tokenizer DIR)
  TAIL=4 step structured 420 python3 benchmarks/structured.py --tokenizer "${TOKENIZER:-bench-tokenizer}"
fi
if has sampling; then
  TAIL=12 step sampling 300 python3 benchmarks/sampling.py
fi
if has tp_check; then
  TAIL=4 step tp_check 300 python3 benchmarks/tp_graph_check.py
fi
if has tp_tests; then
  step tp_tests 270 python3 -m pytest -q -m gpu tests/test_tensor_parallel.py
fi
if has tp_bench; then
  step bench_8b_tp1 200 python3 bench.py --model benchmarks/configs/qwen3-8b --dummy --tp 1 --no-tqdm
  step bench_8b_tp2 200 python3 bench.py --model benchmarks/configs/qwen3-8b --dummy --tp 2 --no-tqdm
fi
printf '\n== summary ==\n'
printf '%s\n' "${summary[@]}"
