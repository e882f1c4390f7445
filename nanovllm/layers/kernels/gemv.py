"""Small-batch linear layers: y [M, N] = x [M, K] @ W [N, K]^T (+ bias) for M <= MAX_ROWS (decode at small batch).

At batch 1-16 a linear layer is a read of W. Each program owns BLOCK_N rows of W (output columns) and streams them
once, with every row of x: one row multiplies and adds on the CUDA cores, 2-16 rows go through one 16-row tl.dot.
On one H200 (benchmarks/small_gemm.py, docs/benchmarks.md) this took a batch-1 decode step's linear layers (Qwen3-0.6B
shapes) from 994 to 743 us; cuBLAS picks slow kernels for some of these shapes (o_proj, 2048 -> 1024: 13.3 us against
5-6 here). Splitting K across programs (atomic adds) was measured too and never won.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # one row: products summed over K once, at the end
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if EVEN:  # no masks on W: its loads vectorize
            w = tl.load(w_rows + offs_k[None, :])  # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if BLOCK_M == 1:
            acc1 += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if BLOCK_M == 1:
        acc = tl.sum(acc1, 1)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the best measured on an H200 for the Qwen3-0.6B shapes
    (benchmarks/small_gemm.py --sweep)."""
    if m == 1:
        return 8, 512, 4, 3
    if n >= 65536:  # the LM head: long rows of programs
        return 64, 256, 4, 3
    return (16, 512, 4, 3) if k >= 2048 else (32, 256, 4, 3)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], M <= MAX_ROWS, both with unit stride along K."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.stride(1) == 1 and x.stride(1) == 1
    block_n, block_k, warps, stages = config or gemv_config(m, n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN=n % block_n == 0 and k % block_k == 0, num_warps=warps, num_stages=stages)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through gemv for a few 16-bit rows (a decode step at small batch), else cuBLAS."""
    if (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1 and weight.stride(1) == 1):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
