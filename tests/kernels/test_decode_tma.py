"""The Hopper TMA-ring decode kernel (kernels/hopper/decode_tma.py, Gluon): the rule that picks it and its ring
depth (plain CPU); on a Hopper GPU (marked gpu) against float32 attention over each context's own rows, 16-bit and
fp8 caches, sliding windows and soft-caps, the engine's choice between it and the split-K kernel, and a bound
shorter than a context. Its sm_90
compile without a GPU is in test_hopper_compile.py."""
import pytest
import torch

from nanovllm.layers.attention.fp8 import token_major
from tests.kernels.helpers import FP8, assert_close, block_tables_for, random_cache, random_fp8_cache


def check_decode_tma(context_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, dtype,
                     stages: int, kv_dtype=None, chunk_tiles: int | None = None, window: int | None = None,
                     softcap: float | None = None, max_context_len: int | None = None):
    """The TMA-ring decode kernel (kernels/decode_tma.py, Hopper) against float32 attention over each context's own
    rows. Every 16-bit cache row no context covers holds NaN (the engine's 16-bit cache is not zeroed), so a kernel
    that let a row past a context into its sums would return NaN. An fp8 cache (kv_dtype; V token-major, as the
    engine stores it) is zeroed in the engine, so rows past a context are finite there: here they keep random
    values, with scales 10^8 above any context's, which a kernel must keep out of its running V scale (else every
    p it scales down underflows float16).
    chunk_tiles: the chunks' floor (decode_tma.chunk_tiles_for; default the kernel's). window: each query sees its
    last `window` keys (the reference attends over those rows only); softcap: scores become cap * tanh(s / cap)."""
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
                               tables, scale, stages, max_context_len=max_context_len, chunk_tiles=chunk_tiles,
                               window=window, softcap=softcap, **scales)
    ref = torch.zeros(batch, heads, head_dim, device="cuda")
    group = heads // kv_heads
    for s, n in enumerate(context_lens):
        if n:
            seen = rows[s][-window:] if window else rows[s]
            k, v = (c[seen].repeat_interleave(group, 1) for c in values)
            att = torch.einsum("hd,nhd->hn", q[s].float(), k) * scale
            if softcap:
                att = softcap * torch.tanh(att / softcap)
            ref[s] = torch.einsum("hn,nhd->hd", att.softmax(-1), v)
    assert_close(out, ref, dtype, f"decode_tma context_lens={context_lens} block_size={block_size} stages={stages} "
                 f"kv_dtype={kv_dtype} chunk_tiles={chunk_tiles} window={window} softcap={softcap}",
                 kv_dtype is not None)
    for s, n in enumerate(context_lens):
        if n == 0:  # padding row: zeros
            assert torch.equal(out[s], torch.zeros_like(out[s]))


def test_decode_tma_rule():
    # the TMA ring serves 96 to two SMs' worth of (sequence, KV head) programs under a bound of at most 4,096 tokens
    # (on an H200's 132 SMs: batches 12-33 with 8 KV heads), 4 slots where each program has an SM, 3 past that
    from nanovllm.kernels.hopper import decode_tma
    if decode_tma.gluon is None:
        pytest.skip("this Triton has no Gluon")
    rule = decode_tma.stages_for
    assert [rule(p, 4096, 132) for p in (95, 96, 132, 133, 264, 265)] == [0, 4, 4, 3, 3, 0]
    assert rule(128, 4097, 132) == 0 and rule(128, 512, 132) == 4
    # an fp8 cache: three slots throughout, its contexts in chunks of at least 3 128-token tiles while every
    # (sequence, KV head) has an SM (two programs an SM), else of 1,024 tokens as a 16-bit cache's
    assert [rule(p, 4096, 132, fp8=True) for p in (95, 96, 132, 133, 264, 265)] == [0, 3, 3, 3, 3, 0]
    chunks = decode_tma.chunk_tiles_for
    assert [chunks(p, 132, fp8=True) for p in (96, 132, 133, 264)] == [3, 3, 8, 8]
    assert [chunks(p, 132) for p in (96, 132, 133, 264)] == [16] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 4, 64), (16, 1, 128)])
@pytest.mark.parametrize("stages", [3, 4])
def test_gpu_decode_tma(stages, heads, kv_heads, head_dim, block_size, dtype):
    from nanovllm.kernels.hopper import decode_tma
    if not decode_tma.usable(torch.zeros(1, heads, head_dim, dtype=dtype, device="cuda"),
                             *(torch.zeros(1, block_size, kv_heads, head_dim, dtype=dtype, device="cuda"),) * 2):
        pytest.skip("the TMA decode kernel needs Hopper and Gluon (Triton 3.6 or newer)")
    # contexts ending inside a tile, on a tile's last row, on a block's, the longest the engine's rule allows, 0
    check_decode_tma([640, 1, 63, 64, 65, 0, 4096, 129, 255, 256, 257, 3000, 511, 2, 1000, 192], block_size, heads,
                     kv_heads, head_dim, dtype, stages)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype,block_size", [(torch.bfloat16, 256), (torch.float16, 128)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 4, 64)])
@pytest.mark.parametrize("stages,chunk_tiles", [(3, None), (4, None), (3, 3)])
def test_gpu_decode_tma_fp8(stages, chunk_tiles, heads, kv_heads, head_dim, block_size, dtype, kv_dtype):
    from nanovllm.kernels.hopper import decode_tma
    from nanovllm.layers.attention.fp8 import token_major
    cache = torch.zeros(1, block_size, kv_heads, head_dim, dtype=kv_dtype, device="cuda")
    scales = torch.zeros(1, kv_heads, block_size, device="cuda")
    if not decode_tma.usable(torch.zeros(1, heads, head_dim, dtype=dtype, device="cuda"), cache, token_major(cache),
                             scales, scales):
        pytest.skip("the TMA decode kernel needs Hopper and Gluon (Triton 3.6 or newer)")
    check_decode_tma([640, 1, 63, 64, 65, 0, 4096, 129, 255, 256, 257, 3000, 511, 2, 1000, 192], block_size, heads,
                     kv_heads, head_dim, dtype, stages, kv_dtype, chunk_tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("window,softcap", [(16, None), (100, None), (1, None), (None, 5.0), (100, 5.0),
                                            (1100, None)])
def test_gpu_decode_tma_window_softcap(window, softcap, kv_dtype):
    # sliding windows (one key, inside a tile, across tiles, past one 1,024-token chunk) and soft-capped scores
    # (Gemma 2), over contexts shorter and longer than the window, with a bound past MAX_CONTEXT (a window's span
    # is what the grid is cut for)
    from nanovllm.kernels.hopper import decode_tma
    from nanovllm.layers.attention.fp8 import token_major
    block_size = 256
    cache = torch.zeros(1, block_size, 8, 128, dtype=kv_dtype or torch.bfloat16, device="cuda")
    scales = [torch.zeros(1, 8, block_size, device="cuda")] * 2 if kv_dtype else []
    if not decode_tma.usable(torch.zeros(1, 16, 128, dtype=torch.bfloat16, device="cuda"), cache,
                             token_major(cache) if kv_dtype else cache, *scales):
        pytest.skip("the TMA decode kernel needs Hopper and Gluon (Triton 3.6 or newer)")
    lens = [640, 1, 15, 16, 17, 0, 5000, 129, 255, 256, 257, 3000, 100, 101, 1100, 1200]
    check_decode_tma(lens, block_size, 16, 8, 128, torch.bfloat16, 4 if kv_dtype is None else 3, kv_dtype,
                     window=window, softcap=softcap, max_context_len=8192)


@pytest.mark.gpu
def test_gpu_decode_picks_the_tma_kernel_by_shape(monkeypatch):
    # the engine's path (decode_attention): the TMA ring at 12-33 sequences with 8 KV heads and a bound up to 4,096
    # tokens, the split-K kernel otherwise (and where stages_for says no), for a 16-bit and an fp8 cache; both give
    # the same attention
    from nanovllm.kernels import decode
    from nanovllm.kernels.hopper import decode_tma
    from nanovllm.layers.attention.fp8 import token_major
    if not decode_tma.stages_for(128, 4096, decode.sm_count(torch.device("cuda"))):
        pytest.skip("no Gluon here")
    picked, tma = [], decode_tma.decode_attention_tma
    monkeypatch.setattr(decode_tma, "decode_attention_tma", lambda *a, **k: picked.append(a[6]) or tma(*a, **k))
    sms = decode.sm_count(torch.device("cuda"))

    def attend(batch, width, kv_dtype=None):
        picked.clear()
        lens = [700 - 3 * i for i in range(batch)]
        scales = {}
        if kv_dtype is None:
            k, v = random_cache(batch * width, 256, 8, 128, torch.bfloat16, "cuda")
        else:  # (V token-major, as the engine stores an fp8 cache)
            k, v, k_scale, v_scale = random_fp8_cache(batch * width, 256, 8, 128, kv_dtype, "cuda")
            v, scales = token_major(v), dict(k_scale=k_scale, v_scale=v_scale)
        tables = torch.full((batch, width), -1, dtype=torch.int32, device="cuda")
        t = block_tables_for(lens, 256, batch * width, "cuda")
        tables[:, :t.size(1)] = t
        q = torch.randn(batch, 16, 128, dtype=torch.bfloat16, device="cuda")
        ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out = decode.decode_attention(q, k, v, ctx, tables, 128 ** -0.5, **scales)
        split_k = decode.decode_attention(q, k, v, ctx, tables, 128 ** -0.5, max_split_tokens=128, **scales)
        torch.testing.assert_close(out.float(), split_k.float(), atol=2e-2, rtol=2e-2)
        return list(picked)
    for kv_dtype in (None, torch.float8_e4m3fn):
        assert attend(16, 16, kv_dtype) == [4 if 128 <= sms and kv_dtype is None else 3]
        assert attend(32, 16, kv_dtype) == ([3] if 256 <= 2 * sms else [])
        assert attend(8, 16, kv_dtype) == []  # 64 programs
        assert attend(16, 17, kv_dtype) == []  # a bound of 4,352 tokens
    # a window's span is the bound the rule sees: a windowed layer under an 8,192-token bound takes the ring (the
    # split-K kernel gives the same attention)
    picked.clear()
    lens = [700 - 3 * i for i in range(16)]
    k, v = random_cache(16 * 32, 256, 8, 128, torch.bfloat16, "cuda")
    tables = torch.full((16, 32), -1, dtype=torch.int32, device="cuda")
    t = block_tables_for(lens, 256, 16 * 32, "cuda")
    tables[:, :t.size(1)] = t
    q = torch.randn(16, 16, 128, dtype=torch.bfloat16, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ring = decode.decode_attention(q, k, v, ctx, tables, 128 ** -0.5, window=200, softcap=20.0)
    assert picked == [4 if 128 <= sms else 3]
    split_k = decode.decode_attention(q, k, v, ctx, tables, 128 ** -0.5, max_split_tokens=128, window=200,
                                      softcap=20.0)
    torch.testing.assert_close(ring.float(), split_k.float(), atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(decode_tma, "stages_for", lambda *a, **k: 0)
    assert attend(16, 16) == [] and attend(16, 16, torch.float8_e4m3fn) == []


@pytest.mark.gpu
def test_gpu_decode_tma_context_past_its_bound_is_still_whole():
    # a caller's bound shorter than a context (the engine never passes one): the grid's chunks grow to cover it, so
    # the answer is the same as under a true bound; the split counters the split-K and linear kernels share go
    # back to zero, and nothing is written past out
    from nanovllm.kernels import decode
    from nanovllm.kernels.hopper import decode_tma
    if not decode_tma.usable(torch.zeros(1, 16, 128, dtype=torch.bfloat16, device="cuda"),
                             *(torch.zeros(1, 256, 8, 128, dtype=torch.bfloat16, device="cuda"),) * 2):
        pytest.skip("the TMA decode kernel needs Hopper and Gluon (Triton 3.6 or newer)")
    lens = [2500] * 15 + [700]
    k, v = random_cache(16 * 10, 256, 8, 128, torch.bfloat16, "cuda")
    tables = block_tables_for(lens, 256, 16 * 10, "cuda")
    q = torch.randn(16, 16, 128, dtype=torch.bfloat16, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    whole = decode_tma.decode_attention_tma(q, k, v, ctx, tables, 128 ** -0.5, 4, None, 2560)  # 3 chunks
    guard = torch.zeros(2, 16, 16, 128, dtype=torch.bfloat16, device="cuda")  # out, then what lies past it
    for bound in (2048, 1024):
        guard.zero_()
        decode_tma.decode_attention_tma(q, k, v, ctx, tables, 128 ** -0.5, 4, guard[0], bound)
        torch.cuda.synchronize()
        assert not decode.split_counters(q.device, 16 * 8)[:16 * 8].any(), bound
        assert not guard[1].any(), bound
        torch.testing.assert_close(guard[0].float(), whole.float(), atol=2e-2, rtol=2e-2)
