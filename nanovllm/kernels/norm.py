"""RMSNorm over the last dimension, optionally with the residual add first, one program per row: the same
arithmetic and roundings as layers/layernorm.py (the reference): the sum x + residual is rounded to the input's
type, normalized in float32, rounded, then scaled by the weight. Gemma's norm (OFFSET, offset_rms_norm) scales by
(1 + weight) in float32 and rounds once, at the end."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.hopper.pdl import pdl_enabled, pdl_launch


@triton.jit
def rms_normed(x, w, n, eps, dtype: tl.constexpr):
    """rms_norm(x) * w over a whole row in registers (n real elements, the rest zeros), rounded as the reference:
    normalized in float32, rounded, then scaled; also the one-row linear kernel's (gemv.py)."""
    xf = x.to(tl.float32)
    return ((xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)).to(dtype) * w).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, n, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, OFFSET: tl.constexpr = False):
    if PDL:  # launched early (hopper/pdl.py): wait for the kernel before; the next linear layer's kernel may then
        tl.extra.cuda.gdc_wait()  # start loading its weights
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if OFFSET:
        xf = x.to(tl.float32)
        y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps) * (1.0 + w.to(tl.float32))
    else:
        y = rms_normed(x, w, n, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: bool = False):
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual.reshape(-1, n) if residual is not None else x
    if res.stride(-1) != 1:
        res = res.contiguous()
    if rows:
        block, pdl = triton.next_power_of_2(n), pdl_enabled(x.device)
        _rms_norm_kernel[(rows,)](x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0),
                                  res_out.stride(0), n, eps, ADD=residual is not None, BLOCK=block,
                                  PDL=pdl, OFFSET=offset, num_warps=min(8, max(1, block // 256)),
                                  **pdl_launch(pdl))
    return out.view(shape), res_out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual)."""
    return _launch(x, residual, weight, eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalized x times (1 + weight), in float32, rounded once (layernorm.offset_rms_norm)."""
    return _launch(x, None, weight, eps, offset=True)[0]
