"""The fused MoE Triton kernel on the Qwen3-30B-A3B layer shape (128 experts, top-8, hidden 2048, expert
intermediate 768; bf16), written for an H200.

    python benchmarks/moe_kernel.py            # decode batches 1, 16, 256 and a 16k-token prefill
    python benchmarks/moe_kernel.py --sweep    # also try other tiles for each case and print the fastest
    python benchmarks/moe_kernel.py --cpu      # tiny shapes through the Triton interpreter (smoke test)

Every case is first checked against the torch experts (nanovllm.layers.moe.fused_experts_torch, float32) on the same
data. Routing is uniform at random (top-k of a softmax over random logits), as a random router gives.

Decode is timed as CUDA-graph replays of the whole fused_moe call (alignment, both GEMMs, the per-token sum), each
replay running ROTATIONS calls on different tokens and routings so that the experts one call reads are rarely still
in L2 (50 MiB) from the call before. Its figure is GB/s over the expert weights that must be read: each expert hit
at least once, gate_up and down, read once, (2 * I * H + H * I) * 2 bytes, against the H200's measured 4170 GB/s copy
bandwidth. Prefill counts 2 * pairs * (H * 2I + I * H) FLOPs, against 748 TFLOP/s measured for a bf16 matmul and
against torch's dense bf16 matmuls of the same total shape (every pair through one [H, 2I] and one [I, H] weight).
Times are medians (triton.testing.do_bench).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HBM_GBPS = 4170.0
MATMUL_TFLOPS = 748.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny shapes on CPU through TRITON_INTERPRET=1 (smoke test)")
    p.add_argument("--sweep", action="store_true", help="also time other tile configurations")
    p.add_argument("--decode", default=None, help="decode batch sizes (default 1,16,256; 1,16 with --cpu)")
    p.add_argument("--prefill", type=int, default=16384, help="prefill tokens")
    return p.parse_args()


ARGS = parse_args()
if ARGS.cpu:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import timing  # noqa: E402
from nanovllm.kernels.fused_moe import MoeTiles, align_pairs, fused_moe, moe_tiles  # noqa: E402
from nanovllm.layers.moe import fused_experts_torch, route  # noqa: E402

DEVICE = "cpu" if ARGS.cpu else "cuda"
DTYPE = torch.float32 if ARGS.cpu else torch.bfloat16
# experts, top-k, hidden, expert intermediate
EXPERTS, TOP_K, HIDDEN, INTER = (8, 2, 64, 32) if ARGS.cpu else (128, 8, 2048, 768)
ROTATIONS = 2 if ARGS.cpu else 8  # calls per timed decode run, each on other tokens and routing
TOL = dict(atol=1e-4, rtol=1e-4) if ARGS.cpu else dict(atol=3e-2, rtol=3e-2)

# tiles --sweep tries besides moe_tiles' choice: (block_m, block_n, block_k, group_m, warps, stages)
DECODE_SWEEP = [(16, 32, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 4), (16, 64, 64, 1, 4, 5),
                (32, 64, 128, 1, 4, 4), (32, 128, 64, 1, 4, 4), (64, 64, 128, 1, 4, 3), (64, 128, 64, 8, 4, 3)]
PREFILL_SWEEP = [(64, 128, 64, 8, 4, 3), (128, 128, 64, 8, 8, 3), (128, 128, 64, 16, 8, 4), (128, 256, 64, 8, 8, 3),
                 (128, 64, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3)]


def time_ms(fn, graph: bool) -> float:
    return timing.time_ms(fn, graph, ARGS.cpu)


def make_inputs(num_tokens: int, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen, device=DEVICE).to(DTYPE)
    weights, ids = route(torch.randn(num_tokens, EXPERTS, generator=gen, device=DEVICE), TOP_K, renormalize=True)
    return x, weights, ids


def make_experts():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=DEVICE) * HIDDEN ** -0.5).to(DTYPE)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=DEVICE) * INTER ** -0.5).to(DTYPE)
    return gate_up, down


def check(x, gate_up, down, weights, ids, tiles: MoeTiles | None):
    out = fused_moe(x, gate_up, down, weights, ids, tiles)
    ref = fused_experts_torch(x.float(), gate_up.float(), down.float(), weights, ids)
    torch.testing.assert_close(out.float(), ref, **TOL, msg=lambda m: f"{x.size(0)} tokens, tiles {tiles}: {m}")


def expert_bytes(ids: torch.Tensor, gate_up: torch.Tensor) -> int:
    per_expert = 3 * INTER * HIDDEN * gate_up.element_size()
    return len(ids.unique()) * per_expert


def decode_case(batch: int, gate_up, down, tiles: MoeTiles | None) -> tuple[float, float]:
    """(ms per call, GB/s over the hit experts' weights), ROTATIONS calls on different routings per timed run."""
    inputs = [make_inputs(batch, seed) for seed in range(ROTATIONS)]
    x, weights, ids = inputs[0]
    check(x, gate_up, down, weights, ids, tiles)

    def run():
        for x, weights, ids in inputs:
            fused_moe(x, gate_up, down, weights, ids, tiles)
    ms = time_ms(run, graph=not ARGS.cpu) / ROTATIONS
    gbytes = statistics.mean(expert_bytes(ids, gate_up) for _, _, ids in inputs) / 1e9
    return ms, gbytes / (ms / 1e3)


def prefill_case(num_tokens: int, gate_up, down, tiles: MoeTiles | None) -> tuple[float, float]:
    x, weights, ids = make_inputs(num_tokens, 0)
    check(x, gate_up, down, weights, ids, tiles)
    ms = time_ms(lambda: fused_moe(x, gate_up, down, weights, ids, tiles), graph=False)
    return ms, 2 * num_tokens * TOP_K * 3 * HIDDEN * INTER / (ms / 1e3) / 1e12


def dense_ms(num_tokens: int) -> float:
    """torch's dense matmuls with the same FLOPs: every pair through one gate_up and one down weight."""
    a = torch.randn(num_tokens * TOP_K, HIDDEN, device=DEVICE, dtype=DTYPE)
    w1 = torch.randn(HIDDEN, 2 * INTER, device=DEVICE, dtype=DTYPE)
    w2 = torch.randn(INTER, HIDDEN, device=DEVICE, dtype=DTYPE)
    return time_ms(lambda: (a @ w1)[:, :INTER] @ w2, graph=False)


def align_ms(num_tokens: int) -> float:
    _, _, ids = make_inputs(num_tokens, 0)
    block_m = moe_tiles(ids.numel(), EXPERTS, DTYPE).block_m
    return time_ms(lambda: align_pairs(ids, EXPERTS, block_m), graph=not ARGS.cpu)


def sweep(case, size: int, gate_up, down, candidates) -> None:
    results = []
    for t in candidates:
        tiles = MoeTiles(*t)
        try:
            results.append((case(size, gate_up, down, tiles), tiles))
        except Exception as e:  # a tile that does not fit (shared memory) or does not compile
            print(f"    {tiles}: {type(e).__name__}: {str(e)[:80]}")
    results.sort(key=lambda r: r[0][0])
    for (ms, figure), tiles in results[:3]:
        print(f"    {ms * 1e3:8.1f} us  {figure:8.1f}  {tiles}")


def main():
    device = "CPU (Triton interpreter)" if ARGS.cpu else torch.cuda.get_device_name()
    print(f"{device}: {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert intermediate {INTER}, "
          f"{str(DTYPE).removeprefix('torch.')}; triton {triton.__version__}")
    gate_up, down = make_experts()
    print(f"decode ({'wall clock' if ARGS.cpu else 'CUDA-graph replays'}; bandwidth over the hit experts' weights)")
    print(f"{'batch':>6} {'experts hit':>11} {'us':>8} {'GB/s':>8} {'of HBM':>7} {'align us':>9}  tiles")
    for batch in (int(b) for b in (ARGS.decode or ("1,16" if ARGS.cpu else "1,16,256")).split(",")):
        _, _, ids = make_inputs(batch, 0)
        tiles = moe_tiles(batch * TOP_K, EXPERTS, DTYPE)
        ms, gbps = decode_case(batch, gate_up, down, None)
        print(f"{batch:>6} {len(ids.unique()):>11} {ms * 1e3:>8.1f} {gbps:>8.0f} {gbps / HBM_GBPS:>7.0%} "
              f"{align_ms(batch) * 1e3:>9.1f}  {tiles}")
        if ARGS.sweep and not ARGS.cpu:
            sweep(decode_case, batch, gate_up, down, DECODE_SWEEP)
    n = ARGS.prefill if not ARGS.cpu else 64
    print(f"prefill ({n} tokens, {n * TOP_K} pairs)")
    ms, tflops = prefill_case(n, gate_up, down, None)
    dense = dense_ms(n)
    print(f"  fused_moe {ms:.2f} ms, {tflops:.0f} TFLOP/s ({tflops / MATMUL_TFLOPS:.0%} of {MATMUL_TFLOPS:.0f}); "
          f"align {align_ms(n) * 1e3:.0f} us; dense torch matmuls of the same FLOPs {dense:.2f} ms; "
          f"tiles {moe_tiles(n * TOP_K, EXPERTS, DTYPE)}")
    if ARGS.sweep and not ARGS.cpu:
        sweep(prefill_case, n, gate_up, down, PREFILL_SWEEP)


if __name__ == "__main__":
    main()
