"""The fused q/k RMSNorm + rotary kernel (kernels/rope.py), in place on views of one qkv projection, and with the
K/V cache store folded in (plain and fp8 caches; one or several heads a program). Interpreted on CPU; compiled on a
GPU (marked gpu); and the arguments it refuses before any launch."""
import pytest
import torch

from tests.kernels.helpers import DTYPES, assert_close, qkv_views


def check_qk_norm_rope(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, norm: bool, device="cpu",
                       heads_per_program: int = 0, offset: bool = False):
    """The fused q/k RMSNorm + rotary kernel, in place on views of one qkv projection, against the torch modules
    (norm in float32 then rounded, as the reference does; rotary over positions anywhere in the cache). offset:
    Gemma's norm, scaled by (1 + weight), with weights around 0."""
    from nanovllm.kernels.rope import qk_norm_rope_
    from nanovllm.layers.layernorm import offset_rms_norm, rms_norm
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    rope = RotaryEmbedding(head_dim, 4096, 1000000.0).to(device)
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, device)
    v_before = v.clone()
    positions = torch.randint(0, 4096, (tokens,), device=device)
    q_w, k_w = (torch.rand(head_dim, dtype=dtype, device=device) + (-0.5 if offset else 0.5) for _ in range(2))
    ref_q, ref_k = q.float(), k.float()
    if norm:
        fn = offset_rms_norm if offset else rms_norm
        ref_q, ref_k = fn(ref_q, q_w.float(), 1e-6), fn(ref_k, k_w.float(), 1e-6)
    ref_q, ref_k = rope(positions, ref_q, ref_k)
    out_q, out_k = qk_norm_rope_(q, k, positions, rope.cos_sin_cache, *((q_w, k_w, 1e-6) if norm else ()),
                                 heads_per_program=heads_per_program, offset=offset)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_close(q, ref_q.to(dtype), dtype, f"rope q norm={norm}")
    assert_close(k, ref_k.to(dtype), dtype, f"rope k norm={norm}")
    assert torch.equal(v, v_before), "the rotary kernel wrote into v"


def check_qk_norm_rope_store(tokens: int, dtype, device="cpu", block_size: int = 16, kv_dtype=None,
                             heads_per_program: int = 0):
    """The rotary kernel writing the K/V cache itself: the cache afterwards equals the rotary kernel then
    store_kvcache's (skipped slots -1 untouched), q and k as without the store. kv_dtype fp8: V token-major as the
    engine stores it, and the scales too."""
    from nanovllm.kernels.rope import qk_norm_rope_
    from nanovllm.kernels.store_kvcache import store_kvcache
    from nanovllm.layers.attention import fp8
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    heads, kv_heads, head_dim = 4, 3, 64
    rope = RotaryEmbedding(head_dim, 4096, 1000000.0).to(device)
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, device)
    v.mul_(3.0)  # (K and V of different magnitudes: a scale written to the wrong tensor shows)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    q_w, k_w = (torch.rand(head_dim, dtype=dtype, device=device) + 0.5 for _ in range(2))
    slots = torch.randperm(8 * block_size, device=device)[:tokens].to(torch.int32)
    slots[tokens // 2] = -1
    caches = [torch.randn(8, block_size, kv_heads, head_dim, device=device).to(kv_dtype or dtype) for _ in range(2)]
    scales = []
    if kv_dtype is not None:
        caches[1] = fp8.token_major(caches[1])
        scales = [torch.rand(8, kv_heads, block_size, device=device) for _ in range(2)]
    want_cache = [c.clone() for c in caches]  # (clone keeps a token-major V's strides, in a buffer of its own)
    want_scales = [s.clone() for s in scales]
    q2, k2 = q.clone(), k.clone()
    # (the same heads per program: another split of a token's heads may round the norm's sum differently)
    qk_norm_rope_(q2, k2, positions, rope.cos_sin_cache, q_w, k_w, 1e-6, heads_per_program=heads_per_program)
    store_kvcache(k2, v, *want_cache, slots, *want_scales)
    qk_norm_rope_(q, k, positions, rope.cos_sin_cache, q_w, k_w, 1e-6, store=(v, *caches, slots, *scales),
                  heads_per_program=heads_per_program)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    for got, want in zip(caches + scales, want_cache + want_scales):
        assert torch.equal(fp8.raw(got), fp8.raw(want))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 128)])
def test_rope_kernel(heads, kv_heads, head_dim, norm, dtype):
    check_qk_norm_rope(7, heads, kv_heads, head_dim, dtype, norm)
    check_qk_norm_rope(7, heads, kv_heads, head_dim, dtype, norm, heads_per_program=2)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kernel_gemma_norm(dtype):
    check_qk_norm_rope(7, 4, 1, 256, dtype, True, offset=True)  # (Gemma 3 1B's heads: 4 query, 1 KV, 256)
    check_qk_norm_rope(7, 4, 1, 256, dtype, True, heads_per_program=2, offset=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kernel(dtype):
    check_qk_norm_rope_store(5, dtype)
    check_qk_norm_rope_store(5, dtype, kv_dtype=torch.float8_e4m3fn)
    # two heads per program (decode batches): 4 q heads in two programs, 3 K/V heads in two (one head masked)
    check_qk_norm_rope_store(5, dtype, heads_per_program=2)
    check_qk_norm_rope_store(5, dtype, kv_dtype=torch.float8_e4m3fn, heads_per_program=2)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 300, 16384])
def test_gpu_rope_and_store(tokens, norm):
    check_qk_norm_rope(tokens, 16, 8, 128, torch.bfloat16, norm, device="cuda")
    check_qk_norm_rope(tokens, 4, 1, 256, torch.bfloat16, norm, device="cuda", offset=True)
    for heads in (1, 2, 4):
        check_qk_norm_rope(min(tokens, 256), 16, 8, 128, torch.bfloat16, norm, device="cuda", heads_per_program=heads)
    check_qk_norm_rope_store(min(tokens, 128), torch.bfloat16, device="cuda", block_size=256)
    check_qk_norm_rope_store(min(tokens, 128), torch.bfloat16, device="cuda", block_size=256,
                             kv_dtype=torch.float8_e4m3fn)
    for heads in (1, 2):
        check_qk_norm_rope_store(min(tokens, 128), torch.bfloat16, device="cuda", block_size=256,
                                 heads_per_program=heads)
        check_qk_norm_rope_store(min(tokens, 128), torch.bfloat16, device="cuda", block_size=256,
                                 kv_dtype=torch.float8_e4m3fn, heads_per_program=heads)


def test_rotary_store_refuses_a_v_unlike_k():
    # the kernel reads every token's V rows (slot -1 too) before it stores: a V with fewer tokens or heads than k
    # must fail before any launch, not read past its end
    from nanovllm.kernels.rope import qk_norm_rope_
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    caches = [torch.zeros(2, 8, 2, 16) for _ in "kv"]
    slots = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    cos_sin = torch.randn(64, 16)
    with pytest.raises(ValueError, match="shaped like k"):
        qk_norm_rope_(q, k, torch.arange(4), cos_sin, store=(torch.randn(2, 2, 16), *caches, slots))
