"""The fused MoE Triton kernel against the torch experts (nanovllm.layers.moe.fused_experts_torch) on random data.

Run by tests/test_moe.py in a subprocess with TRITON_INTERPRET=1 (CPU); `check_*` and `routing` are also used there by
the GPU tests. Not collected on its own (no test_ prefix). Interpreter sizes are kept tiny: it is slow.
"""
import pytest
import torch

from nanovllm.kernels.fused_moe import MoeTiles, align_pairs, fused_moe, max_blocks, moe_tiles
from nanovllm.layers.moe import fused_experts_torch, route

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


def check_fused_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype, load="uniform",
                    tiles: MoeTiles | None = None, device="cpu"):
    weights, ids = routing(num_tokens, num_experts, top_k, load, device, seed=num_tokens)
    gate_up, down = random_experts(num_experts, hidden, inter, dtype, device, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens + 2)).to(dtype).to(device)
    out = fused_moe(x, gate_up, down, weights, ids, tiles)
    ref = fused_experts_torch(x.float(), gate_up.float(), down.float(), weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    assert torch.isfinite(out).all()
    what = f"T={num_tokens} E={num_experts} K={top_k} H={hidden} I={inter} {dtype} {load} {tiles}"
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype], msg=lambda m: f"{what}: {m}")


# ---- interpreted on CPU --------------------------------------------------------------------------

@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (6, 3), (64, 4)])
@pytest.mark.parametrize("num_tokens", [1, 3, 40, 300])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align(num_tokens, num_experts, top_k, block_m):
    for load in ("uniform", "skewed", "one"):
        _, ids = routing(num_tokens, num_experts, top_k, load, seed=num_tokens)
        check_align(ids, num_experts, block_m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 2, 16, 67, 300])
@pytest.mark.parametrize("load", ["uniform", "skewed"])
def test_fused_moe(num_tokens, load, dtype):
    check_fused_moe(num_tokens, 8, 2, 64, 48, dtype, load)  # tiles from moe_tiles: block_m 16 to 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiles", [MoeTiles(16, 32, 32, 1, 4, 1), MoeTiles(32, 16, 64, 4, 4, 1),
                                   MoeTiles(64, 64, 16, 2, 4, 1)])
def test_fused_moe_tiles(tiles, dtype):
    """Tiles narrower than I and H (several column tiles), K not a multiple of block_k, grouped tile order."""
    check_fused_moe(50, 6, 3, 40, 40, dtype, "skewed", tiles)


@pytest.mark.parametrize("num_tokens", [1, 9, 200])
def test_fused_moe_every_token_to_one_expert(num_tokens):
    check_fused_moe(num_tokens, 8, 2, 32, 32, torch.float32, "one")


def test_fused_moe_many_experts_and_top_1():
    check_fused_moe(100, 64, 4, 32, 16, torch.float16, "skewed")  # pairs counted in several chunks
    check_fused_moe(33, 4, 1, 32, 16, torch.float32, "uniform")


def test_tiles_follow_the_batch():
    assert moe_tiles(8, 128, torch.bfloat16).block_m == 16  # decode, one token
    assert moe_tiles(256 * 8, 128, torch.bfloat16).block_m == 32  # 16 pairs per expert on average
    assert moe_tiles(16384 * 8, 128, torch.bfloat16).block_m == 128  # prefill
    assert moe_tiles(16384 * 8, 128, torch.float32).block_m == 64
