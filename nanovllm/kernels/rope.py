"""Rotary embedding (neox style, the whole head) of q and k in place, with Qwen3's per-head q/k RMSNorm before it:
one program per token for all its q and k heads (at decode batches of a few tokens, a few heads per program),
instead of a chain of compiled kernels (norm q, norm k, rotate q, rotate k) that each re-read the heads. Used by
the decoder on CUDA (layers/rotary_embedding.py is the torch reference, layers/layernorm.py's rms_norm the
norm's)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.hopper.pdl import pdl_enabled, pdl_launch
from nanovllm.kernels.store_kvcache import row_scale, to_fp8


@triton.jit
def _rotate_heads(x_ptr, w_ptr, stride_t, stride_h, token, h0, num_heads, cos, sin, eps,
                  NORM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, OFFSET: tl.constexpr = False):
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    ptr = x_ptr + token.to(tl.int64) * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HALF]: the first half of each head
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # in float32 up to the one final rounding: the eager path rounds the normed heads to 16 bits before
        # rotating them, and the rotation's cancellation can turn that into a large error on a small output (a
        # variant that rounds twice misses the float32 reference by 0.024 on a rare bf16 element)
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)
        if OFFSET:  # Gemma's norm scales by (1 + weight)
            w1, w2 = w1 + 1.0, w2 + 1.0
        x1 = x1 * inv * w1[None, :]
        x2 = x2 * inv * w2[None, :]
    y1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(ptr, y1, mask=mask)
    tl.store(ptr + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _store_halves(cache_ptr, scale_ptr, x1, x2, rows, step_d, scale_dst, mask_h,
                  QUANT: tl.constexpr, FP8_MAX: tl.constexpr, HALF: tl.constexpr):
    """One token's heads [BLOCK_H, HALF] x 2 into the cache at rows (+ d * step_d); fp8: with the row scales that
    store_kvcache.py computes (amax over the whole head)."""
    if QUANT:
        amax = tl.maximum(tl.max(tl.abs(x1.to(tl.float32)), 1), tl.max(tl.abs(x2.to(tl.float32)), 1))
        scale = row_scale(amax, FP8_MAX)
        x1 = to_fp8(x1, scale, FP8_MAX, cache_ptr.dtype.element_ty)
        x2 = to_fp8(x2, scale, FP8_MAX, cache_ptr.dtype.element_ty)
        tl.store(scale_ptr + scale_dst, scale, mask=mask_h)
    tl.store(cache_ptr + rows, x1, mask=mask_h[:, None])
    tl.store(cache_ptr + rows + HALF * step_d, x2, mask=mask_h[:, None])


@triton.jit(do_not_specialize=["trigger_first"])  # (0 or 1: one compiled kernel for both)
def _qk_norm_rope_kernel(q_ptr, k_ptr, positions_ptr, cache_ptr, q_w_ptr, k_w_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
                         k_scale_ptr, v_scale_ptr, slot_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                         stride_vh, stride_cache, stride_kb, stride_ks, stride_kh_c, stride_vb, stride_vs,
                         stride_vh_c, stride_vd, stride_sb, stride_sh, num_q_heads, num_k_heads, eps, trigger_first,
                         NORM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
                         STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
                         FP8_MAX: tl.constexpr, PDL: tl.constexpr = False, OFFSET: tl.constexpr = False):
    if PDL:  # launched early (hopper/pdl.py): with trigger_first, early decode attention may launch and ask L2 for
        # its K/V while the qkv projection runs (kernels/decode.py); then wait for that projection before reading or
        # writing anything
        if trigger_first:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token, chunk = tl.program_id(0), tl.program_id(1)
    q_chunks = tl.cdiv(num_q_heads, BLOCK_HQ)
    together = tl.num_programs(1) == 1  # one program rotates all the token's heads (q, then k)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d)[None, :]  # the cache rows are [cos | sin], float32
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d)[None, :]
    if together or chunk < q_chunks:
        _rotate_heads(q_ptr, q_w_ptr, stride_qt, stride_qh, token, chunk * BLOCK_HQ, num_q_heads, cos, sin, eps,
                      NORM, BLOCK_HQ, HALF, OFFSET)
    if together or chunk >= q_chunks:
        h0 = 0 if together else (chunk - q_chunks) * BLOCK_HK
        k1, k2 = _rotate_heads(k_ptr, k_w_ptr, stride_kt, stride_kh, token, h0, num_k_heads, cos, sin, eps, NORM,
                               BLOCK_HK, HALF, OFFSET)
        if STORE:  # the token's K and V rows of these heads into the paged cache, as store_kvcache.py would
            slot = tl.load(slot_ptr + token).to(tl.int64)
            # V read beside the slot, not after its check: one memory round trip less in a row
            offs_h = h0 + tl.arange(0, BLOCK_HK)
            mask_h = offs_h < num_k_heads
            mask = mask_h[:, None]
            v = v_ptr + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            v1 = tl.load(v, mask=mask, other=0.0)
            v2 = tl.load(v + HALF, mask=mask, other=0.0)
            if slot >= 0:  # (slot -1: skip)
                block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
                scale_dst = block * stride_sb + offs_h * stride_sh + offset
                _store_halves(k_cache_ptr, k_scale_ptr, k1, k2, block * stride_kb + offset * stride_ks
                              + offs_h[:, None] * stride_kh_c + offs_d[None, :], 1, scale_dst, mask_h, QUANT,
                              FP8_MAX, HALF)
                _store_halves(v_cache_ptr, v_scale_ptr, v1, v2, block * stride_vb + offset * stride_vs
                              + offs_h[:, None] * stride_vh_c + offs_d[None, :] * stride_vd, stride_vd, scale_dst,
                              mask_h, QUANT, FP8_MAX, HALF)


SPLIT_HEADS_UP_TO = 16  # tokens (decode batch sizes) whose heads are spread over programs, HEADS_PER_PROGRAM each
HEADS_PER_PROGRAM = 2


def heads_per_program_for(tokens: int) -> int:
    """Heads per program (0: all of a token's, one program per token). A few tokens give a few programs, one per
    token on as many SMs: two heads per program make the kernel faster at batches 1-16 (docs/kernels.md); at batch
    64 they do not help."""
    return HEADS_PER_PROGRAM if tokens <= SPLIT_HEADS_UP_TO else 0


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, store: tuple | None = None,
                  heads_per_program: int | None = None, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] (views of the qkv projection are fine: the
    last dimension must be contiguous); positions [tokens] int64; cos_sin_cache [max_position, head_dim] float32.
    With q_weight/k_weight, each head is RMS-normalized (eps) and scaled first (offset: by 1 + weight, Gemma's).
    Writes q and k in place and returns them. store=(v, k_cache, v_cache, slot_mapping[, k_scale, v_scale]): also
    writes each token's rotated K and its V into the paged cache [num_blocks, block_size, kv_heads, head_dim] (K
    unit-stride along head_dim, V any layout) at its slot, fp8 with its scales, as store_kvcache does: one kernel
    fewer per layer. (One program per token stores a token-major V byte by byte: decode steps only, where
    store_kvcache does the same.) heads_per_program (a power of two): each program rotates that many q or k heads
    of one token (and stores those K/V heads), else one program per token does them all (heads_per_program_for's
    choice)."""
    tokens, num_q_heads, head_dim = q.shape
    if tokens == 0:
        return q, k
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0 and cos_sin_cache.stride(-1) == 1
    norm = q_weight is not None
    v, k_cache, v_cache, slots, *scales = store if store is not None else (k, k, k, positions)
    quant = bool(scales)
    if store is not None and not (v.stride(-1) == 1 and v.shape == k.shape and k_cache.shape == v_cache.shape
                                  and k_cache.stride(-1) == 1
                                  and slots.numel() == tokens and len(scales) in (0, 2)
                                  and (not quant or scales[0].stride() == scales[1].stride())):
        raise ValueError("qk_norm_rope_(store=...) takes unit-stride V rows shaped like k, two caches of one shape "
                         "(K unit-stride along head_dim), a slot per token and, for fp8, two scale tensors of one "
                         "layout")
    k_scale, v_scale = scales if quant else (k, k)
    num_k_heads = k.size(1)
    if heads_per_program is None:
        heads_per_program = heads_per_program_for(tokens)
    if heads_per_program < 0 or heads_per_program & (heads_per_program - 1):
        raise ValueError(f"qk_norm_rope_: heads_per_program must be 0 (all of a token's) or a power of two, got "
                         f"{heads_per_program}")
    if heads_per_program:
        block_hq = block_hk = heads_per_program
        chunks = triton.cdiv(num_q_heads, block_hq) + triton.cdiv(num_k_heads, block_hk)
        warps = max(1, min(4, heads_per_program // 2))
    else:
        block_hq, block_hk = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_k_heads)
        chunks, warps = 1, 4
    pdl = pdl_enabled(q.device)
    _qk_norm_rope_kernel[(tokens, chunks)](
        q, k, positions, cos_sin_cache, q_weight if norm else q, k_weight if norm else k, v, k_cache, v_cache,
        k_scale, v_scale, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        *(k_cache.stride()[:3] if store is not None else (0, 0, 0)), *(v_cache.stride() if store is not None else
                                                                      (0, 0, 0, 0)),
        *(k_scale.stride()[:2] if quant else (0, 0)), num_q_heads, num_k_heads, eps,
        int(tokens > 1),  # trigger_first past one token: at batch 1 it makes decode slower (docs/kernels.md)
        NORM=norm, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        HALF=head_dim // 2, STORE=store is not None, BLOCK_SIZE=k_cache.size(1) if store is not None else 1,
        QUANT=quant, FP8_MAX=torch.finfo(k_cache.dtype).max if quant else 1.0, num_warps=warps,
        PDL=pdl, OFFSET=offset and norm, **pdl_launch(pdl),
    )
    return q, k
