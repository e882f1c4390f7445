"""Split-K decode attention (kernels/decode.py) against TorchAttention: the engine's split heuristic, forced and
fixed-length splits, padding rows, groups that are no power of two, fp8 caches, V token-major; its split and
early-launch rules (plain CPU); a CUDA graph replayed with other contexts. Interpreted on CPU; compiled on a GPU
(marked gpu). The Hopper TMA-ring decode kernel has its own file (test_decode_tma.py)."""
import pytest
import torch

from nanovllm.kernels.decode import decode_attention
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
    qkv_views,
    random_cache,
    random_fp8_cache,
    reference,
)


def check_decode(context_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, dtype,
                 num_splits: int | None = None, device="cpu", kv_dtype=None, max_split_tokens: int | None = None,
                 v_token_major: bool = False, window: int | None = None, softcap: float | None = None):
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
    fp8 = bool(extra)
    extra |= {k: v for k, v in (("window", window), ("softcap", softcap)) if v}
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
                 f"max_split_tokens={max_split_tokens} window={window} softcap={softcap}", fp8)
    for s, n in enumerate(context_lens):
        if n == 0:  # padding row: zeros, like the reference
            assert torch.equal(out[s], torch.zeros_like(out[s]))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 1), (32, 128, 2), (256, 64, 4), (256, 128, 8)])
def test_decode(block_size, head_dim, group, dtype):
    # 1-token and long contexts, a padding row (context 0, table all -1); the heuristic splits the 600-long one
    check_decode([1, 600, 0, 37, 130], block_size, heads=group * 2, kv_heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("window,softcap", [(16, None), (1, None), (100, None), (None, 0.5), (40, 0.5)])
def test_decode_window_and_softcap(window, softcap):
    # windows inside a key tile, of one key, across splits (600 and 130 long contexts), shorter contexts than the
    # window, a padding row; forced equal splits too; an fp8 cache, V token-major
    lens = [1, 600, 0, 37, 130]
    check_decode(lens, 16, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, window=window, softcap=softcap)
    check_decode(lens, 32, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16, num_splits=3, window=window,
                 softcap=softcap)
    check_decode(lens, 256, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16, kv_dtype=torch.float8_e4m3fn,
                 v_token_major=True, window=window, softcap=softcap)


@pytest.mark.interpreter
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("block_size,v_token_major", [(16, False), (128, True)])
def test_fp8_decode(block_size, v_token_major, num_splits, dtype, kv_dtype):
    # 128-token blocks, V token-major (the engine's fp8 layout): whole tiles read unmasked
    check_decode([1, 600, 0, 37, 130], block_size, heads=4, kv_heads=2, head_dim=64, dtype=dtype,
                 num_splits=num_splits, kv_dtype=kv_dtype, v_token_major=v_token_major)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_decode_splits(num_splits):
    # forced splits: one program per sequence, a few, and more splits than tiles (empty splits)
    check_decode([1, 600, 0, 37], 32, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, num_splits=num_splits)


@pytest.mark.interpreter
@pytest.mark.parametrize("block_size,max_split_tokens", [(16, 32), (16, 64), (16, 4096), (128, 64), (128, 128)])
def test_decode_split_tokens(block_size, max_split_tokens):
    # fixed-length splits: one tile each (a 600-token context takes 19 programs, a 33-token one 2), two tiles, and
    # one split per sequence; contexts of 0, 1, a tile and one past it, on a batch wide enough to need few splits.
    # 128-token blocks: every split inside one block (its table entry read once, beside the context length)
    check_decode([1, 600, 0, 32, 33, 257], block_size, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32,
                 max_split_tokens=max_split_tokens)


@pytest.mark.interpreter
def test_decode_group_of_three():
    # a group that is no power of two (Qwen3-14B has 5): the merge's padded head rows, and more splits (10) than
    # one merge load takes (4 at a padded group of 4)
    check_decode([1, 600, 0, 130], 128, heads=6, kv_heads=2, head_dim=64, dtype=torch.float32, max_split_tokens=64)


@pytest.mark.interpreter
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


@pytest.mark.interpreter
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_decode_v_token_major(kv_dtype):
    # V read through its own strides: a cache whose heads keep their tokens contiguous gives the same attention
    check_decode([1, 600, 0, 37], 16, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16, kv_dtype=kv_dtype,
                 v_token_major=True)


def test_decode_launched_early_and_its_prefetch(monkeypatch):
    # under PDL with the L2 prefetch: a 16-bit cache in fixed splits of 1-2 tiles inside a block: the engine's
    # batches 1-16 (8 KV heads) at a max_model_len of 4,096, not 17 (4-tile splits); past 8,192 tokens their splits
    # hold 3 tiles. Each program asks for all its tiles where the grid is resident at once (an H200's 132 SMs off-GPU:
    # batches 1 and 2, 256 and 512 programs), else for its first (batch 3, 768; batch 16, 4,096)
    from nanovllm.kernels import decode
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert not decode.launched_early(2, 256, 64, 128, bf16, cpu)  # no PDL on CPU
    monkeypatch.setattr(decode, "pdl_enabled", lambda device: True)
    splits = {b: decode.decode_splits(b, 8, 4096, 64, cpu) for b in (1, 2, 3, 16, 17)}
    assert splits == {1: (32, 2), 2: (32, 2), 3: (32, 2), 16: (32, 2), 17: (16, 4)}
    for batch in (1, 16):
        assert decode.decode_splits(batch, 8, 8192, 64, cpu) == (64, 2)
        assert decode.decode_splits(batch, 8, 8448, 64, cpu)[1] == 3
    assert decode.launched_early(2, 256, 64, 128, bf16, cpu) and decode.launched_early(1, 256, 64, 128, bf16, cpu)
    assert not decode.launched_early(4, 256, 64, 128, bf16, cpu)  # batch 17; more tiles than the prefetch covers
    assert not decode.launched_early(3, 256, 64, 128, bf16, cpu)
    assert not decode.launched_early(2, 256, 64, 128, torch.float8_e4m3fn, cpu)  # fp8
    assert not decode.launched_early(2, 256, 64, 128, torch.float32, cpu)  # (128-byte lines of 64 values)
    assert not decode.launched_early(0, 256, 64, 128, bf16, cpu)  # equal runs (tests' num_splits)
    assert not decode.launched_early(2, 64, 64, 128, bf16, cpu)  # a split across blocks
    assert not decode.launched_early(2, 256, 64, 96, bf16, cpu)  # rows not whole 128-byte lines
    assert [decode.prefetch_tiles(b * 8 * 32, 2, cpu) for b in (1, 2, 3, 16)] == [2, 2, 1, 1]
    assert decode.prefetch_tiles(528, 2, cpu) == 2 and decode.prefetch_tiles(529, 2, cpu) == 1
    assert decode.prefetch_tiles(4096, 1, cpu) == 1


def test_early_decode_launch_wiring(monkeypatch):
    # what decode_attention and qk_norm_rope_ pass their kernels where PDL is on (forced here; the kernels are stood
    # in for, nothing runs): early launches at batches 1 and 16 of a 4,096-token bound, with SPLIT_IN_BLOCK (the
    # prefetch needs the split's block) and both tiles asked for at batch 1, the first at 16; not early for an fp8
    # or float32 cache or past 16 (4-tile splits); the rotary kernel triggers first past one token only
    from nanovllm.kernels import decode, rope
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, kw))
    for module in (decode, rope):
        monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(decode, "_decode_kernel", Kernel())
    monkeypatch.setattr(rope, "_qk_norm_rope_kernel", Kernel())
    block_size, kv_heads, head_dim = 256, 8, 128

    def decode_launch(batch, dtype=torch.bfloat16, kv_dtype=None):
        launches.clear()
        k, v = (torch.zeros(4, block_size, kv_heads, head_dim, dtype=kv_dtype or dtype) for _ in range(2))
        scales = {}
        if kv_dtype is not None:
            scales = dict(k_scale=torch.ones(4, kv_heads, block_size), v_scale=torch.ones(4, kv_heads, block_size))
        decode.decode_attention(torch.zeros(batch, 2 * kv_heads, head_dim, dtype=dtype), k, v,
                                torch.ones(batch, dtype=torch.int32), torch.zeros(batch, 16, dtype=torch.int32),
                                head_dim ** -0.5, **scales)
        (grid, _, kw), = launches
        return grid, kw
    for batch, tiles in ((1, 2), (16, 1)):
        grid, kw = decode_launch(batch)
        assert grid == (batch, kv_heads, 32) and kw["EARLY"] and kw["launch_pdl"] and kw["SPLIT_IN_BLOCK"]
        assert kw["PREFETCH_TILES"] == tiles, (batch, kw["PREFETCH_TILES"])
    for grid, kw in (decode_launch(17), decode_launch(16, kv_dtype=torch.float8_e4m3fn),
                     decode_launch(16, dtype=torch.float32)):
        assert not kw["EARLY"] and "launch_pdl" not in kw and kw["PREFETCH_TILES"] == 0 and kw["PDL"], grid
    for tokens in (1, 2, 16, 300):
        launches.clear()
        q, k = torch.zeros(tokens, 16, head_dim), torch.zeros(tokens, kv_heads, head_dim)
        rope.qk_norm_rope_(q, k, torch.zeros(tokens, dtype=torch.int64), torch.zeros(64, head_dim))
        (_, args, kw), = launches
        assert args[-1] == int(tokens > 1) and kw["PDL"] and kw["launch_pdl"], (tokens, args[-1])


def test_decode_split_lengths():
    # The heuristic's choices (H200 shape, 132 SMs; tables 4,096 tokens wide): short splits at small batch, longer
    # ones as the batch grows; a 16-bit cache at batch 256 is not split, an fp8 one in splits of 1,024 tokens
    from nanovllm.kernels.decode import decode_splits
    cpu = torch.device("cpu")

    def split_tokens(batch, quant):
        num_splits, split_tiles = decode_splits(batch, 8, 4096, 128 if quant else 64, cpu, quant=quant)
        return split_tiles * (128 if quant else 64), num_splits

    assert split_tokens(16, False) == (128, 32) and split_tokens(64, False) == (512, 8)
    assert split_tokens(256, False) == (4096, 1)
    assert split_tokens(128, True) == (512, 8) and split_tokens(256, True) == (1024, 4)
    # fp8 with a long bound at large batch: no dozens of mostly empty splits, one per sequence as for 16-bit
    assert decode_splits(512, 8, 131072, 128, cpu, quant=True) == (1, 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 16, 8, 128), (256, 16, 8, 128),
                                                               (256, 32, 4, 64), (32, 8, 8, 256)])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_decode(batch, block_size, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    lens[0] = 4096
    if batch > 1:
        lens[1], lens[-1] = 1, 0  # shortest context and a CUDA-graph padding row
    check_decode(lens, block_size, heads, kv_heads, head_dim, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_fp8(batch, block_size, kv_dtype):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    lens[0] = 4096
    if batch > 1:
        lens[1], lens[-1] = 1, 0
    check_decode(lens, block_size, 16, 8, 128, torch.bfloat16, device="cuda", kv_dtype=kv_dtype)


@pytest.mark.gpu
# the split-K kernel; the TMA ring on Hopper (two 1,024-token chunks of a 1,280-token bound: 1,200 is merged)
@pytest.mark.parametrize("batch,block_size", [(8, 16), (16, 64)])
def test_gpu_decode_cuda_graph(batch, block_size, monkeypatch):
    """Captured once, replayed with other context lengths, tables and queries: the grid must not depend on them."""
    from nanovllm.kernels import decode
    from nanovllm.kernels.hopper import decode_tma
    from nanovllm.layers.attention.torch_ref import TorchAttention
    from nanovllm.layers.attention.triton_backend import TritonAttention
    from nanovllm.layers.context import Context
    heads, kv_heads, head_dim, width = 16, 8, 128, 1280 // block_size
    tma_launches, tma = [], decode_tma.decode_attention_tma
    monkeypatch.setattr(decode_tma, "decode_attention_tma", lambda *a, **k: tma_launches.append(1) or tma(*a, **k))
    k_cache, v_cache = random_cache(batch * width, block_size, kv_heads, head_dim, torch.bfloat16, "cuda")
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    tables = torch.full((batch, width), -1, dtype=torch.int32, device="cuda")
    context = Context(False, context_lens=lens, block_tables=tables)
    backend, scale = TritonAttention(), head_dim ** -0.5
    backend.decode(q, k_cache, v_cache, context, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(q, k_cache, v_cache, context, scale)
    tma_expected = batch == 16 and decode_tma.stages_for(batch * kv_heads, width * block_size,
                                                         decode.sm_count(q.device)) > 0 and decode_tma.usable(
        q, k_cache, v_cache)
    assert bool(tma_launches) == tma_expected
    for new_lens in ([1, 1024, 0, 37, 700, 256, 1, 999], [5, 0, 0, 1200, 3, 17, 512, 100]):
        new_lens = (new_lens * 2)[:batch]
        table = block_tables_for(new_lens, block_size, batch * width, "cuda")
        tables.fill_(-1)
        tables[:, :table.size(1)] = table
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = TorchAttention().decode(q.float(), k_cache.float(), v_cache.float(), context, scale)
        assert_close(out, ref, torch.bfloat16, f"graph replay context_lens={new_lens}")
