"""RMSNorm (with and without the residual add, and Gemma's (1 + weight) norm), SiLU-and-mul and Gemma's
gelu-tanh-and-mul: the Triton kernels against layers/layernorm.py and layers/activation.py. Interpreted on CPU;
compiled on a GPU (marked gpu)."""
import pytest
import torch

from tests.kernels.helpers import DTYPES, assert_close


def check_silu_and_mul(tokens: int, inter: int, dtype, device="cpu"):
    from nanovllm.kernels.activation import silu_and_mul
    from nanovllm.layers.activation import silu_and_mul as reference_silu
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device) * 3
    assert_close(silu_and_mul(x), reference_silu(x.float()).to(dtype), dtype, f"silu_and_mul {tokens}x{inter}")


def check_gelu_and_mul(tokens: int, inter: int, dtype, device="cpu"):
    from nanovllm.kernels.activation import gelu_tanh_and_mul
    from nanovllm.layers.activation import GeluTanhAndMul
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device) * 3
    reference = GeluTanhAndMul()(x.float().cpu()).to(device=device, dtype=dtype)  # (the torch path: CPU)
    assert_close(gelu_tanh_and_mul(x), reference, dtype, f"gelu_tanh_and_mul {tokens}x{inter}")


def check_offset_rms_norm(rows: int, width: int, dtype, device="cpu"):
    """Gemma's norm, normalized x times (1 + weight) in float32, against layers/layernorm.py's; weights near 0 and
    near -1 (a kernel scaling by the weight alone, or by 1 + a rounded weight, misses)."""
    from nanovllm.kernels import norm
    from nanovllm.layers import layernorm
    x = torch.randn(rows, width, dtype=dtype, device=device) * 2
    weight = torch.rand(width, dtype=dtype, device=device) - 0.5
    assert_close(norm.offset_rms_norm(x, weight, 1e-6), layernorm.offset_rms_norm(x, weight, 1e-6), dtype,
                 "offset_rms_norm")


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


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norm_and_gelu_kernels(dtype):
    check_offset_rms_norm(5, 1000, dtype)
    check_gelu_and_mul(5, 1500, dtype)


@pytest.mark.interpreter
def test_gelu_kernel_negative_gates_keep_their_digits():
    # gelu-tanh where 1 + tanh(u) is small (gates -8 to -1): float32 within 1e-5 of float64, relative (a form
    # computing 1 + tanh from a tanh near -1 loses about three digits there)
    import math

    from nanovllm.kernels.activation import gelu_tanh_and_mul
    gate = torch.linspace(-8, -1, 64, dtype=torch.float64)
    # (0.5 x (1 + tanh(u)) written as x / (1 + exp(-2u)): even float64 cancels to 0 the other way at -8)
    want = gate / (1 + torch.exp(-2 * math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    got = gelu_tanh_and_mul(torch.cat([gate, torch.ones(64, dtype=torch.float64)]).float()[None])[0].double()
    assert ((got - want).abs() / want.abs()).max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300, 16384])
def test_gpu_silu_and_norm(tokens):
    check_silu_and_mul(tokens, 3072, torch.bfloat16, device="cuda")
    check_rms_norm(tokens, 1024, torch.bfloat16, device="cuda")
    check_gelu_and_mul(tokens, 3072, torch.bfloat16, device="cuda")
    check_offset_rms_norm(tokens, 1152, torch.bfloat16, device="cuda")
