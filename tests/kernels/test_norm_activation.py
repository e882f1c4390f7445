"""RMSNorm (with and without the residual add) and SiLU-and-mul: the Triton kernels against layers/layernorm.py and
layers/activation.py. Interpreted on CPU; compiled on a GPU (marked gpu)."""
import pytest
import torch

from tests.kernels.helpers import DTYPES, assert_close


def check_silu_and_mul(tokens: int, inter: int, dtype, device="cpu"):
    from nanovllm.kernels.activation import silu_and_mul
    from nanovllm.layers.activation import silu_and_mul as reference_silu
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device) * 3
    assert_close(silu_and_mul(x), reference_silu(x.float()).to(dtype), dtype, f"silu_and_mul {tokens}x{inter}")


def check_rms_norm(rows: int, width: int, dtype, device="cpu"):
    """The Triton norms against layers/layernorm.py, with and without the residual add."""
    from nanovllm.kernels import norm
    from nanovllm.layers import layernorm
    x, residual = (torch.randn(rows, width, dtype=dtype, device=device) * 2 for _ in range(2))
    weight = torch.rand(width, dtype=dtype, device=device) + 0.5
    assert_close(norm.rms_norm(x, weight, 1e-6), layernorm.rms_norm(x, weight, 1e-6), dtype, "rms_norm")
    out, res = norm.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_res = layernorm.add_rms_norm(x, residual, weight, 1e-6)
    assert_close(res, ref_res, dtype, "add_rms_norm residual")
    assert_close(out, ref_out, dtype, "add_rms_norm")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_kernel(dtype):
    check_rms_norm(5, 1000, dtype)  # a width that is no power of two


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_kernel(dtype):
    check_silu_and_mul(5, 1500, dtype)  # a partial last column block


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300, 16384])
def test_gpu_silu_and_norm(tokens):
    check_silu_and_mul(tokens, 3072, torch.bfloat16, device="cuda")
    check_rms_norm(tokens, 1024, torch.bfloat16, device="cuda")
