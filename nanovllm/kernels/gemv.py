"""Small-batch linear layers: y [M, N] = x [M, K] @ W [N, K]^T (+ bias) for M <= MAX_ROWS (decode at small batch).

At batch 1-16 a linear layer is a read of W. Each program owns BLOCK_N rows of W (output columns) and streams them
once, with every row of x: one row multiplies and adds on the CUDA cores, 2-16 rows go through one 16-row tl.dot.
Where that pays (swapped()), 2-16 rows take the product the other way round, y^T = W x^T: 64 rows of W are the
dot's M, so Triton issues Hopper's wgmma (asynchronous, operands read from shared memory, at most 16 columns of x
as N) instead of mma.sync, which needs M = 16 on x's side; a program streams 64 rows of W four stages deep.
cuBLAS picks slow kernels for some of these shapes (o_proj's K 2,048 and N 1,024 among them); measured gain:
docs/kernels.md. Where the output columns give fewer programs than half the SMs, K is split over programs
(gemv_split_k), the last split adding the partials; a split with atomic adds into a zeroed output is slower.

One row (batch-1 decode, K up to ROW_MAX_K) has its own kernel, which loads each program's whole slice of W at
once, folds in the op before the layer (RMSNorm + residual add, SiLU-and-mul: the decoder's forward_small) and
starts early under programmatic dependent launch (kernels/hopper/pdl.py); the one-row kernel, and then the folds
with PDL, each shorten a batch-1 step (docs/kernels.md; `benchmarks/small_gemm.py --chain` times the chain). The
general kernel does not fold the norm in: there each program would re-read the rows of x, which makes 2-16 rows
slower.

2-16 rows fold an RMSNorm between two linear layers differently (add_norm, then NormedRows): rms_norm(h) @ W^T =
rstd * ((h * w) @ W^T) per row, so the layer before (o_proj, down) adds the residual in its epilogue and writes
h * w and its columns' partial sums of squares of h, and the layer after (gate_up, the next qkv) runs its loop on
h * w unchanged and scales each output row by rstd at its end: no norm kernel, nothing read before the loop.
"""
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels import activation
from nanovllm.kernels import norm as norm_kernels
from nanovllm.kernels.decode import sm_count
from nanovllm.kernels.hopper.pdl import pdl_enabled, pdl_launch
from nanovllm.kernels.scratch import scratch, split_counters

MAX_ROWS = 16  # the rows of one tl.dot (layers/linear.py's SMALL_BATCH_ROWS)

MAX_SPLIT_K = 4  # K-splits of the general kernel at most (the range benchmarks/small_gemm.py measures)
SWAP_TILE = (64, 256, 4, 4)  # (BLOCK_N, BLOCK_K, num_warps, num_stages) of the swapped product (swapped())
SWAP_MIN_K = 2048  # ... or where K is this long: cut into K-splits, the few programs still stream long runs
ROW_MAX_K = 4096  # one row of x: each program holds its whole [BLOCK_N, K] slice of W in registers up to this K


@triton.jit(do_not_specialize=["M"])  # (one kernel for 2-16 rows: 9 and 16 rows are both decode and prefill)
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                 stride_ym, res_ptr, xn_ptr, nw_ptr, sumsq_ptr, n_parts, eps, s_ptr, stride_s, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                 SPLIT: tl.constexpr, SWAP: tl.constexpr = False, PDL: tl.constexpr = False,
                 ADD_NORM: tl.constexpr = False, SCALE_ROWS: tl.constexpr = False, PARTS: tl.constexpr = 1,
                 GATED_OUT: tl.constexpr = False, SCALE: tl.constexpr = 0, GROUP: tl.constexpr = 1,
                 SHARED: tl.constexpr = False):
    """Grid (N / BLOCK_N, splits): program (n, s) takes columns [n * BLOCK_N, +BLOCK_N) over K-range s (k_per_split
    long, a multiple of BLOCK_K; each split holds some K). SPLIT: each writes its float32 partial sums [BLOCK_M,
    BLOCK_N] to part_ptr ([splits, BLOCK_M, N]) and counts itself in count_ptr[n]; the last one to arrive adds them
    up, writes y and sets the counter back to zero (no second kernel, no zeroed output). The split count is a
    run-time value: one compiled kernel for every count.
    ADD_NORM: y is h = y + residual (res_ptr, rounded as layernorm.add_rms_norm rounds), and the program also
    writes h * nw to xn_ptr and its columns' sums of squares of h to sumsq_ptr[n] ([BLOCK_M] floats).
    SCALE_ROWS: x is such an h * nw; the n_parts sums of squares at sumsq_ptr give each row's rstd (K = h's width),
    which scales the row's products before the bias.
    GATED_OUT: W is an MLP's [gate; up] (N rows, N/2 each) and y [M, N/2] is silu(gate) * up: program n takes
    gate rows [n * BLOCK_N/2, +BLOCK_N/2) and the matching up rows, and rounds both before the SiLU-and-mul (as
    kernels/activation.py after the layer).
    SCALE (one row; 2-16 rows of an fp8 W take fp8_gemm.w8a16, measured faster): W is fp8 (widened to float32 as
    it is read; exact) with float32 scales at s_ptr: 1, one per W row, applied to the sums; 2, one per W row and
    GROUP columns ([N, groups], stride_s), applied to each BLOCK_K step's products (BLOCK_K divides GROUP); SHARED:
    every row of the program shares its scales, so they scale the step's x instead, once for all BLOCK_N rows (any
    BLOCK_K)."""
    if PDL:  # launched early (hopper/pdl.py): the kernel after this one (norm, SiLU, rotary, ...) may launch
        tl.extra.cuda.gdc_launch_dependents()  # now and wait; then wait for the kernel before this one
        tl.extra.cuda.gdc_wait()
    tl.static_assert(SCALE == 0 or BLOCK_M == 1, "an fp8 W takes one row (2-16 rows: fp8_gemm.w8a16)")
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    HALF: tl.constexpr = BLOCK_N // 2
    if GATED_OUT:  # the tile's W rows: gate rows, then the up rows N/2 further
        r = tl.arange(0, BLOCK_N)
        offs_n = pid_n * HALF + r % HALF + (r // HALF) * (N // 2)
        mask_n = pid_n * HALF + r % HALF < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    # (loaded before the loop, used after it: the loads overlap the stream of W)
    if SCALE_ROWS:
        offs_p = tl.arange(0, PARTS)
        sumsq = tl.load(sumsq_ptr + offs_p[:, None] * BLOCK_M + offs_m[None, :], mask=(offs_p < n_parts)[:, None],
                        other=0.0)
    if ADD_NORM:
        res = tl.load(res_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :],
                      other=0.0)
        nw = tl.load(nw_ptr + offs_n, mask=mask_n, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # SWAP: y^T = W x^T, W's rows as the dot's M (wgmma)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # one row: products summed over K once, at the end
    k_start, k_end = 0, K
    if SPLIT:
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if EVEN:  # no masks on W: its loads vectorize
            w = tl.load(w_rows + offs_k[None, :])  # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        # (one row widens an fp8 W straight to float32: through bfloat16 costs more conversions than its FMAs)
        if SCALE == 2 and SHARED:  # the program's first row's scales serve all its rows
            xs = x.to(tl.float32) * tl.load(s_ptr + pid_n * BLOCK_N * stride_s + offs_k // GROUP, mask=mask_k,
                                            other=0.0)[None, :]
            acc1 += w.to(tl.float32) * xs
        elif SCALE == 2:  # this step's group scale per W row, on the step's products
            gs = tl.load(s_ptr + offs_n * stride_s + k0 // GROUP, mask=mask_n, other=0.0)
            acc1 += w.to(tl.float32) * x.to(tl.float32) * gs[:, None]
        elif BLOCK_M == 1:
            acc1 += w.to(tl.float32) * x.to(tl.float32)
        elif SWAP:
            acc_t = tl.dot(w, tl.trans(x), acc_t)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if BLOCK_M == 1:
        acc = tl.sum(acc1, 1)[None, :]
    elif SWAP:
        acc = tl.trans(acc_t)
    if SPLIT:
        splits = tl.num_programs(1)
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]  # split 0's [BLOCK_M, BLOCK_N]
        tl.store(part + pid_k * BLOCK_M * N, acc, mask=mask_n[None, :])
        tl.debug_barrier()  # every thread's partials are written before this program counts itself (release)
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") != splits - 1:
            return
        tl.store(count_ptr + pid_n, 0)  # the last split: ready for the next launch
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(0, splits):  # written by other SMs: read from L2 (.cg), never a stale L1 line
            acc += tl.load(part + s * BLOCK_M * N, mask=mask_n[None, :], other=0.0, cache_modifier=".cg")
    if SCALE == 1:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if SCALE_ROWS:
        acc = acc * tl.rsqrt(tl.sum(sumsq, 0) / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    y_at = offs_m[:, None] * stride_ym + offs_n[None, :]
    mask_y = mask_m[:, None] & mask_n[None, :]
    if ADD_NORM:
        h = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(y_ptr + y_at, h, mask=mask_y)
        tl.store(xn_ptr + y_at, (h.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dtype), mask=mask_y)
        h = tl.where(mask_y, h.to(tl.float32), 0.0)
        tl.store(sumsq_ptr + pid_n * BLOCK_M + offs_m, tl.sum(h * h, 1))
    elif GATED_OUT:
        gate, up = tl.split(tl.permute(tl.reshape(acc.to(dtype), [BLOCK_M, 2, HALF]), (0, 2, 1)))
        offs_o = pid_n * HALF + tl.arange(0, HALF)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_o[None, :], activation.silu_mul(gate, up, dtype),
                 mask=mask_m[:, None] & (offs_o < N // 2)[None, :])
    else:
        tl.store(y_ptr + y_at, acc.to(dtype), mask=mask_y)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, nw_ptr, res_out_ptr, s_ptr, N, K, stride_wn, stride_s, eps,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                     NORM: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr, SCALE: tl.constexpr = 0,
                     GROUP: tl.constexpr = 1, SHARED: tl.constexpr = False):
    """One row of x. Each program loads its whole [BLOCK_N, K] slice of W at once: no kernel writes W, so with
    programmatic dependent launch (PDL) those loads may start while the kernel before is finishing; gdc_wait then
    waits for it before x is read or anything written. The whole row of x is in registers too, so the op before
    the layer folds in at no extra pass (the roundings of kernels/activation.py and norm.py):
    GATED: x is [gate, up] (2K wide) and the layer reads silu(gate) * up;
    ADD: the layer reads x + residual, which program 0 also writes out (the new residual);
    NORM: then rms_norm(.) * nw.
    SCALE: an fp8 W's scales, as in _gemv_kernel (2: GROUP divides BLOCK_K; SHARED: they scale x)."""
    dtype = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_k = offs_n < N, offs_k < K
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)
    if SCALE == 1:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    elif SCALE == 2 and SHARED:  # the program's rows share their scales: x takes them, once for every row
        s = tl.load(s_ptr + pid * BLOCK_N * stride_s + offs_k // GROUP, mask=mask_k, other=0.0)
    elif SCALE == 2:
        NG: tl.constexpr = BLOCK_K // GROUP
        offs_g = tl.arange(0, NG)
        s = tl.load(s_ptr + offs_n[:, None] * stride_s + offs_g[None, :],
                    mask=mask_n[:, None] & (offs_g < tl.cdiv(K, GROUP))[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
    if GATED:
        x = activation.silu_mul(x, tl.load(x_ptr + K + offs_k, mask=mask_k, other=0.0), dtype)
    if ADD:
        x = (x.to(tl.float32) + tl.load(res_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)).to(dtype)
        if pid == 0:
            tl.store(res_out_ptr + offs_k, x, mask=mask_k)
    if NORM:
        x = norm_kernels.rms_normed(x, nw, K, eps, dtype)
    if SCALE == 2 and SHARED:
        x = x.to(tl.float32) * s
    prods = w.to(tl.float32) * x.to(tl.float32)[None, :]
    if SCALE == 2 and not SHARED:
        acc = tl.sum(tl.sum(tl.reshape(prods, [BLOCK_N, NG, GROUP]), 2) * s, 1)
    else:
        acc = tl.sum(prods, 1)
    if SCALE == 1:
        acc *= s
    if HAS_BIAS:
        acc += b
    tl.store(y_ptr + offs_n, acc.to(dtype), mask=mask_n)


def row_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the one-row kernel: a [BLOCK_N, K] slice of at most 16k elements (32
    registers a thread at 8 warps; for an fp8 W, 32k measured no faster: docs/quantization.md)."""
    block_k = triton.next_power_of_2(k)
    return max(1, min(16, 16384 // block_k)), block_k, 8


def swapped(m: int, n: int, k: int, device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16) -> bool:
    """2-16 rows of a 16-bit model as y^T = W x^T on Hopper (wgmma; tuned on Hopper only; a float32 tile would
    overflow shared memory) where the 64-row programs still cover half the SMs, or K is long enough to split
    (SWAP_MIN_K); never for the LM head. At 16 rows this is faster or even for Qwen3-0.6B's gate_up, down and o_proj
    and for every Qwen3-8B layer; Qwen3-0.6B's qkv (64 programs, K 1,024) is faster unswapped and stays so
    (docs/kernels.md)."""
    device = device or torch.device("cpu")
    programs = triton.cdiv(n, SWAP_TILE[0])
    return (1 < m and n < 65536 and dtype.itemsize == 2 and _has_wgmma(device)
            and (2 * programs > sm_count(device) or k >= SWAP_MIN_K))


@functools.lru_cache
def _has_wgmma(device: torch.device) -> bool:
    """Hopper (sm_90; Blackwell has no wgmma, and less shared memory on some parts); off-GPU (the interpreter's
    tests) as Hopper."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9


def gemv_config(m: int, n: int, k: int, swap: bool = False, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest on Hopper, for the Qwen3-0.6B shapes, of the tiles
    benchmarks/small_gemm.py --sweep (--swap) tries; swap: the swapped product's (swapped()). One row of an fp8 W
    (itemsize 1; Qwen3-8B's down projection, K 12,288) steps twice as far along K: the same bytes a step (block-scaled
    weights then step one block, unless each program's rows share their scales: _general)."""
    if m == 1:
        return 8, 512 * 2 // itemsize if itemsize <= 2 else 512, 4, 3
    if swap:
        return SWAP_TILE
    if n >= 65536:  # the LM head: long rows of programs
        return 64, 256, 4, 3
    return (16, 512, 4, 3) if k >= 2048 else (32, 256, 4, 3)


def k_splits(k: int, want: int, block_k: int) -> tuple[int, int]:
    """(splits, K per split): at most `want` runs of whole BLOCK_K tiles, none of them empty."""
    per_split = triton.cdiv(triton.cdiv(k, max(want, 1)), block_k) * block_k
    return triton.cdiv(k, per_split), per_split


def gemv_split_k(m: int, n: int, k: int, block_n: int, block_k: int, device: torch.device, swap: bool = False) -> int:
    """K-splits of the general kernel where its columns leave most SMs without a second program, such as o_proj of
    Qwen3-0.6B at 16 rows (1,024 columns, 64 programs of 16), split in 4 (a gain that depends on the machine:
    docs/kernels.md). With two programs a SM already, splitting loses (its qkv, 128 programs). The swapped product
    splits less: its o_proj and down (16 programs of 64 columns) in 4."""
    programs = triton.cdiv(n, block_n)
    if m == 1 or 2 * programs > sm_count(device):
        return 1
    if swap:  # up to half the SMs, no further: past that, splits do not pay for Qwen3-8B's o_proj and down
        # (64 programs each at 16 rows)
        return k_splits(k, min(MAX_SPLIT_K, max(1, sm_count(device) // 2 // programs)), block_k)[0]
    return k_splits(k, min(MAX_SPLIT_K, 2 * sm_count(device) // programs), block_k)[0]


class WeightScale(NamedTuple):
    """An fp8 weight's float32 scales: `scales` [N] (one per row, group None) or [N, groups], one per row and
    `group` columns (a power of two). rows: every aligned run of this many rows (a power of two) has the same
    scales (a checkpoint's 128-row blocks: shared_rows()); a one-row product then scales x per group, once for a
    program's rows, instead of each product per group (Qwen's FP8 checkpoints at batch 1: docs/quantization.md)."""
    scales: torch.Tensor
    group: int | None
    rows: int = 1


def shared_rows(scales: torch.Tensor, most: int = 128) -> int:
    """WeightScale.rows for [N, groups] scales: the longest aligned run of rows, a power of two up to `most`, over
    which they do not change (1 for per-row scales). Compares on the scales' device: call it at load, not in a
    captured graph."""
    if scales.dim() != 2:
        return 1
    index = torch.arange(scales.shape[0], device=scales.device)
    run = most
    while run > 1 and not torch.equal(scales, scales[index // run * run]):
        run //= 2
    return run


@dataclass
class NormedRows:
    """The input of a linear layer with the RMSNorm before it folded in (gemv's add_norm gives it, gemv's normed
    takes it): x = h * the norm's weight, rounded, and h's rows' sums of squares in `parts` partial sums (float32
    [parts, MAX_ROWS] in a scratch buffer shared by every layer: valid until the next add_norm launch)."""
    x: torch.Tensor
    sumsq: torch.Tensor
    parts: int
    eps: float


def _check(ok: bool, what: str, **shapes):
    if not ok:
        raise ValueError(f"gemv: {what}; got " + ", ".join(f"{k} {tuple(v.shape) if isinstance(v, torch.Tensor) else v}"
                                                     for k, v in shapes.items()))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, ...] | None = None, row_kernel: bool | None = None, pdl: bool | None = None,
         scale: "WeightScale | None" = None):
    """F.linear(x, weight, bias) for x [M, K], M <= MAX_ROWS, both unit-stride along K. One row up to ROW_MAX_K
    takes the one-row kernel (under PDL where the GPU has it), 2-16 rows the general kernel. scale (one row): weight
    is fp8 and this its scales (the product is x @ dequantized(weight)^T). For benchmarks and tests: config (BLOCK_N,
    BLOCK_K, num_warps, num_stages[, K-splits[, swapped]]) picks the general kernel's tile (K-splits 0: the default
    count); row_kernel and pdl force those choices."""
    m, k = x.shape
    _check(m <= MAX_ROWS and weight.stride(1) == 1 and x.stride(1) == 1 and weight.shape[1] == k
           and (not row_kernel or m == 1), "x [1-16, K] and weight [N, K], unit stride along K (row_kernel: one row)",
           x=x, weight=weight)
    _check(scale is None or m == 1, "an fp8 weight (scale) takes one row of x; 2-16 rows take fp8_gemm.w8a16", x=x)
    if row_kernel if row_kernel is not None else (m == 1 and k <= ROW_MAX_K and config is None):
        return _row(x, weight, bias, pdl=pdl, scale=scale)
    return _general(x, weight, bias, config, scale=scale)


def gemv_folded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
                gated: bool = False, pdl: bool | None = None, scale: "WeightScale | None" = None):
    """One row, with the op before the layer folded into the one-row kernel (run as its own kernel first where K
    exceeds ROW_MAX_K): gated, x is [1, 2K] and the layer reads silu_and_mul(x); norm=(weight, eps), the layer reads
    rms_norm(x), or with a residual rms_norm(x + residual) and returns (y, x + residual)."""
    k = weight.shape[1]
    _check(x.shape[0] == 1 and x.shape[1] == (2 * k if gated else k) and x.stride(1) == 1
           and (residual is None or (norm is not None and residual.shape == x.shape)),
           "one row of K (gated: 2K) and a residual only with a norm", x=x, weight=weight,
           residual=residual if residual is not None else "none")
    if k <= ROW_MAX_K:
        return _row(x, weight, bias, pdl=pdl, gated=gated, norm=norm, residual=residual, scale=scale)
    new_residual = None
    if gated:
        x = activation.silu_and_mul(x)
    if residual is not None:
        x, new_residual = norm_kernels.add_rms_norm(x, residual, *norm)
    elif norm is not None:
        x = norm_kernels.rms_norm(x, *norm)
    y = _general(x, weight, bias, scale=scale)
    return (y, new_residual) if residual is not None else y


def gemv_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, config: tuple[int, ...] | None = None):
    """2-16 rows, the first half of an RMSNorm folded between two layers: returns (h, NormedRows) with h = x @ W^T
    (+ bias) + residual, the new residual, and the next layer's input with the norm's weight applied (gemv_normed
    takes it)."""
    m, n = x.shape[0], weight.shape[0]
    _check(1 < m <= MAX_ROWS and residual.shape == (m, n) and residual.is_contiguous() and norm_weight.shape == (n,),
           "2-16 rows, a contiguous residual [M, N] and a norm weight [N]", x=x, weight=weight, residual=residual,
           norm_weight=norm_weight)
    return _general(x, weight, bias, config, add_norm=(residual, norm_weight, eps))


def gemv_normed(rows: "NormedRows", weight: torch.Tensor, bias: torch.Tensor | None = None,
                gated_out: bool = False, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """The layer after gemv_add_norm: rms_norm(h) @ W^T (+ bias) from its NormedRows. gated_out: weight is an MLP's
    [gate; up] and the layer returns silu_and_mul of its output, [M, N/2], from the kernel's epilogue."""
    _check(1 < rows.x.shape[0] <= MAX_ROWS and (not gated_out or weight.shape[0] % 2 == 0),
           "2-16 rows (gated_out: an even N)", x=rows.x, weight=weight)
    return _general(rows.x, weight, bias, config, normed=rows, gated_out=gated_out)


def _scale_args(scale: "WeightScale | None", y: torch.Tensor, row_block_k: int | None = None) -> tuple:
    """(s_ptr, stride_s, SCALE, GROUP) kernel arguments for `scale`. The one-row kernel (row_block_k: its BLOCK_K,
    the whole row) takes a group no wider than that (one group: the row); the general kernel the group itself."""
    if scale is None:
        return y, 0, 0, 1
    if scale.group is None:
        return scale.scales, 0, 1, 1
    group = scale.group if row_block_k is None else min(scale.group, row_block_k)
    return scale.scales, scale.scales.stride(0), 2, group


def _shares(scale: "WeightScale | None", m: int, block_n: int) -> bool:
    """One row, group scales, and each program's block_n rows inside one run of rows with the same scales."""
    return m == 1 and scale is not None and scale.group is not None and scale.rows >= block_n


def _row(x, weight, bias, pdl=None, gated=False, norm=None, residual=None, scale=None):
    n, k = weight.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x.device) if pdl is None else pdl
    res_out = torch.empty_like(residual) if residual is not None else y
    residual = residual.contiguous() if residual is not None else x
    block_n, block_k, warps = row_config(n, k)
    s_ptr, stride_s, scaled, group = _scale_args(scale, y, block_k)
    _gemv_row_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, residual, norm[0] if norm is not None else weight,
        res_out, s_ptr, n, k, weight.stride(0), stride_s, norm[1] if norm is not None else 0.0, BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, GATED=gated, NORM=norm is not None, ADD=res_out is not y,
        PDL=pdl, SCALE=scaled, GROUP=group, SHARED=_shares(scale, 1, block_n), num_warps=warps, **pdl_launch(pdl))
    return (y, res_out) if res_out is not y else y


def _general(x, weight, bias, config=None, add_norm=None, normed=None, gated_out=False, scale=None):
    m, k = x.shape
    _check(m == 1 or weight.dtype == x.dtype, "2-16 rows take a weight of x's dtype (an fp8 W: fp8_gemm.w8a16)",
           x=x, weight=weight)
    n = weight.shape[0]
    y = torch.empty(m, n // 2 if gated_out else n, dtype=x.dtype, device=x.device)
    if config is None:
        swap = swapped(m, n, k, x.device, x.dtype)
        block_n, block_k, warps, stages, split = *gemv_config(m, n, k, swap, weight.element_size()), 0
    else:
        block_n, block_k, warps, stages, split, swap = (*config, 0, False)[:6]
        swap = swap and m > 1
    shared = _shares(scale, m, block_n)
    if scale is not None and scale.group is not None and not shared:
        block_k = min(block_k, scale.group)  # (a step's products take one group's scale)
    split_k, k_per_split = k_splits(k, split or gemv_split_k(m, n, k, block_n, block_k, x.device, swap), block_k)
    block_m = 1 if m == 1 else 16
    if split_k > 1:
        part = scratch(x.device, "gemv_partials", split_k * block_m * n, torch.float32)
        counters = split_counters(x.device, triton.cdiv(n, block_n))
    else:
        part, counters = y, y  # unused
    res, xn, norm_w, sumsq, parts, eps = y, y, y, y, 1, 0.0  # (unused without a fold)
    if add_norm is not None:
        res, norm_w, eps = add_norm
        xn = torch.empty_like(y)
        parts = triton.cdiv(n, block_n)
        sumsq = scratch(x.device, "gemv_sumsq", parts * block_m, torch.float32)
    elif normed is not None:
        sumsq, parts, eps = normed.sumsq, normed.parts, normed.eps
    s_ptr, stride_s, scaled, group = _scale_args(scale, y)
    pdl = pdl_enabled(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, bias if bias is not None else weight, y, part, counters, m, n, k, k_per_split, x.stride(0),
        weight.stride(0), y.stride(0), res, xn, norm_w, sumsq, parts, eps, s_ptr, stride_s, BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN=n % block_n == 0 and k % block_k == 0, SPLIT=split_k > 1,
        SWAP=swap, PDL=pdl, ADD_NORM=add_norm is not None, SCALE_ROWS=normed is not None,
        PARTS=triton.next_power_of_2(parts), GATED_OUT=gated_out, SCALE=scaled, GROUP=group, SHARED=shared,
        num_warps=warps, num_stages=stages,
        **pdl_launch(pdl))
    if add_norm is not None:
        return y, NormedRows(xn, sumsq, parts, eps)
    return y
