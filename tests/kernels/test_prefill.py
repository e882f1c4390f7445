"""Prefill attention (kernels/prefill.py) against TorchAttention: fresh prompts, chunks over a cached history read
through block tables, fp8 caches, V token-major. Interpreted on CPU; compiled on a GPU (marked gpu)."""
import pytest
import torch

from nanovllm.kernels.decode import decode_attention
from nanovllm.kernels.prefill import prefill_attention
from nanovllm.layers.attention.fp8 import token_major
from nanovllm.layers.attention.torch_ref import TorchAttention
from nanovllm.layers.attention.triton_backend import TritonAttention
from nanovllm.layers.context import Context
from tests.kernels.helpers import (
    DTYPES,
    FP8,
    GPU_DTYPES,
    assert_close,
    block_tables_for,
    cu_seqlens,
    qkv_views,
    random_cache,
    random_fp8_cache,
    reference,
)


def check_prefill(lens_q: list[int], lens_k: list[int] | None, block_size: int, heads: int, kv_heads: int,
                  head_dim: int, dtype, device="cpu", kv_dtype=None, v_token_major: bool = False,
                  window: int | None = None, softcap: float | None = None):
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
    fp8 = bool(extra)
    extra |= {k: v for k, v in (("window", window), ("softcap", softcap)) if v}
    out = TritonAttention().prefill(q, k, v, k_cache, v_cache, context, scale, **extra)
    ref = reference(lambda *a: TorchAttention().prefill(*a, **extra), q, k, v, k_cache, v_cache, context, scale)
    assert_close(out, ref, dtype, f"prefill lens_q={lens_q} lens_k={lens_k} kv_dtype={kv_dtype} window={window} "
                 f"softcap={softcap}", fp8)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_fresh(group, head_dim, dtype):
    # ragged batch: a single token, a partial tile, several tiles
    check_prefill([1, 17, 300], None, 16, heads=2 * group, kv_heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 2), (32, 128, 4), (256, 64, 1), (256, 128, 2)])
def test_prefill_history(block_size, head_dim, group, dtype):
    # prefix hit (40 of 300), decode-like chunk (1 of 70), no history (17 of 17), later chunk (64 of 130),
    # and 3 of 65: the first query sits at 62, just before a key-tile edge (unmasked/masked loop boundary)
    check_prefill([40, 1, 17, 64, 3], [300, 70, 17, 130, 65], block_size, heads=2 * group, kv_heads=2,
                  head_dim=head_dim, dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("window,softcap", [(16, None), (1, None), (100, None), (None, 0.5), (24, 0.5)])
def test_prefill_window_and_softcap(window, softcap):
    # windows shorter than a key tile, of one key, past a tile edge; soft-capped scores (q, k ~ N(0, 1): scores
    # reach several caps); fresh prompts and chunks over a history (the 3-of-65 chunk sees only cached keys)
    check_prefill([1, 17, 300], None, 16, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, window=window,
                  softcap=softcap)
    check_prefill([40, 1, 64, 3], [300, 70, 130, 65], 16, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16,
                  window=window, softcap=softcap)
    check_prefill([40, 1], [300, 70], 32, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16,
                  kv_dtype=torch.float8_e4m3fn, window=window, softcap=softcap)


# fp8 caches: values written by the torch reference (the interpreter's float32 -> float8 conversion is wrong at
# some exponent boundaries, e.g. 127.9 -> 64 instead of 128, so the quantizing store is checked on the GPU only).
@pytest.mark.interpreter
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,v_token_major", [(16, False), (16, True), (64, True)])
def test_fp8_prefill_history(block_size, v_token_major, dtype, kv_dtype):
    # V token-major as the engine stores an fp8 cache: read through strides (16-token blocks, smaller than a key
    # tile), or whole tiles unmasked (64)
    check_prefill([40, 1, 17, 64, 3], [300, 70, 17, 130, 65], block_size, heads=4, kv_heads=2, head_dim=64,
                  dtype=dtype, kv_dtype=kv_dtype, v_token_major=v_token_major)


@pytest.mark.interpreter
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 4, 64), (8, 8, 256)])
def test_gpu_prefill_fresh(heads, kv_heads, head_dim, dtype):
    check_prefill([1, 17, 300, 2048, 129], None, 16, heads, kv_heads, head_dim, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 16, 8, 128), (256, 16, 8, 128),
                                                               (32, 32, 4, 64)])
def test_gpu_prefill_history(block_size, heads, kv_heads, head_dim, dtype):
    check_prefill([40, 1, 17, 512, 3, 1000], [3000, 70, 17, 1536, 65, 1000], block_size, heads, kv_heads, head_dim,
                  dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_prefill_history_fp8(block_size, kv_dtype):
    check_prefill([40, 1, 17, 512, 3, 1000], [3000, 70, 17, 1536, 65, 1000], block_size, 16, 8, 128, torch.bfloat16,
                  device="cuda", kv_dtype=kv_dtype)
