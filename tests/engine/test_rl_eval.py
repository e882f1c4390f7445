"""Offline jobs: n samples per prompt, prompt log-probabilities, weight updates in place, sleep and wake.
Token-exact against transformers in float32 on tiny random checkpoints."""
import pickle
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.outputs import FlatLogprobs, Logprob
from tests.compare import assert_logprobs_close
from tests.tiny_models import hf_greedy, hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


def _samples(out: dict) -> list[list[int]]:
    return [o["token_ids"] for o in out["outputs"]]


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        yield llm


def _all_blocks_free(llm) -> bool:
    return llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


# ---- n samples per prompt -------------------------------------------------------------------------

@pytest.mark.parametrize("length", [16, 21])  # a full last prompt block (shared), a partial one (copied)
def test_greedy_n_gives_n_equal_samples_equal_to_transformers(llm, qwen3_tied, length):
    prompt = _prompts(0, [length])[0]
    out = llm.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    expected = hf_greedy(qwen3_tied, prompt, 12)
    assert _samples(out) == [expected] * 4
    assert out["token_ids"] == expected and out["text"] == out["outputs"][0]["text"]
    assert [o["finish_reason"] for o in out["outputs"]] == ["length"] * 4
    assert _all_blocks_free(llm)


def test_the_prompt_is_computed_once(llm):
    prompt = _prompts(1, [37])[0]
    computed = []
    step = llm._step
    llm._step = lambda: (lambda r: (computed.append(r[1]), r)[1])(step())
    try:
        out = llm.generate([prompt], SamplingParams(n=5, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0]
    finally:
        del llm._step
    assert sum(n for n in computed if n > 0) == len(prompt)  # one prefill of the prompt, for all 5 samples
    assert all(len(ids) == 6 for ids in _samples(out))


def test_seeded_samples_differ_repeat_and_ignore_their_batch(llm):
    prompt = _prompts(2, [21])[0]
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=1)
    alone = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert len({tuple(s) for s in _samples(alone)}) == 4  # the samples differ from each other
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert _samples(again) == _samples(alone)
    for a, b in zip(again["outputs"], alone["outputs"]):  # (the second run reads its prompt from the cache)
        assert_logprobs_close(a["logprobs"], b["logprobs"])
    others = _prompts(3, [5, 30, 12])
    mixed = llm.generate([others[0], prompt, others[1], others[2]],
                         [SamplingParams(n=3, temperature=0.8, max_tokens=14, ignore_eos=True), sp,
                          SamplingParams(temperature=0.5, max_tokens=8, ignore_eos=True, repetition_penalty=1.2),
                          SamplingParams(n=2, temperature=0, max_tokens=9, ignore_eos=True)], use_tqdm=False)
    assert _samples(mixed[1]) == _samples(alone)
    assert [len(o["outputs"]) for o in mixed] == [3, 4, 1, 2]
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("length", [16, 21])  # a full last prompt block (shared), a partial one (copied)
def test_seeded_samples_equal_independent_requests(qwen3_tied, length):
    """Sample i of n with seed s is the request with seed s + i alone (as vLLM): checked against such requests,
    not only against each other. With a partly filled last prompt block, samples that shared it instead of each
    copying it would write their different tokens into the same slots: their continuations would drift."""
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256,
             enable_prefix_caching=False) as llm:
        prompt = _prompts(20, [length])[0]
        sp = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
        together = _samples(llm.generate([prompt], SamplingParams(n=3, seed=11, **sp), use_tqdm=False)[0])
        alone = [llm.generate([prompt], SamplingParams(seed=11 + i, **sp), use_tqdm=False)[0]["token_ids"]
                 for i in range(3)]
        assert together == alone and len({tuple(t) for t in alone}) == 3


def test_forks_share_the_full_prompt_blocks_and_copy_the_last(qwen3_tied):
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        seq = llm.add_request(_prompts(21, [40])[0], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4))
        llm.step()  # the prefill: the prompt's 3 blocks (2 full), shared by the 4 samples, the partial one copied
        assert llm.num_kvcache_blocks - llm.scheduler.block_manager.num_free_blocks == 2 + 4
        while not llm.is_finished():
            llm.step()
        assert seq.is_finished and _all_blocks_free(llm)


def test_forks_count_against_max_num_seqs(qwen3_tied):
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, max_num_seqs=4) as llm:
        params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
        prompts = _prompts(22, [9, 12])
        for prompt in prompts:
            llm.add_request(prompt, params)
        most = 0
        while not llm.is_finished():
            llm.step()
            most = max(most, len(llm.scheduler.running))
        assert most == 3  # the second request's 3 samples waited for the first's: 6 would exceed 4


def test_admission_reserves_the_fork_copies(qwen3_tied):
    """Two n=4 requests whose prompts end in a partial block need 1 + 4 blocks each at the end of their prefill; a
    cache of 8 holds one: the second waits instead of running out of blocks mid-fork."""
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=64) as llm:
        prompts = _prompts(23, [21, 22])
        outs = llm.generate(prompts, SamplingParams(n=4, temperature=0, max_tokens=4, ignore_eos=True),
                            use_tqdm=False)
        assert [_samples(o) for o in outs] == [[hf_greedy(qwen3_tied, p, 4)] * 4 for p in prompts]
        assert _all_blocks_free(llm)


def test_n_with_a_cache_too_small_preempts_and_stays_exact(qwen3_tied):
    # 4 samples of 20 + 40 tokens need 16 blocks of 16; the cache has 10: decode must preempt samples
    small = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=10, max_model_len=128)
    preempted = []
    preempt = small.scheduler.preempt
    small.scheduler.preempt = lambda seq: (preempted.append(seq.sample_index), preempt(seq))
    prompts = _prompts(4, [20, 9])
    outs = small.generate(prompts, SamplingParams(n=4, temperature=0, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)
    assert preempted
    for prompt, out in zip(prompts, outs):
        assert _samples(out) == [hf_greedy(qwen3_tied, prompt, 40)] * 4
    assert _all_blocks_free(small)


def test_n_streams_each_sample_and_stops_each_on_its_own(llm):
    prompts = _prompts(5, [10, 18])
    base = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
              SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True, stop=base[1]["text"][4:7])]
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert [o["finish_reason"] for o in expected[1]["outputs"]] == ["stop", "stop"]
    streamed: dict[tuple[int, int], list[int]] = {}
    for item in llm.stream(prompts, params):
        streamed.setdefault((item["index"], item["sample_index"]), []).extend(item["token_ids"])
    assert streamed == {(i, j): o["token_ids"] for i, out in enumerate(expected)
                        for j, o in enumerate(out["outputs"])}


def test_n_under_async_scheduling_equals_the_plain_loop(qwen3_tied):
    prompts = _prompts(6, [7, 23, 40])
    params = [SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=12, ignore_eos=True, frequency_penalty=0.4),
              SamplingParams(n=2, temperature=0, max_tokens=15, ignore_eos=True, logprobs=2),
              SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)]
    results = [LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=30, max_model_len=128,
                   async_scheduling=overlap).generate(prompts, params, use_tqdm=False) for overlap in (False, True)]
    assert [o["outputs"] for o in results[0]] == [o["outputs"] for o in results[1]]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(n=0), ValueError, "n must be >= 1"),
    (dict(n=2.0), TypeError, "n must be an int"),
    (dict(prompt_logprobs=-2), ValueError, r"prompt_logprobs must be None, -1 \(the whole vocabulary\) or an int >= 0"),
])
def test_bad_n_and_prompt_logprobs(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_requests_that_can_never_run_are_refused(llm, qwen3_tied):
    small = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128, max_num_seqs=4)
    with pytest.raises(ValueError, match="more than max_num_seqs=4"):
        small.generate([[1, 2, 3]], SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(ValueError, match="need 10 KV blocks to start, but the cache has 8"):  # 7 + 3 copies
        small.generate([list(range(100))], SamplingParams(n=4, max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=401 exceeds the vocabulary"):
        small.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=401), use_tqdm=False)
    prompt = _prompts(7, [9])[0]
    assert small.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 12)
    assert _all_blocks_free(small)


# ---- prompt log-probabilities ---------------------------------------------------------------------

def _reference_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every prompt position, float32: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0].float(), -1)


def _check_prompt_logprobs(path: str, prompt: list[int], scored: list, k: int):
    reference = _reference_logprobs(path, prompt)
    assert len(scored) == len(prompt) and scored[0] is None
    for p in range(1, len(prompt)):
        row, entry = reference[p - 1], scored[p]
        top = row.topk(k)
        assert set(entry) == {prompt[p], *top.indices.tolist()}
        for token, value in entry.items():
            assert abs(value - row[token].item()) <= 1e-4, (p, token)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_transformers(llm, qwen3_tied, k):
    prompts = _prompts(8, [1, 2, 17, 70])
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        _check_prompt_logprobs(qwen3_tied, prompt, out["prompt_logprobs"], k)


def test_prompt_logprobs_under_chunked_prefill_and_with_n(qwen3_tied):
    chunked = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256,
                  max_num_batched_tokens=30)
    prompts = _prompts(9, [75, 12, 44])
    outs = chunked.generate(prompts, [SamplingParams(max_tokens=3, prompt_logprobs=2, n=3, temperature=0.7, seed=1),
                                      GREEDY, SamplingParams(max_tokens=2, prompt_logprobs=1)], use_tqdm=False)
    _check_prompt_logprobs(qwen3_tied, prompts[0], outs[0]["prompt_logprobs"], 2)
    _check_prompt_logprobs(qwen3_tied, prompts[2], outs[2]["prompt_logprobs"], 1)
    assert "prompt_logprobs" not in outs[1] and len(outs[0]["outputs"]) == 3
    assert outs[1]["token_ids"] == hf_greedy(qwen3_tied, prompts[1], 12)


def test_forked_samples_share_the_scored_prompt(llm, qwen3_tied):
    """The prompt is scored once: a forked sample never asks for prompt logprobs again (a preempted one would
    otherwise recompute its prompt without prefix hits, to score it a second time)."""
    prompt = _prompts(17, [26])[0]
    first = llm.add_request(prompt, SamplingParams(n=3, max_tokens=4, prompt_logprobs=0, temperature=0))
    forks = list(first.forks)
    while not llm.is_finished():
        llm.step()
    assert all(f.prompt_logprobs is first.prompt_logprobs and not f.needs_prompt_logprobs for f in forks)
    _check_prompt_logprobs(qwen3_tied, prompt, first.prompt_logprobs, 0)


def test_prompt_logprobs_after_a_prefix_cache_hit(llm, qwen3_tied):
    """A request with prompt_logprobs computes its whole prompt (cached positions have no logits): it takes no
    prefix hit, but its blocks still serve others."""
    base = _prompts(10, [40])[0]
    llm.generate([base], GREEDY, use_tqdm=False)  # its blocks are now cached
    longer = base + _prompts(11, [10])[0]
    out = llm.generate([longer], SamplingParams(max_tokens=4, prompt_logprobs=0, temperature=0), use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 0
    _check_prompt_logprobs(qwen3_tied, longer, out["prompt_logprobs"], 0)
    assert out["token_ids"] == hf_greedy(qwen3_tied, longer, 4)
    again = llm.generate([longer], GREEDY, use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 48


# ---- weight updates -------------------------------------------------------------------------------

def test_update_weights_in_place(qwen3_tied, qwen3_b):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    prompt, other = _prompts(12, [40, 19])
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 12)
    llm.update_weights(hf_model(qwen3_b).state_dict())  # a state dict with the checkpoint's names
    out = llm.generate([prompt, other], GREEDY, use_tqdm=False)
    assert out[0]["num_cached_tokens"] == 0  # the prompt cached under the old weights is not reused
    assert [o["token_ids"] for o in out] == [hf_greedy(qwen3_b, p, 12) for p in (prompt, other)]
    llm.update_weights(qwen3_tied)  # a checkpoint directory
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 12)
    llm.update_weights(iter(hf_model(qwen3_b).named_parameters()))  # (name, tensor) pairs, a generator
    assert llm.generate([other], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_b, other, 12)


def test_bad_weights_change_nothing(qwen3_tied, qwen3_b):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    good = list(hf_model(qwen3_b).state_dict().items())
    q = "model.layers.0.self_attn.q_proj.weight"
    for bad, error, match in [
        (good + [("model.layers.0.mlp.nope.weight", torch.zeros(2))], ValueError, "'model.layers.0.mlp.nope.weight' "
                                                                                  "matches no parameter"),
        (good + [(q, torch.zeros(64, 64 + 1))], ValueError, rf"'{q}': shape \(64, 65\) does not match"),
        # our packed layers' names: one fused tensor, not the checkpoint's parts
        (good + [("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(128, 64))], ValueError,
         "load q_proj, k_proj and v_proj by their own names"),
        (good + [("model.layers.1.mlp.gate_up_proj.weight", torch.zeros(256, 64))], ValueError,
         r"load its parts \(gate_proj and up_proj\) by their own names"),
        (good + [("model.norm.weight", [1.0] * 64)], TypeError, "must be a \\(str, torch.Tensor\\) pair"),
        # a meta tensor holds no values: refused before the valid tensors before it are written
        ([good[0], ("model.norm.weight", torch.empty(64, device="meta"))], ValueError, "is a meta tensor"),
        ([("model.norm.weight", torch.ones(64, dtype=torch.int64))], ValueError, "floating-point"),
        (42, TypeError, "update_weights takes"),
        ("/no/such/dir", ValueError, "not a checkpoint directory"),
    ]:
        with pytest.raises(error, match=match):
            llm.update_weights(bad)
        prompt = _prompts(13, [11])[0]
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 12)
    running = llm.stream([[1, 2, 3]], SamplingParams(max_tokens=5))
    next(running)
    with pytest.raises(RuntimeError, match="update_weights\\(\\) called while another call is using this engine"):
        llm.update_weights(good)
    running.close()
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    with pytest.raises(RuntimeError, match="update_weights\\(\\) called while requests are running"):
        llm.update_weights(good)


def test_a_write_that_fails_half_way_is_never_served(qwen3_tied, qwen3_b, monkeypatch):
    """A failure inside the write itself (not the input: out of memory, a lost worker) leaves some weights new:
    generate refuses until a full set is loaded."""
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    runner = llm.executor.runner
    write = type(runner).update_weights

    def half_write(self, weights, require_all=False):
        write(self, weights[:1], require_all=False)
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(type(runner), "update_weights", half_write)
    state = hf_model(qwen3_b).state_dict()
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.update_weights(state)
    monkeypatch.undo()
    prompt = _prompts(13, [11])[0]
    with pytest.raises(RuntimeError, match="update_weights\\(\\) failed while writing .* load a full set"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="lacks weights for"):
        llm.update_weights({"model.norm.weight": state["model.norm.weight"]})
    llm.update_weights(state)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_b, prompt, 12)


# ---- sleep and wake -------------------------------------------------------------------------------

def test_sleep_and_wake_up(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    prompts = _prompts(14, [30, 8])
    sp = [GREEDY, SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=10, ignore_eos=True)]
    before = llm.generate(prompts, sp, use_tqdm=False)
    import gc
    import weakref
    cache = weakref.ref(llm.executor.runner.kv_cache)
    llm.sleep(level=1)
    assert llm.is_sleeping() and llm.executor.runner.kv_cache is None
    gc.collect()
    assert cache() is None  # nothing, no attention layer included, still holds the freed cache
    assert all(layer.k_cache.numel() == 0 for layer in llm.executor.runner.attn_layers)
    with pytest.raises(RuntimeError, match="asleep .* call wake_up\\(\\) first"):
        llm.generate(prompts, sp, use_tqdm=False)
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep()
    with pytest.raises(RuntimeError, match="needs the weights awake first"):
        llm.wake_up(["kv_cache"])
    with pytest.raises(ValueError, match="unknown wake_up tags \\['cache'\\]"):
        llm.wake_up(["cache"])
    llm.wake_up()
    assert not llm.is_sleeping()
    after = llm.generate(prompts, sp, use_tqdm=False)
    assert [o["outputs"] for o in after] == [o["outputs"] for o in before]
    assert after[0]["num_cached_tokens"] == 0  # the cache was freed, so nothing is served from it


def test_after_sleep_level_2_every_weight_must_come_back(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    state = hf_model(qwen3_tied).state_dict()
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="lacks weights for: model.embed_tokens.weight"):
        llm.update_weights({"model.norm.weight": state["model.norm.weight"]})  # a subset: the rest would be garbage
    assert llm.is_sleeping()
    llm.update_weights(state)
    llm.wake_up()
    prompt = _prompts(18, [20])[0]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 12)
    llm.update_weights({"model.norm.weight": state["model.norm.weight"]})  # awake, a subset is fine


def test_reset_prefix_cache_and_argument_checks(llm):
    prompt = _prompts(19, [40])[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 32
    assert llm.reset_prefix_cache() is True  # (vLLM returns True; RL scripts assert it)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 0
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(True)
    with pytest.raises(TypeError, match="tags must be a list, e.g. \\['weights'\\]"):
        llm.wake_up("weights")


def test_auto_backend_avoids_flash_attn_for_an_fp8_cache(monkeypatch):
    import importlib.util

    from nanovllm.layers.attention import get_backend
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn"
                        else find_spec(name, *a))
    assert get_backend("auto", "cuda", fp8_kv_cache=True).name == "triton"


def test_sleep_level_2_then_new_weights(qwen3_tied, qwen3_b):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    prompt = _prompts(15, [25])[0]
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=3)
    llm.sleep(level=2)
    params = dict(llm.executor.runner.model.named_parameters())
    assert all(p.numel() == 0 for p in params.values())  # the weights are freed
    llm.update_weights(qwen3_b)  # before wake_up: wakes the weights, then loads them
    llm.wake_up(["kv_cache"])
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_b, prompt, 12)
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="freed by sleep\\(level=2\\); load a full set with update_weights"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.update_weights(hf_model(qwen3_tied).state_dict())  # after wake_up
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 12)


@pytest.mark.gpu
def test_cuda_sleep_frees_the_kv_cache_and_gives_it_back(qwen3_tied):
    llm = LLM(qwen3_tied, device="cuda", dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    prompt = _prompts(16, [40])[0]
    before = llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
    kv_bytes = llm.executor.runner.kv_cache.numel() * llm.executor.runner.kv_cache.element_size()
    awake = torch.cuda.memory_reserved()
    llm.sleep(level=1)
    asleep = torch.cuda.memory_reserved()
    assert awake - asleep >= kv_bytes
    llm.wake_up()
    assert torch.cuda.memory_reserved() >= awake - (awake - asleep - kv_bytes)  # the cache is back
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == before == hf_greedy(qwen3_tied, prompt, 12)
    llm.exit()


def _plain(positions) -> list:
    """Logprob dicts as comparable tuples (a Logprob equals its float alone)."""
    return [None if d is None else {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()}
            for d in positions]


@pytest.mark.parametrize("k", [0, 3])
def test_flat_logprobs_read_as_the_dicts(qwen3_tied, k):
    """SamplingParams(flat_logprobs=True): logprobs and prompt_logprobs come as FlatLogprobs that read, position by
    position, as the dicts without it: values, ranks and texts, under chunked prefill (a prompt scored in several
    steps), with n=2 (one prompt_logprobs shared) and a stream's one-position slices."""
    llm = LLM(qwen3_tied, device="cpu", max_model_len=256, kvcache_block_size=16, max_num_batched_tokens=32)
    try:
        prompts = _prompts(21, [5, 40, 70])
        params = dict(max_tokens=4, prompt_logprobs=k, logprobs=2, temperature=0.8, seed=1, n=2, ignore_eos=True)
        plain = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
        flat = llm.generate(prompts, SamplingParams(flat_logprobs=True, **params), use_tqdm=False)
        for a, b in zip(plain, flat):
            assert isinstance(b.prompt_logprobs, FlatLogprobs) and len(b.prompt_logprobs) == len(a.prompt_logprobs)
            assert b.prompt_logprobs[0] is None and _plain(b.prompt_logprobs) == _plain(a.prompt_logprobs)
            for x, y in zip(a.outputs, b.outputs):
                assert isinstance(y.logprobs, FlatLogprobs) and _plain(y.logprobs) == _plain(x.logprobs)
                assert y.cumulative_logprob == x.cumulative_logprob
        by_sample = {}
        for item in llm.stream(prompts[:1], SamplingParams(flat_logprobs=True, **params)):
            assert isinstance(item["logprobs"], FlatLogprobs) and len(item["logprobs"]) == 1
            by_sample.setdefault(item["sample_index"], []).extend(_plain(item["logprobs"]))
        for i, out in enumerate(plain[0].outputs):  # (a stream's entries carry no text; its batch is another)
            want = _plain(out.logprobs)
            assert [{t: r for t, (_, r, _) in d.items()} for d in by_sample[i]] == \
                [{t: r for t, (_, r, _) in d.items()} for d in want]
            assert all(text is None and v == pytest.approx(w[t][0], abs=1e-4) for d, w in zip(by_sample[i], want)
                       for t, (v, _, text) in d.items())
    finally:
        llm.exit()


def test_flat_logprobs_as_a_sequence():
    flat = FlatLogprobs()
    flat.append(None)
    flat.append({5: Logprob(-0.5, 1, "a"), 9: -2.0})
    flat.extend(flat[1:])  # (a FlatLogprobs: its entries' offsets move)
    flat.extend([{3: Logprob(-1.0, 2)}])
    assert len(flat) == 4 and flat[0] is None and flat[-1] == {3: -1.0} and flat[-1][3].rank == 2
    assert flat[1] == flat[2] == {5: -0.5, 9: -2.0} and flat[2][5].decoded_token == "a" and flat[2][9].rank is None
    assert list(flat[1:3]) == [flat[1], flat[2]] and flat == list(flat)
    assert pickle.loads(pickle.dumps(flat)) == flat  # (data parallelism sends outputs between processes)
    copy = flat.copy()
    copy.decoded_tokens[0] = "b"
    assert flat[1][5].decoded_token == "a"
    with pytest.raises(TypeError, match="flat_logprobs must be True or False"):
        SamplingParams(flat_logprobs=1)
