"""Causal flash attention over packed variable-length sequences, keys from k/v or from the paged cache.

Grid: (query tiles of the longest sequence, sequences, heads), tiles in reverse so the costliest start first. A
program whose tile starts past its sequence's end returns at once. Each program keeps one [BLOCK_M, head_dim] fp32
accumulator and walks the key tiles with an online softmax: first the tiles every query row sees in full (no mask),
then the tiles on the diagonal (causal + length mask); tiles wholly above the diagonal are never visited.
Keys read from an fp8 cache (QUANT, paged only) are handled as in the decode kernel: with a 16-bit q the dots run
in float16 (fp8 widens to it exactly, in one instruction), the scores are scaled per key, and the V scales are
folded into p, the accumulator kept in units of the largest V scale seen.

A sliding window (window > 0: a query at position p sees keys p - window < key <= p) starts each tile's walk at
the first key tile its first row sees and masks every tile (the rows of a tile start their windows at different
keys, so a row may see no key of a tile: its running max stays -inf until one comes). A logit soft-cap (Gemma 2)
turns each score s into cap * tanh(s / cap) before the softmax.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged_kv import fp8_pv, kv_rows, token_major_rows

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, v_top, q, pos_m, n0, n_end, k_head_ptr, v_head_ptr, k_scale_head_ptr,
                 v_scale_head_ptr, table_row_ptr, k_start, stride_kb, stride_kt, stride_vb, stride_vt, stride_vd,
                 stride_sb, qk_scale, window, softcap,
                 MASKED: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                 V_TOKEN_MAJOR: tl.constexpr, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
    """One online-softmax step over keys n0:n0+BLOCK_N. acc [BLOCK_M, HEAD_DIM], m_i/l_i [BLOCK_M] (log2 units);
    QUANT: acc in units of v_top, the largest V scale so far (as in the decode kernel). WINDOW: keys at or below
    pos - window are masked too; SOFTCAP: softcap (log2 units) caps the scores."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < n_end  # all true for unmasked tiles; still bounds the block-table reads
    block, row = kv_rows(table_row_ptr, n0, offs_n, mask_n, k_start, PAGED, BLOCK_SIZE, BLOCK_N)
    k_ptrs = k_head_ptr + (block * stride_kb + row * stride_kt)[:, None] + offs_d[None, :]
    if V_TOKEN_MAJOR:  # the tile lies in one block, its tokens contiguous there: unmasked, vectorized loads (keys
        # past the end lie in the same block, finite, and get weight 0; layers/attention/fp8.py)
        v_row = token_major_rows(n0, BLOCK_SIZE, BLOCK_N)
        v = tl.load(v_head_ptr + block * stride_vb + v_row[:, None] + offs_d[None, :] * stride_vd)
    v_ptrs = v_head_ptr + (block * stride_vb + row * stride_vt)[:, None] + offs_d[None, :] * stride_vd
    if MASKED:
        k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0)
        if not V_TOKEN_MAJOR:
            v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        if not V_TOKEN_MAJOR:
            v = tl.load(v_ptrs)
    if QUANT:
        scale_off = block * stride_sb + row  # (the head's offset is in the pointers)
        k_scale = tl.load(k_scale_head_ptr + scale_off, mask=mask_n, other=0.0)
        v_scale = tl.load(v_scale_head_ptr + scale_off, mask=mask_n, other=0.0)
        k = k.to(q.dtype)  # exact: every fp8 value is a float16 (q is float16 here, or float32)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if QUANT:  # one multiply per score: the K scales and the softmax scale (log2 units) together
        s = s * (k_scale * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if SOFTCAP:
        s = softcap * tanh(s / softcap)
    if MASKED:
        visible = (offs_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
        if WINDOW:
            visible = visible & (offs_n[None, :] > pos_m[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    # Without a window every row saw key 0 in the first tile visited, so m_new is finite and no NaN appears; with
    # one, a row that has seen no key yet keeps m = -inf: its exponents are taken against 0 (p = 0, acc = 0).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if WINDOW else m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:  # V scales folded into p, acc in units of the largest so far
        acc, v_top = fp8_pv(acc, p, v, alpha, v_scale, v_top, PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i, v_top


@triton.jit
def tanh(x):
    """tanh from one exp (saturates to +-1; Triton's core language has no tanh)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# the block-table width changes from batch to batch: one compiled kernel for every width, not one per
# Triton specialization of it (1, a multiple of 16, other)
@triton.jit(do_not_specialize=["stride_table"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, o_ptr, cu_q_ptr, cu_k_ptr, table_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_sb, stride_sh,
                    stride_table, qk_scale, window, softcap,
                    GROUP: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PRECISION: tl.constexpr, QUANT: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr,
                    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
    # Heaviest tiles (the last ones of the longest sequences: most keys under the causal mask) start first.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq, head = tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    len_q = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= len_q:
        return
    if PAGED:
        len_k = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    else:
        len_k = len_q  # fresh k/v are packed like q
    kv_head = head // GROUP
    table_row_ptr = table_ptr + seq.to(tl.int64) * stride_table

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < len_q
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=mask_m[:, None],
                other=0.0)
    if QUANT and q.dtype != tl.float32:  # dots in float16: fp8 widens to it in one instruction (decode.py says more)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    pos_m = len_k - len_q + offs_m  # absolute position of each query; it sees keys <= its position

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    v_top = tl.full([], 1e-30, dtype=tl.float32)  # fp8: acc's unit (unused otherwise)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    k_scale_head_ptr = k_scale_ptr + kv_head * stride_sh  # (scales are [blocks, kv_heads, block_size])
    v_scale_head_ptr = v_scale_ptr + kv_head * stride_sh
    first_pos = len_k - len_q + tile * BLOCK_M
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys below this are visible to every row of the tile
    n_end = len_k - len_q + tl.minimum((tile + 1) * BLOCK_M, len_q)  # one past the last row's last key
    if WINDOW:  # every tile masked, from the first the tile's first row sees
        full_end = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i, v_top = _attend_tile(acc, m_i, l_i, v_top, q, pos_m, n0, n_end, k_head_ptr, v_head_ptr,
                                                k_scale_head_ptr, v_scale_head_ptr, table_row_ptr, q_start,
                                                stride_kb, stride_kt, stride_vb, stride_vt, stride_vd, stride_sb,
                                                qk_scale, window, softcap, False, PAGED, BLOCK_SIZE, BLOCK_N,
                                                HEAD_DIM, PRECISION, QUANT, V_TOKEN_MAJOR, WINDOW, SOFTCAP)
    for n0 in range(full_end, n_end, BLOCK_N):
        acc, m_i, l_i, v_top = _attend_tile(acc, m_i, l_i, v_top, q, pos_m, n0, n_end, k_head_ptr, v_head_ptr,
                                            k_scale_head_ptr, v_scale_head_ptr, table_row_ptr, q_start, stride_kb,
                                            stride_kt, stride_vb, stride_vt, stride_vd, stride_sb, qk_scale,
                                            window, softcap, True, PAGED, BLOCK_SIZE, BLOCK_N, HEAD_DIM, PRECISION,
                                            QUANT, V_TOKEN_MAJOR, WINDOW, SOFTCAP)
    if QUANT:
        acc = acc * v_top
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])


def _prefill_config(head_dim: int, dtype: torch.dtype, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), sized for Hopper (227 KiB shared memory per SM)."""
    if dtype == torch.float32:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    elif head_dim <= 64:
        block_m, block_n, warps, stages = 128, 64, 4, 3
    elif head_dim <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 64, 4, 2
    # Decode-like queries (a few tokens: chunked prefill tails, prefix hits) waste less with a 16-row tile (the
    # least tl.dot takes); everything longer takes the full tile. Two sizes, not every power of two: each is one
    # more Triton compile at start-up on a fresh machine, and mid-sized queries are cheap either way.
    if max_seqlen_q <= 16:
        block_m, warps = 16, 4
    return block_m, block_n, warps, stages


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, scale: float,
                      block_tables: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """q [tokens, heads, head_dim] packed by cu_seqlens_q [num_seqs + 1] int32.

    block_tables None: k, v [tokens, kv_heads, head_dim] packed like q (causal self-attention).
    block_tables [num_seqs, max_blocks] int32: k, v are the caches [num_blocks, block_size, kv_heads, head_dim];
    sequence s attends over its first cu_seqlens_k[s+1] - cu_seqlens_k[s] cached tokens, its queries being the last
    ones; an fp8 cache comes with k_scale, v_scale [num_blocks, kv_heads, block_size] float32. window: a query at
    position p sees the keys after p - window only; softcap: scores s become softcap * tanh(s / softcap). Returns
    [tokens, heads, head_dim] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.size(-2)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    paged = block_tables is not None
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    if not paged and v.stride(-1) != 1:
        v = v.contiguous()
    assert num_heads % num_kv_heads == 0
    if paged:  # (a cache's V may be token-major: read through its strides)
        assert k.dim() == 4 and v.shape == k.shape and k.stride(-1) == 1
        block_size, table, stride_table = k.size(1), block_tables, block_tables.stride(0)
        stride_kb, stride_kt, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vb, stride_vt, stride_vh, stride_vd = v.stride()
    else:
        block_size, table, stride_table = 16, cu_seqlens_q, 0  # table unused
        stride_kb, stride_kt, stride_kh = 0, k.stride(0), k.stride(1)
        stride_vb, stride_vt, stride_vh, stride_vd = 0, v.stride(0), v.stride(1), 1
    quant = paged and k_scale is not None
    if quant:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    block_m, block_n, warps, stages = _prefill_config(head_dim, q.dtype, max_seqlen_q)
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k, v, k_scale if quant else k, v_scale if quant else v, out, cu_seqlens_q, cu_seqlens_k, table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd,
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0, stride_table,
        scale * LOG2E, window or 0, (softcap or 0.0) * LOG2E,
        GROUP=num_heads // num_kv_heads, PAGED=paged, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANT=quant,
        # unmasked V tiles only for an fp8 cache: the engine zeroes it, so bytes past a context are finite
        V_TOKEN_MAJOR=quant and stride_vt == 1 and block_size % block_n == 0,
        WINDOW=bool(window), SOFTCAP=bool(softcap), num_warps=warps, num_stages=stages,
    )
    return out
