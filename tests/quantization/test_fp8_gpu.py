"""FP8 weights on CUDA (skipped without a GPU): the activation quantizer, the block-scaled GEMM, the per-channel
path (torch._scaled_mm) and the small-batch w8a16 kernel against float32 references on the same fp8 operands; the
engine on fp8 checkpoints of both formats and with quantization="fp8", against bf16 on the same weights
dequantized."""
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.quantization.checkpoints import make_fp8
from tests.tiny_models import make_checkpoint

pytestmark = pytest.mark.gpu


def _reference(q, sq, w, sw, group):
    """float32 x @ W^T of the dequantized fp8 operands."""
    def expand(s, cols):
        return s[:, None].expand(-1, cols) if s.dim() == 1 else s.repeat_interleave(group, 1)[:, :cols]
    k = q.shape[1]
    return (q.float() * expand(sq if sq.shape[1] > 1 else sq[:, 0], k)) @ (w.float() * expand(sw, k)).t()


@pytest.mark.parametrize("m", [1, 7, 16, 100, 1000])
@pytest.mark.parametrize("group", [None, 128])
def test_fp8_linear_against_float32(m, group):
    from nanovllm.kernels.fp8_gemm import fp8_linear, quantize_activations
    from nanovllm.quantization.fp8 import quantize_rows
    torch.manual_seed(m)
    n, k = 384, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda") * 0.05
    if group is None:
        wq, ws = quantize_rows(w)
    else:  # per output row and 128-column group (block scales as the layers keep them)
        blocks = w.view(n, k // group, group)
        ws = blocks.abs().amax(-1) / 448.0
        wq = (blocks / ws[..., None]).to(torch.float8_e4m3fn).view(n, k)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_activations(x, group)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (m, 1 if group is None else k // group)
    # the quantizer: each row (group) scaled to its |max| / 448, values within fp8's rounding of x
    xs = s[:, :, None].expand(-1, -1, group or k).reshape(m, k)
    torch.testing.assert_close(q.float() * xs, x.float(), atol=1e-3, rtol=0.07)
    y = fp8_linear(x, wq, ws, group, bias)
    if m <= 16:  # (small batches: w8a16, x unquantized against the fp8 weight)
        ones = torch.ones(m, 1, device="cuda")
        expected = _reference(x, ones, wq, ws, group) + bias.float()
    else:
        expected = _reference(q, s, wq, ws, group) + bias.float()
    torch.testing.assert_close(y.float(), expected, atol=2e-2, rtol=2e-2)


def test_activation_quantizer_on_rows_longer_than_a_tile():
    """Per-token rows of 20,000 columns (past MAX_TILE: read in two passes) get |max| / 448 as their scale and
    values within e4m3's rounding, at magnitudes 100^-1 to 100."""
    from nanovllm.kernels.fp8_gemm import MAX_TILE, quantize_activations
    assert 20000 > MAX_TILE
    x = torch.randn(3, 20000, device="cuda") * torch.tensor([[0.01], [1.0], [100.0]], device="cuda")
    q, s = quantize_activations(x.to(torch.bfloat16), None)
    x = x.to(torch.bfloat16).float()
    torch.testing.assert_close(s[:, 0], x.abs().amax(-1) / 448.0)
    assert ((q.float() * s - x).abs() <= x.abs() / 16 + s * 2 ** -9).all()


@pytest.mark.parametrize("arch,fmt", [("qwen3", "qwen"), ("qwen3", "compressed-tensors"), ("qwen3", "online"),
                                      ("qwen3_moe", "qwen"), ("qwen3_moe", "online")])
def test_engine_on_fp8_weights(arch, fmt, tmp_path):
    """Greedy tokens in bf16 on CUDA: fp8 weights (activations quantized on the fly) against the same weights
    dequantized. This tiny random model's logits are close together, so activation rounding moves many of them:
    on CPU, transformers in float32 with the same per-group activation rounding agrees on 26 of these 64 tokens
    (4 of 4 first tokens) for the block format. A broken path would agree by chance (1 in 400). qwen3_moe: the
    experts in fp8 too, through the fused MoE kernel."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1)
    base = make_checkpoint(tmp_path / "base", arch, tie=True, num_kv_heads=2, num_heads=4, head_dim=64,
                           hidden=256, intermediate_size=512, seed=3, **(moe if arch == "qwen3_moe" else {}))
    fp8, reference = make_fp8(base, tmp_path / "fp8", "compressed-tensors" if fmt == "online" else fmt,
                              tmp_path / "reference")
    model, options = (base, {"quantization": "fp8"}) if fmt == "online" else (fp8, {})
    rng = random.Random(0)
    prompts = [[rng.randrange(400) for _ in range(n)] for n in (3, 17, 70, 200)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for path, opts in ((model, options), (reference, {})):
        with LLM(path, device="cuda", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=256,
                 max_model_len=512, **opts) as llm:
            runs.append([o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)])
    first = [a[0] == b[0] for a, b in zip(*runs)]
    agree = sum(x == y for a, b in zip(*runs) for x, y in zip(a, b))
    print(f"{arch} {fmt}: first tokens equal {sum(first)}/{len(first)}, tokens equal {agree}/{16 * len(prompts)}")
    assert sum(first) >= 2 and agree >= 10
