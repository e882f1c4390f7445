"""Tensor parallelism. On CPU over gloo: TP=2 gives transformers' and TP=1's greedy tokens; two TP
engines run side by side; a worker failure surfaces in rank 0 as an exception, not a hang; shutdown
leaves no process and no shared-memory segment. Marked GPU tests check NCCL on two CUDA devices.

Spawning a worker costs a few seconds (it imports torch), so engines are shared where possible."""
import glob
import math
import multiprocessing
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from unittest import mock

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.distributed import tensor_parallel
from nanovllm.distributed.channel import RpcChannel
from nanovllm.distributed.tensor_parallel import WorkerError, check_tensor_parallel
from nanovllm.engine.batch import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from tests.tiny_models import hf_greedy, hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TP_OPTIONS = dict(tensor_parallel_size=2, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=48)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


def _tokens(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def _segments(llm) -> list[str]:
    return glob.glob(f"/dev/shm/{llm.executor.workers.channel.prefix}*")


def _assert_nothing_left(workers):
    """The engine's worker processes are gone (and reaped) and its shared memory is removed."""
    children = multiprocessing.active_children()
    assert all(p.exitcode is not None and p not in children for p in workers.processes)
    assert glob.glob(f"/dev/shm/{workers.channel.prefix}*") == []


@contextmanager
def _deadline(seconds: int):
    """Fail instead of hanging (pytest-timeout is not a dependency)."""
    def fail(*_):
        raise TimeoutError(f"no answer within {seconds}s: the engine hangs")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    n = torch.get_num_threads()  # a TP engine on CPU shares the cores between its ranks
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tp_tied(qwen3_tied):
    # A tiny first channel segment: long prompts outgrow it and the channel must move to a larger one.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RpcChannel, "initial_bytes", 512)
        llm = LLM(qwen3_tied, max_num_batched_tokens=128, **TP_OPTIONS)  # prompts over 128 tokens are chunked
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def tp_mha(qwen3_untied_mha):
    llm = LLM(qwen3_untied_mha, **TP_OPTIONS)
    yield llm
    llm.exit()


# ---- exactness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine, path", [("tp_tied", "qwen3_tied"), ("tp_mha", "qwen3_untied_mha")])
def test_greedy_equals_tp1_and_transformers(request, engine, path):
    llm, path = request.getfixturevalue(engine), request.getfixturevalue(path)
    prompts = _prompts(0, [3, 16, 17, 70, 300])  # one block to many; 300 is chunked in tp_tied
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    single = LLM(path, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=48)
    assert _tokens(outs) == _tokens(single.generate(prompts, GREEDY, use_tqdm=False))
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(path, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)} tokens"


def test_lora_under_tp_equals_peft(qwen3_tied, lora_attention, lora_mixed):
    """Adapters split as their layers are (B's rows of column-parallel q/k/v and gate/up, A's columns of row-parallel
    o and down): the base model and two adapters in one call give transformers + PEFT's tokens; chunked prefill."""
    from tests.lora.adapters import peft_greedy
    prompts = _prompts(12, [5, 40, 17, 150])
    loras = [lora_mixed, None, lora_attention, lora_mixed]
    with LLM(qwen3_tied, enable_lora=True, max_loras=2, max_num_batched_tokens=64, **TP_OPTIONS) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(prompts, loras, outs):
        want = hf_greedy(qwen3_tied, prompt, 16) if lora is None else peft_greedy(qwen3_tied, lora.lora_path, prompt,
                                                                                  16)
        assert out["token_ids"] == want, (lora, len(prompt))


def test_fp8_kv_cache_under_tp_equals_tp1(qwen3_untied_mha):
    # the 8-bit cache is sharded by KV head: each rank quantizes its own heads with the per-(token, head) scales one
    # rank would use, so greedy tokens equal TP=1's with the same cache (chunked prefill reads history back too)
    prompts = _prompts(5, [3, 17, 70, 200])
    options = dict(TP_OPTIONS, kv_cache_dtype="fp8", max_num_batched_tokens=128)
    with LLM(qwen3_untied_mha, **options) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(qwen3_untied_mha, **{**options, "tensor_parallel_size": 1}) as single:
        assert _tokens(outs) == _tokens(single.generate(prompts, GREEDY, use_tqdm=False))


def test_prefix_cache_hit_and_a_channel_that_grows(tp_tied, qwen3_tied):
    base = _prompts(1, [50])[0]
    assert tp_tied.generate([base], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 0
    longer = base + _prompts(2, [20])[0]
    out = tp_tied.generate([longer], GREEDY, use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 48
    assert out["token_ids"] == hf_greedy(qwen3_tied, longer, GREEDY.max_tokens)
    long_prompt = _prompts(3, [250])[0]  # its message outgrows the 512-byte first segment
    out = tp_tied.generate([long_prompt], GREEDY, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(qwen3_tied, long_prompt, GREEDY.max_tokens)
    channel = tp_tied.executor.workers.channel
    assert channel.data.size > 512 and len(_segments(tp_tied)) == 2  # moved on; the old segment is gone


def test_preemption_and_prefix_hits_of_preempted_sequences(qwen3_tied):
    # 12 blocks for 6 sequences needing ~4 each: decode preempts, and a preempted sequence's blocks come
    # back from the prefix cache, down to a one-token prefill that workers must receive in full.
    with LLM(qwen3_tied, **{**TP_OPTIONS, "num_kvcache_blocks": 12, "max_model_len": 192}) as llm:
        prompts = _prompts(4, [30, 35, 40, 20, 45, 33])
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        one_token_prefills = []
        allocate = llm.scheduler.block_manager.allocate

        def watch(seq):
            allocate(seq)
            if seq.num_cached_tokens == seq.num_tokens - 1 and seq.num_completion_tokens:
                one_token_prefills.append(seq.seq_id)
        llm.scheduler.block_manager.allocate = watch
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert one_token_prefills, "the test should hit a preempted sequence's blocks in the prefix cache"
        for prompt, out in zip(prompts, outs):
            assert out["token_ids"] == hf_greedy(qwen3_tied, prompt, 30)


def test_sequence_sends_workers_only_the_tokens_of_the_step():
    seq = Sequence(list(range(100)), 16)
    seq.num_cached_tokens, seq.num_scheduled_tokens = 32, 40  # a chunk after a prefix hit
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.token_ids == list(range(32, 72)) and copy[32:72] == list(range(32, 72))
    seq.num_cached_tokens, seq.num_scheduled_tokens = 99, 1  # decode, or a one-token prefill
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.last_token == 99 and copy[99:100] == [99] and len(copy) == 100
    assert len(pickle.dumps(seq)) < 200


def test_collective_rpc_reaches_every_rank(tp_tied, qwen3_tied):
    infos = tp_tied.collective_rpc("describe")
    assert [i["rank"] for i in infos] == [0, 1] and all(i["num_kvcache_blocks"] == 48 for i in infos)
    full = sum(p.numel() for p in hf_model(qwen3_tied).parameters())
    assert all(i["num_parameters"] < full for i in infos)  # each rank holds its shard
    with pytest.raises(ValueError, match="not a public ModelRunner method"):
        tp_tied.collective_rpc("__init__")
    with pytest.raises(TypeError, match="bad arguments for ModelRunner.describe"):  # refused before any rank runs it
        tp_tied.collective_rpc("describe", args=(1,))
    out = tp_tied.generate(_prompts(11, [7]), GREEDY, use_tqdm=False)[0]  # the engine still works
    assert out["token_ids"] == hf_greedy(qwen3_tied, _prompts(11, [7])[0], GREEDY.max_tokens)


def test_rl_jobs_under_tp(tp_tied, qwen3_tied, tmp_path):
    """n samples, prompt logprobs, weight updates (sharded to every rank) and sleep/wake over two ranks."""
    from tests.tiny_models import make_checkpoint
    other = make_checkpoint(tmp_path / "b", "qwen3", tie=True, num_kv_heads=2, seed=1)
    prompt = _prompts(12, [21])[0]
    out = tp_tied.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True,
                                                    prompt_logprobs=1), use_tqdm=False)[0]
    assert [o["token_ids"] for o in out["outputs"]] == [hf_greedy(qwen3_tied, prompt, 8)] * 3
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(qwen3_tied)(torch.tensor([prompt])).logits[0].float(), -1)
    assert all(abs(out["prompt_logprobs"][p][prompt[p]] - reference[p - 1, prompt[p]].item()) < 1e-4
               for p in range(1, len(prompt)))
    try:
        with pytest.raises(ValueError, match="does not match the expected"):  # checked before any rank changes
            tp_tied.update_weights({"model.norm.weight": torch.ones(3)})
        tp_tied.update_weights(hf_model(other).state_dict())
        assert tp_tied.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == \
            hf_greedy(other, prompt, GREEDY.max_tokens)
        tp_tied.sleep(level=1)
        tp_tied.wake_up()
        assert tp_tied.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == \
            hf_greedy(other, prompt, GREEDY.max_tokens)
    finally:  # the engine is shared by this module's tests
        tp_tied.update_weights(qwen3_tied)
    assert tp_tied.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == \
        hf_greedy(qwen3_tied, prompt, GREEDY.max_tokens)


def test_sampling_on_rank_0(tp_tied, qwen3_tied):
    """Rank 0 samples from the gathered logits as one rank does: seeded sampling, penalties and logprobs equal
    TP=1's (logprobs up to rounding: the ranks add their partial sums in another order)."""
    prompts = _prompts(5, [8, 20, 140])  # 140 tokens are chunked at 128 a step
    params = [
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11),
        SamplingParams(temperature=0.8, top_k=50, max_tokens=12, ignore_eos=True, seed=12, logprobs=3,
                       repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.3,
                       logprobs=2),
    ]
    single = LLM(qwen3_tied, max_num_batched_tokens=128, **{**TP_OPTIONS, "tensor_parallel_size": 1})
    expected = single.generate(prompts, params, use_tqdm=False)
    outs = tp_tied.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == _tokens(expected)
    assert [len(o.get("logprobs", [])) for o in outs] == [0, 12, 12]
    for out, ref in zip(outs, expected):
        for got, want in zip(out.get("logprobs", []), ref.get("logprobs", [])):
            assert got.keys() == want.keys()
            assert all(math.isclose(got[t], want[t], abs_tol=1e-4) for t in want)


# ---- the channel ----------------------------------------------------------------------------------

def test_channel_has_no_size_cap():
    ctx = multiprocessing.get_context("spawn")
    owner = RpcChannel.create(ctx, 1)
    worker = RpcChannel.attach(owner.ends[0])
    try:
        big = os.urandom(3 * 2**20)  # 3 MiB: more than the first segment holds
        for payload in (b"small", big, b"small again", big + big):
            owner.send("run", payload, 7)
            assert worker.recv() == ("run", (payload, 7))
        assert owner.data.size >= 6 * 2**20
        assert set(glob.glob(f"/dev/shm/{owner.prefix}*")) == {f"/dev/shm/{owner.prefix}_c",
                                                               f"/dev/shm/{owner.data.name}"}
    finally:
        worker.close()
        owner.close()
    assert glob.glob(f"/dev/shm/{owner.prefix}*") == []


# ---- several engines ------------------------------------------------------------------------------

def test_two_tp_engines_side_by_side(tp_tied, tp_mha, qwen3_tied, qwen3_untied_mha):
    assert len(multiprocessing.active_children()) >= 2
    a, b = tp_tied.executor.workers, tp_mha.executor.workers
    assert a.channel.prefix != b.channel.prefix and a.store.port != b.store.port
    prompts = _prompts(6, [5, 40])
    for _ in range(2):  # interleaved: each engine's collectives stay within its own group
        for llm, path in ((tp_tied, qwen3_tied), (tp_mha, qwen3_untied_mha)):
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert _tokens(outs) == [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]


# ---- errors and shutdown --------------------------------------------------------------------------

def test_indivisible_sizes_fail_before_any_process_starts(qwen3_tied):
    before = set(multiprocessing.active_children())
    with _deadline(20), pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by "
                                                        "tensor_parallel_size=3"):
        LLM(qwen3_tied, tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) == before
    config = Config(qwen3_tied)
    config.tensor_parallel_size = 2
    config.hf_config.vocab_size = 401
    with pytest.raises(ValueError, match="vocab_size=401 is not divisible by tensor_parallel_size=2"):
        check_tensor_parallel(config)


def test_a_worker_that_raises_surfaces_in_rank_0(qwen3_tied):
    with _deadline(60):
        llm = LLM(qwen3_tied, **TP_OPTIONS)
        workers = llm.executor.workers
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]
        # Only the worker runs this: a sequence with no KV blocks makes its prepare_decode raise.
        workers.channel.send("run", (ScheduledBatch([Sequence([1, 2, 3], 16)], False, [3]),), {}, False)
        # after a failure rank 0 aborts the group, then destroys its CUDA graphs so that the abort can finish
        events, shutdown, release = [], workers.shutdown, llm.executor.runner.release_graphs
        workers.shutdown = lambda: (events.append("shutdown"), shutdown())[1]
        llm.executor.runner.release_graphs = lambda: (events.append("graphs"), release())[1]
        with pytest.raises(RuntimeError, match=r"(?s)worker rank 1 raised.*IndexError"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert events[:2] == ["shutdown", "graphs"]
        _assert_nothing_left(workers)  # the failure shut the workers down
        with pytest.raises(WorkerError, match="the engine was shut down after a worker failure"):
            llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)
        llm.exit()
    _assert_nothing_left(workers)


def test_a_worker_that_dies_mid_generate_surfaces_in_rank_0(qwen3_tied):
    with _deadline(60):
        with LLM(qwen3_tied, **TP_OPTIONS) as llm:
            workers = llm.executor.workers
            worker = workers.processes[0]
            killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
            killer.start()
            long_run = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            with pytest.raises(RuntimeError, match=r"worker rank 1 exited unexpectedly \(exit code -9\)"):
                llm.generate(_prompts(7, [10, 10, 10, 10]), long_run, use_tqdm=False)
            killer.join()
        _assert_nothing_left(workers)


@pytest.mark.parametrize("where", ["settle", "sample"])
def test_an_interrupt_between_launch_and_sample_shuts_the_workers_down(qwen3_tied, monkeypatch, where):
    """Async scheduling: rank 0 launches decode step N+1, the workers then wait in its token broadcast, and rank 0
    samples it; with bad words (or a grammar) it settles step N in between. A Ctrl-C in that settle left the workers
    waiting, and the next call's collectives met theirs: a hang. There, as in the sampling itself, the workers are
    shut down, the interrupt raised, and later calls raise WorkerError."""
    monkeypatch.setattr(tensor_parallel, "TIMEOUT_S", 60.0)  # (rank 0's collectives: a hang fails in 60 s, not 300)
    with _deadline(150):
        llm = LLM(qwen3_tied, async_scheduling=True, **TP_OPTIONS)
        workers = llm.executor.workers
        # settle: the executor's (each decode step's settle of the step before comes between launch and sample);
        # sample: rank 0's runner's, inside the executor's guard (the prefill's first, then each decode step's)
        owner = llm.executor if where == "settle" else llm.executor.runner
        real, calls = getattr(owner, where), []

        def failing_third(*args):
            calls.append(where)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real(*args)

        bad_words = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=["zzz"])
        with mock.patch.object(owner, where, side_effect=failing_third), pytest.raises(KeyboardInterrupt):
            llm.generate(_prompts(8, [3, 9]), bad_words, use_tqdm=False)
        _assert_nothing_left(workers)
        shut_down = r"the engine was shut down after an error on rank 0 .*\(KeyboardInterrupt"
        with pytest.raises(WorkerError, match=shut_down):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        llm.add_request([4, 5, 6], GREEDY)
        with pytest.raises(WorkerError, match=shut_down):
            llm.step()
        llm.exit()


def test_a_failed_start_leaves_nothing(qwen3_tied, tmp_path):
    # config and tokenizer but no weights: every rank raises while loading
    for name in os.listdir(qwen3_tied):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(qwen3_tied, name), tmp_path / name)
    children, segments = set(multiprocessing.active_children()), set(glob.glob("/dev/shm/nanovllm_*"))
    with _deadline(60), pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path), **TP_OPTIONS)
    assert set(multiprocessing.active_children()) <= children
    assert set(glob.glob("/dev/shm/nanovllm_*")) <= segments


@pytest.mark.parametrize("broken", ["generation_config.json", "tokenizer.json"])
def test_a_start_that_fails_after_the_config_leaves_nothing(qwen3_tied, tmp_path, broken):
    """generation_config.json is read before any worker starts (its error names the file); a tokenizer that fails to
    load is found after the workers started: they are shut down, and their shared memory removed."""
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(qwen3_tied, path)
    (path / broken).write_text('{"temperature": -1}' if broken == "generation_config.json" else "{not json")
    children, segments = set(multiprocessing.active_children()), set(glob.glob("/dev/shm/nanovllm_*"))
    with _deadline(60), pytest.raises(ValueError, match="generation_config.json sets a default" if
                                       broken == "generation_config.json" else "tokenizer files .* cannot be loaded"):
        LLM(str(path), **TP_OPTIONS)
    assert set(multiprocessing.active_children()) <= children
    assert set(glob.glob("/dev/shm/nanovllm_*")) <= segments


def test_explicit_exit_and_exit_at_interpreter_exit_leave_nothing(qwen3_tied):
    # Explicit exit: the with-block's end.
    with LLM(qwen3_tied, **TP_OPTIONS) as llm:
        workers = llm.executor.workers
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    _assert_nothing_left(workers)
    # a polite exit: each worker left by itself, cleanly (not terminated, not an error on its way out)
    assert [p.exitcode for p in workers.processes] == [0] * len(workers.processes)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    # At interpreter exit: a script that never calls exit().
    script = (
        "import sys\n"
        "from nanovllm import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({qwen3_tied!r}, **{TP_OPTIONS!r})\n"
        "    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "    print(llm.executor.workers.channel.prefix, llm.executor.workers.processes[0].pid)\n"
    )
    with _deadline(90):
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr
    prefix, pid = done.stdout.split()
    assert glob.glob(f"/dev/shm/{prefix}*") == []
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
    assert "leaked" not in done.stderr  # multiprocessing's resource tracker found no segment left


# ---- NCCL teardown order (CPU stand-ins for what only a GPU can show) ------------------------------

class _BlockingPG:
    """A communicator whose shutdown blocks, as NCCL's does while a CUDA graph still holds it."""

    def __init__(self):
        self.release, self.calls = threading.Event(), 0

    def shutdown(self):
        self.calls += 1
        self.release.wait(30)

    abort = shutdown


def test_nccl_teardown_never_blocks_the_caller(monkeypatch):
    import time

    from nanovllm.distributed import group as distributed
    from nanovllm.distributed.group import TPGroup
    monkeypatch.setattr(distributed, "TEARDOWN_S", 0.5)
    for healthy in (True, False):
        group = TPGroup("cpu", torch.distributed.HashStore(), 0, 1, timedelta(seconds=5))
        group.is_nccl, group.pg = True, _BlockingPG()  # as on CUDA, with a communicator that blocks
        pg, start = group.pg, time.monotonic()
        group.abort()  # the monitor thread, on a worker's death ...
        group.close(healthy)  # ... then the main thread: the communicator is not torn down twice
        assert time.monotonic() - start < 2  # at most one TEARDOWN_S, not the 30 s the communicator would take
        assert group.pg is None and pg.calls == 1
        pg.release.set()


def test_no_collective_enters_an_aborted_communicator():
    """torch's NCCL abort holds the group's lock until NCCL is done, which waits for the CUDA graphs: a
    collective issued after the abort must raise, not block on that lock."""
    from nanovllm.distributed.group import TPGroup
    group = TPGroup("cpu", torch.distributed.HashStore(), 0, 1, timedelta(seconds=5))
    x = torch.ones(3)
    assert group.all_reduce(x).tolist() == [1, 1, 1]  # a working group (gloo, one rank)
    group.is_nccl, group.pg = True, _BlockingPG()  # as on CUDA, with an abort that blocks
    pg = group.pg
    group.abort()  # starts the abort in the background and returns at once
    with pytest.raises(RuntimeError, match="aborted"):
        group.all_reduce(x)
    with pytest.raises(RuntimeError, match="aborted"):
        group.gather(x)
    pg.release.set()
    assert pg.calls == 1


def test_rank0_closes_its_group_before_waiting_for_the_workers(qwen3_tied):
    """A worker's NCCL shutdown waits for rank 0's: rank 0 must not wait for the workers to exit first."""
    with _deadline(60):
        llm = LLM(qwen3_tied, **TP_OPTIONS)
        workers, events = llm.executor.workers, []
        close = workers.group.close
        workers.group.close = lambda healthy: (events.append(("close", healthy)), close(healthy))[1]
        for process in workers.processes:
            join = process.join
            process.join = lambda timeout=None, join=join: (events.append("join"), join(timeout))[1]
        llm.exit()
    assert events[0] == ("close", True) and "join" in events
    _assert_nothing_left(workers)


def test_rank0_destroys_its_graphs_before_the_group():
    """NCCL's shutdown waits for every graph that captured one of its collectives: graphs go first."""
    from nanovllm.distributed.tensor_parallel import MultiprocExecutor
    from nanovllm.engine.model_runner import ModelRunner
    order = []

    class Graphs:
        def release(self):
            order.append("graphs")

    class Workers:
        def shutdown(self):
            order.append("workers and group")

    runner, executor = ModelRunner.__new__(ModelRunner), MultiprocExecutor.__new__(MultiprocExecutor)
    runner.graphs = Graphs()
    executor.runner, executor.workers = runner, Workers()
    executor.shutdown()
    assert order == ["graphs", "workers and group"] and runner.graphs is None


# ---- GPU ------------------------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_tp2_equals_tp1_in_float32(qwen3_untied_mha, enforce_eager):
    prompts = _prompts(8, [3, 17, 70, 300])
    options = dict(device="cuda", dtype="float32", attention_backend="triton", max_model_len=512,
                   num_kvcache_blocks=8, enforce_eager=enforce_eager)
    outs = {}
    for tp in (1, 2):
        with LLM(qwen3_untied_mha, tensor_parallel_size=tp, **options) as llm:
            outs[tp] = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert outs[2] == outs[1]


@pytest.mark.gpu
@two_gpus
def test_cuda_two_engines_and_a_dying_worker(qwen3_tied, qwen3_untied_mha):
    options = dict(device="cuda", dtype="float32", attention_backend="triton", max_model_len=2048,
                   num_kvcache_blocks=64, tensor_parallel_size=2)
    prompts = _prompts(9, [5, 40])
    # eager, so that the long generate below is still running when its worker is killed
    with LLM(qwen3_tied, enforce_eager=True, **options) as a, LLM(qwen3_untied_mha, **options) as b:
        for llm, path in ((a, qwen3_tied), (b, qwen3_untied_mha), (a, qwen3_tied)):
            assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
                [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
        # NCCL does not notice a dead peer: rank 0's monitor must abort the group.
        _kill_a_worker_mid_generate(a, delay=1.0)
        assert _tokens(b.generate(prompts, GREEDY, use_tqdm=False)) == \
            [hf_greedy(qwen3_untied_mha, p, GREEDY.max_tokens) for p in prompts]
        # The same with decode graphs alive: NCCL's abort finishes only once rank 0 has destroyed them.
        _kill_a_worker_mid_generate(b, delay=0.5)


def _kill_a_worker_mid_generate(llm, delay: float):
    worker = llm.executor.workers.processes[0]
    killer = threading.Timer(delay, os.kill, (worker.pid, signal.SIGKILL))
    killer.start()
    with _deadline(120), pytest.raises(RuntimeError, match="worker rank 1 exited unexpectedly"):
        llm.generate(_prompts(10, [10] * 8), SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
                     use_tqdm=False)
    killer.join()


@pytest.mark.gpu
@two_gpus
def test_cuda_bench_runs_with_tp2():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--tp", "2", "--num-seqs", "16",
                           "--min-input", "16", "--max-input", "256", "--min-output", "8", "--max-output", "64",
                           "--no-tqdm"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tok/s" in done.stdout
