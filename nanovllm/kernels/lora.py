"""LoRA's two products for every adapter of a step in one launch each, indexed per token (punica's idea):
shrink s = x @ A[slot]^T and expand y += s @ B[slot]^T, where slot is the token's adapter (-1: none, no update).

A program takes a tile of tokens in adapter order (`order`: the step's tokens sorted by slot, so that a tile
mostly holds one adapter's tokens, punica's SGMV grouping) and runs one tl.dot per adapter present in it, with the
other tokens' rows masked to zero: each adapter's matrices are read once per tile. Shrink's
reduction runs over the whole input width, so at decode sizes (a few tiles of tokens, one to three blocks of
ranks) it is split over programs that add their parts into s (split-K), to keep the GPU's SMs busy.
The token count is not a specialization (do_not_specialize): the variants the start-up compiles (a large prefill,
the decode graphs) are all a run needs. The torch
reference is nanovllm/lora/stack.py's CPU path."""
import functools

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # ranks a program (shrink) or loop step (expand) takes
BLOCK_K = 64  # input columns a shrink step takes


def _block_t(tokens: int) -> int:
    """Tokens a program takes: 16 (tl.dot's smallest M) for decode-sized steps, 64 for prefill chunks."""
    return 16 if tokens <= 256 else 64


@functools.lru_cache(maxsize=8)
def _programs_wanted(device: torch.device) -> int:
    """Shrink's split-K aims at this many programs: four per SM (a fixed 256 in the interpreter)."""
    if device.type != "cuda":
        return 256
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _tile(order_ptr, slots_ptr, T, BLOCK_T: tl.constexpr):
    """This program's tokens (rows of x, s and y; int64: a step's rows times a layer's width pass 2**31 elements, e.g.
    64k tokens through Qwen3-14B's gate_up output of 34816), which are real, their slots, and the lowest and highest
    adapter slot among them (lo > hi: none)."""
    at = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = at < T
    rows = tl.load(order_ptr + at, mask=rmask, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + rows, mask=rmask, other=-1)
    lo = tl.min(tl.where(slot >= 0, slot, 1 << 30), axis=0)
    hi = tl.max(slot, axis=0)
    return rows, rmask, slot, lo, hi


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, order_ptr, s_ptr, T, K, K_SPLIT, stride_x, stride_as, stride_ar,
                   stride_s, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows, rmask, slot, lo, hi = _tile(order_ptr, slots_ptr, T, BLOCK_T)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_start = tl.program_id(2) * K_SPLIT  # this program's share of the reduction (all of it without split-K)
    k_end = tl.minimum(k_start + K_SPLIT, K)
    acc = tl.zeros((BLOCK_T, BLOCK_R), tl.float32)
    for one in range(lo, hi + 1):
        mine = rmask & (slot == one)
        if tl.max(mine.to(tl.int32), axis=0) > 0:  # (slots between lo and hi that no token here uses: skipped)
            for k0 in range(k_start, k_end, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < k_end
                x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=mine[:, None] & kmask[None, :],
                            other=0)
                a = tl.load(a_ptr + one * stride_as + ranks[None, :] * stride_ar + k[:, None], mask=kmask[:, None],
                            other=0)
                if IEEE:
                    acc += tl.dot(x, a, input_precision="ieee")
                else:
                    acc += tl.dot(x, a)
    # s starts at zero and every split adds its part (one path for any split: no variant to compile per split)
    tl.atomic_add(s_ptr + rows[:, None] * stride_s + ranks[None, :], acc, mask=rmask[:, None])


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(s_ptr, b_ptr, slots_ptr, order_ptr, y_ptr, T, N, stride_s, stride_bs, stride_bn, stride_y,
                   R: tl.constexpr, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    rows, rmask, slot, lo, hi = _tile(order_ptr, slots_ptr, T, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    if lo <= hi:
        acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
        for one in range(lo, hi + 1):
            mine = rmask & (slot == one)
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                for r0 in range(0, R, BLOCK_R):
                    ranks = r0 + tl.arange(0, BLOCK_R)
                    s = tl.load(s_ptr + rows[:, None] * stride_s + ranks[None, :], mask=mine[:, None], other=0)
                    b = tl.load(b_ptr + one * stride_bs + cols[None, :] * stride_bn + ranks[:, None],
                                mask=nmask[None, :], other=0)
                    if IEEE:
                        acc += tl.dot(s, b.to(tl.float32), input_precision="ieee")
                    else:
                        acc += tl.dot(s.to(b.dtype), b)
        ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
        mask = rmask[:, None] & nmask[None, :]
        y = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """s [T, R] float32 = x [T, K] @ a[slots[t]]^T, a [slots, R, K] (R a multiple of BLOCK_R); rows whose slot is
    -1 get zeros. order: the T token indices, grouped by slot (any order is correct; grouped is fast)."""
    t, k = x.shape
    r = a.shape[1]
    if not t:
        return torch.zeros(0, r, dtype=torch.float32, device=x.device)
    block_t = _block_t(t)
    tiles, steps = triton.cdiv(t, block_t) * (r // BLOCK_R), triton.cdiv(k, BLOCK_K)
    split = max(1, min(steps, triton.cdiv(_programs_wanted(x.device), tiles)))
    k_split = triton.cdiv(steps, split) * BLOCK_K
    split = triton.cdiv(k, k_split)
    s = torch.zeros(t, r, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(t, block_t), r // BLOCK_R, split)
    _shrink_kernel[grid](x, a, slots, order, s, t, k, k_split, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
                         IEEE=x.dtype == torch.float32, BLOCK_T=block_t, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return s


def lora_expand_(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                 order: torch.Tensor) -> torch.Tensor:
    """y [T, N] += s [T, R] @ b[slots[t]]^T in place, b [slots, N, R]; rows whose slot is -1 are left as they are.
    order: as lora_shrink's."""
    t, n = y.shape
    if t:
        block_t, block_n = _block_t(t), 64
        grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n))
        _expand_kernel[grid](s, b, slots, order, y, t, n, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
                             R=b.shape[2], IEEE=y.dtype == torch.float32, BLOCK_T=block_t, BLOCK_R=BLOCK_R,
                             BLOCK_N=block_n)
    return y
