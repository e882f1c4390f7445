"""The 8-bit KV cache format: each token's K (and V) of each KV head is stored as float8 with one float32 scale,
amax(|x|) / the format's largest value. A per-token-per-head scale needs no calibration data and follows outliers
token by token (a per-layer scale would be set by the largest K anywhere); it costs 4 bytes per 128-element row,
3% of the fp8 cache. In the cache the scales of one block are laid out [kv_heads, block_size], so a kernel reads a
head's scales for consecutive tokens from consecutive addresses.

V is stored token-major: each block as [kv_heads, head_dim, block_size], so a head's consecutive tokens are
consecutive bytes (K keeps the 16-bit layout, [block_size, kv_heads, head_dim]). The decode kernel's p @ V takes V
as the matrix operand whose reduction runs over tokens; with 8-bit values Triton can only feed it from a
token-contiguous layout without byte-by-byte shuffles (with V stored like K the fp8 kernel spills registers and
reads well below the copy bandwidth: docs/kernels.md). Every consumer
indexes V as [blocks, block_size, kv_heads, head_dim] through its strides. The torch functions here are the
reference the Triton kernels are tested against."""
import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MIN_SCALE = 1e-12  # an all-zero row stores zeros, not NaN


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (float8 values [..., head_dim], float32 scales [...]) with x ~= values * scales."""
    fmax = torch.finfo(dtype).max
    scale = (x.float().abs().amax(-1) / fmax).clamp(min=MIN_SCALE)
    values = (x.float() / scale.unsqueeze(-1)).clamp(-fmax, fmax).to(dtype)
    return values, scale


def cache_layout(scale: torch.Tensor) -> torch.Tensor:
    """Row scales [..., block_size, kv_heads] (as quantize returns them) -> the cache's [..., kv_heads, block_size]."""
    return scale.transpose(-1, -2).contiguous()


def raw(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as bytes (indexing ops need not support float8 on every device); others as they are."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def token_major(v: torch.Tensor) -> torch.Tensor:
    """The same V values stored [blocks, kv_heads, head_dim, block_size], returned with the usual [blocks, block_size,
    kv_heads, head_dim] indexing (tests, benchmarks; the engine allocates its cache so, kv_cache.allocate)."""
    return raw(v).permute(0, 2, 3, 1).contiguous().view(v.dtype).permute(0, 3, 1, 2)


def dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 [..., head_dim] and float32 [...] -> float32 [..., head_dim]."""
    return values.float() * scale.unsqueeze(-1)
