"""Engine on CUDA (skipped without a GPU): exact greedy tokens in float32, graphs equal eager."""
import os
import random
import subprocess
import sys

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.cuda_graph import bucket_for, decode_buckets
from tests.compare import assert_near_float32
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def no_tf32():
    # float32 matmuls must really be float32 for token-exact comparisons
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("eager", [True, False])
def test_cuda_greedy_matches_transformers(qwen3_tied, backend, block_size, eager):
    llm = LLM(qwen3_tied, device="cuda", dtype="float32", kvcache_block_size=block_size, enforce_eager=eager,
              attention_backend=backend, max_num_seqs=37, max_model_len=1024, num_kvcache_blocks=4096 // block_size)
    prompts = _prompts(0, [3, 17, 70, 300, 513])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(qwen3_tied, prompt, 24)
    llm.exit()


@pytest.mark.parametrize("eager", [True, False])
def test_cuda_yarn_matches_transformers(tmp_path, eager):
    """YaRN (its attention factor carried by the cos/sin table) through the fused q/k-norm rotary kernel, eager and
    under graphs, on prompts past the original context."""
    from tests.tiny_models import make_checkpoint
    path = make_checkpoint(tmp_path, "qwen3", tie=False, rope_theta=1e6, max_position_embeddings=256,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=None, kvcache_block_size=16, num_kvcache_blocks=64,
              enforce_eager=eager)
    assert llm.config.max_model_len == 256
    prompts = _prompts(3, [40, 150, 230])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(path, prompt, 16)
    llm.exit()


def test_cuda_chunked_prefill_prefix_cache_and_preemption(qwen3_untied_mha):
    llm = LLM(qwen3_untied_mha, device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=40,
              max_model_len=256, max_num_batched_tokens=100)
    prompts = _prompts(1, [120, 60, 200, 33, 90])
    prompts.append(prompts[0] + [5, 6, 7])  # a prefix hit
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(qwen3_untied_mha, prompt, 40)
    llm.exit()


@pytest.mark.parametrize("eager", [True, False])
def test_cuda_lora_matches_peft(qwen3_tied, lora_attention, lora_mixed, eager):
    """The LoRA kernels in the engine: base-model and adapter requests in prefill (chunked) and decode, under the
    decode graphs' LoRA variant, give transformers + PEFT's tokens; a base-only call after them, the plain graphs'."""
    from tests.lora.adapters import peft_greedy
    llm = LLM(qwen3_tied, device="cuda", dtype="float32", enable_lora=True, max_loras=2, kvcache_block_size=16,
              enforce_eager=eager, max_num_batched_tokens=64, max_model_len=512, max_num_seqs=37)
    prompts = _prompts(3, [5, 40, 17, 150, 3, 90, 33])
    loras = [None, lora_attention, lora_mixed, lora_mixed, lora_attention, None, lora_attention]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(prompts, loras, outs):
        want = hf_greedy(qwen3_tied, prompt, 24) if lora is None else peft_greedy(qwen3_tied, lora.lora_path, prompt,
                                                                                  24)
        assert out["token_ids"] == want, (lora, len(prompt))
    outs = llm.generate(prompts[:2], sp, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(qwen3_tied, p, 24) for p in prompts[:2]]
    llm.exit()


def test_graph_replay_equals_eager(qwen3_tied):
    prompts = _prompts(2, [5, 40, 100, 7, 64, 250, 31])
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    results = []
    for eager in (True, False):
        llm = LLM(qwen3_tied, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=100,
                  max_model_len=512, num_kvcache_blocks=16)
        results.append(llm.generate(prompts, sp, use_tqdm=False))
        llm.exit()
    for a, b in zip(*results):
        assert a["token_ids"] == b["token_ids"]
        for da, db in zip(a["logprobs"], b["logprobs"]):
            for tid in da:
                assert abs(da[tid] - db[tid]) < 1e-3


def test_async_scheduling_equals_the_plain_loop(qwen3_tied):
    prompts = _prompts(4, [5, 40, 100, 7, 64, 250, 31])
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=40, seed=5, logprobs=2, repetition_penalty=1.2)] * 4
    results = []
    for overlap in (False, True):
        llm = LLM(qwen3_tied, device="cuda", dtype="float32", max_num_seqs=100, max_model_len=512,
                  num_kvcache_blocks=16, async_scheduling=overlap)
        results.append(llm.generate(prompts, params[: len(prompts)], use_tqdm=False))
        llm.exit()
    for a, b in zip(*results):
        assert a["token_ids"] == b["token_ids"]


def test_every_batch_size_finds_a_graph(qwen3_tied):
    llm = LLM(qwen3_tied, device="cuda", dtype="bfloat16", max_num_seqs=100, max_model_len=256,
              gpu_memory_utilization=0.5)  # the KV cache carved from free memory
    assert llm.executor.runner.graphs.buckets[-1] == 100
    for bs in range(1, 101):
        assert bucket_for(decode_buckets(100), bs) >= bs
    prompts = _prompts(3, [8] * 100)  # 97..100 once failed in nano-vllm
    outs = llm.generate(prompts[:97], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o["token_ids"]) == 4 for o in outs)
    llm.exit()


COMPILE_PROBE = """
import json, sys, threading
from triton import knobs
events = []
knobs.compilation.listener = lambda **kw: events.append(
    (kw["src"].fn.__name__ if hasattr(kw["src"], "fn") else "?", threading.current_thread().name, kw["cache_hit"]))
from nanovllm import LLM, LoRARequest, SamplingParams
adapters = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(sys.argv[2:])]  # LoRA: the base model
lora = dict(enable_lora=True, max_loras=len(adapters)) if adapters else {}  # and each adapter in every call
llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_num_seqs=40, max_model_len=512, num_kvcache_blocks=64,
          **lora)
start = list(events)
del events[:]
for n, length in ((1, 5), (3, 40), (16, 9), (40, 200)):
    requests = [([None] + adapters)[i % (1 + len(adapters))] for i in range(n)] if adapters and n > 1 else None
    llm.generate([[7] * length] * n, SamplingParams(temperature=0.6, max_tokens=6, ignore_eos=True), use_tqdm=False,
                 lora_request=requests)
# seeded rows (the keyed race; top-k: their draws by token id) and the three penalty variants
for opts in (dict(seed=3), dict(seed=3, top_k=20), dict(seed=3, top_p=0.9), dict(repetition_penalty=1.2),
             dict(presence_penalty=0.5, frequency_penalty=0.5), dict(repetition_penalty=1.2, frequency_penalty=0.5)):
    for n in (1, 40):
        llm.generate([[7] * 9] * n, SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True, **opts),
                     use_tqdm=False)
llm.exit()
print(json.dumps({"start": start, "run": events}))
"""


@pytest.mark.parametrize("lora", [False, True])
def test_start_up_compiles_ahead_and_no_step_compiles(qwen3_tied, tmp_path, lora, request):
    # A fresh Triton cache: every kernel compiles on compile_ahead's threads (engine/warmup.py), the model's and the
    # sampler's, and no step of a run compiles or loads one (every batch size's variant is there already: prefill
    # with and without history, each decode bucket, the LM head's small-batch kernels; with LoRA, its kernels in
    # prefill and in the decode graphs' LoRA variant).
    import json
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    adapters = [request.getfixturevalue(name).lora_path for name in ("lora_attention", "lora_mixed")] if lora else []
    out = subprocess.run([sys.executable, "-c", COMPILE_PROBE, qwen3_tied, *adapters], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    events = json.loads(out.stdout.strip().splitlines()[-1])
    assert events["run"] == [], events["run"]
    ahead = [name for name, thread, _ in events["start"] if thread.startswith("triton-compile")]
    serial = {name for name, thread, _ in events["start"] if not thread.startswith("triton-compile")}
    assert len(ahead) >= 10, events["start"]
    assert not serial, events["start"]


def test_bench_runs_on_the_dummy_qwen3_0_6b():
    args = ["--num-seqs", "16", "--min-input", "16", "--max-input", "256", "--min-output", "8", "--max-output", "64",
            "--no-tqdm"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tok/s" in out.stdout


@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_n_samples_and_prompt_logprobs(qwen3_tied, block_size):
    """Forked samples (shared blocks, a copied partial block) and prompt logprobs on the Triton backend with graphs
    and async scheduling, in float32: exact against transformers."""
    from tests.tiny_models import hf_model
    llm = LLM(qwen3_tied, device="cuda", dtype="float32", kvcache_block_size=block_size, max_model_len=1024,
              num_kvcache_blocks=4096 // block_size, max_num_batched_tokens=256)
    prompts = _prompts(6, [21, 300, 32])
    sp = SamplingParams(n=4, temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert [o["token_ids"] for o in out["outputs"]] == [hf_greedy(qwen3_tied, prompt, 20)] * 4
        with torch.no_grad():
            reference = torch.log_softmax(hf_model(qwen3_tied)(torch.tensor([prompt])).logits[0].float(), -1)
        assert out["prompt_logprobs"][0] is None
        for p in range(1, len(prompt)):
            for token, value in out["prompt_logprobs"][p].items():
                assert abs(value - reference[p - 1, token].item()) < 1e-3
            assert set(reference[p - 1].topk(2).indices.tolist()) <= set(out["prompt_logprobs"][p])  # the top 2
    seeded = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    a, b = (llm.generate(prompts[:1], seeded, use_tqdm=False)[0] for _ in range(2))
    assert [o["token_ids"] for o in a["outputs"]] == [o["token_ids"] for o in b["outputs"]]
    assert len({tuple(o["token_ids"]) for o in a["outputs"]}) == 4
    llm.exit()


@pytest.fixture(scope="module")
def qwen3_attention_shape(tmp_path_factory):
    """Qwen3-0.6B's attention (16 query and 8 KV heads of 128), small elsewhere: batches of 12-33 decode on the TMA
    ring (kernels/decode_tma.py) where it serves."""
    from tests.tiny_models import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_attention_shape"), "qwen3", num_heads=16, num_kv_heads=8,
                           head_dim=128, hidden=128)


@pytest.mark.parametrize("kv_cache_dtype,tolerance", [("auto", 0.25), ("fp8", 0.5)])
def test_cuda_bf16_batch_16_on_the_tma_ring(qwen3_attention_shape, kv_cache_dtype, tolerance, monkeypatch):
    """Batch 16 in bfloat16 with graphs, decode attention on the TMA ring (a 16-bit or an fp8 cache): on the
    sequences it generated, each token is within `tolerance` nats of the best under transformers in float32, and
    its logprob within `tolerance` of float32's (0.25 as test_engine's bfloat16 test; fp8 adds its rounding of K/V,
    up to 0.26 nats on the bundled model in float32, docs/benchmarks.md)."""
    from nanovllm.kernels.hopper import decode_tma
    from tests.tiny_models import hf_model
    scaled, tma = [], decode_tma.decode_attention_tma
    monkeypatch.setattr(decode_tma, "decode_attention_tma",
                        lambda *a, **k: scaled.append(len(a) > 9 and a[9] is not None) or tma(*a, **k))
    llm = LLM(qwen3_attention_shape, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=1024,
              num_kvcache_blocks=64, kv_cache_dtype=kv_cache_dtype)
    prompts = _prompts(11, [100 + 37 * i for i in range(16)])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    llm.exit()
    if not scaled:
        pytest.skip("decode attention did not run on the TMA ring here (it needs Hopper and Gluon)")
    assert set(scaled) == {kv_cache_dtype == "fp8"}  # the fp8 cache's scales reached the ring
    assert_near_float32(hf_model(qwen3_attention_shape), prompts, outs, tolerance)


def test_cuda_fp8_kv_cache_graphs_equal_eager(qwen3_tied):
    """An fp8 cache through the Triton kernels: decode graphs give the eager tokens; chunked prefill reads fp8
    history; the first token (its prompt's K/V read back from the cache, as every prefill's are) is within 0.5 nats
    of transformers' best in float32 (the fp8 tolerance of the bfloat16 tests; on CPU the torch backend's first
    tokens here are transformers' own, within 0.2 nats)."""
    from tests.tiny_models import hf_model
    prompts = _prompts(7, [5, 40, 100, 7, 64, 250, 31])
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    results = []
    for eager in (True, False):
        llm = LLM(qwen3_tied, device="cuda", dtype="float32", kv_cache_dtype="fp8", enforce_eager=eager,
                  max_num_seqs=100, max_model_len=512, num_kvcache_blocks=16, max_num_batched_tokens=128)
        results.append(llm.generate(prompts, sp, use_tqdm=False))
        llm.exit()
    for a, b in zip(*results):
        assert a["token_ids"] == b["token_ids"]
    firsts = [{"token_ids": out["token_ids"][:1], "logprobs": out["logprobs"][:1]} for out in results[0]]
    assert_near_float32(hf_model(qwen3_tied), prompts, firsts, 0.5)


@pytest.mark.gpu
def test_an_engine_dropped_in_a_reference_cycle_frees_its_memory_for_the_next(qwen3_tied):
    # both size their KV cache from free memory (most of the GPU): the first, dropped while a reference cycle still
    # holds it, must not keep that memory from the second (the engine collects garbage as it starts)
    import gc
    first = LLM(qwen3_tied, kvcache_block_size=16)
    first.cycle = first
    blocks = first.num_kvcache_blocks
    gc.disable()  # (no collection by chance in between: only the engine's own)
    try:
        del first
        second = LLM(qwen3_tied, kvcache_block_size=16)
    finally:
        gc.enable()
    assert second.num_kvcache_blocks > blocks // 2
    second.exit()
