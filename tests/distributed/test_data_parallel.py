"""data_parallel_size: N engine replicas in spawned processes behind one LLM. On CPU each replica gets its share of
the cores, so CI runs the same code path as a GPU host."""
import gc
import multiprocessing
import os
import random
import signal
import threading
import time
import weakref

import pytest
import torch

from nanovllm import LLM, BeamSearchParams, SamplingParams
from nanovllm.distributed.data_parallel import DataParallelLLM, ReplicaError, route
from tests.compare import assert_logprobs_close
from tests.tiny_models import CHAT_TEMPLATE, make_checkpoint

# Replicas take a GPU each on a CUDA host with two or more; elsewhere (CI, a one-GPU machine) they share the CPU cores
DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
OPTIONS = dict(device=DEVICE, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(rng.randint(3, 60))] for _ in range(count)]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("dp_chat"), "qwen3", tie=True, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def dp(chat_model):
    with LLM(chat_model, data_parallel_size=2, **OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def single(chat_model):
    with LLM(chat_model, **OPTIONS) as llm:
        yield llm


def _same(outs: list[dict], expected: list[dict]):
    """Tokens, text and finish reasons equal; logprobs equal up to float rounding (a replica batches the requests
    differently, and the float sums of a step depend a little on what shares it)."""
    for out, ref in zip(outs, expected, strict=True):
        for a, b in zip(out["outputs"], ref["outputs"], strict=True):
            assert {k: v for k, v in a.items() if k != "logprobs"} == {k: v for k, v in b.items() if k != "logprobs"}
            assert_logprobs_close(a.get("logprobs"), b.get("logprobs"))


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0.8, seed=9, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)] * 4


def test_unseeded_copies_of_a_prompt_draw_apart(dp):
    """A GRPO batch, one short prompt k times without a seed: each replica draws from its own generator, so copies
    sent to different replicas are not the same sample (each replica seeded alike repeated the other's draws)."""
    outs = dp.generate([[5, 6, 7, 8, 9]] * 8, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 8


def test_outputs_equal_one_engine_in_input_order(dp, single):
    assert isinstance(dp, DataParallelLLM) and dp.num_replicas == 2
    prompts = _prompts(0, 12)
    prompts[5] = prompts[0] + [1, 2, 3]  # shares prompt 0's first block: routed to the same replica
    expected = single.generate(prompts, _params(), use_tqdm=False)
    outs = dp.generate(prompts, _params(), use_tqdm=False)
    _same(outs, expected)
    assert [o["prompt_token_ids"] for o in outs] == prompts
    assert sorted(s["replica"] for s in dp.last_stats) == [0, 1] and all(s["requests"] for s in dp.last_stats)
    assert sum(s["output_tokens"] for s in dp.last_stats) == sum(len(o["token_ids"]) for out in outs
                                                                 for o in out["outputs"])


def test_streaming_and_chat_equal_one_engine(dp, single):
    prompts = _prompts(1, 7)
    expected = single.generate(prompts, _params()[:7], use_tqdm=False)
    streamed: dict[tuple[int, int], list[int]] = {}
    for item in dp.stream(prompts, _params()[:7]):
        streamed.setdefault((item["index"], item["sample_index"]), []).extend(item["token_ids"])
    assert streamed == {(i, j): o["token_ids"] for i, out in enumerate(expected) for j, o in enumerate(out["outputs"])}
    conversations = [[{"role": "user", "content": q}] for q in ("Hello world!", "How are you?", "Paris?")]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o["token_ids"] for o in dp.chat(conversations, greedy, use_tqdm=False)] == \
        [o["token_ids"] for o in single.chat(conversations, greedy, use_tqdm=False)]


def test_vllm_shapes_through_replicas(dp, single):
    """RequestOutputs with their prompt text and call-wide request ids, Logprob ranks, the accessors, beam search."""
    tokenizer = dp.get_tokenizer()
    words = ["Hello world", "How are you", "Paris", "one two three"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    outs, expected = dp.generate(words, params, use_tqdm=False), single.generate(words, params, use_tqdm=False)
    assert [o.prompt for o in outs] == words and [o.prompt_token_ids for o in outs] == [tokenizer.encode(w)
                                                                                         for w in words]
    assert len({o.request_id for o in outs + dp.generate(words, params, use_tqdm=False)}) == 2 * len(words)
    for out, ref in zip(outs, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert [{t: lp.rank for t, lp in step.items()} for step in out.outputs[0].logprobs] == \
            [{t: lp.rank for t, lp in step.items()} for step in ref.outputs[0].logprobs]
    assert dp.llm_engine.model_config.max_model_len == single.llm_engine.model_config.max_model_len
    assert dp.get_default_sampling_params() == single.get_default_sampling_params()
    beam = BeamSearchParams(beam_width=2, max_tokens=4)
    assert [[s.tokens for s in o.sequences] for o in dp.beam_search(words[:2], beam)] == \
        [[s.tokens for s in o.sequences] for o in single.beam_search(words[:2], beam)]


def test_bad_requests_and_an_abandoned_stream_leave_the_replicas_working(dp, single):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompts, error, match in [([[1, 2, 3], []], ValueError, "prompt is empty"),
                                  ([[1, 2, 3], [1, 999]], ValueError, "outside the vocabulary"),
                                  ([1, 2, 3], TypeError, "flat list of ints")]:
        with pytest.raises(error, match=match):
            dp.generate(prompts, greedy, use_tqdm=False)
        with pytest.raises(error, match=match):
            dp.stream(prompts, greedy)
    running = dp.stream(_prompts(2, 6), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(running)
    running.close()
    prompts = _prompts(3, 4)
    assert [o["token_ids"] for o in dp.generate(prompts, greedy, use_tqdm=False)] == \
        [o["token_ids"] for o in single.generate(prompts, greedy, use_tqdm=False)]


def test_structured_outputs_through_replicas(dp, single):
    """The params travel pickled to the replicas, each compiles for itself; a bad spec raises here."""
    pytest.importorskip("xgrammar")
    from nanovllm import StructuredOutputsParams
    spec = StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"')
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, structured_outputs=spec) for i in range(6)]
    prompts = _prompts(4, 6)
    outs = dp.generate(prompts, params, use_tqdm=False)
    _same(outs, single.generate(prompts, params, use_tqdm=False))
    assert all(o["text"].startswith("(") for o in outs)
    with pytest.raises(ValueError, match="grammar cannot be compiled"):
        dp.generate(prompts[:2], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= x")),
                    use_tqdm=False)
    assert [o["token_ids"] for o in dp.generate(prompts, params, use_tqdm=False)] == [o["token_ids"] for o in outs]


def test_routing_keeps_prefixes_together_and_balances_tokens():
    shares = route([100, 10, 10, 100, 50, 40], ["a", "b", "c", "a", "d", "e"], 2)
    assert sorted(shares, key=len) == [[0, 3], [1, 2, 4, 5]]  # 200 tokens against 110
    assert route([5] * 4, [1, 2, 3, 4], 3) == [[0, 3], [1], [2]]


def test_a_killed_replica_raises_and_nothing_is_left(chat_model):
    llm = LLM(chat_model, data_parallel_size=2, **OPTIONS)
    processes = list(llm.processes)
    os.kill(processes[1].pid, signal.SIGKILL)
    with pytest.raises(ReplicaError, match="replica 1 exited unexpectedly \\(exit code -9\\)"):
        llm.generate(_prompts(4, 6), SamplingParams(max_tokens=50), use_tqdm=False)
    assert all(not p.is_alive() for p in processes) and not set(processes) & set(multiprocessing.active_children())
    with pytest.raises(ReplicaError, match="shut down after a failure"):
        llm.generate(_prompts(4, 2), use_tqdm=False)
    llm.exit()


def test_bad_options_fail_before_any_process_starts(chat_model, monkeypatch):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        LLM(chat_model, data_parallel_size=0)
    with pytest.raises(TypeError, match="data_parallel_size must be int"):
        LLM(chat_model, data_parallel_size="2")
    with pytest.raises(TypeError, match="unknown option"):
        LLM(chat_model, data_parallel_size=2, no_such_option=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ValueError, match="data_parallel_size=2 x tensor_parallel_size=2 needs 4 GPUs but only 3"):
        LLM(chat_model, device="cuda", data_parallel_size=2, tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before


def test_exit_leaves_no_process(chat_model):
    with LLM(chat_model, data_parallel_size=2, **OPTIONS) as llm:
        processes = list(llm.processes)
    assert all(p.exitcode == 0 for p in processes)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], use_tqdm=False)
    # dropped without exit() (`del llm`): the replicas stop then, not at exit
    llm = LLM(chat_model, data_parallel_size=2, **OPTIONS)
    processes, alive = list(llm.processes), weakref.ref(llm)
    del llm
    gc.collect()
    assert alive() is None and all(p.exitcode == 0 for p in processes)


def test_replicas_leave_nothing_for_the_resource_tracker(chat_model):
    # a replica leaves without its interpreter's teardown (distributed/process.leave_now) but after multiprocessing's
    # own finalizers: the lock tqdm makes in every replica's generate is removed, not reported leaked at exit
    import subprocess
    import sys
    script = ("from nanovllm import LLM\n"
              "if __name__ == '__main__':\n"
              f"    with LLM({chat_model!r}, data_parallel_size=2, **{OPTIONS!r}) as llm:\n"
              "        llm.generate([[1, 2, 3]] * 2, use_tqdm=False)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr
    # a script that leaves without exit(), having made a weakref.finalize before multiprocessing was imported (a
    # TemporaryDirectory does): the replicas are stopped before multiprocessing's exit hook joins them (that
    # order hung until killed when only weakref.finalize's own exit hook stopped them)
    script = ("import tempfile\n"
              "keep = tempfile.TemporaryDirectory()\n"
              "from nanovllm import LLM\n"
              "if __name__ == '__main__':\n"
              f"    llm = LLM({chat_model!r}, data_parallel_size=2, **{OPTIONS!r})\n"
              "    llm.generate([[1, 2, 3]] * 2, use_tqdm=False)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("option", ["data_parallel_size", "tensor_parallel_size"])
def test_a_script_without_a_main_guard_is_told_so(chat_model, tmp_path, option):
    """Spawned replicas and workers import the user's script again; one that builds the LLM at module level makes
    them fail at start. The error says what to change."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text(f"from nanovllm import LLM\nllm = LLM({chat_model!r}, {option}=2, max_model_len=256, "
                      f"kvcache_block_size=16, num_kvcache_blocks=32, device={DEVICE!r})\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr, done.stderr[-2000:]


# ---- faults: every answer belongs to its own prompt, nothing hangs ------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def deadline():
    """Fails a test that hangs (SIGALRM after 240 s) instead of blocking the suite."""
    def hung(signum, frame):
        raise TimeoutError("the data-parallel engine hung")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _expected(single, prompts) -> list[list[int]]:
    return [o["token_ids"] for o in single.generate(prompts, GREEDY, use_tqdm=False)]


def test_a_bad_request_is_refused_before_any_replica_works(dp, single, deadline):
    rng = random.Random(5)
    good = [[rng.randrange(400) for _ in range(40)] for _ in range(6)]  # 2 full blocks each: cached once computed
    for bad, error in [((x for x in [1, 2]), TypeError), ([1, 999], ValueError)]:
        with pytest.raises(error):
            dp.generate(good + [bad], GREEDY, use_tqdm=False)
        with pytest.raises(error):
            dp.stream(good + [bad], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        sp = SamplingParams(temperature=0)
        sp.max_tokens = 0  # changed after construction: checked at submission
        dp.generate(good, sp, use_tqdm=False)
    outs = dp.generate(good, GREEDY, use_tqdm=False)
    assert [o["num_cached_tokens"] for o in outs] == [0] * 6  # no replica had computed any of them
    assert [o["token_ids"] for o in outs] == _expected(single, good)


def test_an_open_stream_holds_the_replicas(dp, single, deadline):
    prompts, other = _prompts(7, 4), _prompts(8, 3)
    expected = _expected(single, prompts)
    stream = dp.stream(prompts, GREEDY)
    got: dict[int, list[int]] = {}
    item = next(stream)
    got.setdefault(item["index"], []).extend(item["token_ids"])
    with pytest.raises(RuntimeError, match="another call is using this engine"):
        dp.generate(other, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="another call is using this engine"):
        next(dp.stream(other, GREEDY))
    for item in stream:  # the open stream lost nothing
        got.setdefault(item["index"], []).extend(item["token_ids"])
    assert [got[i] for i in range(len(prompts))] == expected
    assert [o["token_ids"] for o in dp.generate(other, GREEDY, use_tqdm=False)] == _expected(single, other)


def _interrupt_after(seconds: float):
    import _thread
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    return timer


def test_random_faults_between_calls(dp, single, deadline):
    """A random mix of interrupted generates, abandoned and half-read streams and bad prompts; after each, a call's
    answers are those of its own prompts (every call has prompts of its own, so a stale answer cannot pass)."""
    rng = random.Random(0)
    for step in range(24):
        prompts = _prompts(1000 + step, rng.randint(1, 6))
        fault = rng.choice(["interrupt", "dropped stream", "half-read stream", "bad prompt", "none"])
        if fault == "interrupt":
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            try:
                timer = _interrupt_after(rng.uniform(0.0, 0.3))
                dp.generate(_prompts(2000 + step, 6), long, use_tqdm=False)
                timer.cancel()
                timer.join()
                time.sleep(0.05)  # (an interrupt that came late lands here)
            except KeyboardInterrupt:
                pass
        elif fault == "dropped stream":
            dp.stream(_prompts(3000 + step, 4), GREEDY)
        elif fault == "half-read stream":
            stream = dp.stream(_prompts(4000 + step, 4), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
            for _ in range(rng.randint(1, 5)):
                next(stream)
            if rng.random() < 0.5:
                stream.close()
            del stream
        elif fault == "bad prompt":
            with pytest.raises((TypeError, ValueError)):
                dp.stream([[1, 2], (t for t in [3])], GREEDY) if rng.random() < 0.5 else \
                    dp.generate([[1, 2], [5, 10**6]], GREEDY, use_tqdm=False)
        if rng.random() < 0.5:
            outs = dp.generate(prompts, GREEDY, use_tqdm=False)
            assert [o["token_ids"] for o in outs] == _expected(single, prompts), (step, fault)
            assert [o["prompt_token_ids"] for o in outs] == prompts
        else:
            got: dict[int, list[int]] = {}
            for item in dp.stream(prompts, GREEDY):
                got.setdefault(item["index"], []).extend(item["token_ids"])
            assert [got[i] for i in range(len(prompts))] == _expected(single, prompts), (step, fault)


def test_exit_mid_stream_is_prompt(chat_model):
    llm = LLM(chat_model, data_parallel_size=2, **OPTIONS)
    stream = llm.stream(_prompts(9, 6), SamplingParams(temperature=0, max_tokens=240, ignore_eos=True))
    next(stream)
    start = time.monotonic()
    llm.exit()
    assert time.monotonic() - start < 10 and all(p.exitcode == 0 for p in llm.processes)


# ---- the weight and memory calls reach every replica ----------------------------------------------------------
def test_weights_sleep_and_rpc_on_every_replica(chat_model, qwen3_b, deadline):
    from tests.tiny_models import hf_greedy, hf_model
    prompts = _prompts(11, 6)
    with LLM(chat_model, data_parallel_size=2, **OPTIONS) as llm:
        assert [r["rank"] for r in llm.collective_rpc("describe")] == [0, 0]  # rank 0 of each replica
        state = hf_model(qwen3_b).state_dict()
        with pytest.raises(ValueError, match="matches no parameter"):
            llm.update_weights({**state, "model.nope.weight": torch.zeros(2)})
        with pytest.raises(TypeError, match="item 0 must be a \\(name, tensor\\) pair"):
            llm.update_weights([torch.zeros(3)])
        llm.update_weights(state)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)  # every replica serves the new weights
        assert [o["token_ids"] for o in outs] == [hf_greedy(qwen3_b, p, 10) for p in prompts]
        assert sorted(s["replica"] for s in llm.last_stats) == [0, 1]
        stream = llm.stream(prompts, GREEDY)  # made awake, read asleep: refused, as on one engine
        llm.sleep(level=1)
        assert llm.is_sleeping()
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="asleep"):
            list(stream)
        llm.wake_up()
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [o["token_ids"] for o in outs]
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert any(o["num_cached_tokens"] for o in again) or all(len(p) <= 16 for p in prompts)
        assert llm.reset_prefix_cache() is True
        assert all(o["num_cached_tokens"] == 0 for o in llm.generate(prompts, GREEDY, use_tqdm=False))
        llm.sleep(level=2)
        with pytest.raises(ValueError, match="lacks weights"):
            llm.update_weights({"model.norm.weight": state["model.norm.weight"]})
        llm.update_weights(state)
        llm.wake_up()
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [o["token_ids"] for o in outs]


def test_lora_through_replicas(qwen3_tied, lora_attention, lora_mixed, tmp_path, deadline):
    """enable_lora with data_parallel_size=2: the base model and two adapters in one call give transformers +
    PEFT's tokens, in input order; a bad adapter is refused before any replica works, and the replicas serve on;
    add_lora / remove_lora / list_loras reach every replica."""
    from nanovllm import LoRARequest
    from tests.lora.adapters import peft_greedy
    from tests.tiny_models import hf_greedy
    prompts = _prompts(21, 6)
    loras = [None, lora_attention, lora_mixed, lora_mixed, None, lora_attention]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(qwen3_tied, data_parallel_size=2, enable_lora=True, max_loras=2, **OPTIONS) as llm:
        outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
        for prompt, lora, out in zip(prompts, loras, outs):
            want = hf_greedy(qwen3_tied, prompt, 8) if lora is None else peft_greedy(qwen3_tied, lora.lora_path,
                                                                                     prompt, 8)
            assert out.outputs[0].token_ids == want and out.lora_request == lora
        streamed = [t for item in llm.generate(prompts[1:2], sp, stream=True, lora_request=lora_attention)
                    for t in item["token_ids"]]
        assert streamed == outs[1].outputs[0].token_ids
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.generate(prompts[:2], sp, lora_request=[lora_mixed, LoRARequest("bad", 9, str(tmp_path))],
                         use_tqdm=False)
        assert llm.list_loras() == {1, 2}
        assert llm.remove_lora(2) and llm.list_loras() == {1} and not llm.remove_lora(2)
        assert llm.add_lora(lora_mixed) and llm.list_loras() == {1, 2}
        again = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_exit_while_a_call_runs_gives_it_a_clear_error(chat_model, deadline):
    """exit() from another thread or while a stream is open: the running call raised KeyError (exit() had emptied
    the front's books of open calls). It says the LLM was shut down, and no replica is left."""
    with LLM(chat_model, data_parallel_size=2, **OPTIONS) as llm:
        stream = llm.stream(_prompts(12, 4), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        next(stream)
        llm.exit()
        with pytest.raises(RuntimeError, match="shut down .* while the call ran"):
            list(stream)
        assert not any(p.is_alive() for p in llm.processes)


def test_adapter_books_stay_those_of_the_replicas(qwen3_tied, lora_attention, lora_mixed, deadline):
    """add_lora / remove_lora refused while a stream is open changed this process's list of adapters anyway (one
    engine refuses before touching it), and a stream read after a remove_lora had the replicas read its adapter
    again while this process still listed it as removed: list_loras and remove_lora then answered for adapters
    the replicas did not have, or not for those they did."""
    from nanovllm import LoRARequest
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = _prompts(31, 4)
    with LLM(qwen3_tied, data_parallel_size=2, enable_lora=True, max_loras=2, **OPTIONS) as llm:
        llm.generate(prompts, sp, lora_request=[lora_attention, lora_mixed] * 2, use_tqdm=False)
        stream = llm.stream(prompts, sp)
        next(stream)
        with pytest.raises(RuntimeError, match="another call is using this engine"):
            llm.remove_lora(lora_mixed.lora_int_id)
        with pytest.raises(RuntimeError, match="another call is using this engine"):
            llm.add_lora(LoRARequest("third", 3, lora_attention.lora_path))
        assert llm.list_loras() == {1, 2}
        stream.close()
        stream = llm.stream(prompts[:2], sp, lora_request=lora_mixed)
        assert llm.remove_lora(lora_mixed.lora_int_id) and llm.list_loras() == {1}
        list(stream)  # read after the remove: served under the adapter, which every replica knows again
        assert llm.list_loras() == {1, 2}
        assert llm.remove_lora(lora_mixed.lora_int_id) and llm.list_loras() == {1}


def test_a_collective_rpc_that_raises_leaves_the_replicas_serving(dp, single, deadline):
    """A ModelRunner method that raises something other than ValueError, TypeError or RuntimeError (here
    AttributeError, from a bad argument) reaches the caller as one engine raises it; it shut every replica down."""
    with pytest.raises(AttributeError) as expected:
        single.collective_rpc("prepare", (None,))
    with pytest.raises(AttributeError, match=str(expected.value)):
        dp.collective_rpc("prepare", (None,))
    prompts = _prompts(32, 4)
    assert [o["token_ids"] for o in dp.generate(prompts, GREEDY, use_tqdm=False)] == _expected(single, prompts)


def test_request_ids_count_as_one_engine_counts_them(dp, single):
    """One engine draws a request's id when it checks it: the requests of a stream, and those checked before a bad
    one in a refused call, take ids. The front drew ids only for generate's outputs, so after a stream or a refused
    call its request_ids were not one engine's."""
    pytest.importorskip("xgrammar")
    from nanovllm import StructuredOutputsParams

    def ids_taken(llm) -> list[int]:
        first = int(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].request_id)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2], [3, 4], [5, 999]], GREEDY, use_tqdm=False)
        list(llm.stream([[1, 2], [3, 4]], GREEDY))
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= x"))
        with pytest.raises(ValueError, match="grammar cannot be compiled"):
            llm.generate([[1, 2], [3, 4]], [GREEDY, bad], use_tqdm=False)
        return [int(o.request_id) - first for o in llm.generate([[1, 2], [3, 4]], GREEDY, use_tqdm=False)]

    assert ids_taken(dp) == ids_taken(single) == [7, 8]


def test_the_step_api_is_refused_saying_what_to_use(dp):
    """The step APIs (nanovllm's add_request / step / is_finished, vLLM's llm.llm_engine.add_request / step /
    abort_request): one engine's loop, which replicas do not expose; a bare AttributeError said neither why nor what
    to call."""
    engine = dp.llm_engine
    for call in (lambda: dp.add_request([1, 2, 3], GREEDY), dp.step, dp.is_finished,
                 lambda: engine.add_request("0", [1, 2, 3], GREEDY), engine.step,
                 lambda: engine.abort_request(["0"])):
        with pytest.raises(NotImplementedError, match="data_parallel_size > 1.*use generate\\(\\) or stream\\(\\)"):
            call()
    assert [o["token_ids"] for o in dp.generate([[1, 2, 3]], GREEDY, use_tqdm=False)]
