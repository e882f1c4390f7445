"""The fused decode step (kernels/fused_step.FusedDecodeStep: the norms, residual adds and SiLU-and-mul inside the
projections' kernels) against the plain model (helpers.check_fused_step); on a GPU (marked gpu), and a decoder
layer's kernels chained under PDL and replayed as a CUDA graph, plain and folded as the fused step folds them.
Interpreted on CPU; compiled on a GPU."""
import pytest
import torch

from tests.kernels.helpers import block_tables_for, check_fused_step, random_cache, random_fp8_cache


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 9, 16])
def test_fused_step(rows):
    check_fused_step(rows, torch.float16)


@pytest.mark.interpreter
@pytest.mark.parametrize("group,block_rows", [(None, 1), (32, 1), (32, 16)])
def test_fused_step_on_fp8_weights(group, block_rows):
    # one row of fp8 projections, scales per row, per 32 columns, or per 16 x 32 block (each program's 16 rows share
    # them: x takes them), read by the folded kernels with their scales
    check_fused_step(1, torch.float16, fp8_group=group, fp8_block_rows=block_rows)


def test_fused_step_takes_one_row_of_fp8_weights():
    # build on a dense decoder: 1 and 9-16 rows in 16 bits; with any fp8 projection one row only (9-16 rows run the
    # model, whose w8a16 kernel measured faster; an ignore list may leave any of the four 16-bit)
    from types import SimpleNamespace

    from nanovllm.kernels.fused_step import FusedDecodeStep
    from nanovllm.models.decoder import DecoderFlags, DecoderModel
    from nanovllm.quantization.config import QuantConfig
    from nanovllm.quantization.fp8 import Fp8Linear
    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=96, rms_norm_eps=1e-6, vocab_size=50, max_position_embeddings=64,
                             num_hidden_layers=2)
    model = SimpleNamespace(model=DecoderModel(config, DecoderFlags()).to(torch.float16))
    step = FusedDecodeStep.build(model, torch.float16, torch.device("cuda"))
    assert step.accepts(1) and step.accepts(12)
    for part, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                       ("mlp", "down_proj")):
        model = SimpleNamespace(model=DecoderModel(config, DecoderFlags()).to(torch.float16))
        lin = getattr(getattr(model.model.layers[1], part), name)
        lin.weight.data = lin.weight.data.to(torch.float8_e4m3fn)
        lin.quant = Fp8Linear(QuantConfig("fp8"))
        step = FusedDecodeStep.build(model, torch.float16, torch.device("cuda"))
        assert step.accepts(1) and not step.accepts(12), name


def test_fused_step_takes_fp8_weights_and_declines_others():
    # build: a 16-bit dense decoder or one with fp8 projections; a weight of another dtype (or quant method) declines
    from types import SimpleNamespace

    from nanovllm.kernels.fused_step import _takes
    from nanovllm.layers.linear import ColumnParallelLinear
    from nanovllm.quantization.config import QuantConfig
    from nanovllm.quantization.fp8 import Fp8Linear
    lin = ColumnParallelLinear(32, 16)
    lin.weight.data = lin.weight.data.to(torch.bfloat16)
    assert _takes(lin, torch.bfloat16) and not _takes(lin, torch.float16)
    lin.weight.data = lin.weight.data.to(torch.float8_e4m3fn)
    assert not _takes(lin, torch.bfloat16)  # fp8 without its method
    lin.quant = Fp8Linear(QuantConfig("fp8"))
    assert _takes(lin, torch.bfloat16)
    lin.quant = SimpleNamespace()  # another method
    assert not _takes(lin, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_fused_step():
    # the fused step against the plain model in float16 at 16 and 9 rows (three layers of bfloat16 roundings, in
    # another order, would not meet a tolerance that catches a misplaced weight)
    torch.manual_seed(0)
    for rows in (16, 9):
        check_fused_step(rows, torch.float16, device="cuda", tolerance=dict(atol=1e-2, rtol=1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,kv_dtype,fold", [(1, None, False), (16, None, False), (16, torch.float8_e4m3fn, False),
                                               (16, None, True), (12, torch.float8_e4m3fn, True)])
def test_gpu_layer_chain_under_pdl(rows, kv_dtype, fold, monkeypatch):
    """Two decoder layers' kernels at decode shapes (Qwen3-0.6B), each reading what the one before wrote: launched
    under PDL (the norms, SiLU, rotary + K/V store, the 2-16-row linear kernel, decode attention with its early
    L2 prefetch at 1 row, and at 16 rows the TMA ring, which copies the tiles before the new token before its wait,
    from a 16-bit or an fp8 cache), replayed as a CUDA graph with new inputs, they give the bits of plain launches.
    A kernel that read before the one before it had finished would not. fold: the norms between the projections
    folded into them as the fused step does (gemv_add_norm, then gemv_normed)."""
    from nanovllm.kernels import activation, decode, gemv, norm, rope
    from nanovllm.kernels.hopper import pdl
    from nanovllm.layers.attention.fp8 import raw, token_major
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    if not pdl.pdl_enabled(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch here (before Hopper)")
    torch.manual_seed(rows)
    hidden, heads, kv_heads, head_dim, inter, block_size, width, eps = 1024, 16, 8, 128, 3072, 256, 16, 1e-6
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def weight(n, k):
        return torch.randn(n, k, **bf16) * k ** -0.5
    layers = [(weight((heads + 2 * kv_heads) * head_dim, hidden), weight(hidden, heads * head_dim),
               weight(2 * inter, hidden), weight(hidden, inter)) for _ in range(2)]
    nw, q_w, k_w = torch.rand(hidden, **bf16) + 0.5, torch.rand(head_dim, **bf16) + 0.5, torch.rand(head_dim, **bf16)
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).to("cuda").cos_sin_cache
    if kv_dtype is None:
        start = [random_cache(rows * width, block_size, kv_heads, head_dim, torch.bfloat16, "cuda") for _ in layers]
    else:  # (K, V token-major, K scales, V scales), as the engine stores an fp8 cache
        start = [random_fp8_cache(rows * width, block_size, kv_heads, head_dim, kv_dtype, "cuda") for _ in layers]
        start = [(k, token_major(v), ks, vs) for k, v, ks, vs in start]
    caches = [tuple(t.clone() for t in c) for c in start]
    x, res = torch.empty(rows, hidden, **bf16), torch.empty(rows, hidden, **bf16)
    lens = torch.empty(rows, dtype=torch.int32, device="cuda")
    tables = torch.full((rows, width), -1, dtype=torch.int32, device="cuda")
    positions = torch.empty(rows, dtype=torch.int64, device="cuda")
    slots = torch.empty(rows, dtype=torch.int32, device="cuda")
    early = []
    launched_early = decode.launched_early
    monkeypatch.setattr(decode, "launched_early", lambda *a: early.append(launched_early(*a)) or early[-1])
    from nanovllm.kernels.hopper import decode_tma
    tma_launches, tma = [], decode_tma.decode_attention_tma
    monkeypatch.setattr(decode_tma, "decode_attention_tma", lambda *a, **k: tma_launches.append(1) or tma(*a, **k))

    def step():
        h, r = norm.add_rms_norm(x, res, nw, eps)
        normed = None
        for (w_qkv, w_o, w_gate_up, w_down), (k_cache, v_cache, *scales) in zip(layers, caches):
            qkv = gemv.gemv(h, w_qkv) if normed is None else gemv.gemv_normed(normed, w_qkv)
            q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
            k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
            rope.qk_norm_rope_(q, k, positions, cos_sin, q_w, k_w, eps, store=(v, k_cache, v_cache, slots, *scales))
            o = decode.decode_attention(q, k_cache, v_cache, lens, tables, head_dim ** -0.5,
                                        **dict(zip(("k_scale", "v_scale"), scales)))
            if fold:
                r, normed = gemv.gemv_add_norm(o.view(rows, -1), w_o, None, r, nw, eps)
                act = activation.silu_and_mul(gemv.gemv_normed(normed, w_gate_up))
                r, normed = gemv.gemv_add_norm(act, w_down, None, r, nw, eps)
                h = normed.x
            else:
                h, r = norm.add_rms_norm(gemv.gemv(o.view(rows, -1), w_o), r, nw, eps)
                h = gemv.gemv(activation.silu_and_mul(gemv.gemv(h, w_gate_up)), w_down)
                h, r = norm.add_rms_norm(h, r, nw, eps)
        return h, r

    def inputs(i):  # new contexts (the new token last), tables, slots and hidden states; the caches as at start
        gen = torch.manual_seed(100 * rows + i)  # (block_tables_for draws from the global generator)
        new_lens = torch.randint(1, 900, (rows,), generator=gen)
        table = block_tables_for(new_lens.tolist(), block_size, rows * width, "cuda")
        tables.fill_(-1)
        tables[:, :table.size(1)] = table
        lens.copy_(new_lens)
        positions.copy_(new_lens - 1)
        last = (new_lens - 1).to("cuda")
        slots.copy_(table.gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size)
        x.copy_(torch.randn(rows, hidden, generator=gen).to(x))
        res.copy_(torch.randn(rows, hidden, generator=gen).to(res))
        for cache, cache0 in zip(caches, start):
            for t, t0 in zip(cache, cache0):
                t.copy_(t0)

    inputs(0)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    # decode attention launched early at 1 row; at 16 (128 programs) the TMA ring, which requests the tiles before
    # the new token before its wait, where the kernel runs here (Hopper with Gluon)
    if rows >= 12 and decode_tma.stages_for(rows * kv_heads, width * block_size, decode.sm_count(x.device)):
        assert tma_launches and not early
    else:
        assert early and all(early) and not tma_launches
    got = []
    for i in range(3):
        inputs(i)
        graph.replay()
        torch.cuda.synchronize()
        got.append([raw(t).clone() for t in (*out, *caches[0], *caches[1])])
    for module in (activation, decode, decode_tma, gemv, norm, rope):
        monkeypatch.setattr(module, "pdl_enabled", lambda device: False)
    for i in range(3):
        inputs(i)
        want = [raw(t) for t in (*step(), *caches[0], *caches[1])]  # (fp8 compared as bytes)
        assert all(torch.equal(a, b) for a, b in zip(got[i], want)), f"replay {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("group", [None, 32])
def test_gpu_fused_step_on_fp8_weights(group):
    # compiled: the folded one-row kernels read fp8 projections with their scales, against the dequantized model
    torch.manual_seed(1)
    check_fused_step(1, torch.float16, device="cuda", tolerance=dict(atol=1e-2, rtol=1e-2), fp8_group=group)
