"""Where the speed comes in: the layers pick their CUDA kernels by the tensors' device (the CPU runs the torch
functions, which are the kernels' references), and the fused decode step is installed only for models it takes."""
from types import SimpleNamespace

import pytest
import torch

from nanovllm.models.decoder import DecoderFlags, DecoderForCausalLM, MoeSpec


def test_cpu_linear_of_a_few_rows_equals_f_linear():
    # CPU, 2-64 float32 rows: (W @ x^T)^T (a faster MKL path); other shapes F.linear. Same values, contiguous rows.
    import torch.nn.functional as F

    from nanovllm.layers import linear as linear_module
    torch.manual_seed(0)
    w, b = torch.randn(96, 40), torch.randn(96)
    calls = []
    mm = torch.mm
    for rows in (1, 2, 7, linear_module.CPU_TRANSPOSED_ROWS, linear_module.CPU_TRANSPOSED_ROWS + 1):
        x = torch.randn(rows, 40)
        for bias in (None, b):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(torch, "mm", lambda *a, rows=rows: calls.append(rows) or mm(*a))
                y = linear_module.linear(x, w, bias)
            assert y.shape == (rows, 96) and y.is_contiguous()
            torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert sorted(set(calls)) == [2, 7, linear_module.CPU_TRANSPOSED_ROWS]  # (addmm when there is a bias)


def test_a_cpu_model_imports_no_triton():
    import subprocess
    import sys
    code = ("import sys, torch; from nanovllm.layers.layernorm import RMSNorm; "
            "from nanovllm.layers.activation import SiluAndMul; from nanovllm.sampling.sampler import Sampler; "
            "RMSNorm(8)(torch.randn(2, 8)); SiluAndMul()(torch.randn(2, 8)); Sampler(16); "
            "assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_sampler_picks_its_kernels_by_device():
    from nanovllm.sampling.sampler import Sampler, race_in_log_space
    cpu = Sampler(16)
    assert cpu.race_fn is race_in_log_space and not cpu.keyed and not cpu.penalties.fused
    forced = Sampler(16, triton=True)  # (the interpreter's tests run the kernels on the CPU so)
    from nanovllm.kernels.race import race
    assert forced.race_fn is race and forced.keyed and forced.penalties.fused


def _config(**extra):
    return SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=96, rms_norm_eps=1e-6, vocab_size=50, max_position_embeddings=64,
                           num_hidden_layers=2, **extra)


def test_the_fused_step_takes_plain_16_bit_decoders_on_cuda_only():
    from nanovllm.kernels.fused_step import FusedDecodeStep
    cuda = torch.device("cuda")  # (only its type is read: no GPU needed)
    model = DecoderForCausalLM(_config(), DecoderFlags()).to(torch.bfloat16)
    step = FusedDecodeStep.build(model, torch.bfloat16, cuda)
    assert step is not None and [r for r in range(1, 40) if step.accepts(r)] == [1, *range(9, 17)]
    assert FusedDecodeStep.build(model, torch.bfloat16, torch.device("cpu")) is None
    assert FusedDecodeStep.build(model.float(), torch.float32, cuda) is None
    moe = DecoderForCausalLM(_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                             DecoderFlags(moe=MoeSpec(4, 2, 32, True))).to(torch.bfloat16)
    assert FusedDecodeStep.build(moe, torch.bfloat16, cuda) is None
    # a linear layer that is not one of the plain ones (an adapter, a quantized weight) makes it decline
    from nanovllm.layers.linear import RowParallelLinear

    class Adapted(RowParallelLinear):
        pass
    model.model.layers[1].mlp.down_proj.__class__ = Adapted
    assert FusedDecodeStep.build(model, torch.bfloat16, cuda) is None
