"""What the kernel tests share: random caches and q/k/v views shaped like the engine's, block tables and slots,
the tolerances and assert_close, the fp8 helpers, a sequence stand-in for the sampler, and the fused-step check
(used by the fused-step and the one-row gemv tests). Not collected (no test_ prefix).

Every check takes a device: "cpu" runs a kernel through Triton's interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets where there is no CUDA), "cuda" the compiled kernel.
"""
import torch

from nanovllm.layers.attention.fp8 import cache_layout, is_fp8, quantize

DTYPES = [torch.float32, torch.float16]  # the interpreter tests' (CPU)
GPU_DTYPES = [torch.bfloat16, torch.float32]  # the GPU tests': against the torch reference in float32
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=1e-2),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# bf16 over an fp8 cache: dequantized V is rounded to bf16 before p @ V, the reference stays in float32
FP8_TOLERANCES = {**TOLERANCES, torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}


def random_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
    """Random K and V caches, [num_blocks, block_size, kv_heads, head_dim] slices of one tensor like the engine's."""
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    return kv[0], kv[1]


def random_fp8_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, kv_dtype, device):
    """(k_cache, v_cache, k_scale, v_scale): random rows of varied magnitude quantized as the engine stores them."""
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device)
    kv *= torch.exp(torch.randn(2, num_blocks, block_size, kv_heads, 1, device=device))  # per-row magnitudes
    values, scales = quantize(kv, kv_dtype)
    scales = cache_layout(scales)
    return values[0], values[1], scales[0], scales[1]


def block_tables_for(lengths: list[int], block_size: int, num_blocks: int, device) -> torch.Tensor:
    """Distinct shuffled blocks per sequence, right-padded with -1 (plus one extra -1 column, like a wider batch)."""
    need = [(n + block_size - 1) // block_size for n in lengths]
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks).tolist()
    table = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
    start = 0
    for s, n in enumerate(need):
        table[s, :n] = torch.tensor(perm[start:start + n], dtype=torch.int32)
        start += n
    return table.to(device)


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device):
    """Random q [tokens, heads, head_dim], k, v [tokens, kv_heads, head_dim] as strided views of one fused projection
    output, like the model passes them (row stride (heads + 2 * kv_heads) * head_dim)."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


def cu_seqlens(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def slots_for(num_blocks: int, block_size: int, runs: bool) -> tuple[int, torch.Tensor]:
    """(tokens, slot_mapping with some -1) into num_blocks >= 8 blocks of block_size >= 16: scattered slots (a decode
    step), or runs of consecutive slots as a prefill writes them: one crossing a block edge, one of two blocks' worth
    at a block start (a whole group of the store kernel's 16 tokens in one run), one with a skipped token."""
    if not runs:
        slots = torch.randperm(num_blocks * block_size)[:11].to(torch.int32)
        slots[[1, 4, 10]] = -1
        return 11, slots
    edge = block_size * 2 - 7
    slots = torch.cat([torch.arange(edge, edge + 21), torch.arange(3 * block_size, 3 * block_size + 32),
                       torch.arange(5 * block_size, 5 * block_size + 18)]).to(torch.int32)
    slots[21 + 32 + 5] = -1
    return len(slots), slots


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, fp8: bool = False):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    tolerance = (FP8_TOLERANCES if fp8 else TOLERANCES)[dtype]
    torch.testing.assert_close(out.float(), ref.float(), **tolerance, msg=lambda m: f"{what}: {m}")


def reference(fn, *tensors_and_rest):
    """Run a TorchAttention method on float32 copies of the floating-point tensors (the exact-ish answer)."""
    args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() and not is_fp8(a.dtype) else a
            for a in tensors_and_rest]
    return fn(*args)


def fp8_steps(x: torch.Tensor) -> torch.Tensor:
    """float8 values as signed counts of representable steps from zero (+0 and -0 both 0)."""
    code = x.view(torch.uint8).to(torch.int16)
    return torch.where(code >= 128, 128 - code, code)


class SeqStub:
    """What Sampler.prepare and its processors read of a sequence."""

    def __init__(self, sp, num_tokens: int, sample_index: int = 0, seq_id: int = 0):
        self.sampling_params, self.sample_index, self.seq_id = sp, sample_index, seq_id
        self.token_ids = list(range(num_tokens))
        self.num_tokens = self.num_prompt_tokens = num_tokens
        self.num_completion_tokens, self.is_finished, self.generator = 0, False, None


def check_fused_step(rows: int, dtype, device="cpu", tolerance: dict | None = None, fp8_group: int | None = 0,
                     fp8_block_rows: int = 1):
    """Three decoder layers and the final norm through kernels/fused_step.FusedDecodeStep (the norms, residual adds
    and SiLU-and-mul inside the projections' kernels) against the plain model; attention replaced by a fixed map of
    qkv (its kernels have their own checks), so this pins which norm, residual and weight goes where (a wrong one
    moves outputs by tenths). tolerance: assert_close's, where not the dtype's. fp8_group (not 0): the step's
    projections hold fp8 weights (scales per row, or per row and fp8_group columns) and the plain model their
    dequantized values; fp8_block_rows: one group scale per block of that many rows (a checkpoint's blocks: the
    one-row kernels then scale x)."""
    from types import SimpleNamespace

    from nanovllm.kernels.fused_step import FusedDecodeStep
    from nanovllm.models.decoder import DecoderFlags, DecoderModel
    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=96, rms_norm_eps=1e-6, vocab_size=50, max_position_embeddings=64,
                             num_hidden_layers=3)
    model = DecoderModel(config, DecoderFlags(qkv_bias=True, o_bias=True)).to(device=device, dtype=dtype)
    for p in model.parameters():
        p.data.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    for layer in model.layers:
        mix = torch.randn(128, 64, device=device).to(dtype) * 0.3  # qkv width (4 + 2 * 2) * 16 -> heads * head_dim
        layer.self_attn.attend = lambda positions, qkv, mix=mix: qkv @ mix
    fused = model
    if fp8_group != 0:
        import copy

        from nanovllm.kernels.gemv import shared_rows
        from nanovllm.quantization.config import QuantConfig
        from nanovllm.quantization.fp8 import Fp8Linear, dequantize
        fused = copy.deepcopy(model)
        for plain, quantized in zip(model.layers, fused.layers):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                part = "self_attn" if name in ("qkv_proj", "o_proj") else "mlp"
                lin = getattr(getattr(quantized, part), name)
                w = lin.weight.data.float()
                if fp8_group is None:
                    scale = w.abs().amax(-1) / 448.0
                    q = (w / scale[:, None]).to(torch.float8_e4m3fn)
                else:
                    blocks = w.view(w.shape[0], -1, fp8_group)
                    scale = blocks.abs().amax(-1) / 448.0
                    scale = scale.view(-1, fp8_block_rows, scale.shape[1]).amax(1).repeat_interleave(fp8_block_rows, 0)
                    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(w.shape)
                lin.weight = torch.nn.Parameter(q, requires_grad=False)
                lin.quant = Fp8Linear(QuantConfig("fp8", block=(1, fp8_group)))
                lin.quant.scale = scale
                lin.quant.shared_rows = shared_rows(scale)
                assert lin.quant.shared_rows == (fp8_block_rows if fp8_group else 1)
                getattr(getattr(plain, part), name).weight.data.copy_(dequantize(q, scale, fp8_group))
    step = FusedDecodeStep(SimpleNamespace(model=fused), rows_fold=True)
    assert step.accepts(rows) == (rows == 1 or 9 <= rows <= 16)
    ids = torch.randint(0, 50, (rows,), device=device)
    positions = torch.arange(rows, device=device)
    want, got = model(ids, positions), step(ids, positions)
    if tolerance is None:
        assert_close(got, want.float(), dtype, f"fused step, rows={rows}")
    else:
        torch.testing.assert_close(got.float(), want.float(), **tolerance)
