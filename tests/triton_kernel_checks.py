"""Triton attention kernels against TorchAttention on random data.

Run by tests/test_triton_kernels.py in a subprocess with TRITON_INTERPRET=1 (CPU); the case builders and `check_*`
functions are also used there by the GPU tests. Not collected on its own (no test_ prefix).
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode import decode_attention
from nanovllm.kernels.prefill import prefill_attention
from nanovllm.kernels.race import _exp1, _uniforms
from nanovllm.layers.attention.fp8 import cache_layout, is_fp8, quantize, token_major
from nanovllm.layers.attention.torch_ref import TorchAttention
from nanovllm.layers.attention.triton_backend import TritonAttention
from nanovllm.layers.context import Context


@pytest.fixture(autouse=True)
def _fixed_data():
    """Each check draws the same random data whichever tests run before it (the interpreter's rare fp8 conversion
    errors made an fp8 check fail on one draw in a few)."""
    torch.manual_seed(0)


TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=1e-2),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


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


# bf16 over an fp8 cache: dequantized V is rounded to bf16 before p @ V, the reference stays in float32
FP8_TOLERANCES = {**TOLERANCES, torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}


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


def check_store_fp8(block_size: int, kv_heads: int, head_dim: int, dtype, kv_dtype, device="cuda",
                    v_token_major: bool = True, runs: bool = False):
    """The quantizing store against the torch one: the same scales, and values within one fp8 step (Triton's float32
    division is div.full.f32, which may differ from torch's IEEE division in the last bits, and that can move a
    value across a rounding boundary, zero and subnormals included)."""
    num_blocks = 8
    tokens, slots = slots_for(num_blocks, block_size, runs)
    _, k, v = qkv_views(tokens, 1, kv_heads, head_dim, dtype, device)
    k.mul_(torch.exp(torch.randn(tokens, kv_heads, 1, device=device)).to(dtype))  # rows of varied magnitude
    slots = slots.to(device)
    caches = [[torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=kv_dtype, device=device) for _ in "kv"]
              + [torch.zeros(num_blocks, kv_heads, block_size, device=device) for _ in "kv"] for _ in range(2)]
    if v_token_major:  # as the engine stores an fp8 V
        for c in caches:
            c[1] = token_major(c[1])
    TritonAttention().store_kvcache(k, v, caches[0][0], caches[0][1], slots, caches[0][2], caches[0][3])
    TorchAttention().store_kvcache(k, v, caches[1][0], caches[1][1], slots, caches[1][2], caches[1][3])
    ours, ref = caches
    for i in (2, 3):
        if device == "cpu":  # interpreted: numpy's float32 division, IEEE as torch's: the same bits
            assert torch.equal(ours[i], ref[i]), "store fp8: scales differ"
        else:
            torch.testing.assert_close(ours[i], ref[i], rtol=1e-6, atol=0)
    if device == "cpu":  # the interpreter's float8 rounding is its own (subnormals flushed; a value that rounds up
        return  # to the next power of two comes out half of it): its values are not compared
    for i in (0, 1):  # fp8 codes count steps from zero (sign bit apart): at most one step apart
        a, b = (fp8_steps(c) for c in (ours[i], ref[i]))
        assert ((a - b).abs() <= 1).all(), "store fp8: values more than one step apart"


def fp8_steps(x: torch.Tensor) -> torch.Tensor:
    """float8 values as signed counts of representable steps from zero (+0 and -0 both 0)."""
    code = x.view(torch.uint8).to(torch.int16)
    return torch.where(code >= 128, 128 - code, code)


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


def check_store(block_size: int, kv_heads: int, head_dim: int, dtype, device="cpu", v_token_major: bool = False,
                runs: bool = False):
    num_blocks = 8
    k_cache, v_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    if v_token_major:
        v_cache = token_major(v_cache)
    tokens, slots = slots_for(num_blocks, block_size, runs)
    _, k, v = qkv_views(tokens, 1, kv_heads, head_dim, dtype, device)
    slots = slots.to(device)
    ours = (k_cache.clone(), v_cache.clone())  # (clone keeps the strides)
    ref = (k_cache.clone(), v_cache.clone())
    TritonAttention().store_kvcache(k, v, *ours, slots)
    TorchAttention().store_kvcache(k, v, *ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots[slots >= 0].long()] = True
    for new, old in zip(ours, (k_cache, v_cache)):  # -1 slots wrote nothing: every other slot is unchanged
        assert torch.equal(new.flatten(0, 1)[~written], old.flatten(0, 1)[~written])


def check_prefill(lens_q: list[int], lens_k: list[int] | None, block_size: int, heads: int, kv_heads: int,
                  head_dim: int, dtype, device="cpu", kv_dtype=None, v_token_major: bool = False):
    """lens_k None: no history (keys are the fresh k, v). Else sequence s has lens_k[s] cached tokens, the last
    lens_q[s] of them new, read through block tables (an fp8 cache with its scales when kv_dtype is given)."""
    tokens = sum(lens_q)
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, device)
    scale = head_dim ** -0.5
    if lens_k is None:
        k_cache = v_cache = torch.empty(0, device=device)
        tables, cu_k, max_k = None, cu_seqlens(lens_q, device), max(lens_q)
    else:
        num_blocks = sum((n + block_size - 1) // block_size for n in lens_k) + 3
        if kv_dtype is not None:
            k_cache, v_cache, *scales = random_fp8_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype, device)
        else:
            k_cache, v_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
        if v_token_major:
            v_cache = token_major(v_cache)
        tables, cu_k, max_k = block_tables_for(lens_k, block_size, num_blocks, device), cu_seqlens(lens_k, device), \
            max(lens_k)
    context = Context(True, cu_seqlens_q=cu_seqlens(lens_q, device), cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                      max_seqlen_k=max_k, block_tables=tables)
    extra = dict(zip(("k_scale", "v_scale"), scales)) if kv_dtype is not None and lens_k is not None else {}
    out = TritonAttention().prefill(q, k, v, k_cache, v_cache, context, scale, **extra)
    ref = reference(lambda *a: TorchAttention().prefill(*a, **extra), q, k, v, k_cache, v_cache, context, scale)
    assert_close(out, ref, dtype, f"prefill lens_q={lens_q} lens_k={lens_k} kv_dtype={kv_dtype}", bool(extra))


def check_decode(context_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, dtype,
                 num_splits: int | None = None, device="cpu", kv_dtype=None, max_split_tokens: int | None = None,
                 v_token_major: bool = False):
    """num_splits None: the engine's split heuristic (splits of a fixed length, max_split_tokens if given);
    else each context cut into num_splits equal runs."""
    batch = len(context_lens)
    num_blocks = sum((n + block_size - 1) // block_size for n in context_lens) + 3
    extra = {}
    if kv_dtype is not None:
        k_cache, v_cache, k_scale, v_scale = random_fp8_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype,
                                                              device)
        extra = dict(k_scale=k_scale, v_scale=v_scale)
    else:
        k_cache, v_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    if v_token_major:  # the same values stored [blocks, kv_heads, head_dim, block_size]
        v_cache = token_major(v_cache)
    tables = block_tables_for(context_lens, block_size, num_blocks, device)
    q = qkv_views(batch, heads, kv_heads, head_dim, dtype, device)[0]
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    context = Context(False, context_lens=lens, block_tables=tables)
    scale = head_dim ** -0.5
    if max_split_tokens is not None:
        out = decode_attention(q, k_cache, v_cache, lens, tables, scale, max_split_tokens=max_split_tokens, **extra)
    elif num_splits is None:
        out = TritonAttention().decode(q, k_cache, v_cache, context, scale, **extra)
    else:
        out = decode_attention(q, k_cache, v_cache, lens, tables, scale, num_splits=num_splits, **extra)
    ref = reference(lambda *a: TorchAttention().decode(*a, **extra), q, k_cache, v_cache, context, scale)
    assert_close(out, ref, dtype, f"decode context_lens={context_lens} splits={num_splits} kv_dtype={kv_dtype} "
                 f"max_split_tokens={max_split_tokens}", bool(extra))
    for s, n in enumerate(context_lens):
        if n == 0:  # padding row: zeros, like the reference
            assert torch.equal(out[s], torch.zeros_like(out[s]))


def check_decode_tma(context_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, dtype,
                     stages: int, kv_dtype=None, chunk_tiles: int | None = None):
    """The TMA-ring decode kernel (kernels/decode_tma.py, Hopper) against float32 attention over each context's own
    rows. Every 16-bit cache row no context covers holds NaN (the engine's 16-bit cache is not zeroed), so a kernel
    that let a row past a context into its sums would return NaN. An fp8 cache (kv_dtype; V token-major, as the
    engine stores it) is zeroed in the engine, so rows past a context are finite there: here they keep random
    values, with scales 10^8 above any context's, which a kernel must keep out of its running V scale (else every
    p it scales down underflows float16).
    chunk_tiles: the chunks' floor (decode_tma.chunk_tiles_for; default the kernel's)."""
    from nanovllm.kernels.hopper.decode_tma import decode_attention_tma
    from nanovllm.layers.attention.fp8 import dequantize
    batch = len(context_lens)
    num_blocks = sum((n + block_size - 1) // block_size for n in context_lens) + 3
    if kv_dtype is None:
        k_cache, v_cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, "cuda")
        scales = {}
    else:
        k_cache, v_cache, k_scale, v_scale = random_fp8_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype,
                                                              "cuda")
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    tables = block_tables_for(context_lens, block_size, num_blocks, "cuda")
    covered = torch.zeros(num_blocks * block_size, dtype=torch.bool, device="cuda")
    rows = []
    for s, n in enumerate(context_lens):
        pos = torch.arange(n, device="cuda")
        rows.append(tables[s, pos // block_size].long() * block_size + pos % block_size)
        covered[rows[-1]] = True
    if kv_dtype is None:
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[~covered] = float("nan")
        values = [c.view(-1, kv_heads, head_dim).float() for c in (k_cache, v_cache)]
    else:
        row_scales = [sc.transpose(1, 2) for sc in scales.values()]  # [blocks, block_size, kv_heads] views
        values = [dequantize(c.reshape(-1, kv_heads, head_dim), sc.reshape(-1, kv_heads))
                  for c, sc in zip((k_cache, v_cache), row_scales)]
        top = max(sc.max().item() for sc in row_scales)
        for sc in row_scales:
            sc[~covered.view(num_blocks, block_size)] = top * 1e8
        v_cache = token_major(v_cache)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda")
    scale = head_dim ** -0.5
    out = decode_attention_tma(q, k_cache, v_cache, torch.tensor(context_lens, dtype=torch.int32, device="cuda"),
                               tables, scale, stages, chunk_tiles=chunk_tiles, **scales)
    ref = torch.zeros(batch, heads, head_dim, device="cuda")
    group = heads // kv_heads
    for s, n in enumerate(context_lens):
        if n:
            k, v = (c[rows[s]].repeat_interleave(group, 1) for c in values)
            att = torch.einsum("hd,nhd->hn", q[s].float(), k) * scale
            ref[s] = torch.einsum("hn,nhd->hd", att.softmax(-1), v)
    assert_close(out, ref, dtype, f"decode_tma context_lens={context_lens} block_size={block_size} stages={stages} "
                 f"kv_dtype={kv_dtype} chunk_tiles={chunk_tiles}", kv_dtype is not None)
    for s, n in enumerate(context_lens):
        if n == 0:  # padding row: zeros
            assert torch.equal(out[s], torch.zeros_like(out[s]))


def check_qk_norm_rope(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, norm: bool, device="cpu",
                       heads_per_program: int = 0):
    """The fused q/k RMSNorm + rotary kernel, in place on views of one qkv projection, against the torch modules
    (norm in float32 then rounded, as the reference does; rotary over positions anywhere in the cache)."""
    from nanovllm.kernels.rope import qk_norm_rope_
    from nanovllm.layers.layernorm import rms_norm
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    rope = RotaryEmbedding(head_dim, 4096, 1000000.0).to(device)
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, dtype, device)
    v_before = v.clone()
    positions = torch.randint(0, 4096, (tokens,), device=device)
    q_w, k_w = (torch.rand(head_dim, dtype=dtype, device=device) + 0.5 for _ in range(2))
    ref_q, ref_k = q.float(), k.float()
    if norm:
        ref_q, ref_k = rms_norm(ref_q, q_w.float(), 1e-6), rms_norm(ref_k, k_w.float(), 1e-6)
    ref_q, ref_k = rope(positions, ref_q, ref_k)
    out_q, out_k = qk_norm_rope_(q, k, positions, rope.cos_sin_cache, *((q_w, k_w, 1e-6) if norm else ()),
                                 heads_per_program=heads_per_program)
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


def check_gemv(m: int, n: int, k: int, dtype, bias: bool, device="cpu", config=None):
    """The small-batch linear kernel (each row layout: one row, a 16-row dot) against F.linear in float32."""
    from nanovllm.kernels.gemv import gemv
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = gemv(x, w, b, config=config)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, ref, dtype, f"gemv m={m} n={n} k={k} bias={bias}")


def check_race(batch: int, vocab: int, dtype, device="cpu"):
    """The race kernel picks exactly what the torch race picks on the same logits and noise (ties and -inf too);
    with a batch under 4 rows a SM each row is split into vocabulary chunks (kernels/race.py's race_chunks)."""
    from nanovllm.kernels.race import race
    from nanovllm.sampling.sampler import race_in_log_space
    logits = (torch.randn(batch, vocab, device=device) * 3).to(dtype)
    noise = torch.empty(batch, vocab, device=device).exponential_(1)
    logits[0, : vocab // 2] = float("-inf")  # a masked half
    logits[-1] = 1.0  # every logit equal: the noise decides
    if batch > 2:  # an exact tie between two chunks, and in one lane of the kernel's block: the first index wins
        logits[1], noise[1] = -5.0, 1.0
        for i in (100, 100 + 1024, 100 + 4096, vocab - 3):
            logits[1, min(i, vocab - 3)] = 4.0
    temps = torch.rand(batch, 1, device=device) + 0.3
    picks = race(logits, temps, noise)
    assert torch.equal(picks, race_in_log_space(logits, temps, noise))
    if batch > 2:
        assert picks[1] == 100


def check_race_draws(dtype, device="cpu", rows: int = 4000, vocab: int = 3000):
    """The race kernel drawing its own noise: each row's pick follows softmax(logits / T) (counts within 5 standard
    deviations over `rows` rows; the candidates spread over the vocabulary chunks of a small batch), -inf logits
    are never picked, the same seed picks the same tokens whether or not the rows are split."""
    from nanovllm.kernels.decode import sm_count
    from nanovllm.kernels.race import PROGRAMS_PER_SM, race, race_chunks
    values = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5, 3.0, -2.0])
    where = torch.linspace(0, vocab - 1, len(values)).long()
    logits = torch.full((vocab,), float("-inf"))
    logits[where] = values
    logits = logits.to(device=device, dtype=dtype)
    seed = torch.tensor([12345], dtype=torch.int64, device=device)
    dev = torch.device(device)
    whole = max(rows, PROGRAMS_PER_SM * sm_count(dev))  # rows enough for one program a row
    assert race_chunks(whole, vocab, dev)[0] == 1 and race_chunks(3, vocab, dev)[0] > 1
    temps = torch.full((whole, 1), 0.7, device=device)
    picks = race(logits.expand(whole, -1).contiguous(), temps, seed=seed)
    if dev.type != "cpu":  # (the interpreter runs one program at a time: a rerun has nothing to race, and took 30 s)
        assert torch.equal(picks, race(logits.expand(whole, -1).contiguous(), temps, seed=seed))
    assert torch.equal(picks[:3], race(logits.expand(3, -1).contiguous(), temps[:3], seed=seed))  # split rows
    picks, temps = picks[:rows], temps[:rows]
    assert torch.isin(picks, where.to(device)).all()
    counts = torch.bincount(picks.cpu(), minlength=vocab).double()[where]
    p = torch.softmax(values.double() / 0.7, 0)
    assert counts[4] == 0
    assert ((counts - rows * p).abs() <= 5 * (rows * p * (1 - p)).sqrt() + 1).all(), (counts, rows * p)
    # 64 rows again (split into chunks, unlike the first call): the same seed draws the same tokens, another seed
    # other ones (64 rows all alike by chance: about 2e-15, sum(p^2)^64)
    few = min(rows, 64)
    assert torch.equal(picks[:few], race(logits.expand(few, -1).contiguous(), temps[:few], seed=seed))
    other = race(logits.expand(few, -1).contiguous(), temps[:few], seed=seed + 1)
    assert not torch.equal(picks[:few], other)


@triton.jit
def _exp1_probe(seed_ptr, u_ptr, e_ptr, lanes_ptr):
    """The race kernel's uniform draws of tokens 0-7 for one row key, its Exp(1) draws from them (base 2), and the
    four Philox lanes of counters 0 and 1 (lanes_ptr [4, 2])."""
    offs = tl.arange(0, 8)
    u = _uniforms(tl.load(seed_ptr), 0, 8)
    tl.store(u_ptr + offs, u)
    tl.store(e_ptr + offs, _exp1(u))
    c = tl.arange(0, 2)
    u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr), c)
    tl.store(lanes_ptr + c, u0)
    tl.store(lanes_ptr + 2 + c, u1)
    tl.store(lanes_ptr + 4 + c, u2)
    tl.store(lanes_ptr + 6 + c, u3)


def check_race_draws_small_uniform(dtype, device="cpu"):
    """A tiny uniform draw gives a tiny Exp(1) draw, not 0. Row key 13261905 draws U = 52 * 2^-31 for token 4 (lane 0
    of Philox counter 1; found by searching Triton's Philox, the probe pins it): E = 2.4e-8, so token 4 (logit -22)
    scores -22 + 17.5 (in nats) and loses to token 0. With E = -log(1 - U) in float32, 1 - U rounds to 1, E = 0
    (log E = -inf) and token 4 wins: a 1e-10 token picked with probability 3e-8 per token and step. Token 4k + j
    draws lane j of counter k."""
    from nanovllm.kernels.race import race
    seed = torch.tensor([13261905], dtype=torch.int64, device=device)
    u, e, lanes = (torch.empty(8, device=device) for _ in range(3))
    _exp1_probe[(1,)](seed, u, e, lanes)
    assert u[4].item() == pytest.approx(52 * 2.0 ** -31, rel=1e-6), u  # else Triton's Philox changed: find another key
    assert torch.equal(u, lanes.view(4, 2).t().reshape(8)), (u, lanes)
    exact = -torch.log1p(-u.double()) / math.log(2)
    assert ((e.double() - exact).abs() <= 1e-6 * exact).all(), (e, exact)
    logits = torch.full((1, 8), float("-inf"), device=device)
    logits[0, 0], logits[0, 4] = 0.0, -22.0
    assert race(logits.to(dtype), torch.ones(1, 1, device=device), seed=seed).item() == 0


def check_race_keys(dtype, device="cpu", vocab: int = 5000):
    """Seeded rows: keyed by their own key and stream, their picks do not depend on the batch, its step seed or the
    vocabulary split; unseeded rows (stream 0) pick as without keys; exp_draws gives the kernel's own draws, also
    gathered by token id."""
    from nanovllm.kernels.race import exp_draws, race
    from nanovllm.sampling.sampler import race_in_log_space
    logits = (torch.randn(6, vocab, device=device) * 2).to(dtype)
    temps = torch.rand(6, 1, device=device) + 0.5
    seed = torch.tensor([777], dtype=torch.int64, device=device)
    keys = torch.tensor([0, 5, -3, 0, 2**63 - 1, 5], dtype=torch.int64, device=device)
    streams = torch.tensor([0, 9, 1, 0, 4, 10], dtype=torch.int64, device=device)
    picks = race(logits, temps, seed=seed, keys=keys, streams=streams)
    plain = race(logits, temps, seed=seed)
    unseeded = streams == 0
    assert torch.equal(picks[unseeded], plain[unseeded])
    for row in (1, 2, 4, 5):  # alone, with another step seed: the same token
        alone = race(logits[row:row + 1], temps[row:row + 1], seed=seed + 99, keys=keys[row:row + 1],
                     streams=streams[row:row + 1])
        assert alone.item() == picks[row].item(), row
    # (the kernel scores in base 2, the reference in nats: a near-tie could differ; none does on this data)
    noise = exp_draws(seed, (6, vocab), keys=keys, streams=streams)
    assert torch.equal(picks, race_in_log_space(logits, temps, noise))
    assert torch.equal(plain, race_in_log_space(logits, temps, exp_draws(seed, (6, vocab))))
    ids = torch.stack([torch.randperm(vocab, device=device)[:300] for _ in range(6)])
    assert torch.equal(exp_draws(seed, (6, 300), ids, keys, streams), noise.gather(1, ids))
    # the stream is the counter's high word: two positions' draws share no values (a stream in the low word would
    # shift them by 4 tokens), and a seeded row with stream 1 draws apart from an unseeded row of the same key
    one_key = torch.full((2,), 5, dtype=torch.int64, device=device)
    near = exp_draws(seed, (2, vocab), keys=one_key, streams=torch.tensor([1, 2], device=device))
    assert torch.isin(near[0], near[1]).float().mean() < 0.01
    unseeded = exp_draws(torch.tensor([5], device=device), (1, vocab))
    assert torch.isin(near[0], unseeded[0]).float().mean() < 0.01
    # one key: every stream its own draws; the same stream the same draws
    flat = torch.zeros(1, vocab, device=device, dtype=dtype)
    one = dict(keys=torch.tensor([5], device=device), streams=torch.tensor([9], device=device))
    firsts = {race(flat, temps[:1], seed=seed, keys=one["keys"], streams=one["streams"] + s).item() for s in range(8)}
    assert len(firsts) == 8, firsts
    with pytest.raises(ValueError, match="both or neither"):
        race(logits, temps, seed=seed, keys=keys)
    with pytest.raises(ValueError, match="int64"):
        race(logits, temps, seed=seed, keys=keys.int(), streams=streams)


def check_race_keys_follow_softmax(device="cpu", rows: int = 300):
    """One key over `rows` streams (a seeded request's positions): the picks follow softmax(logits / T)."""
    from nanovllm.kernels.race import race
    values = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    vocab = 600
    where = torch.linspace(0, vocab - 1, len(values)).long()
    logits = torch.full((rows, vocab), float("-inf"), device=device)
    logits[:, where.to(device)] = values.to(device)
    temps = torch.full((rows, 1), 0.8, device=device)
    seed = torch.tensor([1], dtype=torch.int64, device=device)
    keys = torch.full((rows,), 4242, dtype=torch.int64, device=device)
    streams = torch.arange(1, rows + 1, device=device)
    picks = race(logits, temps, seed=seed, keys=keys, streams=streams).cpu()
    counts = torch.bincount(picks, minlength=vocab).double()[where]
    p = torch.softmax(values.double() / 0.8, 0)
    assert counts[4] == 0 and counts.sum() == rows
    assert ((counts - rows * p).abs() <= 5 * (rows * p * (1 - p)).sqrt() + 1).all(), (counts, rows * p)
    same = race(logits, temps, seed=seed, keys=keys, streams=torch.full_like(streams, 3)).cpu()
    assert (same == same[0]).all()


class _Seq:
    """What Sampler.prepare and its processors read of a sequence."""

    def __init__(self, sp, num_tokens: int, sample_index: int = 0, seq_id: int = 0):
        self.sampling_params, self.sample_index, self.seq_id = sp, sample_index, seq_id
        self.token_ids = list(range(num_tokens))
        self.num_tokens = self.num_prompt_tokens = num_tokens
        self.num_completion_tokens, self.is_finished, self.generator = 0, False, None


def check_sampler_seeded_rows(device="cpu", vocab: int = 3000, positions: int = 20):
    """The sampler with the race kernel: a seeded row's token is the same alone and in a batch whatever the other
    rows ask for (top-k / top-p or not, another seed, greedy), on both paths (the kernel's race; exp_draws for the
    filtered path); its sample index and its position change it. Over `positions` positions (each about 27 sampler
    calls)."""
    from nanovllm.sampling.sampler import Sampler
    from nanovllm.sampling_params import SamplingParams
    sampler = Sampler(vocab, device=device, triton=True)
    to_device = lambda data, dtype: torch.tensor(data, dtype=dtype, device=device)  # noqa: E731
    logits = torch.randn(4, vocab, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50),
              SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=8, top_p=0.8)]

    def pick(rows, seeded, positions, sample_index=0):
        """The seeded row's token; it always reads logits[0], the other row logits[1]."""
        seqs = [_Seq(sp, 10, sample_index if sp is seeded else 0, i) for i, sp in enumerate(rows)]
        st = sampler.prepare(seqs, [True] * len(rows), to_device, positions)
        at = rows.index(seeded)
        batch = logits[:1] if len(rows) == 1 else logits[:2] if at == 0 else logits[[1, 0]]
        return sampler(batch, st, gen)[0][at].item()
    pos_range = range(10, 10 + positions)
    for seeded in (SamplingParams(temperature=1.0, seed=123), SamplingParams(temperature=1.0, seed=123, top_k=40),
                   SamplingParams(temperature=1.0, seed=123, top_p=0.9)):
        alone = [pick([seeded], seeded, [p]) for p in pos_range]
        assert len(set(alone)) > 3, alone  # every position its own draws
        for other in others:
            assert [pick([other, seeded], seeded, [5, p]) for p in pos_range] == alone, other
        assert [pick([seeded, others[1]], seeded, [p, 5]) for p in pos_range] == alone
        assert [pick([seeded], seeded, [p], sample_index=1) for p in pos_range] != alone
    # seeds wrap into 64 bits: sample 1 of seed 2**64 - 1 is sample 0 of seed 0; seed 2**63 is key -2**63
    wrapped = SamplingParams(temperature=1.0, seed=2**64 - 1)
    zero = SamplingParams(temperature=1.0, seed=0)
    at = [pick([zero], zero, [p]) for p in range(10, 20)]
    assert [pick([wrapped], wrapped, [p], sample_index=1) for p in range(10, 20)] == at
    assert [pick([wrapped], wrapped, [p]) for p in range(10, 20)] != at
    high = SamplingParams(temperature=1.0, seed=2**63)
    assert len({pick([high], high, [p]) for p in range(10, 20)}) > 1


def check_penalties(batch: int, vocab: int, device="cpu", exact: bool = True):
    """The penalties kernel against the processor's torch form: repetition alone, presence and frequency alone, all
    three; rows reading scattered lines of the history; positive, negative and -inf logits."""
    from nanovllm.kernels.penalties import apply_penalties
    from nanovllm.sampling.logits_processors import PenaltiesProcessor
    processor = PenaltiesProcessor(vocab, torch.device(device))
    lines = batch + 5
    processor.seen = torch.rand(lines, vocab, device=device) < 0.3
    processor.counts = torch.randint(0, 4, (lines, vocab), device=device).float() * processor.seen
    logits = torch.randn(batch, vocab, device=device) * 4
    logits[0, :7] = float("-inf")
    rows = torch.randperm(lines, device=device)[:batch]
    rep = torch.rand(batch, device=device) + 0.6
    rep[-1] = 1.0 if batch > 1 else 1.5  # (a row without repetition penalty beside rows with one)
    pres, freq = torch.rand(batch, device=device) * 2 - 1, torch.rand(batch, device=device) * 2 - 1
    for state in ({"repetition": rep}, {"presence": pres, "frequency": freq},
                  {"repetition": rep, "presence": pres, "frequency": freq}):
        state["lines"] = rows
        ref = processor.apply_torch(logits, state)
        out = apply_penalties(logits, rows, processor.seen, processor.counts, state.get("repetition"),
                              state.get("presence"), state.get("frequency"))
        if exact or "presence" not in state:  # (the division rounds as torch's: tl.div_rn)
            assert torch.equal(out, ref), (out - ref).abs().max()
        else:  # the GPU kernel may fuse a multiply and a subtraction
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)
        assert not torch.equal(out, logits)


def check_logprob_stats(batch: int, vocab: int, k: int, dtype, device="cpu", ties: bool = False,
                        masked: float = 0.0, keep: int = 0):
    """The logprobs kernel against torch: each row's logsumexp (close), its k largest logits (the same values, in
    order; the ids hold them, none twice); ties (rounded logits) and -inf logits (a grammar's mask); keep: only ids
    5 .. 5 + keep - 1 finite (a grammar allowing fewer than k tokens: the rest of the top k is -inf)."""
    from nanovllm.kernels.logprobs import logprob_stats
    x = torch.randn(batch, vocab, device=device) * 4
    if ties:
        x = x.round()
    if masked:
        x[torch.rand(batch, vocab, device=device) < masked] = float("-inf")
    if keep:
        x[:, :5] = float("-inf")
        x[:, 5 + keep:] = float("-inf")
    x = x.to(dtype)
    lse, values, ids = logprob_stats(x, k)
    xf = x.float()
    torch.testing.assert_close(lse, torch.logsumexp(xf, -1), atol=1e-5, rtol=1e-6)
    if not k:
        assert values is None and ids is None
        return
    assert torch.equal(values, xf.topk(k, -1).values), (values, xf.topk(k, -1).values)
    assert ids.dtype == torch.int64 and torch.equal(xf.gather(1, ids), values)
    assert all(len(set(row)) == k for row in ids.tolist()), "an id twice"


def logprob_stats_empty() -> bool:
    """A batch of no rows: empty results, no launch."""
    from nanovllm.kernels.logprobs import logprob_stats
    lse, values, ids = logprob_stats(torch.empty(0, 3000), 5)
    return lse.shape == (0,) and values.shape == ids.shape == (0, 5) and ids.dtype == torch.int64


def check_sampler_logprobs(device="cpu", vocab: int = 3000):
    """The sampler's logprobs with the kernel and with torch (its reference), on the same logits and tokens
    (greedy rows): top ids of the same logits, values close; with a penalty too (float32 logits), and past MAX_K
    (torch on both)."""
    import unittest.mock

    from nanovllm.kernels import logprobs as logprobs_kernel
    from nanovllm.kernels.logprobs import MAX_K, logprob_stats
    from nanovllm.sampling.sampler import Sampler
    from nanovllm.sampling_params import SamplingParams
    to_device = lambda data, dtype: torch.tensor(data, dtype=dtype, device=device)  # noqa: E731
    logits = (torch.randn(3, vocab, device=device) * 3).to(torch.bfloat16)
    for params in (SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0, logprobs=0),
                   SamplingParams(temperature=0, logprobs=MAX_K + 1),
                   SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.3)):
        out = []
        for compiled in (True, False):
            sampler = Sampler(vocab, device=device, triton=compiled)
            seqs = [_Seq(params, 10, 0, i) for i in range(3)]
            st = sampler.prepare(seqs, [True] * 3, to_device)
            with unittest.mock.patch.object(logprobs_kernel, "logprob_stats", side_effect=logprob_stats) as kernel:
                out.append(sampler(logits, st, None))
            assert kernel.call_count == (compiled and params.logprobs <= MAX_K), (compiled, params)  # its path
        (tokens, (values, ids, chosen)), (ref_tokens, (ref_values, ref_ids, ref_chosen)) = out
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(chosen, ref_chosen, atol=1e-5, rtol=1e-6)
        if params.logprobs:  # ids of the same logits (16-bit logits tie often: either id of a tie)
            assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids)), (ids, ref_ids)
            torch.testing.assert_close(values, ref_values, atol=1e-5, rtol=1e-6)
        else:
            assert values is None and ids is None and ref_values is None


def check_gemv_fused(m: int, n: int, k: int, dtype, device="cpu"):
    """The small-batch kernel with the op before the layer: silu_and_mul (gated), RMSNorm with and without the
    residual add (folded into the one-row kernel, else separate kernels first), against the separate torch ops
    then F.linear in float32; the new residual exact."""
    from nanovllm.kernels.gemv import gemv_folded
    from nanovllm.layers import activation, layernorm
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    h = (torch.randn(m, 2 * k, device=device) * 2).to(dtype)
    ref = torch.nn.functional.linear(activation.silu_and_mul(h).float(), w.float())
    assert_close(gemv_folded(h, w, gated=True), ref, dtype, f"gated gemv m={m} n={n} k={k}")
    x, residual = ((torch.randn(m, k, device=device) * 3).to(dtype) for _ in range(2))
    nw = (torch.rand(k, device=device) + 0.5).to(dtype)
    y = gemv_folded(x, w, norm=(nw, 1e-6))
    ref = torch.nn.functional.linear(layernorm.rms_norm(x, nw, 1e-6).float(), w.float())
    assert_close(y, ref, dtype, f"normed gemv m={m} n={n} k={k}")
    y, new_residual = gemv_folded(x, w, norm=(nw, 1e-6), residual=residual)
    normed, ref_residual = layernorm.add_rms_norm(x, residual, nw, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    assert_close(y, torch.nn.functional.linear(normed.float(), w.float()), dtype, f"add-normed gemv m={m} k={k}")


def check_gemv_add_norm(m: int, n: int, k: int, n_next: int, dtype, configs=(None, None), device="cpu"):
    """The RMSNorm folded between two small-batch linear layers (gemv's add_norm, then normed): h = x @ W^T +
    residual and rms_norm(h) * nw @ W2^T + b2 against layernorm.add_rms_norm and F.linear in float32."""
    from nanovllm.kernels.gemv import gemv_add_norm, gemv_normed
    from nanovllm.layers import layernorm
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    residual = (torch.randn(m, n, device=device) * 3).to(dtype)
    nw = (torch.rand(n, device=device) + 0.5).to(dtype)
    w2 = (torch.randn(n_next, n, device=device) * n ** -0.5).to(dtype)
    b2 = torch.randn(n_next, device=device).to(dtype)
    h, rows = gemv_add_norm(x, w, None, residual, nw, 1e-6, config=configs[0])
    y = gemv_normed(rows, w2, b2, config=configs[1])
    ref_y = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
    ref_normed, ref_h = layernorm.add_rms_norm(ref_y, residual, nw, 1e-6)
    what = f"gemv add_norm m={m} n={n} k={k} configs={configs}"
    assert_close(h, ref_h.float(), dtype, what + ", h")
    assert_close(rows.x, (ref_h.float() * nw.float()), dtype, what + ", h * nw")
    ref_next = torch.nn.functional.linear(ref_normed.float(), w2.float(), b2.float())
    assert_close(y, ref_next, dtype, what + ", next")
    if n_next % 2 == 0:  # the next layer an MLP's [gate; up], SiLU-and-mul in its epilogue: as the SiLU kernel
        # after the same layer (against ref_next a 1-ulp difference in gate or up can exceed the tolerance)
        from nanovllm.layers.activation import silu_and_mul
        act = gemv_normed(rows, w2, b2, gated_out=True, config=configs[1])
        assert_close(act, silu_and_mul(y).float(), dtype, what + ", next gated")


def check_fused_step(rows: int, dtype, device="cpu", tolerance: dict | None = None):
    """Three decoder layers and the final norm through kernels/fused_step.FusedDecodeStep (the norms, residual adds
    and SiLU-and-mul inside the projections' kernels) against the plain model; attention replaced by a fixed map of
    qkv (its kernels have their own checks), so this pins which norm, residual and weight goes where (a wrong one
    moves outputs by tenths). tolerance: assert_close's, where not the dtype's."""
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
    step = FusedDecodeStep(SimpleNamespace(model=model), rows_fold=True)
    assert step.accepts(rows) == (rows == 1 or 9 <= rows <= 16)
    ids = torch.randint(0, 50, (rows,), device=device)
    positions = torch.arange(rows, device=device)
    want, got = model(ids, positions), step(ids, positions)
    if tolerance is None:
        assert_close(got, want.float(), dtype, f"fused step, rows={rows}")
    else:
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_kernel(dtype):
    check_rms_norm(5, 1000, dtype)  # a width that is no power of two


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias", [(1, 64, 1024, False), (1, 37, 300, True), (1, 20, 5000, True),
                                        (3, 64, 1024, True), (16, 100, 2048, False)])
def test_gemv_kernel(m, n, k, bias, dtype):
    # even shapes (unmasked loads of W) and ragged ones (a partial tile of W rows and of K); one row: the one-row
    # kernel up to K = 4096, the general one past it
    check_gemv(m, n, k, dtype, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias,config", [(5, 40, 400, True, (16, 64, 4, 2, 3)),
                                               (16, 64, 1000, False, (32, 128, 4, 2, 4)),
                                               (2, 64, 1024, False, (16, 256, 4, 2, 2)),
                                               (16, 192, 512, False, (64, 128, 4, 4, 1, True)),
                                               (3, 100, 1000, True, (64, 128, 4, 4, 1, True)),
                                               (7, 64, 1000, True, (64, 128, 4, 4, 3, True))])
def test_gemv_split_k(m, n, k, bias, config, dtype):
    # K cut over programs (the last split shorter: 400 = 192 + 192 + 16, 1000 = 3 x 256 + 232 or 2 x 384 + 232),
    # the last to arrive adds the partials; the swapped product (y^T = W x^T) whole, ragged, and split; run twice:
    # each launch leaves the counters at zero for the next
    for _ in range(2):
        check_gemv(m, n, k, dtype, bias, config=config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 64, 1024), (1, 37, 300), (1, 40, 5000)])
def test_gemv_fused_kernel(m, n, k, dtype):
    # one row: folded into the one-row kernel; past its K: the separate kernels, then the layer
    check_gemv_fused(m, n, k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,n_next,configs", [
    (2, 64, 512, 96, (None, None)),
    (16, 256, 512, 384, ((64, 128, 4, 2, 2, True), (32, 128, 4, 2))),  # a split, swapped producer; plain consumer
    (7, 96, 200, 80, ((32, 64, 4, 2, 3), (64, 64, 4, 2, 2, True))),  # ragged: masked columns, rows, K; split both
])
def test_gemv_add_norm(m, n, k, n_next, configs, dtype):
    check_gemv_add_norm(m, n, k, n_next, dtype, configs)


@pytest.mark.parametrize("rows", [1, 9, 16])
def test_fused_step(rows):
    check_fused_step(rows, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kernel(dtype):
    check_qk_norm_rope_store(5, dtype)
    check_qk_norm_rope_store(5, dtype, kv_dtype=torch.float8_e4m3fn)
    # two heads per program (decode batches): 4 q heads in two programs, 3 K/V heads in two (one head masked)
    check_qk_norm_rope_store(5, dtype, heads_per_program=2)
    check_qk_norm_rope_store(5, dtype, kv_dtype=torch.float8_e4m3fn, heads_per_program=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_race_kernel(dtype):
    check_race(4, 9000, dtype)  # split: nine vocabulary chunks per row
    check_race(140, 5000, dtype)  # three chunks a row, two blocks each
    check_race(528, 4200, dtype)  # one program per row (batch >= 4 x the SM count), two blocks each


@pytest.mark.parametrize("dtype", DTYPES)
def test_race_kernel_draws(dtype):
    # the draws do not depend on the logits' type (loaded, then float32): the full count for one, a smaller one for
    # the other (a row is one program, slow in the interpreter: 1,000 rows took 63 s)
    check_race_draws(dtype, rows=1000 if dtype == torch.float32 else 200)
    check_race_draws_small_uniform(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_race_kernel_keys(dtype):
    check_race_keys(dtype)


def test_race_keys_follow_softmax():
    check_race_keys_follow_softmax()


def test_race_sampler_seeded_rows():
    check_sampler_seeded_rows(positions=8)  # (20 on the GPU; 8 took the interpreter from 69 to about 30 s)


def test_penalties_kernel():
    check_penalties(5, 3000)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprob_stats_kernel(dtype):
    check_logprob_stats(3, 5000, 5, dtype)  # five vocabulary chunks a row
    check_logprob_stats(2, 4099, 20, dtype, masked=0.5)  # 4 chunks, the last takes the 3 ids left over; half -inf
    check_logprob_stats(2, 2000, 32, dtype, ties=True)  # MAX_K, many ties
    check_logprob_stats(2, 3000, 1, dtype)
    check_logprob_stats(2, 3000, 0, dtype)  # the logsumexp alone
    check_logprob_stats(2, 5000, 12, dtype, keep=10)  # fewer finite logits than k
    # one program a row (528 rows: 4 a SM of an H200; few finite logits, so few insertions: fast in the interpreter)
    check_logprob_stats(528, 1100, 20, dtype, keep=3)
    assert logprob_stats_empty()


def test_sampler_logprobs_kernel():
    check_sampler_logprobs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 128)])
def test_rope_kernel(heads, kv_heads, head_dim, norm, dtype):
    check_qk_norm_rope(7, heads, kv_heads, head_dim, dtype, norm)
    check_qk_norm_rope(7, heads, kv_heads, head_dim, dtype, norm, heads_per_program=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_kernel(dtype):
    check_silu_and_mul(5, 1500, dtype)  # a partial last column block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,head_dim,v_token_major", [(16, 2, 64, False), (32, 1, 128, False),
                                                                       (256, 3, 64, False), (16, 2, 64, True),
                                                                       (256, 3, 64, True)])
@pytest.mark.parametrize("runs", [False, True])
def test_store(block_size, kv_heads, head_dim, v_token_major, runs, dtype):
    check_store(block_size, kv_heads, head_dim, dtype, v_token_major=v_token_major, runs=runs)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("v_token_major,runs", [(True, False), (True, True), (False, True)])
def test_store_fp8(kv_dtype, v_token_major, runs):
    """The quantizing store's scales, exactly (a scale off by any factor, e.g. amax / (fp8 max / 2), fails)."""
    check_store_fp8(16, 2, 64, torch.float32, kv_dtype, device="cpu", v_token_major=v_token_major, runs=runs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_fresh(group, head_dim, dtype):
    # ragged batch: a single token, a partial tile, several tiles
    check_prefill([1, 17, 300], None, 16, heads=2 * group, kv_heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 2), (32, 128, 4), (256, 64, 1), (256, 128, 2)])
def test_prefill_history(block_size, head_dim, group, dtype):
    # prefix hit (40 of 300), decode-like chunk (1 of 70), no history (17 of 17), later chunk (64 of 130),
    # and 3 of 65: the first query sits at 62, just before a key-tile edge (unmasked/masked loop boundary)
    check_prefill([40, 1, 17, 64, 3], [300, 70, 17, 130, 65], block_size, heads=2 * group, kv_heads=2,
                  head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 1), (32, 128, 2), (256, 64, 4), (256, 128, 8)])
def test_decode(block_size, head_dim, group, dtype):
    # 1-token and long contexts, a padding row (context 0, table all -1); the heuristic splits the 600-long one
    check_decode([1, 600, 0, 37, 130], block_size, heads=group * 2, kv_heads=2, head_dim=head_dim, dtype=dtype)


# fp8 caches: values written by the torch reference (the interpreter's float32 -> float8 conversion is wrong at
# some exponent boundaries, e.g. 127.9 -> 64 instead of 128, so the quantizing store is checked on the GPU only).
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,v_token_major", [(16, False), (16, True), (64, True)])
def test_fp8_prefill_history(block_size, v_token_major, dtype, kv_dtype):
    # V token-major as the engine stores an fp8 cache: read through strides (16-token blocks, smaller than a key
    # tile), or whole tiles unmasked (64)
    check_prefill([40, 1, 17, 64, 3], [300, 70, 17, 130, 65], block_size, heads=4, kv_heads=2, head_dim=64,
                  dtype=dtype, kv_dtype=kv_dtype, v_token_major=v_token_major)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("block_size,v_token_major", [(16, False), (128, True)])
def test_fp8_decode(block_size, v_token_major, num_splits, dtype, kv_dtype):
    # 128-token blocks, V token-major (the engine's fp8 layout): whole tiles read unmasked
    check_decode([1, 600, 0, 37, 130], block_size, heads=4, kv_heads=2, head_dim=64, dtype=dtype,
                 num_splits=num_splits, kv_dtype=kv_dtype, v_token_major=v_token_major)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_decode_splits(num_splits):
    # forced splits: one program per sequence, a few, and more splits than tiles (empty splits)
    check_decode([1, 600, 0, 37], 32, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("block_size,max_split_tokens", [(16, 32), (16, 64), (16, 4096), (128, 64), (128, 128)])
def test_decode_split_tokens(block_size, max_split_tokens):
    # fixed-length splits: one tile each (a 600-token context takes 19 programs, a 33-token one 2), two tiles, and
    # one split per sequence; contexts of 0, 1, a tile and one past it, on a batch wide enough to need few splits.
    # 128-token blocks: every split inside one block (its table entry read once, beside the context length)
    check_decode([1, 600, 0, 32, 33, 257], block_size, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32,
                 max_split_tokens=max_split_tokens)


def test_decode_group_of_three():
    # a group that is no power of two (Qwen3-14B has 5): the merge's padded head rows, and more splits (10) than
    # one merge load takes (4 at a padded group of 4)
    check_decode([1, 600, 0, 130], 128, heads=6, kv_heads=2, head_dim=64, dtype=torch.float32, max_split_tokens=64)


def test_decode_bound_past_the_table():
    # a context bound past the table's width (more splits than table entries): the same attention
    block_size, lens = 128, [300, 5]
    k_cache, v_cache = random_cache(8, block_size, 2, 64, torch.float32, "cpu")
    tables = block_tables_for(lens, block_size, 8, "cpu")
    q = qkv_views(2, 4, 2, 64, torch.float32, "cpu")[0]
    lens_t = torch.tensor(lens, dtype=torch.int32)
    want = decode_attention(q, k_cache, v_cache, lens_t, tables, 0.125, max_split_tokens=64)
    got = decode_attention(q, k_cache, v_cache, lens_t, tables, 0.125, max_split_tokens=64,
                           max_context_len=2 * tables.size(1) * block_size)
    assert torch.equal(got, want)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_and_decode_16bit_token_major_v_past_the_context_is_never_read(block_size, dtype):
    # Only an fp8 cache (zeroed by the engine) is read in whole unmasked tiles: a 16-bit token-major V may hold
    # anything past a context (torch.empty memory), NaN here, and must not reach the output
    num_blocks, lens = 12, [10, 130]
    k_cache, v_cache = random_cache(num_blocks, block_size, 1, 64, dtype, "cpu")
    v_cache = token_major(v_cache)
    tables = block_tables_for(lens, block_size, num_blocks, "cpu")
    for s, n in enumerate(lens):  # NaN in every slot past each sequence's context
        for i in range(n, (n + block_size - 1) // block_size * block_size):
            v_cache[tables[s, i // block_size], i % block_size] = float("nan")
    q = qkv_views(len(lens), 2, 1, 64, dtype, "cpu")[0]
    out = decode_attention(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), tables, 0.125)
    assert torch.isfinite(out).all()
    lens_q = [3, 5]  # the last tokens of each sequence as a prefill chunk over its cached history
    q = qkv_views(sum(lens_q), 2, 1, 64, dtype, "cpu")[0]
    out = prefill_attention(q, k_cache, v_cache, cu_seqlens(lens_q, "cpu"), cu_seqlens(lens, "cpu"), max(lens_q),
                            0.125, block_tables=tables)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_decode_v_token_major(kv_dtype):
    # V read through its own strides: a cache whose heads keep their tokens contiguous gives the same attention
    check_decode([1, 600, 0, 37], 16, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16, kv_dtype=kv_dtype,
                 v_token_major=True)
