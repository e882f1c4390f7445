"""The fused small ops (Triton kernels, torch.compile for the rest) are switched on only where asked (the CUDA
runner) and switch back."""
import pytest
import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul, silu_and_mul
from nanovllm.layers.compile import compiled, use_compiled_ops
from nanovllm.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary


def _model():
    return nn.ModuleList([RMSNorm(8), SiluAndMul(), RotaryEmbedding(8, 16, 10000.0)])


def test_switch_on_and_back():
    norm, act, rope = model = _model()
    assert (norm.norm_fn, norm.add_norm_fn, act.fn, rope.fn) == (rms_norm, add_rms_norm, silu_and_mul, apply_rotary)
    use_compiled_ops(model, True)
    from nanovllm.layers.kernels import activation
    from nanovllm.layers.kernels import norm as triton_norm
    assert norm.norm_fn is triton_norm.rms_norm and norm.add_norm_fn is triton_norm.add_rms_norm
    assert act.fn is activation.silu_and_mul and rope.fn is compiled(apply_rotary)
    use_compiled_ops(model, False)
    assert (norm.norm_fn, norm.add_norm_fn, act.fn, rope.fn) == (rms_norm, add_rms_norm, silu_and_mul, apply_rotary)


def test_switching_on_imports_no_dynamo():
    # torch.compile runs at the first call of a compiled function, not when layers switch: importing torch._dynamo
    # alone took seconds of start-up (fresh interpreter: other tests import it)
    import subprocess
    import sys
    code = ("import sys; from torch import nn; from nanovllm.layers.compile import use_compiled_ops; "
            "from nanovllm.layers.rotary_embedding import RotaryEmbedding; "
            "rope = RotaryEmbedding(8, 16, 10000.0); use_compiled_ops(nn.ModuleList([rope]), True); "
            "assert rope.fn.__name__ == 'apply_rotary' and 'torch._dynamo' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_sampler_race_switches():
    from nanovllm.layers.sampler import Sampler, race_in_log_space
    sampler = Sampler()
    assert sampler.race_fn is race_in_log_space
    assert not sampler.keyed and not sampler.penalties.fused  # CPU: a generator per seeded row, torch penalties
    use_compiled_ops(sampler, True)
    from nanovllm.layers.kernels.race import race
    assert sampler.race_fn is race and sampler.keyed and sampler.penalties.fused
    use_compiled_ops(sampler, False)
    assert sampler.race_fn is race_in_log_space and not sampler.keyed and not sampler.penalties.fused


def test_environment_switch_keeps_eager(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("NANOVLLM_COMPILE", "0")
    norm, act, rope = model = _model()
    use_compiled_ops(model, True)
    assert (norm.norm_fn, act.fn, rope.fn) == (rms_norm, silu_and_mul, apply_rotary)


def test_decoder_attention_fuses_norm_and_rope_when_compiled():
    """On CUDA the decoder's q/k norm + rotary become one Triton kernel; eager keeps the torch modules (the
    reference, and the CPU path). A head size whose half is no power of two keeps the torch path."""
    from transformers import Qwen3Config

    from nanovllm.layers.kernels.rope import qk_norm_rope_
    from nanovllm.models.decoder import DecoderAttention, DecoderFlags
    rope = RotaryEmbedding(16, 32, 10000.0)
    for head_dim, fused in ((16, qk_norm_rope_), (24, None)):
        config = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
        attn = DecoderAttention(config, DecoderFlags(qk_norm=True), rope)
        assert attn.fused_rope is None
        use_compiled_ops(attn, True)
        assert attn.fused_rope is fused
        use_compiled_ops(attn, False)
        assert attn.fused_rope is None


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
