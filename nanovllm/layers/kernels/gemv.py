"""Small-batch linear layers: y [M, N] = x [M, K] @ W [N, K]^T (+ bias) for M <= MAX_ROWS (decode at small batch).

At batch 1-16 a linear layer is a read of W. Each program owns BLOCK_N rows of W (output columns) and streams them
once, with every row of x: one row multiplies and adds on the CUDA cores, 2-16 rows go through one 16-row tl.dot.
On one H200 (benchmarks/small_gemm.py, docs/benchmarks.md) this took a batch-1 decode step's linear layers (Qwen3-0.6B
shapes) from 994 to 743 us; cuBLAS picks slow kernels for some of these shapes (o_proj, 2048 -> 1024: 13.3 us against
5-6 here). Splitting K across programs (atomic adds) was measured too and never won.

One row (batch-1 decode, K up to ROW_MAX_K) has its own kernel, which loads each program's whole slice of W at
once, folds in the op before the layer (RMSNorm + residual add, SiLU-and-mul: the decoder's forward_small) and
starts early under programmatic dependent launch (kernels/pdl.py). `benchmarks/small_gemm.py --chain` on an H200,
a batch-1 step's linear part: 737 us with the general kernel, 645 with the one-row kernel, 463 with the folds and
PDL. (Folded into the general kernel, the norm made 2-16 rows 2-3x slower, in two passes over x or in one: each
program re-reads the rows of x; branches gemv-fold and gemv-fold-rows, docs/benchmarks.md.)
"""
import os

import torch
import triton
import triton.language as tl

from nanovllm.layers.kernels import activation
from nanovllm.layers.kernels import norm as norm_kernels
from nanovllm.layers.kernels.pdl import pdl_enabled, prefetch_rows_l2

MAX_ROWS = 16  # the rows of one tl.dot (layers/linear.py's SMALL_BATCH_ROWS)
_SQ_STRIDE = tl.constexpr(MAX_ROWS)  # a row of the squares' partial sums (ADD_OUT / NORM_IN)

# the general kernel under PDL: "late" lets the next kernel launch after this one's loop, "early" as it starts,
# "off" not at all (NANOVLLM_GEMV_PDL, to compare on a GPU)
GENERAL_PDL = os.environ.get("NANOVLLM_GEMV_PDL", "late")

ROW_MAX_K = 4096  # one row of x: each program holds its whole [BLOCK_N, K] slice of W in registers up to this K


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, sq_in_ptr, sq_out_ptr, nw_ptr, M, N, K, stride_xm,
                 stride_wn, stride_ym, stride_rm, parts_in, eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN: tl.constexpr, NORM_IN: tl.constexpr, SILU_OUT: tl.constexpr, ADD_OUT: tl.constexpr,
                 PDL: tl.constexpr, TRIGGER_EARLY: tl.constexpr):
    """The general kernel, with the ops around a decoder's linear layers at 2-16 rows folded in where they cost no
    extra pass over x (a norm recomputed per program did: the module docstring):
    NORM_IN: x is read as rms_norm(x) * nw, with each row's sum of squares added up from the partial sums the
    kernel that wrote x left in sq_in [parts_in, MAX_ROWS] (ADD_OUT below);
    SILU_OUT: W is [gate; up] (2N rows), y = silu(x @ gate^T) * (x @ up^T) (the MLP's gate_up projection);
    ADD_OUT: y = x @ W^T + residual (the new residual stream), and this program's sums of y^2 over its columns go
    to sq_out [programs, MAX_ROWS] for the next layer's NORM_IN.
    Roundings as the separate kernels (norm.py, activation.py): only the order of the squares' sum differs.
    PDL (launched with launch_pdl): the program's rows of W go to L2 before gdc_wait (kernels/pdl.py), then the
    loop reads them from there; it lets the next kernel launch as it starts (TRIGGER_EARLY) or after its loop."""
    dtype = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    if PDL:
        if TRIGGER_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.minimum(N - pid * BLOCK_N, BLOCK_N)
        row0 = w_ptr + pid.to(tl.int64) * BLOCK_N * stride_wn
        prefetch_rows_l2(row0, rows, stride_wn * 2, K * 2)  # (16-bit W)
        if SILU_OUT:
            prefetch_rows_l2(row0 + N.to(tl.int64) * stride_wn, rows, stride_wn * 2, K * 2)
        tl.extra.cuda.gdc_wait()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + N.to(tl.int64) * stride_wn  # SILU_OUT: the up rows, N rows below the gate rows
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    if NORM_IN:  # the rows' 1 / rms from the writer's partial sums, in a fixed order (the same bits every run)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for p0 in range(0, parts_in, 64):
            offs_p = p0 + tl.arange(0, 64)
            sq += tl.sum(tl.load(sq_in_ptr + offs_p[:, None] * _SQ_STRIDE + offs_m[None, :],
                                 mask=(offs_p < parts_in)[:, None], other=0.0), 0)
        rstd = tl.rsqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # one row: products summed over K once, at the end
    acc1_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if EVEN:  # no masks on W: its loads vectorize
            w = tl.load(w_rows + offs_k[None, :])  # [BLOCK_N, BLOCK_K]
            if SILU_OUT:
                u = tl.load(u_rows + offs_k[None, :])
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            if SILU_OUT:
                u = tl.load(u_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if NORM_IN:  # norm.rms_normed's roundings: normalized in float32, rounded, scaled, rounded
            nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)
            x = ((x.to(tl.float32) * rstd[:, None]).to(dtype) * nw[None, :]).to(dtype)
        if BLOCK_M == 1:
            acc1 += w.to(tl.float32) * x.to(tl.float32)
            if SILU_OUT:
                acc1_u += u.to(tl.float32) * x.to(tl.float32)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
            if SILU_OUT:
                acc_u = tl.dot(x, tl.trans(u), acc_u)
    if PDL and not TRIGGER_EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if BLOCK_M == 1:
        acc = tl.sum(acc1, 1)[None, :]
        if SILU_OUT:
            acc_u = tl.sum(acc1_u, 1)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if SILU_OUT:
            acc_u += tl.load(b_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    if SILU_OUT:  # rounded as the separate kernels round: the layer's outputs, then silu_mul's
        y = activation.silu_mul(y, acc_u.to(dtype), dtype)
    mask = mask_m[:, None] & mask_n[None, :]
    if ADD_OUT:
        res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
        yf = tl.where(mask, y.to(tl.float32), 0.0)
        tl.store(sq_out_ptr + pid * _SQ_STRIDE + offs_m, tl.sum(yf * yf, 1))  # padding rows: zeros
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=mask)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, nw_ptr, res_out_ptr, N, K, stride_wn, eps,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                     NORM: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    """One row of x. Each program loads its whole [BLOCK_N, K] slice of W at once: no kernel writes W, so with
    programmatic dependent launch (PDL) those loads may start while the kernel before is finishing; gdc_wait then
    waits for it before x is read or anything written. The whole row of x is in registers too, so the op before
    the layer folds in at no extra pass (the roundings of kernels/activation.py and norm.py):
    GATED: x is [gate, up] (2K wide) and the layer reads silu(gate) * up;
    ADD: the layer reads x + residual, which program 0 also writes out (the new residual);
    NORM: then rms_norm(.) * nw."""
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
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    if HAS_BIAS:
        acc += b
    tl.store(y_ptr + offs_n, acc.to(dtype), mask=mask_n)


def row_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the one-row kernel: a [BLOCK_N, K] slice of at most 16k elements (32
    registers a thread at 8 warps)."""
    block_k = triton.next_power_of_2(k)
    return max(1, min(16, 16384 // block_k)), block_k, 8


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the best measured on an H200 for the Qwen3-0.6B shapes
    (benchmarks/small_gemm.py --sweep)."""
    if m == 1:
        return 8, 512, 4, 3
    if n >= 65536:  # the LM head: long rows of programs
        return 64, 256, 4, 3
    return (16, 512, 4, 3) if k >= 2048 else (32, 256, 4, 3)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None, row_kernel: bool | None = None,
         pdl: bool | None = None, gated: bool = False, norm: tuple[torch.Tensor, float] | None = None,
         residual: torch.Tensor | None = None):
    """F.linear(x, weight, bias) for x [M, K], M <= MAX_ROWS, both with unit stride along K. One row up to
    ROW_MAX_K takes the one-row kernel, with PDL where the GPU has it. The op before the layer, folded into the
    one-row kernel (else run as its own kernel first): gated, x is [M, 2K] and the layer reads silu_and_mul(x);
    norm=(weight, eps), the layer reads rms_norm(x) or, with a residual, rms_norm(x + residual), and returns
    (y, x + residual). Benchmarks: config picks the general kernel's tile, row_kernel and pdl force choices.
    (gemv_rows below: the general kernel's folds for 2-16 rows.)"""
    m, width = x.shape
    n, k = weight.shape
    if not (m <= MAX_ROWS and weight.stride(1) == 1 and x.stride(1) == 1 and width == (2 * k if gated else k)
            and (residual is None or (norm is not None and residual.shape == x.shape))
            and (not row_kernel or m == 1)):  # the one-row kernel reads row 0 only
        raise ValueError(f"gemv: x {tuple(x.shape)} (strides {x.stride()}), weight {tuple(weight.shape)}, gated "
                         f"{gated}, residual {None if residual is None else tuple(residual.shape)}, row_kernel "
                         f"{row_kernel} do not fit")
    if row_kernel is None:
        row_kernel = m == 1 and k <= ROW_MAX_K and config is None
    if not row_kernel and (gated or norm is not None):  # the op as its own kernel, then the layer
        new_residual = None
        if gated:
            x = activation.silu_and_mul(x)
        if residual is not None:
            x, new_residual = norm_kernels.add_rms_norm(x, residual, *norm)
        elif norm is not None:
            x = norm_kernels.rms_norm(x, *norm)
        y = gemv(x, weight, bias, config, row_kernel=False)
        return (y, new_residual) if residual is not None else y
    if not row_kernel:
        return _general(x, weight, bias, config)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x.device) if pdl is None else pdl
    res_out = torch.empty_like(residual) if residual is not None else y
    residual = residual.contiguous() if residual is not None else x
    block_n, block_k, warps = row_config(n, k)
    _gemv_row_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, residual, norm[0] if norm is not None else weight,
        res_out, n, k, weight.stride(0), norm[1] if norm is not None else 0.0, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, GATED=gated, NORM=norm is not None, ADD=res_out is not y, PDL=pdl,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    return (y, res_out) if res_out is not y else y


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              norm: tuple[torch.Tensor, float, torch.Tensor] | None = None, silu_out: bool = False,
              residual: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None):
    """The general kernel with a decoder's ops folded in (2-16 rows; DecoderModel.forward_rows):
    norm=(weight, eps, squares): x is read as rms_norm(x) * weight, `squares` being what a residual call wrote;
    silu_out: weight is [gate; up] and the result silu(x @ gate^T) * (x @ up^T), [M, N / 2];
    residual: returns (x @ W^T + residual, squares), squares [programs, MAX_ROWS] float32 for the next norm."""
    m, k = x.shape
    n = weight.shape[0]
    if not (m <= MAX_ROWS and weight.stride(1) == 1 and x.stride(1) == 1 and weight.shape[1] == k
            and (not silu_out or n % 2 == 0) and (residual is None or residual.shape == (m, n))
            and (norm is None or (norm[0].shape == (k,) and norm[2].dtype == torch.float32
                                  and norm[2].dim() == 2 and norm[2].shape[1] == MAX_ROWS))):
        raise ValueError(f"gemv_rows: x {tuple(x.shape)} (strides {x.stride()}), weight {tuple(weight.shape)}, "
                         f"silu_out {silu_out}, residual {None if residual is None else tuple(residual.shape)}, "
                         f"norm weight {None if norm is None else tuple(norm[0].shape)} do not fit")
    return _general(x, weight, bias, config, norm, silu_out, residual)


def _general(x, weight, bias, config, norm=None, silu_out=False, residual=None):
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_out else weight.shape[0]
    block_n, block_k, warps, stages = config or gemv_config(m, weight.shape[0], k)
    if silu_out and config is None:  # two rows of W per output column: half the columns per program
        block_n = max(block_n // 2, 8 if m == 1 else 16)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = triton.cdiv(n, block_n)
    squares = torch.empty(grid, MAX_ROWS, dtype=torch.float32, device=x.device) if residual is not None else y
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    nw, eps, squares_in = norm if norm is not None else (weight, 0.0, y)
    # the bulk prefetch takes 16-byte aligned rows of a 16-bit W
    pdl = (pdl_enabled(x.device) and GENERAL_PDL != "off" and weight.element_size() == 2
           and weight.data_ptr() % 16 == 0 and weight.stride(0) % 8 == 0 and k % 8 == 0)
    _gemv_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, y, residual if residual is not None else y, squares_in,
        squares, nw, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else 0, squares_in.shape[0] if norm is not None else 0, eps,
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN=n % block_n == 0 and k % block_k == 0, NORM_IN=norm is not None, SILU_OUT=silu_out,
        ADD_OUT=residual is not None, PDL=pdl, TRIGGER_EARLY=GENERAL_PDL == "early", num_warps=warps,
        num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return (y, squares) if residual is not None else y
