"""Fused MoE experts: every (token, k) pair goes through expert topk_ids[token, k] as two grouped GEMMs.

The pairs are sorted by expert into a padded order where each expert's run is a whole number of BLOCK_M-row tiles,
so a GEMM tile reads one expert's weights (the layout of vLLM's fused_moe with moe_align_block_size). All of it runs
on the device with buffers sized from the shapes alone, worst case P + min(E, P) * (BLOCK_M - 1) padded rows for P
pairs and E experts: no host sync, so it can be captured in a CUDA graph.

1. _count_kernel: per chunk of pairs, how many go to each expert.
2. _offsets_kernel (one program): expert runs padded to BLOCK_M, where each chunk's pairs start in them, and per
   tile its expert and its number of real rows (0: a tile past the end, which the GEMMs skip).
3. _scatter_kernel: each pair's slot in that order (stable: pairs keep their order within an expert).
4. _gate_up_kernel: act[slot] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T), one tile x BLOCK_N columns of I.
5. _down_kernel: pair_out[pair] = weight[pair] * act[slot] @ down_e^T.
6. Each token's top_k rows summed in torch, in a fixed order (deterministic, unlike atomic adds).

fp8 experts (quantization/fp8.py's Fp8Experts): the weights are read in fp8 and converted to x's type in the tile
(exact), with float32 scales per weight row, or per row and group of columns applied to each K step's products;
the activations stay 16-bit (w8a16). Decode reads half the bytes; the experts take half the memory.
"""
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_CHUNKS = 256  # programs that count and scatter pairs; the offsets kernel holds [chunks, experts] at once


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # rows (pairs of one expert) per tile; each expert's run is padded to a multiple of it
    block_n: int
    block_k: int
    group_m: int  # tiles of rows that walk the columns together (the weights of an expert stay in L2)
    num_warps: int
    num_stages: int


def moe_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """Tiles (tuned on Hopper) by the mean rows per expert: about twice that per tile, so that an expert with more
    pairs than the mean still reads its weights once (decode is bound by reading them), up to 128 rows for
    prefill."""
    mean_rows = num_pairs / num_experts
    block_m = min(64 if dtype == torch.float32 else 128, max(16, triton.next_power_of_2(math.ceil(2 * mean_rows))))
    if dtype == torch.float32:
        return MoeTiles(block_m, 64, 32, 8, 4, 2)
    if block_m <= 32:  # decode: many narrow column tiles, deep pipelining of the weight loads
        return MoeTiles(block_m, 64, 128, 1, 4, 4)
    if block_m == 64:
        return MoeTiles(64, 128, 64, 8, 4, 3)
    return MoeTiles(128, 128, 64, 8, 8, 3)


def _chunking(num_pairs: int, block_e: int) -> tuple[int, int, int]:
    """(pairs per inner step, pairs per program, programs): a step holds a [step, experts] one-hot."""
    step = max(16, 4096 // block_e)
    chunks = min(MAX_CHUNKS, triton.cdiv(num_pairs, step))
    chunk = triton.cdiv(triton.cdiv(num_pairs, chunks), step) * step
    return step, chunk, triton.cdiv(num_pairs, chunk)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles in the padded order at worst: each expert that has pairs wastes at most block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, CHUNK, STEP: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, CHUNK, STEP):
        offs = chunk * CHUNK + s + tl.arange(0, STEP)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        total += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + chunk * BLOCK_E + experts, total)


@triton.jit
def _offsets_kernel(counts_ptr, block_expert_ptr, block_rows_ptr, num_chunks, num_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    chunks = tl.arange(0, BLOCK_C)
    experts = tl.arange(0, BLOCK_E)
    ptrs = counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :]
    mask = chunks[:, None] < num_chunks
    counts = tl.load(ptrs, mask=mask, other=0)  # [chunks, experts]
    total = tl.sum(counts, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded  # each expert's first slot; experts past E have none and never own a tile
    # in place: the slot where each chunk's first pair of each expert goes
    tl.store(ptrs, starts[None, :] + tl.cumsum(counts, 0) - counts, mask=mask)
    real_ends = starts + total
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_row = blocks * BLOCK_M
        # a tile belongs to the first expert whose padded run ends after its first row
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)
        real_end = tl.sum(tl.where(experts[None, :] == owner[:, None], real_ends[None, :], 0), 1)
        rows = tl.minimum(tl.maximum(real_end - first_row, 0), BLOCK_M)  # 0 past the last expert's run
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)
        tl.store(block_rows_ptr + blocks, rows, mask=blocks < num_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, num_pairs, CHUNK, STEP: tl.constexpr, BLOCK_E: tl.constexpr):
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    cursor = tl.load(counts_ptr + chunk * BLOCK_E + experts)  # the next free slot of each expert
    for s in range(0, CHUNK, STEP):
        offs = chunk * CHUNK + s + tl.arange(0, STEP)
        valid = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [STEP, experts]
        before = tl.cumsum(onehot, 0) - onehot  # earlier pairs of the same expert in this step
        slot = tl.sum(onehot * (cursor[None, :] + before), 1)
        tl.store(sorted_ptr + slot, offs, mask=valid)
        cursor += tl.sum(onehot, 0)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_pairs [blocks * block_m] int32: pair index token * K + k per slot, padding slots
    unwritten; block_expert [blocks] int32; block_rows [blocks] int32: real rows of each tile, 0 past the end)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    step, chunk, chunks = _chunking(num_pairs, block_e)
    ids = topk_ids.flatten()
    counts = torch.empty(chunks, block_e, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    block_rows = torch.empty(blocks, dtype=torch.int32, device=device)
    _count_kernel[(chunks,)](ids, counts, num_pairs, chunk, STEP=step, BLOCK_E=block_e)
    _offsets_kernel[(1,)](counts, block_expert, block_rows, chunks, blocks, BLOCK_M=block_m,
                          BLOCK_C=triton.next_power_of_2(chunks), BLOCK_E=block_e, BLOCK_B=64, num_warps=8)
    _scatter_kernel[(chunks,)](ids, counts, sorted_pairs, num_pairs, chunk, STEP=step, BLOCK_E=block_e)
    return sorted_pairs, block_expert, block_rows


@triton.jit
def _tile(block_expert_ptr, block_rows_ptr, num_blocks, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GROUP_M: tl.constexpr):
    """This program's tile: GROUP_M row tiles walk the column tiles together. Returns (real rows, 0 for a tile past
    the end; expert; row mask; slots [BLOCK_M]; output columns [BLOCK_N]; the columns to read, past N wrapped to
    valid ones that are never stored)."""
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first = pid // per_group * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    pid_m, pid_n = first + pid % per_group % size, pid % per_group // size
    rows = tl.load(block_rows_ptr + pid_m)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    slots = pid_m.to(tl.int64) * BLOCK_M + offs_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, expert, offs_m < rows, slots, offs_n, (offs_n % N).to(tl.int64)


@triton.jit
def _scaled(acc, a, w, s_ptr, k0, SCALE: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ w, w converted to a's type; SCALE 2: the step's products times the scales of its group at s_ptr
    (one pointer per column of w; BLOCK_K divides GROUP)."""
    w = w.to(a.dtype)
    if SCALE == 2:
        return acc + tl.dot(a, w, input_precision=PRECISION) * tl.load(s_ptr + k0 // GROUP)[None, :]
    return tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, s_ptr,
                    N, K, num_blocks, stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sn,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SCALE: tl.constexpr = 0,
                    GROUP: tl.constexpr = 1):
    """x [T, K]; w [E, 2N, K] (gate rows, then up rows); act [slots, N]. SCALE (fp8 w): 1, scales [E, 2N] per
    row; 2, [E, 2N, groups] per row and GROUP columns."""
    rows, expert, mask_m, slots, offs_n, cols = _tile(block_expert_ptr, block_rows_ptr, num_blocks, N, BLOCK_M,
                                                      BLOCK_N, GROUP_M)
    if rows == 0:
        return
    tokens = (tl.load(sorted_ptr + slots, mask=mask_m, other=0) // TOP_K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + N * stride_wn
    sg_ptrs = s_ptr + expert * stride_se + cols * stride_sn  # (SCALE: the columns' gate rows' scales)
    su_ptrs = sg_ptrs + N * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=mask_k[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=mask_k[:, None], other=0.0)
        acc_g = _scaled(acc_g, a, g, sg_ptrs, k0, SCALE, GROUP, PRECISION)
        acc_u = _scaled(acc_u, a, u, su_ptrs, k0, SCALE, GROUP, PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SCALE == 1:
        acc_g *= tl.load(sg_ptrs)[None, :]
        acc_u *= tl.load(su_ptrs)[None, :]
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, in float32
    tl.store(act_ptr + slots[:, None] * stride_at + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_n < N)[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, s_ptr,
                 N, K, num_blocks, stride_at, stride_we, stride_wn, stride_ot, stride_se, stride_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SCALE: tl.constexpr = 0, GROUP: tl.constexpr = 1):
    """act [slots, K]; w [E, N, K]; out [pairs, N] = routing weight * act @ w_e^T. SCALE as in _gate_up_kernel."""
    rows, expert, mask_m, slots, offs_n, cols = _tile(block_expert_ptr, block_rows_ptr, num_blocks, N, BLOCK_M,
                                                      BLOCK_N, GROUP_M)
    if rows == 0:
        return
    pairs = tl.load(sorted_ptr + slots, mask=mask_m, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + slots[:, None] * stride_at + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]
    s_ptrs = s_ptr + expert * stride_se + cols * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
        acc = _scaled(acc, a, w, s_ptrs, k0, SCALE, GROUP, PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALE == 1:
        acc *= tl.load(s_ptrs)[None, :]
    acc = acc * tl.load(weights_ptr + pairs, mask=mask_m, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True)
class ExpertScales:
    """fp8 experts' float32 scales: gate_up [E, 2I] and down [E, H] (one per row, group None), or [E, 2I, H / group]
    and [E, H, I / group] (one per row and `group` columns, a power of two)."""
    gate_up: torch.Tensor
    down: torch.Tensor
    group: int | None


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tiles: MoeTiles | None = None, scales: ExpertScales | None = None
              ) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_weights [T, K] float32; topk_ids [T, K]; scales: the
    experts are fp8 (x 16-bit), these their scales. Returns [T, H] in x's dtype: sum_k topk_weights[t, k] *
    expert_{topk_ids[t, k]}(x[t])."""
    num_tokens, hidden = x.shape
    num_experts, inter = gate_up.size(0), gate_up.size(1) // 2
    top_k = topk_ids.size(1)
    if num_tokens == 0:
        return torch.zeros_like(x)
    x, gate_up, down = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate_up, down))
    tiles = tiles or moe_tiles(num_tokens * top_k, num_experts, x.dtype)
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    scaled, group, gu_s, down_s = 0, 1, x, x  # (unused without scales)
    if scales is not None:
        gu_s, down_s = scales.gate_up, scales.down
        scaled = 1 if scales.group is None else 2
        if scales.group is not None:
            bk = min(bk, scales.group)
            group = scales.group
    sorted_pairs, block_expert, block_rows = align_pairs(topk_ids.contiguous(), num_experts, bm)
    blocks = block_expert.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (ignored for 16-bit inputs)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)

    act = torch.empty(blocks * bm, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks * triton.cdiv(inter, bn),)](
        x, gate_up, act, sorted_pairs, block_expert, block_rows, gu_s,
        inter, hidden, blocks, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        gu_s.stride(0), gu_s.stride(1) if scaled else 0,
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, EVEN_K=hidden % bk == 0,
        PRECISION=precision, SCALE=scaled, GROUP=group, **launch)
    pair_out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks * triton.cdiv(hidden, bn),)](
        act, down, pair_out, topk_weights.float().contiguous(), sorted_pairs, block_expert, block_rows, down_s,
        hidden, inter, blocks, act.stride(0), down.stride(0), down.stride(1), pair_out.stride(0),
        down_s.stride(0), down_s.stride(1) if scaled else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, EVEN_K=inter % bk == 0,
        PRECISION=precision, SCALE=scaled, GROUP=group, **launch)
    return pair_out.view(num_tokens, top_k, hidden).sum(1)
