"""async_scheduling=True: decode step N+1 is launched before step N's tokens are read back.
Every output must equal the plain loop's (and transformers' for greedy)."""
import random

import torch

from nanovllm import LLM, SamplingParams
from tests.compare import assert_logprobs_close
from tests.tiny_models import hf_greedy

N = 20


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


def _same(a: list[dict], b: list[dict]):
    """The same tokens, text and finish; logprobs to float32 rounding (on CUDA a step's batch can differ: the async
    loop runs a finished row once more, and the kernels' reductions depend on the row count)."""
    for x, y in zip(a, b):
        assert (x["token_ids"], x["text"], x["finish_reason"]) == (y["token_ids"], y["text"], y["finish_reason"])
        assert_logprobs_close(x.get("logprobs"), y.get("logprobs"))


def test_greedy_matches_transformers(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, async_scheduling=True)
    prompts = _prompts(0, [3, 16, 17, 70, 300])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(qwen3_tied, prompt, N) and out["finish_reason"] == "length"
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


def test_chunked_prefill_preemption_and_prefix_hits(qwen3_tied):
    """Prompts of 40 tokens a step, in 12 blocks: chunked, preempted, and the fourth prompt (the third plus three
    tokens) is admitted once the third's prefill is done and hits its three full blocks."""
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192,
              max_num_batched_tokens=40, async_scheduling=True)
    preempted = []
    original = llm.scheduler.preempt
    llm.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
    prompts = _prompts(1, [30, 35, 60, 20, 45, 33])
    prompts.insert(3, prompts[2] + [1, 2, 3])
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert preempted
    assert [o["num_cached_tokens"] for o in outs] == [0, 0, 0, 48, 0, 0, 0]
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(qwen3_tied, prompt, 30)
    assert llm.scheduler.block_manager.num_free_blocks == 12


def test_every_option_equals_the_plain_loop(qwen3_tied):
    plain = LLM(qwen3_tied, kvcache_block_size=16, max_model_len=60, num_kvcache_blocks=20)
    overlapped = LLM(qwen3_tied, kvcache_block_size=16, max_model_len=60, num_kvcache_blocks=20,
                     async_scheduling=True)
    prompts = ["Once upon a time", "Hello world"] + _prompts(2, [12, 30, 50, 8])
    base = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    eos = base[2]["token_ids"][3]
    for llm in (plain, overlapped):
        llm.scheduler.eos_token_ids, llm.executor.runner.sampler.min_tokens.eos_token_ids = {eos}, [eos]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=base[0]["text"][5:8]),
        SamplingParams(temperature=0.9, max_tokens=25, seed=3, logprobs=2, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=25),  # stops on the made-up EOS
        SamplingParams(temperature=0, max_tokens=25, min_tokens=6),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),  # runs into max_model_len
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8, max_tokens=9, seed=8, stop_token_ids=[eos],
                       frequency_penalty=0.5),
    ]
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert expected[2]["finish_reason"] == "stop" and expected[4]["finish_reason"] == "length"
    _same(overlapped.generate(prompts, params, use_tqdm=False), expected)
    streamed = {i: "" for i in range(len(prompts))}
    for item in overlapped.stream(prompts, params):
        streamed[item["index"]] += item["text"]
    assert list(streamed.values()) == [o["text"] for o in expected]
    free = overlapped.scheduler.block_manager.num_free_blocks
    assert overlapped.is_finished() and free == overlapped.num_kvcache_blocks


def test_abandoned_stream_and_step_api(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, async_scheduling=True)
    it = llm.stream(_prompts(3, [10, 10]), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        next(it)
    it.close()
    assert llm.is_finished()
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
    prompt = _prompts(4, [6])[0]
    seq = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while not llm.is_finished():
        llm.step()
    assert seq.completion_token_ids == hf_greedy(qwen3_tied, prompt, 8)
    # the inner step loop still referenced elsewhere when the stream is closed (a traceback, a reference cycle: on a
    # GPU the next generate once found the closed stream's request still running): closing aborts it all the same
    held, real_run = [], llm._run
    llm._run = lambda *args: held.append(real_run(*args)) or held[-1]
    it = llm.stream(_prompts(5, [10]), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(it)
    it.close()
    assert held and llm.is_finished()
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 8)


def test_tensor_parallel_equals_the_plain_loop(qwen3_tied):
    """TP=2 over gloo: the workers take each decode step's inputs from their copy of the previous step's tokens
    (rank 0 broadcasts them). Greedy equals transformers; seeded sampling with n=2, logprobs and chunked prefill
    (40 tokens a step) equal the plain TP loop's, token for token."""
    prompts = _prompts(5, [3, 17, 70, 45])
    kwargs = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=192,
                  max_num_batched_tokens=40, tensor_parallel_size=2)
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=N, ignore_eos=True, logprobs=2)
    with LLM(qwen3_tied, async_scheduling=True, **kwargs) as llm:
        assert llm.config.async_scheduling
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out["token_ids"] == hf_greedy(qwen3_tied, prompt, N)
        async_sampled = llm.generate(prompts, sampled, use_tqdm=False)
    with LLM(qwen3_tied, async_scheduling=False, **kwargs) as plain:
        plain_sampled = plain.generate(prompts, sampled, use_tqdm=False)
    # the same tokens; logprobs to float32 rounding (a step's batch differs: async runs a finished row once more,
    # and the oneDNN matmuls' blocking depends on the row count)
    for x, y in zip(async_sampled, plain_sampled):
        assert (x["token_ids"], x["finish_reason"]) == (y["token_ids"], y["finish_reason"])
        assert_logprobs_close(x["logprobs"], y["logprobs"])


def test_default_is_on_for_one_cuda_rank_only(qwen3_tied, monkeypatch):
    """Left unset, it is on where it overlaps something: one rank on CUDA. CPU and TP run the plain loop."""
    from nanovllm.config import Config
    assert Config(qwen3_tied, device="cpu").async_scheduling is False
    assert Config(qwen3_tied, device="cpu", async_scheduling=True).async_scheduling is True
    assert Config(qwen3_tied, device="cpu", tensor_parallel_size=2).async_scheduling is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the config only reads it
    assert Config(qwen3_tied, device="cuda").async_scheduling is True
    assert Config(qwen3_tied, device="cuda", tensor_parallel_size=2).async_scheduling is False
    assert Config(qwen3_tied, device="cuda", async_scheduling=False).async_scheduling is False


def test_stop_strings_wait_for_min_tokens(qwen3_tied):
    """A stop string seen before min_tokens real tokens must not end the request (a placeholder is no token)."""
    prompts = _prompts(5, [4, 9, 15])
    base = LLM(qwen3_tied, kvcache_block_size=16).generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for min_tokens in (2, 4, 6):
        params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=o["text"][1:3],
                                 min_tokens=min_tokens) for o in base]
        results = [LLM(qwen3_tied, kvcache_block_size=16, async_scheduling=a).generate(prompts, params, use_tqdm=False)
                   for a in (False, True)]
        _same(results[1], results[0])
        assert all(len(o["token_ids"]) >= min_tokens for o in results[1])


def test_step_after_a_failed_settle_reads_the_step_again(qwen3_tied):
    """A settle that raises (a KeyboardInterrupt while waiting for the device) let its step go: its placeholders
    stayed in the output as token -1, and a later step found nothing to schedule. The step's tokens are still on
    the device: the next step() reads them, and every sample, seeded ones too, gets a fresh engine's tokens."""
    from tests.engine.faults import fail_a_step_then_finish
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)]
    prompts = _prompts(6, [20, 36])
    llm = LLM(qwen3_tied, kvcache_block_size=16, async_scheduling=True)
    want = [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]
    for fail_at in (2, 4, 6):  # decode steps with the next one in flight, up to near the end
        firsts = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        samples = [[seq, *seq.forks] for seq in firsts]
        for _ in range(fail_at):
            llm.step()
        fail_a_step_then_finish(llm, "settle")
        assert [[s.completion_token_ids for s in ss] for ss in samples] == want
        assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
