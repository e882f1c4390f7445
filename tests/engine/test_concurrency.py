"""One engine serves one caller at a time: a second caller (another thread, or a second stream while the first is
open) gets RuntimeError at once, and the first caller's answers stay exact."""
import random
import threading

import pytest

from nanovllm import LLM, SamplingParams
from tests.tiny_models import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BUSY = "another call is using this engine"


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    with LLM(qwen3_tied, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        yield llm


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(rng.randint(4, 40))] for _ in range(count)]


def test_two_threads_get_their_own_answers_or_a_clear_refusal(llm, qwen3_tied):
    prompts = {t: _prompts(100 + t, 3) for t in range(2)}
    expected = {t: [hf_greedy(qwen3_tied, p, 12) for p in prompts[t]] for t in range(2)}
    refused = answered = 0
    for _ in range(20):
        barrier, results = threading.Barrier(2), {}

        def call(t, barrier=barrier, results=results):
            barrier.wait()
            try:
                results[t] = [o["token_ids"] for o in llm.generate(prompts[t], GREEDY, use_tqdm=False)]
            except RuntimeError as e:
                results[t] = e
        threads = [threading.Thread(target=call, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for t, result in results.items():
            if isinstance(result, RuntimeError):
                assert BUSY in str(result) and "give each thread its own LLM" in str(result)
                refused += 1
            else:
                assert result == expected[t]  # never another thread's tokens, never a mix
                answered += 1
        assert len(results) == 2 and answered >= 1
        assert llm.scheduler.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
    assert refused >= 1  # the threads did overlap


def test_a_stream_holds_the_engine_from_its_first_item(llm, qwen3_tied):
    a, b = _prompts(7, 1)[0], _prompts(8, 1)[0]
    s1, s2 = llm.stream([a], GREEDY), llm.stream([b], GREEDY)  # creating a stream holds nothing
    first = next(s1)
    with pytest.raises(RuntimeError, match=BUSY):
        list(s2)
    with pytest.raises(RuntimeError, match=BUSY):
        llm.generate([b], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match=BUSY):
        llm.update_weights([])
    tokens = first["token_ids"] + [t for item in s1 for t in item["token_ids"]]
    assert tokens == hf_greedy(qwen3_tied, a, 12)
    # the engine is free again: a new stream of b runs whole
    assert [t for item in llm.stream([b], GREEDY) for t in item["token_ids"]] == hf_greedy(qwen3_tied, b, 12)


def test_a_dropped_or_closed_stream_frees_the_engine(llm, qwen3_tied):
    prompt = _prompts(9, 1)[0]
    unread = llm.stream([prompt], GREEDY)  # never iterated
    del unread
    started = llm.stream([prompt], GREEDY)
    next(started)
    started.close()
    started = llm.stream([prompt], GREEDY)
    next(started)
    del started  # dropped mid-way: collected at once (CPython), which closes it
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 12)
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


def test_step_and_add_request_take_their_turn(llm, qwen3_tied):
    assert llm.step() == ([], 0)  # nothing queued: nothing to do (as vLLM's step)
    stream = llm.stream([[1, 2, 3]], GREEDY)
    next(stream)
    with pytest.raises(RuntimeError, match=BUSY):
        llm.step()
    with pytest.raises(RuntimeError, match=BUSY):
        llm.add_request([1, 2, 3], GREEDY)
    stream.close()
    seq = llm.add_request([4, 5, 6], GREEDY)
    while not seq.is_finished:
        llm.step()
    assert seq.completion_token_ids == hf_greedy(qwen3_tied, [4, 5, 6], 12)


def test_exit_while_a_call_runs_gives_it_a_clear_error(qwen3_tied):
    """exit() from another thread (a watchdog, a server shutting down) or while a stream is open: the running call
    raised AttributeError ('NoneType' object has no attribute 'run'). It says the LLM was shut down."""
    from unittest import mock
    prompts = _prompts(10, 2)
    with LLM(qwen3_tied, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        stream = llm.stream(prompts, GREEDY)
        next(stream)
        llm.exit()
        with pytest.raises(RuntimeError, match="shut down .* while the call ran"):
            list(stream)
    with LLM(qwen3_tied, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        real_run = llm.executor.run

        def run_then_exit(batch):  # another thread's exit() lands while this step runs
            out = real_run(batch)
            other = threading.Thread(target=llm.exit)
            other.start()
            other.join()
            return out
        with mock.patch.object(llm.executor, "run", side_effect=run_then_exit):
            with pytest.raises(RuntimeError, match="shut down .* while the call ran"):
                llm.generate(prompts, GREEDY, use_tqdm=False)


def test_a_stream_refused_as_busy_can_be_read_later(llm, qwen3_tied):
    """A stream whose first read was refused (another stream open) and that is read again once the engine is free
    yielded nothing, silently (the refusal had ended its generator). It runs whole."""
    a, b = _prompts(11, 2)
    s1, s2 = llm.stream([a], GREEDY), llm.stream([b], GREEDY)
    next(s1)
    with pytest.raises(RuntimeError, match=BUSY):
        next(s2)
    s1.close()
    assert [t for item in s2 for t in item["token_ids"]] == hf_greedy(qwen3_tied, b, 12)


def test_a_stream_that_failed_says_so_when_read_again(llm):
    """A stream whose read raised (here: the engine asleep at its first item) ended with that error: read again, it
    raises, naming it, rather than yield nothing as if it had no items."""
    s = llm.stream([_prompts(12, 1)[0]], GREEDY)
    llm.sleep(level=1)
    with pytest.raises(RuntimeError, match="asleep"):
        next(s)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="this stream ended with RuntimeError: .*asleep.*make a new stream"):
        list(s)


def test_exit_interrupted_while_it_waits_still_shuts_down(qwen3_tied):
    """exit() waits for a step another thread is running; a KeyboardInterrupt during that wait still shuts the engine
    down (it was left marked shut down, every call refused, its executor and memory alive, a second exit() a no-op)."""
    llm = LLM(qwen3_tied, device="cpu", kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128)

    class Interrupted:
        def acquire(self, timeout=-1):
            raise KeyboardInterrupt
    llm._stepping = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        llm.exit()
    assert llm.executor is None and not llm._finalizer.alive
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)
