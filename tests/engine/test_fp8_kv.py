"""kv_cache_dtype="fp8": an 8-bit KV cache with a float32 scale per token and head (layers/attention/fp8.py).
On CPU the torch backend is the path under test; the Triton kernels are checked in tests/kernels/."""
import os
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.attention import fp8, torch_ref
from nanovllm.layers.attention.base import AttentionBackend
from tests.tiny_models import make_checkpoint

SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)


def _prompts(seed: int, count: int, lo: int = 4, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@pytest.fixture(scope="module")
def large_k(tmp_path_factory) -> str:
    """A tiny Qwen3 whose keys are about 1000 times larger than usual (k_norm x 1000) and queries 1000 times smaller
    (q_norm / 1000): the same model in float32, but keys far past fp8's range unless each row gets its scale."""
    from safetensors.torch import load_file, save_file
    path = make_checkpoint(tmp_path_factory.mktemp("large_k"), "qwen3", tie=True, num_kv_heads=2,
                           initializer_range=0.1)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in tensors:
        if name.endswith("k_norm.weight"):
            tensors[name] = tensors[name] * 1000
        elif name.endswith("q_norm.weight"):
            tensors[name] = tensors[name] / 1000
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def quality(path: str, prompts: list[list[int]], max_tokens: int = 64, **options) -> dict:
    """Greedy fp8 against float32: share of prompts equal token for token, and |delta logprob| of the chosen
    tokens while the two agree."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ref = LLM(path, **SMALL).generate(prompts, sp, use_tqdm=False)
    outs = LLM(path, kv_cache_dtype="fp8", **{**SMALL, **options}).generate(prompts, sp, use_tqdm=False)
    equal, deltas, firsts = 0, [], []
    for out, r in zip(outs, ref):
        a, b = out["token_ids"], r["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), max_tokens)
        equal += first == max_tokens
        firsts.append(first)
        deltas += [abs(out["logprobs"][i][a[i]] - r["logprobs"][i][b[i]]) for i in range(first)]
    return {"equal": equal / len(prompts), "mean": sum(deltas) / len(deltas), "max": max(deltas),
            "median_first_divergence": sorted(firsts)[len(firsts) // 2]}


def _within_bounds(q: dict) -> bool:
    return q["mean"] <= 0.05 and q["max"] <= 0.3 and q["median_first_divergence"] >= 4


def test_quantize_round_trip():
    x = torch.randn(50, 3, 64) * torch.exp(3 * torch.randn(50, 3, 1))  # rows from tiny to huge
    x[0, 0] = 0  # an all-zero row stays zeros
    for dtype, fmax, step in ((torch.float8_e4m3fn, 448.0, 2 ** -3), (torch.float8_e5m2, 57344.0, 2 ** -2)):
        values, scale = fp8.quantize(x, dtype)
        assert values.dtype == dtype and scale.shape == (50, 3)
        # the scale, from the format's documented largest value: each row's largest magnitude maps onto it
        expected = (x.abs().amax(-1) / fmax).clamp(min=fp8.MIN_SCALE)
        assert torch.equal(scale, expected)
        back = fp8.dequantize(values, scale)
        assert torch.equal(back[0, 0], torch.zeros(64))
        # one rounding: at most half a step of each value, or of the smallest normal step of the row's scale
        bound = step / 2 * x.abs() + expected.unsqueeze(-1) * 2.0 ** -6
        assert ((back - x).abs() <= bound).all()


def test_quality_bounds_hold_and_a_broken_scale_breaks_them(large_k, monkeypatch):
    prompts = _prompts(0, 16)
    torch_backend = dict(attention_backend="torch")  # (the backend whose quantize is broken below, on a GPU too)
    good = quality(large_k, prompts, **torch_backend)
    assert _within_bounds(good), good
    # all scales 1.0: keys of ~1000 saturate at fp8's largest value (448)
    monkeypatch.setattr(torch_ref, "quantize", lambda x, dtype: (x.float().clamp(-448, 448).to(dtype),
                                                                 torch.ones(x.shape[:-1], device=x.device)))
    broken = quality(large_k, prompts, **torch_backend)
    assert not _within_bounds(broken), broken


def test_every_regime_stays_within_the_bounds(large_k):
    """Chunked prefill (history read back from the fp8 cache), preemption, prefix hits and async scheduling."""
    prompts = _prompts(1, 12, 20, 90)
    prompts.append(prompts[0] + [5, 6, 7])  # a prefix hit
    chunked = quality(large_k, prompts, max_num_batched_tokens=40)
    assert _within_bounds(chunked), chunked
    tight = quality(large_k, prompts[:6], **{"num_kvcache_blocks": 14, "max_model_len": 160})  # forces preemption
    assert _within_bounds(tight), tight


def test_a_prefix_hit_a_chunked_prefill_or_a_batch_changes_nothing(qwen3_tied):
    """Attention reads every key and value back from the fp8 cache, a prompt's own too: a request gives what it gives
    on a fresh engine alone when its prefix comes from the cache, its prefill is chunked, or it shares a step with a
    sequence that has history (a prefill without history attended over its unquantized K/V: its first logprobs moved
    by up to 0.1 with a prefix hit, and greedy tokens followed)."""
    base, other = _prompts(3, 1, 48, 48)[0], _prompts(5, 1, 30, 30)[0]
    prompts = [base + tail for tail in _prompts(4, 3, 1, 20)] + [other]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    options = dict(kv_cache_dtype="fp8", **SMALL)
    alone = [LLM(qwen3_tied, **options).generate([p], sp, use_tqdm=False)[0] for p in prompts]

    def check(outs, refs, how):
        for out, ref in zip(outs, refs, strict=True):
            assert out["token_ids"] == ref["token_ids"], how
            for got, want in zip(out["logprobs"], ref["logprobs"]):
                assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-3 for t in got), how

    llm = LLM(qwen3_tied, **options)
    llm.generate([base], sp, use_tqdm=False)
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts[:3]]
    assert [out["num_cached_tokens"] for out in outs] == [48] * 3
    check(outs, alone[:3], "a prefix hit")
    # the last prompt shares its prefill step with a prefix hit
    check(llm.generate([base + [9], other], sp, use_tqdm=False)[1:], alone[3:], "beside a prefix hit")
    check(LLM(qwen3_tied, max_num_batched_tokens=20, **options).generate(prompts, sp, use_tqdm=False), alone,
          "chunked")


def test_async_scheduling_n_samples_and_sleep_equal_the_plain_fp8_loop(large_k):
    prompts = _prompts(2, 5)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=20, ignore_eos=True)] * 2 + \
             [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)]
    plain = LLM(large_k, kv_cache_dtype="fp8", **SMALL)
    expected = plain.generate(prompts, params, use_tqdm=False)
    overlapped = LLM(large_k, kv_cache_dtype="fp8", async_scheduling=True, **SMALL)
    assert [o["outputs"] for o in overlapped.generate(prompts, params, use_tqdm=False)] == \
        [o["outputs"] for o in expected]
    greedy_n = plain.generate(prompts[:1], SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)[0]  # the forked sample reads a copied fp8 block and its scales
    assert [o["token_ids"] for o in greedy_n["outputs"]] == [expected[0]["token_ids"]] * 2
    plain.sleep(level=1)
    plain.wake_up()
    assert [o["outputs"] for o in plain.generate(prompts, params, use_tqdm=False)] == \
        [o["outputs"] for o in expected]


def test_the_cache_holds_about_twice_the_tokens(qwen3_tied):
    sizes = {dt: LLM(qwen3_tied, kvcache_block_size=16, max_model_len=256, cpu_kvcache_gb=0.01, dtype="bfloat16",
                     kv_cache_dtype=dt).num_kvcache_blocks for dt in ("auto", "fp8", "fp8_e5m2")}
    # head_dim 16: a 16-bit row is 32 bytes, an fp8 row 16 + a 4-byte scale (on a GPU the cache is sized from free
    # memory, which moves a little from one engine to the next)
    assert sizes["fp8"] == pytest.approx(sizes["fp8_e5m2"], rel=0.001)
    assert sizes["fp8"] / sizes["auto"] == pytest.approx(32 / 20, rel=0.01)


def test_an_fp8_cache_stores_v_token_major_and_starts_finite(qwen3_tied):
    # The kernels read whole V tiles past a context (weight 0): the bytes there must be finite, so the cache starts
    # zeroed (on CUDA the start-up's kernel warm-up then writes a few tokens into the first blocks); V is
    # token-major (each head's tokens contiguous), K as the 16-bit cache
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256, kv_cache_dtype="fp8")
    runner = llm.executor.runner
    assert torch.isfinite(runner.kv_cache.float()).all() and torch.isfinite(runner.kv_scale).all()
    if not runner.is_cuda:
        assert not runner.kv_cache.view(torch.uint8).any() and not runner.kv_scale.any()
    attn = runner.attn_layers[0]
    assert attn.k_cache.shape == attn.v_cache.shape and attn.k_cache.stride(-1) == 1 and attn.v_cache.stride(1) == 1
    prompt = list(range(3, 40))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert attn.v_cache.view(torch.uint8).any()  # written through the views (outputs: the quality tests above)


def test_bad_kv_cache_dtype_and_a_backend_without_fp8(qwen3_tied):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"):
        LLM(qwen3_tied, kv_cache_dtype="int8")

    class NoFp8(AttentionBackend):
        name, supports_fp8_kv_cache = "no_fp8", False
    NoFp8().check_kv_cache_dtype(torch.bfloat16)
    with pytest.raises(ValueError, match="cannot read an fp8 KV cache; use attention_backend='triton'"):
        NoFp8().check_kv_cache_dtype(torch.float8_e4m3fn)
    from nanovllm.layers.attention.flash_attn_backend import FlashAttention
    assert not FlashAttention.supports_fp8_kv_cache
