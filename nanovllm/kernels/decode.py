"""Paged decode attention: one query token per sequence, split-K ("flash decoding").

On Hopper, at 96 to two SMs' worth of (sequence, KV head) pairs under a bound of at most 4,096 tokens (batches
12-33 with 8 KV heads a rank), decode_attention hands a 16-bit cache, or an fp8 one under a 16-bit q, over to
decode_tma.py: one program per (sequence, KV head, chunk of the context) streaming its tiles through a TMA ring,
which reads closer to the copy bandwidth there (measured gain: docs/kernels.md). This kernel serves every other
case.

Grid: (sequences, kv_heads, splits). A program serves all GROUP = heads // kv_heads query heads of one KV head,
padded to BLOCK_G >= 16 rows so q @ K^T and p @ V run on tl.dot and each K/V tile is read once per KV head.
The grid is fixed by tensor shapes and the caller's context-length bound (never by context_lens values), so the
launch can be captured in a CUDA graph. Split s of a sequence covers keys [s * P, (s + 1) * P) of its context,
P = SPLIT_TILES * BLOCK_N tokens, so every program does at most the same work whatever the mix of context lengths
in the batch (a long sequence gets more programs, not one long one); splits past a sequence's context return at
once. (split_tiles = 0 cuts each sequence into as many equal runs as there are splits: the tests'.) A
sequence served by one split is written directly; otherwise splits write fp32 partials (running max, sum,
unnormalised acc) and count themselves in a per-(sequence, kv head) counter: the last to arrive merges them and
resets the counter (no second kernel: at batch 1 a merge kernel's launch is a noticeable share of the step, for
a few kilobytes of work), loading the partials of up to 8 splits at once.

The kernel is short at small batch, so memory round trips in a row cost as much as bandwidth: where a split lies in
one cache block (the engine's 128-token splits of 256-token blocks) its table entry is read beside the context
length rather than after it (measured gain: docs/kernels.md).

An fp8 cache (QUANT) is read as fp8 bytes with one float32 scale per (token, head), the scales of one block and
head contiguous. With a 16-bit q the dots run in float16, whatever q's type: fp8 widens to float16 in one
instruction (to bfloat16 it takes several, which made the kernel compute-bound; float16 also keeps more mantissa
bits). K tiles are widened and the scores multiplied by the K scales; the V scales are folded into p, divided by
the largest V scale seen so far so that p stays in [0, 1] (float16's range); the accumulator is kept in units of
that scale (rescaled when it grows, like the running max), so p @ V accumulates inside the MMA. A float32 q (tests,
float32 models) computes in float32.

A sliding window (window > 0) keeps the keys after context_len - 1 - window: the splits then cut that run, from the
tile holding its first key (keys before it in that tile are masked), so no program reads the keys the window
drops and the grid is sized for the window, not the context bound. Soft-capped logits (Gemma 2) become
cap * tanh(s / cap). Both run without the early launch; the TMA ring takes them too, its rule then seeing the
window's span (decode_tma.window_bound) as the bound.
"""
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels.hopper import decode_tma
from nanovllm.kernels.hopper.pdl import pdl_enabled, pdl_launch
from nanovllm.kernels.paged_kv import fp8_pv, kv_rows, split_partials, token_major_rows
from nanovllm.kernels.prefill import tanh
from nanovllm.kernels.scratch import split_counters

LOG2E = 1.4426950408889634
PROGRAMS_PER_SM = 4  # aim for this many decode programs per SM when splitting
TYPICAL_CONTEXT = 512  # split lengths are sized for contexts this long, not the (much larger) graph bound
MIN_TOKENS_PER_SPLIT = 128  # below this a split costs more to merge than it saves
MAX_SPLIT_TOKENS = 1024  # a split length past this is not worth a merge: one split per sequence instead
MAX_SPLITS = 64
# fp8 splits long contexts at large batch too, but only into this many splits: a long max_model_len would otherwise
# capture dozens of mostly empty splits (and their float32 partials) per decode graph
QUANT_MAX_SPLITS = 8


# the block-table width changes from batch to batch: one compiled kernel for every width, not one per
# Triton specialization of it (1, a multiple of 16, other)
@triton.jit(do_not_specialize=["stride_table", "table_width", "split_tiles"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr, part_m_ptr, part_l_ptr,
                   part_acc_ptr, count_ptr, context_lens_ptr, table_ptr,
                   stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_cb, stride_ct, stride_ch, stride_vb, stride_vt, stride_vh, stride_vd,
                   stride_sb, stride_sh, stride_table, table_width,
                   qk_scale, split_tiles, window, softcap,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                   V_TOKEN_MAJOR: tl.constexpr, PDL: tl.constexpr, SPLIT_IN_BLOCK: tl.constexpr,
                   MERGE_G: tl.constexpr, MERGE_S: tl.constexpr, EARLY: tl.constexpr = False,
                   PREFETCH_TILES: tl.constexpr = 0, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
    if PDL and not EARLY:  # the o_proj kernel after this one may start loading its weights (hopper/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    table_row_ptr = table_ptr + seq.to(tl.int64) * stride_table
    if SPLIT_IN_BLOCK:  # the split's tiles lie in one cache block: read its table entry beside the context length,
        # not after it (one memory round trip less before the first K/V load)
        first = split * split_tiles * BLOCK_N // BLOCK_SIZE
        split_block = tl.load(table_row_ptr + first, mask=first < table_width, other=0).to(tl.int64)
    context_len = tl.load(context_lens_ptr + seq)
    first_key, origin = 0, 0  # (a window: its first key, and the start of the tile holding it)
    if WINDOW:
        first_key = tl.maximum(context_len - window, 0)
        origin = first_key // BLOCK_N * BLOCK_N
    span = context_len - origin  # the keys the splits cut
    # This split's share of the context: whole BLOCK_N tiles, so tiles never straddle two splits.
    num_splits = tl.num_programs(2)  # a run-time value: one compiled kernel for every split count
    tiles_per_split = _tiles_per_split(span, split_tiles, num_splits, BLOCK_N)
    start = origin + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)  # empty (end <= start) for padding rows
    direct = span <= tiles_per_split * BLOCK_N  # one split holds it all (or context 0: zeros)
    if start >= end and not (direct and split == 0):
        return  # (before any wait: the context lengths and tables are written before the step, by the host copy
        # or the copies ahead of a graph replay, never by a kernel of the step)
    if EARLY:  # launched under PDL while the rotary kernel (or the qkv projection before it) runs: ask L2 for this
        # split's K/V (rotary writes only the new token's row, and L2 is coherent) before waiting for it
        tl.static_assert(SPLIT_IN_BLOCK and PREFETCH_TILES > 0, "early launches need splits inside one block")
        if start < end:
            _prefetch_split(k_cache_ptr, v_cache_ptr, stride_cb, stride_ct, stride_ch, stride_vb, stride_vt,
                            stride_vh, split_block, kv_head, start, end, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                            PREFETCH_TILES)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # query heads served by this program, [BLOCK_G]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)  # [BLOCK_G, HEAD_DIM]; padded rows are zeros
    if QUANT and q.dtype != tl.float32:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)  # (a bfloat16 q past float16's range)

    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)  # fp8: in units of v_top, the largest V scale so far
    v_top = tl.full([], 1e-30, dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_ch
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if SPLIT_IN_BLOCK:
            block, row = split_block, (offs_n % BLOCK_SIZE).to(tl.int64)
        else:
            block, row = kv_rows(table_row_ptr, n0, offs_n, mask_n, 0, True, BLOCK_SIZE, BLOCK_N)
        if V_TOKEN_MAJOR:  # the tile lies in one block: its tokens are contiguous there (lets loads vectorize)
            row = token_major_rows(n0, BLOCK_SIZE, BLOCK_N)
        k = tl.load(k_head_ptr + (block * stride_cb + row * stride_ct)[:, None] + offs_d[None, :],
                    mask=mask_n[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        if V_TOKEN_MAJOR:  # unmasked along tokens, so it vectorizes: rows past the context lie in the same
            # block, finite (the cache starts zeroed) and weighted by p = 0
            v = tl.load(v_head_ptr + block * stride_vb + row[:, None] + offs_d[None, :] * stride_vd)
        else:
            v = tl.load(v_head_ptr + (block * stride_vb + row * stride_vt)[:, None] + offs_d[None, :] * stride_vd,
                        mask=mask_n[:, None], other=0.0)
        if QUANT:
            scale_off = block * stride_sb + kv_head * stride_sh + row  # contiguous along the block's tokens
            k_scale = tl.load(k_scale_ptr + scale_off, mask=mask_n, other=0.0)  # [BLOCK_N]
            v_scale = tl.load(v_scale_ptr + scale_off, mask=mask_n, other=0.0)
            k = k.to(q.dtype)  # exact: every fp8 value is a float16
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_G, BLOCK_N]
        if QUANT:  # one multiply per score: the K scales and the softmax scale (log2 units) together
            s = s * (k_scale * qk_scale)[None, :]
        else:
            s = s * qk_scale
        if SOFTCAP:
            s = softcap * tanh(s / softcap)
        if WINDOW:
            mask_n = mask_n & (offs_n >= first_key)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            acc, v_top = fp8_pv(acc, p, v, alpha, v_scale, v_top, PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if QUANT:
        acc = acc * v_top
    if direct:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # context 0 (graph padding): zeros
        tl.store(o_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        # partials laid out [batch, heads, num_splits] (+ [HEAD_DIM] for acc), contiguous
        num_heads = tl.num_programs(1) * GROUP
        part = (seq.to(tl.int64) * num_heads + heads) * num_splits  # [BLOCK_G], split 0
        tl.store(part_m_ptr + part + split, m_i, mask=mask_g)
        tl.store(part_l_ptr + part + split, l_i, mask=mask_g)
        tl.store(part_acc_ptr + (part + split)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_g[:, None])
        # the splits that hold part of the context (at most all of them, should a context pass the caller's bound:
        # a wrong answer then, but the counter still goes back to zero)
        used = tl.minimum(tl.cdiv(tl.cdiv(span, BLOCK_N), tiles_per_split), num_splits)
        counter = count_ptr + seq * tl.num_programs(1) + kv_head
        tl.debug_barrier()  # every thread's partials are written before this program counts itself (release)
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:  # the last split merges
            tl.store(counter, 0)  # ready for the next launch (nothing else touches it in this one)
            _merge_splits(o_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, seq, kv_head, num_heads, num_splits, used,
                          stride_ob, stride_oh, GROUP, HEAD_DIM, MERGE_G, MERGE_S)


@triton.jit
def _prefetch_split(k_cache_ptr, v_cache_ptr, stride_cb, stride_ct, stride_ch, stride_vb, stride_vt, stride_vh,
                    block, kv_head, start, end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, TILES: tl.constexpr):
    """prefetch.global.L2 of the K and V rows [start, end) (at most TILES tiles) of a split lying in one cache block
    (SPLIT_IN_BLOCK): one request per 128-byte line (16-bit rows), a tile at a time."""
    lines = tl.arange(0, HEAD_DIM // 64) * 64  # 64 16-bit values a line
    for t in tl.static_range(TILES):
        offs = start + t * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (offs % BLOCK_SIZE).to(tl.int64)
        live = (offs < end)[:, None] & (lines >= 0)[None, :]
        k_ptrs = k_cache_ptr + block * stride_cb + kv_head * stride_ch + rows[:, None] * stride_ct + lines[None, :]
        v_ptrs = v_cache_ptr + block * stride_vb + kv_head * stride_vh + rows[:, None] * stride_vt + lines[None, :]
        k_ptrs = tl.where(live, k_ptrs, k_cache_ptr)
        v_ptrs = tl.where(live, v_ptrs, v_cache_ptr)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [k_ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [v_ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _merge_splits(o_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, seq, kv_head, num_heads, num_splits, used, stride_ob,
                  stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_G: tl.constexpr,
                  MERGE_S: tl.constexpr):
    """out = sum_s w_s acc_s / sum_s w_s l_s with w_s = 2^(m_s - max m), over the used splits, MERGE_S of them per
    step loaded together (their loads overlap instead of one L2 round trip per split). Rows are the GROUP heads
    padded to MERGE_G, not the dot's BLOCK_G. The partials were written by other SMs: read from L2 (.cg), never a
    stale L1 line."""
    offs_h = tl.arange(0, MERGE_G)
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    part = (seq.to(tl.int64) * num_heads + heads) * num_splits  # [MERGE_G], split 0
    m_run = tl.full([MERGE_G], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([MERGE_G], dtype=tl.float32)
    out = tl.zeros([MERGE_G, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, used, MERGE_S):
        idx = part[None, :] + (s0 + offs_s)[:, None]  # [MERGE_S, MERGE_G]
        mask = ((s0 + offs_s) < used)[:, None] & mask_h[None, :]
        m_s = tl.load(part_m_ptr + idx, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_l_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(part_acc_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=mask[:, :, None],
                        other=0.0, cache_modifier=".cg")  # [MERGE_S, MERGE_G, HEAD_DIM]
        # padded heads have no split: keep their maximum finite (0) so no -inf - -inf = nan appears
        m_new = tl.where(mask_h, tl.maximum(m_run, tl.max(m_s, 0)), 0.0)
        a, b = tl.exp2(m_run - m_new), tl.exp2(m_s - m_new[None, :])  # b = 0 for splits past used
        l_run = l_run * a + tl.sum(l_s * b, 0)
        out = out * a[:, None] + tl.sum(acc_s * b[:, :, None], 0)
        m_run = m_new
    out = out / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(o_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None])


@triton.jit
def _tiles_per_split(context_len, split_tiles, num_splits, BLOCK_N: tl.constexpr):
    if split_tiles > 0:
        return split_tiles
    return tl.maximum(tl.cdiv(tl.cdiv(context_len, BLOCK_N), num_splits), 1)  # (1 for context 0: no split used)


@functools.lru_cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # a Hopper SXM part's; only shapes the split heuristic off-GPU (interpreter tests)


def decode_splits(batch: int, num_kv_heads: int, max_context_len: int, block_n: int, device: torch.device,
                  max_split_tokens: int | None = None, quant: bool = False) -> tuple[int, int]:
    """(num_splits, split_tiles): each (sequence, kv head) is served by programs of split_tiles BLOCK_N tiles, as
    many as its context needs. The split length (a power of two in [MIN_TOKENS_PER_SPLIT, MAX_SPLIT_TOKENS]) gives
    PROGRAMS_PER_SM programs per SM when contexts are TYPICAL_CONTEXT long: small batches get short splits (many
    programs), larger ones longer splits, and past MAX_SPLIT_TOKENS one split per sequence (nothing to merge):
    short splits make small batches faster, while at large batches splitting costs more than it gains
    (benchmarks/decode_tiles.py; docs/kernels.md). An fp8 cache (quant) reads half the bytes per token, so its
    programs finish sooner: twice as many per SM, and splits of at most MAX_SPLIT_TOKENS at any batch when the
    bound needs at most QUANT_MAX_SPLITS of them (faster than unsplit at batch 256 too: docs/kernels.md).
    Depends only on shapes and the bound, so a captured CUDA graph stays valid; max_split_tokens overrides the
    length (benchmarks)."""
    if max_split_tokens is None:
        per_sm = PROGRAMS_PER_SM * (2 if quant else 1)
        want = batch * num_kv_heads * TYPICAL_CONTEXT // (per_sm * sm_count(device))
        max_split_tokens = max(triton.next_power_of_2(max(want, 1)), MIN_TOKENS_PER_SPLIT)
        if max_split_tokens > MAX_SPLIT_TOKENS:  # (fp8: at most QUANT_MAX_SPLITS such splits, else none)
            few = triton.cdiv(max(max_context_len, 1), MAX_SPLIT_TOKENS) <= QUANT_MAX_SPLITS
            max_split_tokens = MAX_SPLIT_TOKENS if quant and few else max_context_len
    tiles = triton.cdiv(max(max_context_len, 1), block_n)
    split_tiles = max(triton.cdiv(max_split_tokens, block_n), triton.cdiv(tiles, MAX_SPLITS))
    return triton.cdiv(tiles, split_tiles), split_tiles


def split_constants(group: int, block_size: int, block_n: int, split_tiles: int) -> dict:
    """The kernel's split constexprs: SPLIT_IN_BLOCK where every split lies inside one cache block (fixed-length
    splits that divide the block: one table read per program); the merge's rows (the group padded to a power of
    two) and how many splits it loads at once (at most 16 rows of HEAD_DIM floats, at most 8 splits)."""
    merge_g = triton.next_power_of_2(group)
    return dict(SPLIT_IN_BLOCK=split_tiles > 0 and block_size % (split_tiles * block_n) == 0, MERGE_G=merge_g,
                MERGE_S=max(1, min(8, 16 // merge_g)))


def _decode_config(head_dim: int, dtype: torch.dtype, quant: bool, v_token_major: bool = True,
                   batch: int = 256) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). K and V tiles are [BLOCK_N, head_dim], pipelined num_stages deep."""
    if dtype == torch.float32 or head_dim > 128:
        return 32, 4, 2
    if quant:  # the fastest of the tiles measured on Hopper from batch 16 to 256 (benchmarks/decode_tiles.py)
        return (128, 4, 2) if v_token_major else (128, 2, 2)
    # small batches: short splits of few tiles, where 2 warps and 2 stages are faster at batch 16, no slower at 1
    return (64, 2, 2) if batch <= 16 else (64, 4, 3)


def launched_early(split_tiles: int, block_size: int, block_n: int, head_dim: int, cache_dtype: torch.dtype,
                   device: torch.device) -> bool:
    """Launch the kernel under PDL, asking L2 for each split's K/V before it waits for the rotary kernel (which,
    past one token, triggers it before its own wait, so it may start while the qkv projection runs): for a 16-bit
    cache (not fp8, not float32; V unit-stride along head_dim: the caller checks) in fixed splits of at most two
    tiles inside one block (then split_constants sets SPLIT_IN_BLOCK too). Programs with no keys leave before the
    wait, so the graph bound's empty splits hold no slot. (On Hopper, batches 12-16 with 8 KV heads go to
    decode_tma.py instead, which copies its tiles before the wait.) With 8 KV heads a rank batches 1-16 qualify
    up to a max_model_len of 8,192 (past it a split holds 3 or more 64-key tiles, as MAX_SPLITS caps the splits);
    with fewer KV heads a rank (tensor parallelism) larger batches do too (up to 33 at 4). The gain is measured at
    batches 1-16 and a max_model_len of 4,096 only, and shrinks as contexts grow (docs/kernels.md)."""
    return (pdl_enabled(device) and cache_dtype.itemsize == 2 and split_tiles in (1, 2)
            and block_size % (split_tiles * block_n) == 0 and head_dim % 64 == 0)


def prefetch_tiles(programs: int, split_tiles: int, device: torch.device) -> int:
    """How many of its tiles an early program asks L2 for: all where the whole grid is resident at once, else the
    first (where programs wait for later waves, asking for every tile does no better than not launching early:
    docs/kernels.md)."""
    return split_tiles if programs <= PROGRAMS_PER_SM * sm_count(device) else 1


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, max_context_len: int | None = None,
                     num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
                     max_split_tokens: int | None = None, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """q [batch, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim]; context_lens [batch] int32
    (0 allowed: output zeros); block_tables [batch, max_blocks] int32, -1 past each sequence's blocks.
    An fp8 cache comes with k_scale, v_scale [num_blocks, kv_heads, block_size] float32.

    max_context_len: an upper bound of context_lens (default: block_tables width x block_size); it and the shapes
    fix the grid. num_splits (tests: each context cut into that many equal runs) or max_split_tokens (benchmarks)
    override the split heuristic; config (BLOCK_N, num_warps, num_stages) the tile choice (benchmarks). window: each
    query sees its last `window` keys only; softcap: scores s become softcap * tanh(s / softcap).
    Returns [batch, heads, head_dim] in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and (v_cache.stride(-1) == 1 or v_cache.stride(1) == 1)  # V: d or token-major
    assert v_cache.shape == k_cache.shape
    assert num_heads % num_kv_heads == 0 and context_lens.is_contiguous()
    if max_context_len is None:
        max_context_len = block_tables.size(1) * block_size
    group = num_heads // num_kv_heads
    quant = k_scale is not None
    plain = not window and not softcap
    if num_splits is None and config is None and max_split_tokens is None:
        programs, sms = batch * num_kv_heads, sm_count(q.device)
        bound = min(max_context_len, decode_tma.window_bound(window, k_cache.dtype)) if window else max_context_len
        stages = decode_tma.stages_for(programs, bound, sms, quant)
        if stages and decode_tma.usable(q, k_cache, v_cache, k_scale, v_scale):  # (Hopper: decode_tma.py)
            return decode_tma.decode_attention_tma(q, k_cache, v_cache, context_lens, block_tables, scale, stages,
                                                   out, max_context_len, k_scale, v_scale,
                                                   decode_tma.chunk_tiles_for(programs, sms, quant), window, softcap)
    if quant:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    block_n, warps, stages = config or _decode_config(head_dim, q.dtype, quant, v_cache.stride(1) == 1, batch)
    if window:  # the splits cut the window's keys, from the tile of its first: at most window + BLOCK_N - 1
        max_context_len = min(max_context_len, window + block_n - 1)
    if num_splits is None:
        num_splits, split_tiles = decode_splits(batch, num_kv_heads, max_context_len, block_n, q.device,
                                                max_split_tokens, quant)
    else:
        split_tiles = 0  # equal runs
    part_m, part_l, part_acc = split_partials(out, num_splits)
    counters = split_counters(q.device, batch * num_kv_heads)  # (one split: unused within the bound)
    early = plain and v_cache.stride(-1) == 1 and launched_early(split_tiles, block_size, block_n, head_dim,
                                                                 k_cache.dtype, q.device)
    splits = split_constants(group, block_size, block_n, split_tiles)
    if window:  # (a split's block depends on the context length)
        splits["SPLIT_IN_BLOCK"] = False
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, out, part_m, part_l,
        part_acc, counters, context_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(),
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0, block_tables.stride(0),
        block_tables.size(1), scale * LOG2E, split_tiles, window or 0, (softcap or 0.0) * LOG2E,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, HEAD_DIM=head_dim, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANT=quant,
        # unmasked V tiles only for an fp8 cache: the engine zeroes it, so bytes past a context are finite
        V_TOKEN_MAJOR=quant and v_cache.stride(1) == 1 and block_size % block_n == 0, PDL=pdl_enabled(q.device),
        **splits, WINDOW=bool(window), SOFTCAP=bool(softcap), num_warps=warps, num_stages=stages,
        EARLY=early, PREFETCH_TILES=prefetch_tiles(batch * num_kv_heads * num_splits, split_tiles, q.device) if early
        else 0, **pdl_launch(early),
    )
    return out
