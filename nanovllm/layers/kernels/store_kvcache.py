"""Write new K/V rows into the paged cache: one program per token, all kv heads at once. With an fp8 cache each
(token, head) row is quantized with its own scale, amax / the format's largest value, and V is stored token-major
(layers/attention/fp8.py): each cache is addressed through its own strides."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_row(x, cache_ptr, scale_ptr, dst, scale_dst, mask, mask_h, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """x [BLOCK_H, HEAD_DIM] to cache_ptr + dst (same shape), its scales [BLOCK_H] to scale_ptr + scale_dst."""
    if QUANT:
        x = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 1) / FP8_MAX, 1e-12)  # [BLOCK_H]
        x = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
        x = x.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # round to nearest, as torch does
        tl.store(scale_ptr + scale_dst, scale, mask=mask_h)
    tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                          stride_sb, stride_sh,
                          num_kv_heads,
                          BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                          QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # -1: this token's K/V must not be written
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_h = offs_h < num_kv_heads
    mask = mask_h[:, None]
    t = token.to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # int64 slot arithmetic: one layer's cache can exceed 2**31 elements
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    v_dst = block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    scale_dst = block * stride_sb + offs_h * stride_sh + offset
    _store_row(k, k_cache_ptr, k_scale_ptr, k_dst, scale_dst, mask, mask_h, QUANT, FP8_MAX)
    _store_row(v, v_cache_ptr, v_scale_ptr, v_dst, scale_dst, mask, mask_h, QUANT, FP8_MAX)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """k, v [tokens, kv_heads, head_dim]; caches indexed [num_blocks, block_size, kv_heads, head_dim] (K with unit
    stride along head_dim; V any layout);
    slot_mapping [tokens] int32 (block * block_size + offset, -1 = skip). An fp8 cache comes with its
    scales k_scale, v_scale [num_blocks, kv_heads, block_size] float32."""
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
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache.stride(),
        k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
        num_kv_heads,
        BLOCK_SIZE=k_cache.size(1), BLOCK_H=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        QUANT=quant, FP8_MAX=torch.finfo(k_cache.dtype).max if quant else 1.0,
    )
