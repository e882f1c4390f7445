"""The K/V cache store (kernels/store_kvcache.py) against the torch backend's: scattered slots (a decode step) and
runs of slots (a prefill), skipped slots (-1), V token-major; the quantizing fp8 store's scales and values.
Interpreted on CPU; compiled on a GPU (marked gpu)."""
import pytest
import torch

from nanovllm.layers.attention.fp8 import token_major
from nanovllm.layers.attention.torch_ref import TorchAttention
from nanovllm.layers.attention.triton_backend import TritonAttention
from tests.kernels.helpers import DTYPES, FP8, GPU_DTYPES, fp8_steps, qkv_views, random_cache, slots_for


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


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,head_dim,v_token_major", [(16, 2, 64, False), (32, 1, 128, False),
                                                                       (256, 3, 64, False), (16, 2, 64, True),
                                                                       (256, 3, 64, True)])
@pytest.mark.parametrize("runs", [False, True])
def test_store(block_size, kv_heads, head_dim, v_token_major, runs, dtype):
    check_store(block_size, kv_heads, head_dim, dtype, v_token_major=v_token_major, runs=runs)


@pytest.mark.interpreter
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("v_token_major,runs", [(True, False), (True, True), (False, True)])
def test_store_fp8(kv_dtype, v_token_major, runs):
    """The quantizing store's scales, exactly (a scale off by any factor, e.g. amax / (fp8 max / 2), fails)."""
    check_store_fp8(16, 2, 64, torch.float32, kv_dtype, device="cpu", v_token_major=v_token_major, runs=runs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_store(block_size, dtype):
    for runs in (False, True):
        check_store(block_size, 8, 128, dtype, device="cuda", runs=runs)
        check_store(block_size, 8, 128, dtype, device="cuda", v_token_major=True, runs=runs)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_store_fp8(block_size, kv_dtype):
    for runs in (False, True):  # scattered slots, and prefill-like runs (the kernel's contiguous path)
        check_store_fp8(block_size, 8, 128, torch.bfloat16, kv_dtype, device="cuda", runs=runs)
