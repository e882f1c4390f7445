"""The fused MoE Triton kernel (kernels/fused_moe.py) against the torch experts (nanovllm.layers.moe.
fused_experts_torch) on random data: the pairs' alignment into expert tiles, the kernel over loads and tile shapes
(interpreted on CPU, sizes kept tiny: the interpreter is slow), the tile rule, the kernel benchmark's CPU smoke run;
on a GPU (marked gpu) bf16 at the 30B-A3B layer shape, a Mixtral shape, no host sync and CUDA-graph replay. Its
sm_90 compile without a GPU is in test_hopper_compile.py; the MoE models are in tests/models/test_moe.py."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanovllm.kernels.fused_moe import MoeTiles, align_pairs, fused_moe, max_blocks, moe_tiles
from nanovllm.layers.moe import fused_experts_torch, route

ROOT = Path(__file__).resolve().parent.parent.parent


TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=1e-2),
              torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def routing(num_tokens: int, num_experts: int, top_k: int, load: str, device="cpu", seed: int = 0):
    """(topk_weights, topk_ids) for a load pattern: "uniform", "skewed" (expert 0 takes most tokens, the last
    quarter of the experts none), or "one" (every token's first choice is expert 1)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if load == "skewed":
        logits[:, 0] += 3.0
        logits[:, num_experts - max(1, num_experts // 4):] = -1e4
    elif load == "one":
        logits[:, 1] = 1e4
    weights, ids = route(logits, top_k, renormalize=load != "one")
    return weights.to(device), ids.to(device)


def random_experts(num_experts: int, hidden: int, inter: int, dtype, device, seed: int = 0):
    """(gate_up [E, 2I, H], down [E, H, I]) scaled so that activations stay near 1; made on `device` (the 30B-A3B
    layer is 0.6 billion weights)."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen, device=device) * inter ** -0.5
    return gate_up.to(dtype), down.to(dtype)


def check_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Every pair in exactly one slot, in its expert's padded run, in pair order; tiles know their expert and rows."""
    sorted_pairs, block_expert, block_rows = align_pairs(topk_ids, num_experts, block_m)
    ids = topk_ids.flatten().cpu()
    sorted_pairs, block_expert, block_rows = sorted_pairs.cpu(), block_expert.cpu(), block_rows.cpu()
    assert block_expert.numel() == max_blocks(ids.numel(), num_experts, block_m)
    counts = torch.bincount(ids, minlength=num_experts)
    expected_tiles = ((counts + block_m - 1) // block_m).tolist()
    seen, tile = [], 0
    for expert, n_tiles in enumerate(expected_tiles):
        run = []
        for _ in range(n_tiles):
            assert block_expert[tile] == expert, f"tile {tile} should belong to expert {expert}"
            rows = int(block_rows[tile])
            assert 0 < rows <= block_m
            run += sorted_pairs[tile * block_m:tile * block_m + rows].tolist()
            tile += 1
        assert run == torch.nonzero(ids == expert).flatten().tolist(), f"expert {expert}: pairs or their order"
        seen += run
    assert (block_rows[tile:] == 0).all(), "tiles past the last run must be empty"
    assert sorted(seen) == list(range(ids.numel()))


def fp8_experts(w: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weights, scales per row [E, rows] or per row and group [E, rows, cols / group], dequantized float32)."""
    e, rows, cols = w.shape
    blocks = w.float().view(e, rows, -1, group or cols)
    scale = blocks.abs().amax(-1).clamp(min=1e-12) / 448.0
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn)
    return q.view(e, rows, cols), scale if group else scale[..., 0], (q.float() * scale[..., None]).view(e, rows, cols)


def check_fused_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype, load="uniform",
                    tiles: MoeTiles | None = None, device="cpu", fp8_group: int | None = 0):
    """fp8_group (not 0): fp8 experts with scales per row (None) or per row and fp8_group columns, against the
    torch experts on their dequantized weights."""
    weights, ids = routing(num_tokens, num_experts, top_k, load, device, seed=num_tokens)
    gate_up, down = random_experts(num_experts, hidden, inter, dtype, device, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens + 2)).to(dtype).to(device)
    scales = None
    if fp8_group != 0:
        from nanovllm.kernels.fused_moe import ExpertScales
        gate_up, gu_scale, gate_up_ref = fp8_experts(gate_up, fp8_group)
        down, down_scale, down_ref = fp8_experts(down, fp8_group)
        scales = ExpertScales(gu_scale, down_scale, fp8_group)
    out = fused_moe(x, gate_up, down, weights, ids, tiles, scales=scales)
    if scales is not None:
        gate_up, down = gate_up_ref, down_ref
    ref = fused_experts_torch(x.float(), gate_up.float(), down.float(), weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    assert torch.isfinite(out).all()
    what = f"T={num_tokens} E={num_experts} K={top_k} H={hidden} I={inter} {dtype} {load} {tiles}"
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype], msg=lambda m: f"{what}: {m}")


@pytest.mark.interpreter
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (6, 3), (64, 4)])
@pytest.mark.parametrize("num_tokens", [1, 3, 40, 300])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align(num_tokens, num_experts, top_k, block_m):
    for load in ("uniform", "skewed", "one"):
        _, ids = routing(num_tokens, num_experts, top_k, load, seed=num_tokens)
        check_align(ids, num_experts, block_m)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 2, 16, 67, 300])
@pytest.mark.parametrize("load", ["uniform", "skewed"])
def test_fused_moe(num_tokens, load, dtype):
    check_fused_moe(num_tokens, 8, 2, 64, 48, dtype, load)  # tiles from moe_tiles: block_m 16 to 128


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiles", [MoeTiles(16, 32, 32, 1, 4, 1), MoeTiles(32, 16, 64, 4, 4, 1),
                                   MoeTiles(64, 64, 16, 2, 4, 1)])
def test_fused_moe_tiles(tiles, dtype):
    """Tiles narrower than I and H (several column tiles), K not a multiple of block_k, grouped tile order."""
    check_fused_moe(50, 6, 3, 40, 40, dtype, "skewed", tiles)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_tokens", [1, 9, 200])
def test_fused_moe_every_token_to_one_expert(num_tokens):
    check_fused_moe(num_tokens, 8, 2, 32, 32, torch.float32, "one")


@pytest.mark.interpreter
def test_fused_moe_many_experts_and_top_1():
    check_fused_moe(100, 64, 4, 32, 16, torch.float16, "skewed")  # pairs counted in several chunks
    check_fused_moe(33, 4, 1, 32, 16, torch.float32, "uniform")


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [None, 16])
@pytest.mark.parametrize("num_tokens", [1, 67])
def test_fused_moe_fp8_experts(num_tokens, group):
    # fp8 weights with scales per row or per 16 columns (K steps cut to the group), x in 16 bits
    check_fused_moe(num_tokens, 8, 2, 64, 48, torch.float16, "skewed", fp8_group=group)


def test_tiles_follow_the_batch():
    assert moe_tiles(8, 128, torch.bfloat16).block_m == 16  # decode, one token
    assert moe_tiles(256 * 8, 128, torch.bfloat16).block_m == 32  # 16 pairs per expert on average
    assert moe_tiles(16384 * 8, 128, torch.bfloat16).block_m == 128  # prefill
    assert moe_tiles(16384 * 8, 128, torch.float32).block_m == 64


def test_kernel_benchmark_runs_on_cpu():
    cmd = [sys.executable, "benchmarks/moe_kernel.py", "--cpu", "--decode", "1"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "GB/s" in proc.stdout and "TFLOP/s" in proc.stdout


QWEN3_30B_LAYER = dict(num_experts=128, top_k=8, hidden=2048, inter=768)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 64, 256, 512, 2048, 16384])
@pytest.mark.parametrize("load", ["uniform", "skewed"])
def test_gpu_kernel_bf16_qwen3_30b_shape(num_tokens, load):
    s = QWEN3_30B_LAYER
    check_fused_moe(num_tokens, s["num_experts"], s["top_k"], s["hidden"], s["inter"], torch.bfloat16, load,
                    device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
@pytest.mark.parametrize("group", [None, 128])
def test_gpu_kernel_fp8_qwen3_30b_shape(num_tokens, group):
    # the Qwen3-30B-A3B-FP8 layout (128-column blocks) and per-row scales, bf16 activations
    s = QWEN3_30B_LAYER
    check_fused_moe(num_tokens, s["num_experts"], s["top_k"], s["hidden"], s["inter"], torch.bfloat16, "uniform",
                    device="cuda", fp8_group=group)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 100, 3000])
def test_gpu_kernel_mixtral_shape(num_tokens, dtype):
    """8 experts, top-2, Mixtral 8x7B's hidden size and half its intermediate size (one rank of two)."""
    check_fused_moe(num_tokens, 8, 2, 4096, 7168, dtype, "skewed", device="cuda")
    check_align(routing(num_tokens, 8, 2, "skewed", device="cuda")[1], 8, 64)


@pytest.mark.gpu
def test_gpu_kernel_has_no_host_sync_and_replays_in_a_graph():
    """Captured once in a CUDA graph, replayed with other tokens and routing: equals the reference each time; and an
    eager call never synchronizes with the host (torch raises on any sync in "error" mode)."""
    from nanovllm.kernels.fused_moe import fused_moe
    from nanovllm.layers.moe import fused_experts_torch
    s, num_tokens = QWEN3_30B_LAYER, 48
    gate_up, down = random_experts(s["num_experts"], s["hidden"], s["inter"], torch.bfloat16, "cuda")
    x = torch.randn(num_tokens, s["hidden"], device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, s["num_experts"], s["top_k"], "uniform", "cuda")
    fused_moe(x, gate_up, down, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, gate_up, down, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, gate_up, down, weights, ids)
    for seed, load in ((1, "skewed"), (2, "one"), (3, "uniform")):
        new_weights, new_ids = routing(num_tokens, s["num_experts"], s["top_k"], load, "cuda", seed=seed)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = fused_experts_torch(x.float(), gate_up.float(), down.float(), weights, ids)
        torch.testing.assert_close(out.float(), ref, **TOLERANCES[torch.bfloat16],
                                   msg=lambda m, load=load: f"{load}: {m}")
