"""Write new K/V rows into the paged cache. With an fp8 cache each (token, head) row is quantized with its own
scale, amax / the format's largest value, and V is stored token-major (layers/attention/fp8.py).

Grid: (groups of BLOCK_T consecutive tokens of the step, kv heads). When a group's slots are one run inside one
block (a prefill's tokens), a token-major V is written as a [head_dim, BLOCK_T] tile addressed as base + arange
along the tokens, so a warp's byte stores fill shared memory sectors; with scattered slots (decode) each byte is
its own store. (Written byte by byte, a long prefill's fp8 store is a large share of the step: docs/kernels.md.)"""
import torch
import triton
import triton.language as tl

BLOCK_T = 16


@triton.jit
def row_scale(amax, FP8_MAX: tl.constexpr):
    """A row's fp8 scale from its largest magnitude (layers/attention/fp8.py's quantize)."""
    return tl.maximum(amax / FP8_MAX, 1e-12)


@triton.jit
def to_fp8(x, scale, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    """x [rows, d] / its rows' scales, in the cache's fp8 dtype (round to nearest, as torch does)."""
    x = tl.clamp(x.to(tl.float32) / scale[:, None], -FP8_MAX, FP8_MAX)
    return x.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _quantize(x, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    """x [BLOCK_T, HEAD_DIM] -> (values in the cache's dtype, one scale per row; 1.0 without QUANT)."""
    if QUANT:
        scale = row_scale(tl.max(tl.abs(x.to(tl.float32)), 1), FP8_MAX)  # [BLOCK_T]
        return to_fp8(x, scale, FP8_MAX, dtype), scale
    return x.to(dtype), tl.full([x.shape[0]], 1.0, tl.float32)


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, num_tokens,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                          stride_sb, stride_sh,
                          BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
                          QUANT: tl.constexpr, FP8_MAX: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr):
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    keep = slots >= 0  # -1: this token's K/V must not be written (and rows past the step)
    # int64 slot arithmetic: one layer's cache can exceed 2**31 elements
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    t = tokens.to(tl.int64)
    k = tl.load(k_ptr + t[:, None] * stride_kt + head * stride_kh + offs_d[None, :], mask=keep[:, None])
    v = tl.load(v_ptr + t[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask=keep[:, None])
    k, k_scale = _quantize(k, QUANT, FP8_MAX, k_cache_ptr.dtype.element_ty)
    v, v_scale = _quantize(v, QUANT, FP8_MAX, v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + (block * stride_cb + offset * stride_cs + head * stride_ch)[:, None] + offs_d[None, :],
             k, mask=keep[:, None])
    v_row = block * stride_vcb + offset * stride_vcs + head * stride_vch  # [BLOCK_T]
    scale_dst = block * stride_sb + head * stride_sh + offset
    # A run of BLOCK_T consecutive slots in one block (a prefill's tokens): addressed as base + arange, so Triton
    # knows the tokens are contiguous and lays the stores out along them (a token-major V's bytes, the scales).
    slot0 = tl.load(slot_ptr + tl.program_id(0) * BLOCK_T)  # (the first token always exists)
    run = tl.arange(0, BLOCK_T)
    consecutive = (tl.sum((slots == slot0 + run).to(tl.int32), 0) == BLOCK_T) & (slot0 % BLOCK_SIZE + BLOCK_T <=
                                                                               BLOCK_SIZE) & (slot0 >= 0)
    if consecutive:
        base0 = (slot0 // BLOCK_SIZE).to(tl.int64) * stride_vcb + (slot0 % BLOCK_SIZE) * stride_vcs + head * stride_vch
        if V_TOKEN_MAJOR:
            tl.store(v_cache_ptr + base0 + offs_d[:, None] * stride_vcd + run[None, :], tl.trans(v))
        else:
            tl.store(v_cache_ptr + v_row[:, None] + offs_d[None, :] * stride_vcd, v)
        if QUANT:
            s0 = (slot0 // BLOCK_SIZE).to(tl.int64) * stride_sb + head * stride_sh + slot0 % BLOCK_SIZE
            tl.store(k_scale_ptr + s0 + run, k_scale)
            tl.store(v_scale_ptr + s0 + run, v_scale)
    else:
        if V_TOKEN_MAJOR:
            tl.store(v_cache_ptr + v_row[None, :] + offs_d[:, None] * stride_vcd, tl.trans(v), mask=keep[None, :])
        else:
            tl.store(v_cache_ptr + v_row[:, None] + offs_d[None, :] * stride_vcd, v, mask=keep[:, None])
        if QUANT:
            tl.store(k_scale_ptr + scale_dst, k_scale, mask=keep)
            tl.store(v_scale_ptr + scale_dst, v_scale, mask=keep)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """k, v [tokens, kv_heads, head_dim]; caches indexed [num_blocks, block_size, kv_heads, head_dim] (K with unit
    stride along head_dim; V any layout); slot_mapping [tokens] int32 (block * block_size + offset, -1 = skip).
    An fp8 cache comes with its scales k_scale, v_scale [num_blocks, kv_heads, block_size] float32."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.shape == k_cache.shape
    assert slot_mapping.numel() == num_tokens and slot_mapping.is_contiguous()
    quant = k_scale is not None
    if quant:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    _store_kvcache_kernel[(triton.cdiv(num_tokens, BLOCK_T), num_kv_heads)](
        k, v, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, slot_mapping,
        num_tokens, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(),
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
        BLOCK_SIZE=k_cache.size(1), BLOCK_T=BLOCK_T, HEAD_DIM=head_dim, QUANT=quant,
        FP8_MAX=torch.finfo(k_cache.dtype).max if quant else 1.0, V_TOKEN_MAJOR=v_cache.stride(1) == 1,
        num_warps=4,
    )
