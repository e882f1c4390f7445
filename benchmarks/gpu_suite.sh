#!/usr/bin/env bash
# Everything to run on a lent GPU in one call; every step has a time limit and its full log goes to $OUT.
#   bash benchmarks/gpu_suite.sh [startup_probe|engine_cuda|race|host_time|kernel_chain|tests_quick|profile_small|gemv_chain|tiles_small|tiles_default|tiles_split|tiles_token|gemv|gemv_sweep|tests|kernels|bench|plain|fp8|lora|kernels_fp8|latency|fp8_latency|tiles|tiles_fp8|profile|
#                                 profile_fp8|ncu|ncu_small|dp1|eager|sampling|rl|structured|moe|tp_check|tp_tests|
#                                 tp_bench|tp_profile|dp2|moe_tp2|tp4_bench|dp4|dp2_tp2|multi2|multi4]...
# (moe = moe_tests moe_kernel moe_bench, which can also be passed one by one)
# One device call runs at most 10 minutes: pass the steps of one call (tests; bench; kernels sampling; ...).
# (no argument: the single-GPU steps). The tp_* steps need 2 GPUs (nvidia-h200-x2).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nanovllm-gpu}
mkdir -p "$OUT"
steps=${*:-tests kernels bench plain sampling}
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
if has startup_probe; then  # first: on a fresh machine this is the cold-cache case
  TAIL=14 step startup_probe 120 python3 benchmarks/startup_probe.py --tokenizer "${TOKENIZER:-bench-tokenizer}"
fi
if has tests; then
  step gpu_tests 420 python3 -m pytest -q -m gpu tests/ --deselect tests/distributed/test_tensor_parallel.py \
    --deselect tests/models/test_moe.py --deselect tests/kernels/test_fused_moe.py  # (the moe step runs those)
fi
if has engine_cuda; then  # the CPU suite's engine tests, which take CUDA where it is (device "auto"): the CUDA start-up
  # path (warm-ups, graphs, async scheduling) under every feature; CI never runs them there. All 177 ran in 103 s on
  # an H200 (2026-12-02; 15-20 s a test before the KV blocks' Python objects were built lazily).
  # ENGINE_SHARD=k/N runs every N-th test from the k-th (default 1/1: all)
  step engine_cuda 560 python3 benchmarks/engine_shard.py "${ENGINE_SHARD:-1/1}" tests/engine/test_engine.py \
    tests/engine/test_async_scheduling.py tests/engine/test_fp8_kv.py tests/engine/test_rl_eval.py \
    tests/sampling/test_sampling.py tests/models/test_models.py tests/engine/test_errors.py
fi
if has race; then  # the sampler's race kernel on the GPU (its own noise draws included), the folded gemv kernels
  step gpu_race 120 python3 -m pytest -q -m gpu tests/kernels/ \
    -k "gpu_rope or gpu_silu or gpu_race or gemv or gpu_fused_step"
fi
if has tests_quick; then  # the kernel checks, the engine on the GPU, structured outputs
  step gpu_tests_quick 300 python3 -m pytest -q -m gpu tests/kernels/ tests/test_gpu.py \
    tests/sampling/test_structured.py --deselect tests/kernels/test_fused_moe.py
fi
if has kernels; then
  TAIL=25 step kernels 240 python3 benchmarks/attention_kernels.py
fi
if has bench; then
  step bench 240 python3 bench.py --profile --no-tqdm  # async scheduling, the default on one GPU
fi
if has plain; then
  step bench_plain 240 python3 bench.py --no-async-scheduling --profile --no-tqdm
fi
if has fp8; then
  step bench_fp8 240 python3 bench.py --kv-cache-dtype fp8 --profile --no-tqdm
fi
if has lora; then  # LoRA (docs/lora.md): enabled without requests, 4 rank-16 adapters, batch-1/64 decode with one
  step bench_enable_lora 240 python3 bench.py --enable-lora --no-tqdm
  step bench_lora 240 python3 bench.py --lora 4 --profile --no-tqdm
  TAIL=4 step latency_lora 200 python3 benchmarks/latency.py --batches 1 64 --prefill-seqs 0 --new-tokens 128 \
    --clocks-up 2 --lora-rank 16
fi
if has kernels_fp8; then
  TAIL=14 step kernels_fp8 240 python3 benchmarks/attention_kernels.py --quick --kv-cache-dtype fp8
fi
if has kernel_chain; then  # what a dependent kernel launch costs in a CUDA graph, plain and under PDL
  TAIL=8 step kernel_chain 60 python3 benchmarks/kernel_chain.py
fi
if has latency; then  # ms/token at batch 1/16/64, time to first token, 512 x 2048-token prefill
  TAIL=8 step latency 300 python3 benchmarks/latency.py
fi
if has fp8_latency; then  # Qwen3-8B's shape at batch 1 and 16: bf16, per-channel fp8, Qwen's block-scaled FP8; then
  # where a decode step's time goes in each fp8 format (docs/quantization.md's decode rows)
  L="benchmarks/latency.py --dummy --batches 1 16 --prefill-seqs 0 --new-tokens 64 --clocks-up 1"
  TAIL=4 step latency_8b_bf16 120 python3 $L --model benchmarks/configs/qwen3-8b
  TAIL=4 step latency_8b_fp8 120 python3 $L --model benchmarks/configs/qwen3-8b --quantization fp8
  TAIL=4 step latency_8b_fp8_block 120 python3 $L --model benchmarks/configs/qwen3-8b-fp8
  P="benchmarks/profile_step.py --cases decode:1:512 decode:16:512 --top 6 --warm 10 --steps 10"
  TAIL=10 step profile_8b_fp8 120 python3 $P --model benchmarks/configs/qwen3-8b --quantization fp8
  TAIL=10 step profile_8b_fp8_block 120 python3 $P --model benchmarks/configs/qwen3-8b-fp8
fi
if has tiles; then  # the decode kernel's tiles and split lengths, bf16 and fp8
  TAIL=16 step tiles 300 python3 benchmarks/decode_tiles.py --quick
fi
if has tiles_fp8; then  # fp8 tiles incl. no pipelining, with V stored d-major (today) and token-major (an experiment)
  C="default 64,2,1 64,2,2 128,2,1 128,2,2 64,4,1 128,4,1 128,4,2 64,1,1 32,1,1 32,2,1 128,1,1 256,4,1"
  for layout in d token; do
    TAIL=8 step "tiles_fp8_$layout" 200 python3 benchmarks/decode_tiles.py --quick --kv-cache-dtype fp8 \
      --v-layout $layout --shapes 256x1024 256xbench 64xbench 16xbench --configs $C
  done
fi
if has tiles_default; then  # the engine's decode kernel choices (fp8: V token-major), both cache types
  TAIL=10 step tiles_default 150 python3 benchmarks/decode_tiles.py --quick --kv-cache-dtype fp8 auto \
    --shapes 256x1024 256xbench 64xbench 16xbench --configs default
fi
if has tiles_split; then  # fp8 (V token-major): tiles and split lengths on the bench-like mixes
  TAIL=10 step tiles_split 240 python3 benchmarks/decode_tiles.py --quick --kv-cache-dtype fp8 \
    --shapes 256x1024 256xbench 128xbench 64xbench --configs default default,512 default,1024 128,2,2 \
    128,2,2,1024 128,4,3 128,4,3,1024
fi
if has tiles_token; then  # fp8 tiles with V token-major, and the default with V stored like K
  C="default 128,2,2 128,4,2 64,4,3 64,2,3 128,4,3 64,4,4 128,8,2 256,4,2 256,8,2"
  TAIL=12 step tiles_token 300 python3 benchmarks/decode_tiles.py --quick --kv-cache-dtype fp8 --v-layout token \
    --shapes 256x1024 256xbench 64xbench 16xbench --configs $C
  TAIL=6 step tiles_d 120 python3 benchmarks/decode_tiles.py --quick --kv-cache-dtype fp8 --v-layout d \
    --shapes 256x1024 256xbench 64xbench 16xbench --configs default 128,2,2
fi
if has gemv; then  # linear layers at decode batch sizes: cuBLAS against the Triton kernel
  TAIL=14 step gemv 120 python3 benchmarks/small_gemm.py
fi
if has host_time; then  # host time per decode step by part, and the time it waits for the GPU (batch 16 and 1)
  TAIL=30 step host_time 120 python3 benchmarks/host_time.py
fi
if has gemv_chain; then  # a decode step's linear part: separate norm/SiLU kernels, folded, folded + PDL
  TAIL=10 step gemv_chain 120 python3 benchmarks/small_gemm.py --chain --rows 1 4 16
fi
if has tiles_small; then  # the decode kernel at batch 1 and 16, split lengths
  TAIL=10 step tiles_small 150 python3 benchmarks/decode_tiles.py --quick --kv-cache-dtype auto \
    --shapes 1x512 16x512 --configs default default,256 default,512 default,4096 64,2,2 64,2,2,4096
fi
if has gemv_sweep; then
  TAIL=30 step gemv_sweep 400 python3 benchmarks/small_gemm.py --rows 1 16 --sweep
fi
if has ncu; then  # hardware counters of one decode launch, bf16 and fp8, bench-like contexts
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for kv in auto fp8; do
    TAIL=3 step "ncu_$kv" 200 "$NCU" --clock-control none --kernel-name regex:_decode_kernel --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section InstructionStats python3 benchmarks/decode_tiles.py --once --kv-cache-dtype $kv --shapes 256xbench \
      --configs default
  done
fi
if has ncu_small; then  # the same counters at batch 16, contexts of 640 tokens (#14's batch-16 row)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  TAIL=3 step ncu_small 200 "$NCU" --clock-control none --kernel-name regex:_decode_kernel --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis python3 benchmarks/decode_tiles.py --once \
    --kv-cache-dtype auto --shapes 16x640 --configs default
fi
if has profile; then  # kernel time per step (torch.profiler): decode at several batch sizes, a 16k-token prefill
  TAIL=40 step profile 300 python3 benchmarks/profile_step.py --cases decode:256:100-1024 decode:16:512 \
    decode:1:512 prefill:8:2048
fi
if has profile_small; then  # batch 1 and 16 decode steps, kernel by kernel
  TAIL=60 step profile_small 200 python3 benchmarks/profile_step.py --cases decode:1:512 decode:16:512 --top 45
fi
if has profile_fp8; then
  TAIL=24 step profile_fp8 200 python3 benchmarks/profile_step.py --kv-cache-dtype fp8 --cases decode:256:100-1024 \
    decode:64:100-2048 prefill:8:2048
fi
if has dp1; then  # the data-parallel front with one replica is the plain engine: the same throughput
  step bench_dp1 240 python3 bench.py --dp 1 --no-tqdm
fi
if has eager; then
  step bench_eager 240 python3 bench.py --enforce-eager --no-tqdm
fi
if has rl; then
  TAIL=8 step rl_eval 420 python3 benchmarks/rl_eval.py
fi
if has structured; then  # needs xgrammar, and a tokenizer directory (benchmarks/structured.py --save-tokenizer DIR)
  TAIL=7 step structured 420 python3 benchmarks/structured.py --tokenizer "${TOKENIZER:-bench-tokenizer}" --mixed
  TAIL=12 step grammar_host 180 python3 benchmarks/grammar_host.py --tokenizer "${TOKENIZER:-bench-tokenizer}" \
    --threads 1 4 8 16  # the host work per 256-row step alone, by thread count
fi
# MoE: its GPU tests, the fused kernel, Qwen3-30B-A3B end to end (61 GB of bf16 weights)
if has moe || has moe_tests; then
  step moe_tests 200 python3 -m pytest -q -m gpu tests/models/test_moe.py tests/kernels/test_fused_moe.py
fi
if has moe || has moe_kernel; then
  TAIL=14 step moe_kernel 100 python3 benchmarks/moe_kernel.py
fi
if has moe || has moe_bench; then
  step bench_30b_a3b 240 python3 bench.py --model benchmarks/configs/qwen3-30b-a3b --dummy --profile --no-tqdm
fi
if has sampling; then
  TAIL=12 step sampling 300 python3 benchmarks/sampling.py
fi
if has multi2 || has tp_check; then
  TAIL=4 step tp_check 300 python3 benchmarks/tp_graph_check.py
fi
if has multi2 || has tp_tests; then
  step tp_tests 270 python3 -m pytest -q -m gpu tests/distributed/test_tensor_parallel.py
fi
if has multi2 || has tp_bench; then
  step bench_8b_tp1 200 python3 bench.py --model benchmarks/configs/qwen3-8b --dummy --tp 1 --no-tqdm
  step bench_8b_tp2 200 python3 bench.py --model benchmarks/configs/qwen3-8b --dummy --tp 2 --no-tqdm
  step bench_8b_tp2_async 200 python3 bench.py --model benchmarks/configs/qwen3-8b --dummy --tp 2 --async-scheduling --no-tqdm
fi
# Issue #17 on 2 GPUs (nvidia-h200-x2): multi2 = tp_check tp_tests tp_bench tp_profile dp2 moe_tp2;
# on 4 GPUs (nvidia-h200-x4): multi4 = tp4_bench dp4 dp2_tp2. One device call runs 10 minutes at most: split them.
if has multi2 || has tp_profile; then  # a TP=2 decode step on rank 0's GPU: all-reduce time, kernels, host gaps
  TAIL=24 step tp2_profile 240 python3 benchmarks/profile_step.py --model benchmarks/configs/qwen3-8b --tp 2 \
    --cases decode:64:100-1024 decode:256:100-1024
fi
if has multi2 || has dp2; then  # target: at least 1.9x one engine (bench.py at --dp 1: dp1)
  step bench_dp2 240 python3 bench.py --dp 2 --no-tqdm
fi
if has multi2 || has moe_tp2; then
  step moe_tp2 200 python3 -m pytest -q -m gpu tests/models/test_moe.py -k gpu_tensor_parallel
fi
if has multi4 || has tp4_bench; then  # target: TP=4 at least 3x TP=1 (Qwen3-8B shape)
  step bench_8b_tp4 240 python3 bench.py --model benchmarks/configs/qwen3-8b --dummy --tp 4 --no-tqdm
fi
if has multi4 || has dp4; then  # target: at least 3.7x one engine
  step bench_dp4 240 python3 bench.py --dp 4 --no-tqdm
fi
if has multi4 || has dp2_tp2; then
  step bench_8b_dp2_tp2 300 python3 bench.py --model benchmarks/configs/qwen3-8b --dummy --dp 2 --tp 2 --no-tqdm
fi
printf '\n== summary ==\n'
printf '%s\n' "${summary[@]}"
