"""vLLM's LLMEngine step API (nanovllm.LLMEngine, llm.llm_engine): requests named by the caller, step() returning
RequestOutputs by SamplingParams.output_kind, abort_request, EngineArgs from a command line. Every finished output
equals what generate() gives for the same request, whatever the kind, the order requests arrive in, or aborts
beside them."""
import argparse
import dataclasses
import enum
import signal
import threading
from unittest import mock

import pytest

from nanovllm import LLM, EngineArgs, LLMEngine, SamplingParams
from nanovllm.config import Config
from nanovllm.engine.call_guard import Busy
from nanovllm.sampling_params import RequestOutputKind
from tests.compare import assert_logprobs_close
from tests.tiny_models import make_checkpoint

SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=48, max_model_len=256)
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("llm_engine"), "qwen3", tie=True)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "async"])
def llm(model, request):
    with LLM(model, async_scheduling=request.param, **SMALL) as llm:
        yield llm


def _requests(llm) -> list[tuple[str, SamplingParams]]:
    """Prompts and params that cover what an output carries: greedy with logprobs and prompt logprobs, a stop
    string taken from the greedy text (so it is hit mid-run), seeded n=2, a min_tokens / EOS case."""
    greedy = llm.generate(["a b c d"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 3]
    return [
        ("a b c d", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)),
        ("a b c d", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])),
        ("the cat sat", SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=17, logprobs=0)),
        ("x", SamplingParams(temperature=0.8, seed=3, max_tokens=30, min_tokens=5)),
    ]


def _same(got: list[tuple], want) -> None:
    """Samples as (index, text, token_ids, finish_reason, stop_reason, cumulative_logprob, logprobs) against a
    generate() output: the same text and tokens; logprobs to float32 rounding (another run, other batches)."""
    assert [g[:5] for g in got] == [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason)
                                    for c in want.outputs]
    for g, c in zip(got, want.outputs):
        assert (g[5] is None) == (c.cumulative_logprob is None) and (g[5] is None or g[5] == pytest.approx(
            c.cumulative_logprob, abs=1e-3))
        assert_logprobs_close(g[6], c.logprobs)


def _fields(c) -> tuple:
    return (c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
            None if c.logprobs is None else list(c.logprobs))


def _failing_once(fn, at: int):
    """fn, but its `at`-th call raises KeyboardInterrupt (a Ctrl-C there)."""
    calls = []

    def call(*args):
        calls.append(args)
        if len(calls) == at:
            raise KeyboardInterrupt
        return fn(*args)
    return call


def _interrupted_once(fn, at: int):
    """fn, but a SIGINT (a Ctrl-C, which Python raises as KeyboardInterrupt where it runs next) comes in its `at`-th
    call."""
    calls = []

    def call(*args):
        calls.append(args)
        if len(calls) == at:
            signal.raise_signal(signal.SIGINT)
        return fn(*args)
    return call


def _run(engine: LLMEngine, requests, kind) -> dict[str, list]:
    """vLLM's llm_engine_example loop (one request added a step): every RequestOutput each request gets."""
    got: dict[str, list] = {}
    pending = list(enumerate(requests))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, (prompt, params) = pending.pop(0)
            params.output_kind = kind
            engine.add_request(f"req-{i}", prompt, params)
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    return got


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY], ids=lambda k: k.name)
def test_outputs_by_kind_equal_generate(llm, kind):
    requests = _requests(llm)
    expected = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    got = _run(llm.llm_engine, requests, kind)
    assert sorted(got) == [f"req-{i}" for i in range(len(requests))]
    for i, want in enumerate(expected):
        outs = got[f"req-{i}"]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(o.prompt_token_ids == want.prompt_token_ids and o.prompt == want.prompt for o in outs)
        if kind == FINAL_ONLY:
            assert len(outs) == 1
        if kind == DELTA:  # each sample's pieces, joined
            joined = {}
            for out in outs:
                for c in out.outputs:
                    _, text, ids, _, _, _, logprobs = joined.get(c.index, (0, "", [], 0, 0, 0, []))
                    joined[c.index] = (c.index, text + c.text, ids + list(c.token_ids), c.finish_reason,
                                       c.stop_reason, c.cumulative_logprob,
                                       None if c.logprobs is None else logprobs + list(c.logprobs))
            _same([joined[i] for i in sorted(joined)], want)
            assert [o.prompt_logprobs is not None for o in outs] == [
                want.prompt_logprobs is not None] + [False] * (len(outs) - 1)  # (the prompt's, once)
            prompt_logprobs = outs[0].prompt_logprobs
        else:
            _same([_fields(c) for c in outs[-1].outputs], want)
            prompt_logprobs = outs[-1].prompt_logprobs
        assert (prompt_logprobs is None) == (want.prompt_logprobs is None)
        if prompt_logprobs is not None:
            assert prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
            assert_logprobs_close(prompt_logprobs[1:], want.prompt_logprobs[1:])
        if kind == CUMULATIVE:  # each output extends the one before; a running text never shows the stop string
            stops = requests[i][1].stop_strings
            for before, after in zip(outs, outs[1:]):
                for b, a in zip(before.outputs, after.outputs):
                    assert a.text.startswith(b.text) and a.token_ids[:len(b.token_ids)] == b.token_ids
                    assert not any(s in b.text for s in stops)
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.get_num_unfinished_requests() == 0
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


def test_delta_cumulative_logprob_is_the_running_sum(llm):
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=1, output_kind=DELTA)
    engine = llm.llm_engine
    engine.add_request("d", [5, 6, 7], params)
    total, seen = 0.0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            total += sum(d[t] for d, t in zip(c.logprobs, c.token_ids))
            seen.append(c.cumulative_logprob)
    assert seen[-1] == pytest.approx(total)
    assert seen[-1] == pytest.approx(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
                                     .cumulative_logprob)


def test_a_running_text_that_keeps_its_stop_string_holds_nothing_back(llm):
    """vLLM holds back the last len(longest stop) - 1 characters of a running text only where the stop string would
    be cut off: with include_stop_str_in_output each step's text is all the text so far, as without stop strings
    (and so is a stream's)."""
    def run(**stops):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **stops)
        engine.add_request("r", [5, 6, 7], params)
        texts = []
        while engine.has_unfinished_requests():
            texts += [out.outputs[0].text for out in engine.step()]
        return texts, [d["text"] for d in llm.stream([[5, 6, 7]], params)]

    engine = llm.llm_engine
    plain = run()
    assert len(plain[0]) == 6 and plain[0][0]  # (a text at every step)
    assert run(stop=["never in the text"], include_stop_str_in_output=True) == plain


def test_abort_frees_a_request_and_leaves_the_others_exact(llm):
    engine = llm.llm_engine
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("keep", [1, 2, 3, 4], long)
    engine.add_request("drop", [9, 8, 7] * 20, SamplingParams(temperature=0.7, seed=1, n=3, max_tokens=60))
    engine.add_request("never", [4, 4, 4], long)
    engine.abort_request("never")  # (still waiting: never prefilled)
    outputs = {}
    for step in range(200):
        if step == 4:
            engine.abort_request(["drop", "no-such-id"])  # (mid-decode, its samples forked)
            assert engine.get_num_unfinished_requests() == 1
        for out in engine.step():
            assert out.request_id != "never" and (out.request_id != "drop" or step < 4)
            outputs[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert outputs["keep"].finished and "never" not in outputs
    assert outputs["keep"].outputs[0].token_ids == llm.generate([[1, 2, 3, 4]], long, use_tqdm=False)[0]["token_ids"]
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY], ids=lambda k: k.name)
def test_a_request_finished_by_a_step_that_raised_is_still_returned(llm, kind):
    """Async scheduling settles step N before sampling N+1 when N+1 has bad words; should sampling then raise, step()
    raises, and the tokens N applied (here the last of "short") are returned by the next step, not lost."""
    if not llm.config.async_scheduling:
        pytest.skip("the plain loop applies tokens only in a step that returns")
    engine = llm.llm_engine
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=["zzz"], output_kind=kind)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, output_kind=kind)
    engine.add_request("long", [1, 2, 3], long)
    engine.add_request("short", [4, 5, 6], short)
    short_seq, sample = llm.scheduler.waiting[-1], llm.executor.sample

    def sample_failing_once(step):
        if short_seq.is_finished and not failed:
            failed.append(True)
            raise KeyboardInterrupt
        return sample(step)

    failed, outputs = [], {}
    with mock.patch.object(llm.executor, "sample", side_effect=sample_failing_once):
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            try:
                for out in engine.step():
                    outputs.setdefault(out.request_id, []).append(out)
            except KeyboardInterrupt:
                pass
    assert failed and not engine.has_unfinished_requests()
    for rid, params in (("long", long), ("short", short)):
        outs, want = outputs[rid], llm.generate([[1, 2, 3] if rid == "long" else [4, 5, 6]], params,
                                                use_tqdm=False)[0].outputs[0]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        pieces = [o.outputs[0] for o in outs] if kind == DELTA else [outs[-1].outputs[0]]
        assert [t for c in pieces for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in pieces) == want.text
    assert llm.is_finished()


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY], ids=lambda k: k.name)
def test_a_step_interrupted_while_making_outputs_loses_none(llm, kind):
    """A KeyboardInterrupt while step() makes its outputs (decoding a sample's text), after the engine's step
    applied its tokens: a request that step finished was dropped before its output was made, so it was never
    returned (has_unfinished_requests() False), and a DELTA sample's tokens made before the interrupt were counted
    as returned. The next step() returns everything."""
    engine = llm.llm_engine
    requests = [([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)),
                ([4, 5, 6], SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=9, ignore_eos=True, logprobs=0))]
    want = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt, params in requests]
    for at in range(1, 22, 4):
        for i, (prompt, params) in enumerate(requests):
            params.output_kind = kind
            engine.add_request(str(i), prompt, params)
        got = {}
        with mock.patch.object(llm, "_text", side_effect=_failing_once(llm._text, at)):
            while engine.has_unfinished_requests():
                try:
                    outs = engine.step()
                except KeyboardInterrupt:
                    continue
                for out in outs:
                    for c in out.outputs:
                        key = (out.request_id, c.index)
                        if kind == DELTA:
                            got.setdefault(key, [[], []])[0].extend(c.token_ids)
                            got[key][1].extend(c.logprobs)
                        elif out.finished:
                            got[key] = [list(c.token_ids), list(c.logprobs)]
        assert {key: tokens for key, (tokens, _) in got.items()} == {
            (str(i), c.index): c.token_ids for i, w in enumerate(want) for c in w.outputs}, at
        for i, w in enumerate(want):
            for c in w.outputs:
                assert_logprobs_close(got[str(i), c.index][1], c.logprobs)
        assert llm.is_finished()


def test_a_ctrl_c_while_a_step_applies_its_tokens_waits_until_they_all_are(llm):
    """A Ctrl-C (SIGINT) while step() applied its tokens to the requests (here: while a sample's text took its new
    token) left the step half applied: the requests after it never took theirs into their text, so the final text
    missed a piece while token_ids had it. The interrupt now comes once every request has its tokens and text, and
    stepping on gives generate()'s outputs."""
    from nanovllm.engine.detokenizer import IncrementalDetokenizer
    engine, requests = llm.llm_engine, _requests(llm)
    want = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt, params in requests]
    for at in (3, 8, 20, 33):
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params)
        finals, interrupted = {}, 0
        with mock.patch.object(IncrementalDetokenizer, "add", _interrupted_once(IncrementalDetokenizer.add, at)):
            while engine.has_unfinished_requests():
                try:
                    finals.update({o.request_id: o for o in engine.step() if o.finished})
                except KeyboardInterrupt:
                    interrupted += 1
        assert interrupted == 1
        for i, w in enumerate(want):
            _same([_fields(c) for c in finals[str(i)].outputs], w)


def test_a_refused_abort_keeps_the_request(llm):
    """abort_request refused (Busy: another call holds the LLM) leaves the request running and known, so a later
    abort frees it; a view that forgot it would leave its sequences running unseen."""
    engine, params = llm.llm_engine, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.step()
    with llm._exclusive("generate"), pytest.raises(Busy):  # (as a generate() in another thread would)
        engine.abort_request(["a", "a"])
    assert engine.get_num_unfinished_requests() == 1
    engine.abort_request(["a", "a"])
    assert not engine.has_unfinished_requests() and llm.is_finished()
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


def test_aborting_every_request_leaves_the_engine_idle(llm):
    """Under async scheduling a step is still in flight when the last request is aborted: the LLM is idle at once
    all the same (has_unfinished_requests() says so), so the calls that need it idle (sleep, update_weights,
    reset_prefix_cache) run, and the next request is exact."""
    engine, params = llm.llm_engine, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [3, 2, 1], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=30))
    for _ in range(4):
        engine.step()
    engine.abort_request(["a", "b"])
    assert not engine.has_unfinished_requests() and llm.is_finished() and engine.reset_prefix_cache()
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
    engine.add_request("c", [1, 2, 3], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]["token_ids"]


def test_reset_prefix_cache_with_requests_running(llm):
    """vLLM's llm_engine_reset_kv.py: reset_prefix_cache mid-loop. Without reset_running_requests it changes nothing
    and returns False, as vLLM's; with it the running requests are preempted (their blocks freed, a step in flight
    settled first), the cache is emptied, and every request still ends as generate() gives it."""
    engine, requests = llm.llm_engine, _requests(llm)
    expected = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt, params in requests]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    finals = {}
    for step in range(8):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if step == 2:
            hits = llm.scheduler.block_manager.hash_to_block_id.copy()
            assert hits and engine.reset_prefix_cache() is False
            assert llm.scheduler.block_manager.hash_to_block_id == hits  # (nothing reset)
            assert engine.reset_prefix_cache(reset_running_requests=True) is True
            assert not llm.scheduler.block_manager.hash_to_block_id and not llm.scheduler.running
            assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for i, want in enumerate(expected):
        _same([_fields(c) for c in finals[str(i)].outputs], want)
        got = finals[str(i)].prompt_logprobs
        assert (got is None) == (want.prompt_logprobs is None)
        if got is not None:
            assert got[0] is None and want.prompt_logprobs[0] is None
            assert_logprobs_close(got[1:], want.prompt_logprobs[1:])
    assert llm.is_finished() and llm.reset_prefix_cache() is True


def test_reset_prefix_cache_mid_prefill(model):
    """A prompt half prefilled (chunks of 16 tokens) when its blocks are reset starts again: the same tokens and
    prompt logprobs as generate() gives, each prompt position scored once."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    prompt = list(range(3, 43))
    with LLM(model, max_num_batched_tokens=16, **SMALL) as llm:
        want = llm.generate([prompt], params, use_tqdm=False)[0]
        llm.reset_prefix_cache()
        seq = llm.add_request(prompt, params)
        llm.step()
        assert seq.block_table and not seq.is_finished
        assert llm.reset_prefix_cache(reset_running_requests=True) and not seq.block_table
        while not seq.is_finished:
            llm.step()
        assert seq.completion_token_ids == want.outputs[0].token_ids
        assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(prompt)
        assert_logprobs_close(llm._logprobs(seq.prompt_logprobs[1:], True), want.prompt_logprobs[1:])


def test_a_request_ended_by_a_stop_leaves_the_engine_idle(llm):
    """Under async scheduling the step after a stop token was launched before the stop was seen: once the last
    request is returned the LLM is idle all the same, so sleep, update_weights and reset_prefix_cache run (an RL
    loop's weight sync after its last step)."""
    engine, params = llm.llm_engine, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    stop = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]["token_ids"][6]
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].outputs[0].stop_reason == stop
    assert llm.is_finished() and engine.reset_prefix_cache()
    seq = llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))
    while not seq.is_finished:  # (nanovllm's own step API)
        llm.step()
    assert llm.is_finished()
    for fail_at in range(1, 9):  # a settle interrupted (KeyboardInterrupt), its step settled by the next call
        engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))
        with mock.patch.object(llm.executor, "settle", side_effect=_failing_once(llm.executor.settle, fail_at)):
            while engine.has_unfinished_requests():
                try:
                    engine.step()
                except KeyboardInterrupt:
                    pass
        assert llm.is_finished(), fail_at


def test_output_kind_set_after_construction(llm):
    """output_kind set on a SamplingParams after it was made (by name, or vLLM's own enum, a plain Enum) is read as
    the request checks it, not as the object holds it."""
    class VllmKind(enum.Enum):  # (vllm.sampling_params.RequestOutputKind)
        CUMULATIVE, DELTA, FINAL_ONLY = 0, 1, 2

    engine = llm.llm_engine
    for kind, want in (("DELTA", [1, 1, 1]), (VllmKind.DELTA, [1, 1, 1]), (VllmKind.FINAL_ONLY, [3])):
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        params.output_kind = kind
        engine.add_request("a", [1, 2, 3], params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert [len(o.outputs[0].token_ids) for o in outs] == want


def test_refusals_leave_nothing_queued(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(TypeError, match="request_id must be a str"):
        engine.add_request(0, [1, 2], params)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request("a", [1, 2], {"temperature": 0})
    with pytest.raises(ValueError, match="priority=1 is not supported"):
        engine.add_request("a", [1, 2], params, priority=1)
    with pytest.raises(ValueError, match="tokenization_kwargs"):
        engine.add_request("a", [1, 2], params, tokenization_kwargs={"truncation": True})
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", [1] * 300, params)
    assert not engine.has_unfinished_requests() and llm.is_finished()
    engine.add_request("a", [1, 2], params)
    with pytest.raises(ValueError, match="'a' is already running"):
        engine.add_request("a", [3, 4], params)
    with pytest.raises(RuntimeError, match="still running"):  # (generate() would take the step API's requests)
        llm.generate([[1, 2]], params, use_tqdm=False)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["a"] and outs[-1].outputs[0].token_ids == llm.generate(
        [[1, 2]], params, use_tqdm=False)[0]["token_ids"]


def test_requests_added_from_another_thread_mid_loop(llm):
    """A serving loop steps in one thread while another adds requests: add_request waits for the step."""
    engine, params = llm.llm_engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([[i, i + 1, i + 2] for i in range(6)], params, use_tqdm=False)
    added, finished, errors, stepped = threading.Event(), {}, [], threading.Semaphore(0)

    def add():
        try:
            for i in range(6):
                stepped.acquire()  # (after a step: the loop is entering its next one)
                engine.add_request(str(i), [i, i + 1, i + 2], params)
        except Exception as e:  # (the loop below must end either way)
            errors.append(e)
        finally:
            added.set()

    adder = threading.Thread(target=add)
    adder.start()
    engine.add_request("first", [7, 7, 7], params)
    while not added.is_set() or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        stepped.release()
    adder.join()
    assert not errors and finished.pop("first") and finished == {str(i): out["token_ids"]
                                                                   for i, out in enumerate(expected)}


def test_generate_takes_any_output_kind(llm):
    """vLLM's LLM.generate returns whole outputs whatever output_kind says."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]["token_ids"]
    for kind in (DELTA, FINAL_ONLY, 0, "DELTA"):
        sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, output_kind=kind)
        assert llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0]["token_ids"] == want


def test_engine_args_from_a_command_line(model):
    """vLLM's llm_engine_example: EngineArgs.add_cli_args, from_cli_args, LLMEngine.from_engine_args."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=2)  # (a script's own flag stays the script's)
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", model, "--max-model-len", "256", "--block-size", "16",
                              "--num-gpu-blocks-override", "48", "--no-enable-prefix-caching", "--num-prompts", "3"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.options == dict(max_model_len=256, block_size=16, num_gpu_blocks_override=48,
                                       enable_prefix_caching=False)
    engine = LLMEngine.from_engine_args(engine_args)
    try:
        config = engine.llm.config
        assert (config.max_model_len, config.kvcache_block_size, config.num_kvcache_blocks,
                config.enable_prefix_caching) == (256, 16, 48, False)
        assert engine.get_model_config().max_model_len == 256 and engine.get_tokenizer() is engine.llm.tokenizer
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        got = _run(engine, [("hello", params)] * args.num_prompts, FINAL_ONLY)
        assert len(got) == 3 and len({tuple(o[0].outputs[0].token_ids) for o in got.values()}) == 1
    finally:
        engine.llm.exit()
    with pytest.raises(SystemExit):  # (argparse's own error for a bad value)
        EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--max-model-len", "x"])
    with pytest.raises(ValueError, match="data_parallel_size > 1 is not supported"):
        LLMEngine.from_engine_args(EngineArgs(model, data_parallel_size=2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):  # (vLLM's dataclass too)
        EngineArgs(model, no_such_option=1)


def _options_of(config: Config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(Config) if f.init}


def test_engine_args_are_a_dataclass(model):
    """vLLM's EngineArgs is a dataclass: scripts build LLM(**dataclasses.asdict(engine_args)) (the model and every
    option, each at LLM's default unless set: the same engine as from_engine_args), change options with
    dataclasses.replace, and list them with dataclasses.fields."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", model, "--max-model-len", "256", "--block-size",
                                                       "16", "--num-gpu-blocks-override", "48", "-O0",
                                                       "--no-enable-prefix-caching", "--trust-remote-code"]))
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert names[0] == "model" and {"max_model_len", "kvcache_block_size", "block_size", "trust_remote_code",
                                    "tokenizer", "enable_expert_parallel", "revision"} <= set(names)
    as_dict = dataclasses.asdict(args)
    assert list(as_dict) == names and {name: as_dict[name] for name in (
        "model", "max_model_len", "block_size", "kvcache_block_size", "optimization_level", "enforce_eager", "seed",
        "trust_remote_code", "tokenizer", "swap_space")} == dict(
        model=model, max_model_len=256, block_size=16, kvcache_block_size=256, optimization_level=0,
        enforce_eager=False, seed=0, trust_remote_code=True, tokenizer=None, swap_space=4)
    # -O0 is eager though asdict gives enforce_eager=False; vLLM's block_size wins over kvcache_block_size's default
    with LLM(**as_dict) as llm:
        config = _options_of(llm.config)
        assert (config["max_model_len"], config["kvcache_block_size"], config["num_kvcache_blocks"],
                config["enable_prefix_caching"], config["enforce_eager"]) == (256, 16, 48, False, True)
        engine = LLMEngine.from_engine_args(args)
        try:
            assert _options_of(engine.llm.config) == config
            prompts, params = ["hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            assert (llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
                    == engine.llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)
        finally:
            engine.llm.exit()
    # every option left at its default: the engine of EngineArgs(model) and of LLM(model)
    assert _options_of(Config.from_kwargs(**dataclasses.asdict(EngineArgs(model)))) == _options_of(
        Config.from_kwargs(model))
    changed = dataclasses.replace(args, max_model_len=128, block_size=32)
    assert (changed.max_model_len, changed.block_size, args.max_model_len, args.block_size) == (128, 32, 256, 16)
    assert _options_of(Config.from_kwargs(**dataclasses.asdict(changed)))["kvcache_block_size"] == 32
    changed.gpu_memory_utilization = 0.5  # (a script's engine_args.gpu_memory_utilization = 0.5, then LLM(...))
    assert dataclasses.asdict(changed)["gpu_memory_utilization"] == 0.5 and changed.options[
        "gpu_memory_utilization"] == 0.5
    assert repr(EngineArgs(model, max_model_len=256, seed=0)) == f"EngineArgs(model={model!r}, max_model_len=256)"
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        dataclasses.replace(args, no_such_option=1)
    # vLLM's name and nanovllm's for one option, set to two values: refused naming both
    with pytest.raises(ValueError, match="block_size=32 and kvcache_block_size=16 name one option"):
        Config.from_kwargs(model, kvcache_block_size=16, block_size=32)


def test_engine_args_model_from_set_defaults(model):
    """--model may come from parser.set_defaults, as vLLM's examples set it (argparse's check of a required flag
    ignores defaults)."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parser.set_defaults(model=model)
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", "256"]))
    assert (engine_args.model, engine_args.options) == (model, {"max_model_len": 256})


def test_engine_args_take_vllm_flags(model):
    """A vLLM script's flags parse, and LLM(...) then ignores, maps or refuses each by name, as in code."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", model, "--trust-remote-code", "--disable-log-stats", "--tokenizer", model,
                              "--enable-chunked-prefill", "--swap-space", "4", "--max-logprobs", "5", "--task", "auto",
                              "--max-model-len", "256", "--block-size", "16", "--num-gpu-blocks-override", "16"])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        assert (engine.llm.config.model, engine.llm.config.max_model_len) == (model, 256)
    finally:
        engine.llm.exit()
    args = parser.parse_args(["--model", model, "--pipeline-parallel-size", "2", "--enable-expert-parallel"])
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported"):
        LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))


def test_engine_args_take_vllm_short_flags(model):
    """vLLM's short flags -tp, -pp, -dp, -q, -O (-O0 written together, as vLLM's scripts do) and -cc name the
    options their long flags do."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", model, "-tp", "2", "-pp", "1", "-dp", "1", "-q", "fp8", "-O0", "-cc", "{}"])
    a = EngineArgs.from_cli_args(args)
    assert (a.tensor_parallel_size, a.pipeline_parallel_size, a.data_parallel_size, a.quantization,
            a.optimization_level, a.compilation_config) == (2, 1, 1, "fp8", 0, {})


def test_engine_args_read_sizes_as_vllm_does(model):
    """--max-model-len, --max-num-batched-tokens and --kv-cache-memory-bytes take vLLM's sizes: 1k is 1000, 25.6k
    25600, 32K 32768; None the default. A decimal with a binary suffix is argparse's error, as in vLLM."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", model, "--max-model-len", "32K", "--max-num-batched-tokens", "25.6k",
                              "--kv-cache-memory-bytes", "1G"])
    assert EngineArgs.from_cli_args(args).options == dict(max_model_len=32768, max_num_batched_tokens=25600,
                                                          kv_cache_memory_bytes=2**30)
    args = parser.parse_args(["--max-model-len", "1k", "--max-num-batched-tokens", "2048"])
    assert EngineArgs.from_cli_args(args).options == dict(max_model_len=1000, max_num_batched_tokens=2048)
    assert parser.parse_args(["--max-model-len", "None"]).max_model_len is None
    for bad in ("1.5K", "1x", "k"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-model-len", bad])


def test_engine_args_read_json_flags(model):
    """Dict- and config-valued flags read JSON, as vLLM's command line does: the empty dict, vLLM's default for
    --hf-overrides, is accepted, and a dict of overrides changes the model's config, as in code."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", model, "--hf-overrides", "{}", "--limit-mm-per-prompt", "{}",
                              "--compilation-config", "{}", "--speculative-config", "None"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.options == dict(hf_overrides={}, limit_mm_per_prompt={}, compilation_config={})
    assert engine_args.speculative_config is None
    assert Config.from_kwargs(model, **engine_args.options).max_model_len == 2048
    args = parser.parse_args(["--model", model, "--hf-overrides", '{"rope_theta": 1000000}'])
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        assert engine.get_model_config().hf_config.rope_parameters["rope_theta"] == 1000000
    finally:
        engine.llm.exit()
    assert parser.parse_args(["--compilation-config", '{"level": 0}']).compilation_config == {"level": 0}
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", '{"rope_theta": 1'])


def test_flexible_argument_parser(model):
    """vLLM's FlexibleArgumentParser, where vLLM's examples import it (nanovllm.utils.argparse_utils, and
    nanovllm.utils as older vLLM had it): --flag_name reads as --flag-name; dotted keys of a JSON flag merge into
    one dict (-cc.level too); a script's own flags, values such as -0.5 and what follows -- are left alone."""
    from nanovllm.utils import FlexibleArgumentParser as Older
    from nanovllm.utils.argparse_utils import FlexibleArgumentParser
    assert Older is FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.add_argument("--temperature", type=float)
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--model", model, "--max_model_len", "1k", "--enforce_eager", "--temperature", "-0.5",
                              "--hf-overrides.rope_scaling.factor", "4", "--hf_overrides.rope_theta=1e6",
                              "-cc.level", "0", "--", "--x_y.z"])
    assert (args.max_model_len, args.enforce_eager, args.temperature, args.rest) == (1000, True, -0.5, ["--x_y.z"])
    assert args.hf_overrides == {"rope_scaling": {"factor": 4}, "rope_theta": 1e6}
    assert args.compilation_config == {"level": 0}
    args, unknown = parser.parse_known_args(["--max_num_seqs=8", "--no_such_flag"])
    assert (args.max_num_seqs, unknown) == (8, ["--no-such-flag"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides.rope_theta"])


def test_engine_args_read_their_defaults(model):
    """vLLM's EngineArgs has a field per option: one left out reads as LLM(...)'s default; a name that is no option
    is refused, EngineArgs' own attributes' names too."""
    args = EngineArgs(model, max_model_len=256)
    assert (args.model, args.max_model_len, args.block_size, args.enable_prefix_caching, args.tokenizer_mode,
            args.swap_space) == (model, 256, 256, True, "auto", 4)
    # vLLM's options without effect here, or mapped, read as vLLM's defaults (a script's get_tokenizer(
    # engine_args.tokenizer or engine_args.model, trust_remote_code=engine_args.trust_remote_code))
    assert (args.tokenizer, args.trust_remote_code, args.max_logprobs, args.disable_log_stats,
            args.enable_chunked_prefill, args.optimization_level) == (None, False, 20, False, None, 2)
    from nanovllm.engine_args import _VLLM_DEFAULTS
    from nanovllm.vllm_options import NO_EFFECT
    assert set(NO_EFFECT) <= set(_VLLM_DEFAULTS)
    with pytest.raises(AttributeError, match="no option 'no_such_option'"):
        _ = args.no_such_option
    for name in ("options", "make_llm"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            EngineArgs(model, **{name: 1})
