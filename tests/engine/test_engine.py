"""End to end on CPU: greedy tokens equal transformers' own generate in float32."""
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.tiny_models import hf_greedy, hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


def _check_exact(path: str, outputs: list[dict], prompts: list[list[int]], max_tokens: int = 24):
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
        assert out["finish_reason"] == "length"


@pytest.mark.parametrize("fixture", ["qwen3_tied", "qwen3_untied_mha"])
def test_greedy_matches_transformers(request, fixture):
    path = request.getfixturevalue(fixture)
    llm = LLM(path, kvcache_block_size=16)
    prompts = _prompts(0, [3, 15, 16, 17, 70, 300])  # from a few tokens to many blocks
    _check_exact(path, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


def test_default_block_size_and_text(qwen3_tied):
    llm = LLM(qwen3_tied)
    prompts = _prompts(1, [5, 260])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check_exact(qwen3_tied, outs, prompts)
    assert outs[0]["text"] == llm.tokenizer.decode(outs[0]["token_ids"], skip_special_tokens=True)
    text_out = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0]
    ids = llm.tokenizer.encode("The capital of France is")
    assert text_out["token_ids"] == hf_greedy(qwen3_tied, ids, 24)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_block_sizes(qwen3_tied, block_size):
    llm = LLM(qwen3_tied, kvcache_block_size=block_size)
    prompts = _prompts(2, [block_size - 1, block_size, 2 * block_size + 3])
    _check_exact(qwen3_tied, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


def test_chunked_prefill(qwen3_tied):
    # 50 tokens per step: long prompts are split over several steps and resumed from the cache.
    llm = LLM(qwen3_tied, kvcache_block_size=16, max_num_batched_tokens=50)
    prompts = _prompts(3, [120, 7, 49, 51, 200])
    _check_exact(qwen3_tied, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


def test_preemption(qwen3_tied):
    # 12 blocks of 16 tokens for 6 sequences that need ~4 blocks each: decode must preempt and recompute.
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192)
    prompts = _prompts(4, [30, 35, 40, 20, 45, 33])
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    preempted = []
    original = llm.scheduler.preempt
    llm.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert preempted, "the test should force preemption"
    _check_exact(qwen3_tied, outs, prompts, 30)
    assert llm.scheduler.block_manager.num_free_blocks == 12


def test_chunked_prefill_and_preemption_together(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=14, max_model_len=200,
              max_num_batched_tokens=40, enable_prefix_caching=False)
    prompts = _prompts(5, [90, 60, 75, 10])
    _check_exact(qwen3_tied, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


def _watch_allocations(llm) -> list[tuple[int, int]]:
    """(completion tokens, cached tokens) of every sequence the scheduler admits, as it is admitted."""
    seen = []
    allocate = llm.scheduler.block_manager.allocate

    def watch(seq):
        allocate(seq)
        seen.append((seq.num_completion_tokens, seq.num_cached_tokens))
    llm.scheduler.block_manager.allocate = watch
    return seen


def test_num_cached_tokens_is_the_hit_of_the_first_admission(qwen3_tied):
    """Distinct prompts, preempted and recomputed: a readmitted sequence gets its own blocks back from the
    prefix cache, but the reported num_cached_tokens stays what its first admission hit (0)."""
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192)
    admissions = _watch_allocations(llm)
    prompts = _prompts(4, [30, 35, 40, 20, 45, 33])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert any(done and cached for done, cached in admissions), "a readmitted sequence should hit its own blocks"
    assert [o["num_cached_tokens"] for o in outs] == [0] * len(prompts)
    assert all(len(o["token_ids"]) == 30 for o in outs)


def test_same_block_after_another_prefix_is_not_reused(qwen3_tied):
    """Prefix-cache hashes chain: a block of the same 16 tokens after another prefix holds other K/V."""
    llm = LLM(qwen3_tied, kvcache_block_size=16)
    x, y, tail, tail2 = _prompts(15, [16, 16, 5, 7])
    assert llm.generate([x + y + tail], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 0
    out = llm.generate([y + tail2], GREEDY, use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 0
    _check_exact(qwen3_tied, [out], [y + tail2])
    assert llm.generate([x + y + tail2], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 32  # the same chain


def test_prefix_cache_hit_stays_exact(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16)
    base = _prompts(6, [50])[0]
    first = llm.generate([base], GREEDY, use_tqdm=False)[0]
    assert first["num_cached_tokens"] == 0
    longer = base + _prompts(7, [20])[0]
    out = llm.generate([longer], GREEDY, use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 48  # three full blocks of the earlier prompt
    _check_exact(qwen3_tied, [out], [longer])
    # the same prompt again: every full block before the last token comes from the cache
    again = llm.generate([longer], GREEDY, use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 64
    assert again["token_ids"] == out["token_ids"]


def test_prefix_cache_shared_within_batch_and_disabled(qwen3_tied):
    """Prompts of one call share a 40-token prefix (45, 49 and 53 tokens). With 45 tokens a step, the first
    prompt is computed alone; the next two are admitted a step later and hit its two full blocks. Called again,
    each hits its own earlier blocks. Turned off, nothing hits."""
    shared = _prompts(8, [40])[0]
    prompts = [shared + tail for tail in _prompts(9, [5, 9, 13])]
    llm = LLM(qwen3_tied, kvcache_block_size=16, max_num_batched_tokens=45)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["num_cached_tokens"] for o in outs] == [0, 32, 32]
    _check_exact(qwen3_tied, outs, prompts)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["num_cached_tokens"] for o in again] == [32, 48, 48]
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in outs]

    del llm  # (on a GPU the next engine sizes its cache from the memory this one frees)
    llm = LLM(qwen3_tied, kvcache_block_size=16, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o["num_cached_tokens"] == 0 for o in outs)
    _check_exact(qwen3_tied, outs, prompts)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o["num_cached_tokens"] == 0 for o in again)


def test_eos_stops_and_max_model_len(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, max_model_len=40)
    prompt = _prompts(10, [30])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(prompt) + len(out["token_ids"]) == 40
    # make the first greedy token an EOS id: generation stops there with finish_reason "stop"
    first = out["token_ids"][0]
    llm.scheduler.eos_token_ids = {first}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert out["token_ids"] == [first] and out["finish_reason"] == "stop"


def test_sampling_is_reproducible_and_varied(qwen3_tied):
    prompts = _prompts(11, [12, 12])
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = LLM(qwen3_tied, seed=1).generate(prompts, sp, use_tqdm=False)
    b = LLM(qwen3_tied, seed=1).generate(prompts, sp, use_tqdm=False)
    c = LLM(qwen3_tied, seed=2).generate(prompts, sp, use_tqdm=False)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    assert [o["token_ids"] for o in a] != [o["token_ids"] for o in c]


def test_per_prompt_sampling_params_and_many_sequences(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, max_num_seqs=4)  # more prompts than one batch holds
    prompts = _prompts(12, [4, 8, 12, 16, 20, 24, 28])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(3, 10)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs):
        assert out["token_ids"] == hf_greedy(qwen3_tied, prompt, sp.max_tokens)


def test_garbage_in_unused_cache_slots_is_ignored(qwen3_tied):
    # The cache is torch.empty: memory freed by an earlier engine may hold NaN, and a decode step
    # reads whole blocks, past each sequence's length.
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    llm.executor.runner.kv_cache.fill_(float("nan"))
    prompts = _prompts(13, [5, 21])
    _check_exact(qwen3_tied, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


def test_compile_buckets_hold_every_kind_of_bucket():
    # the start-up's first compile pass (cuda_graph.compile_buckets) meets every kind of bucket: each side of 1 and
    # 16 rows, each Triton integer class (1, a multiple of 16, other), every MoE row tile
    import math

    from nanovllm.engine.cuda_graph import compile_buckets, decode_buckets
    from nanovllm.kernels.fused_moe import moe_tiles

    def kind(bs: int):
        return bs == 1, bs <= 16, bs == 1 or bs % 16 == 0
    for max_num_seqs in (1, 3, 8, 16, 17, 37, 100, 256, 512, 1000):
        buckets = decode_buckets(max_num_seqs)
        chosen = compile_buckets(buckets)
        assert set(chosen) <= set(buckets) and chosen[-1] == buckets[-1]
        assert len(chosen) <= 6 + math.ceil(math.log2(max_num_seqs)), chosen
        assert {kind(b) for b in buckets} == {kind(b) for b in chosen}
        for experts, top_k in ((8, 2), (60, 4), (64, 6), (128, 8)):
            tiles = {b: moe_tiles(b * top_k, experts, torch.bfloat16) for b in buckets}
            assert set(tiles.values()) == {tiles[b] for b in chosen}


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_warmup_covers_every_variant_and_leaves_the_engine_exact(qwen3_tied, block_size):
    """The CUDA start-up's second warm-up (every query tile size, with and without cached history) is
    device-independent: run it here."""
    from nanovllm.engine import warmup
    llm = LLM(qwen3_tied, kvcache_block_size=block_size)
    runner, seen = llm.executor.runner, set()
    prefill = runner.backend.prefill
    runner.backend.prefill = lambda *a: (seen.add((a[5].max_seqlen_q, a[5].block_tables is not None)), prefill(*a))[1]
    for seqs in warmup.prefill_variants(runner):
        warmup.prefill(runner, seqs)
    runner.backend.prefill = prefill
    assert seen == {(n, paged) for n in warmup.PREFILL_QUERY_LENS for paged in (False, True)}
    # ... and those query lengths reach every tile the Triton prefill kernel can pick
    import torch

    from nanovllm.kernels.prefill import _prefill_config
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float32, 128)):
        tiles = {_prefill_config(head_dim, dtype, n) for n in range(1, 4097)}
        assert tiles == {_prefill_config(head_dim, dtype, n) for n in warmup.PREFILL_QUERY_LENS}
    prompts = _prompts(13, [20, 40])
    _check_exact(qwen3_tied, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


def test_the_max_size_warmup_runs_where_cuda_runs_it(qwen3_tied, monkeypatch):
    """CUDA sizes the KV cache after a max-size prefill (warmup.warmup), halfway through the runner's start: whatever
    a step reads must be set by then (a tensor-parallel attribute set after it once made every CUDA start raise).
    Run it at that point here, then check the engine is still exact."""
    from nanovllm.engine import kv_cache, warmup
    count_blocks, ran = kv_cache.count_blocks, []

    def warm_then_count(runner):
        warmup.warmup(runner)
        ran.append(runner.rank)
        return count_blocks(runner)
    monkeypatch.setattr(kv_cache, "count_blocks", warm_then_count)
    llm = LLM(qwen3_tied, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8)
    assert ran == [0]
    prompts = _prompts(14, [9, 30])
    _check_exact(qwen3_tied, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


def test_full_prefix_hit_never_writes_into_a_shared_block(qwen3_tied):
    # (the plain loop: with async scheduling, CUDA's default, llm.step() returns before the new request's prefill)
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=20, max_model_len=128, async_scheduling=False)
    prompt = _prompts(14, [32])[0]  # exactly two full blocks
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = llm.add_request(prompt, sp)
    llm.step(), llm.step()  # the first request is decoding; both its blocks are cached
    assert first.num_completion_tokens == 2
    written = []  # every slot the step writes: through the store kernel, or the rotary kernel (Triton, CUDA)
    store = llm.executor.runner.backend.store_kvcache
    llm.executor.runner.backend.store_kvcache = lambda k, v, kc, vc, slots: (written.extend(slots.tolist()),
                                                                          store(k, v, kc, vc, slots))
    from nanovllm.layers.attention import Attention
    for attn in (m for m in llm.executor.runner.model.modules() if isinstance(m, Attention)):
        def target(original=attn.store_target):
            found = original()
            if found is not None:
                written.extend(found[2].tolist())
            return found
        attn.store_target = target
    bm = llm.scheduler.block_manager
    seq = llm.add_request(prompt, sp)
    llm.step()  # the second request's prefill
    shared = {b for b in seq.block_table if bm.blocks[b].ref_count > 1}
    assert shared and seq.num_prefix_hit_tokens == 16
    assert not {slot // 16 for slot in written} & shared


def test_collective_rpc_on_one_rank(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=20, max_model_len=128)
    [info] = llm.collective_rpc("describe")
    hf_params = sum(p.numel() for p in hf_model(qwen3_tied).parameters())
    cuda = llm.config.device == "cuda"  # (this suite runs on a GPU too: gpu_suite.sh engine_cuda)
    assert info == {"rank": 0, "device": "cuda:0" if cuda else "cpu", "num_kvcache_blocks": 20,
                    "num_parameters": hf_params, "cuda_graphs": cuda}
    for bad in ("_prepare_decode", "no_such_method", 3):
        with pytest.raises(ValueError, match="not a public ModelRunner method; valid:.*describe"):
            llm.collective_rpc(bad)
    with pytest.raises(TypeError, match="bad arguments for ModelRunner.describe"):
        llm.collective_rpc("describe", kwargs={"depth": 1})
    for method, instead in (("update_weights", "update_weights"), ("sleep", "sleep"), ("wake_up", "wake_up")):
        with pytest.raises(ValueError, match=f"would bypass the engine's prefix cache .* call llm.{instead}\\(\\)"):
            llm.collective_rpc(method)
    running = llm.stream([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    next(running)
    with pytest.raises(RuntimeError, match="while another call is using this engine"):
        llm.collective_rpc("describe")
    running.close()
    queued = llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    with pytest.raises(RuntimeError, match="while requests are running"):
        llm.collective_rpc("describe")
    while not queued.is_finished:
        llm.step()
    prompts = _prompts(15, [9])
    _check_exact(qwen3_tied, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


def test_bfloat16_on_cpu(qwen3_tied):
    """dtype="bfloat16" runs on CPU. Its greedy tokens are float32's up to near-ties: on the sequence it generated,
    each token is within 0.25 nats of the best under transformers in float32, its logprob is within 0.25 of
    float32's, and the first token is float32's. The logprobs are not float32's to the bit: bfloat16 did run."""
    prompts = _prompts(16, [5, 17, 40])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128, dtype="bfloat16")
    outs = llm.generate(prompts, sp, use_tqdm=False)
    largest_difference = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = out["token_ids"]
        with torch.no_grad():
            logits = hf_model(qwen3_tied)(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits.float(), -1)
        chosen = reference[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert float((reference.max(-1).values - chosen).max()) < 0.25
        ours = torch.tensor([lp[t] for t, lp in zip(tokens, out["logprobs"])])
        difference = float((ours - chosen).abs().max())
        assert difference < 0.25
        largest_difference = max(largest_difference, difference)
        assert tokens[0] == hf_greedy(qwen3_tied, prompt, 1)[0]
    assert largest_difference > 1e-3


def test_a_checkpoint_without_a_tokenizer_is_refused_before_the_weights_load(qwen3_tied, tmp_path, monkeypatch):
    # No vocabulary file: refused at once (transformers 5 would build an empty tokenizer), nothing built; a corrupt
    # one fails in the background thread that loads the tokenizer while the executor builds: its error reaches the
    # caller and the executor it no longer needs is shut down (counted here)
    import shutil

    from nanovllm.distributed import executor
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{qwen3_tied}/{name}", tmp_path / name)
    built, shutdowns = [], []
    real_init, real_shutdown = executor.UniprocExecutor.__init__, executor.UniprocExecutor.shutdown
    monkeypatch.setattr(executor.UniprocExecutor, "__init__",
                        lambda self, *a: (built.append(1), real_init(self, *a))[1])
    monkeypatch.setattr(executor.UniprocExecutor, "shutdown", lambda self: (shutdowns.append(1), real_shutdown(self)))
    with pytest.raises(OSError, match="has no tokenizer"):
        LLM(str(tmp_path))
    assert built == [] and shutdowns == []
    llm = LLM(str(tmp_path), load_format="dummy")  # a bare config for benchmarks: no tokenizer, token ids only
    assert llm.tokenizer is None and "tokenizer (waited for)" in llm.startup
    llm.exit()
    shutdowns.clear()
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(Exception):  # noqa: B017 (whatever transformers raises for it)
        LLM(str(tmp_path))
    assert shutdowns == [1]


def test_an_llm_dropped_without_exit_is_shut_down_and_freed(qwen3_tied, monkeypatch):
    # `del llm` frees the engine at once: on a GPU its weights and KV cache take most of the memory the next engine
    # sizes its cache from. (An atexit hook holding the engine kept
    # it alive until the interpreter left: the CPU suite's engine tests run on a GPU failed from the second one.)
    import gc
    import weakref

    from nanovllm.distributed import executor
    shutdowns = []  # the tags of the executors shut down (an earlier test's engine may be collected meanwhile)
    real_shutdown = executor.UniprocExecutor.shutdown
    monkeypatch.setattr(executor.UniprocExecutor, "shutdown",
                        lambda self: (shutdowns.append(getattr(self, "tag", None)), real_shutdown(self)))
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=20, max_model_len=128)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.executor.tag = "first"
    alive, runner = weakref.ref(llm), weakref.ref(llm.executor.runner)
    gc.disable()  # by reference counts alone: no cycle holds it
    try:
        del llm
        assert alive() is None and runner() is None and shutdowns.count("first") == 1
    finally:
        gc.enable()
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=20, max_model_len=128)
    llm.executor.tag = "second"
    llm.exit()
    llm.exit()
    del llm
    gc.collect()
    assert shutdowns.count("second") == 1  # exit() shuts down once, and the finalizer has nothing left to do


def test_a_decode_step_sends_its_inputs_in_two_copies(qwen3_tied):
    # host time per decode step went mostly to small tensors each pinned and copied (benchmarks/host_time.py): the
    # step's ids, positions and previous-step rows travel in one int64 copy, its attention metadata in one int32 copy;
    # where a decode graph runs the step (CUDA), all of them in one copy straight into the graphs' buffers
    # (DecodeGraphs.stage, tests/engine/test_graph_inputs.py), none through _to_device
    from nanovllm.layers.context import to_device_packed
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=20, max_model_len=128) as llm:
        runner = llm.executor.runner
        seqs = [llm.add_request(list(range(1, n)), SamplingParams(max_tokens=4)) for n in (20, 5)]
        llm.step()  # both prefills
        copies = []

        def to_device(data, dtype):
            copies.append(dtype)
            return torch.tensor(data, dtype=dtype)
        runner._to_device = to_device
        fb, rows = runner._prepare_decode(seqs, [1, -1])
        staged = runner.graphs is not None
    assert copies == ([] if staged else [torch.int32, torch.int64]) and fb.staged == staged
    assert fb.input_ids.tolist() == [seq.last_token for seq in seqs] and rows.tolist() == [1, -1]
    assert fb.positions.tolist() == [len(seq) - 1 for seq in seqs]
    assert fb.context.context_lens.tolist() == [len(seq) for seq in seqs]
    width = len(seqs[0].block_table)  # (the graphs' tables are wider, padded with -1)
    assert fb.context.block_tables[:, :width].tolist() == [seqs[0].block_table, seqs[1].block_table + [-1]]
    assert (fb.context.block_tables[:, width:] == -1).all()
    assert fb.context.slot_mapping.tolist() == [seq.block_table[-1] * 16 + seq.last_block_num_tokens - 1
                                                for seq in seqs]
    # each part starts 16-byte aligned, as a tensor of its own would (Triton specializes on pointer alignment)
    parts = to_device_packed(lambda data, dtype: torch.tensor(data, dtype=dtype), [[1, 2, 3], [], [4], [5, 6]],
                             torch.int32)
    assert [p.tolist() for p in parts] == [[1, 2, 3], [], [4], [5, 6]]
    assert all(p.data_ptr() % 16 == 0 for p in parts)
