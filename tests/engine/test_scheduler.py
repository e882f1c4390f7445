from types import SimpleNamespace

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BS = 16


def _scheduler(num_blocks=16, max_num_seqs=4, max_tokens=64, max_model_len=256):
    cfg = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_model_len,
                          eos_token_ids=[0], primary_eos_token_id=0, kvcache_block_size=BS,
                          enable_prefix_caching=True)
    return Scheduler(cfg, num_blocks)


def _seq(n, start=1, max_tokens=8, ignore_eos=False):
    return Sequence(list(range(start, start + n)), BS, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def _step(s: Scheduler, token=5):
    batch = s.schedule()
    updated = s.postprocess(batch, [token] * len(batch.seqs))
    return batch.seqs, batch.is_prefill, [x for x in updated if x.is_finished]


def test_prefill_then_decode():
    s = _scheduler()
    a, b = _seq(10), _seq(20, start=100)
    s.add(a)
    s.add(b)
    seqs, is_prefill, _ = _step(s)
    assert is_prefill and seqs == [a, b] and [x.num_scheduled_tokens for x in seqs] == [10, 20]
    seqs, is_prefill, _ = _step(s)
    assert not is_prefill and seqs == [a, b] and len(a) == 12


def test_chunked_prefill_respects_budget():
    s = _scheduler(max_tokens=64)
    long, short = _seq(150), _seq(5, start=300)
    s.add(long)
    s.add(short)
    sizes = []
    while long.num_cached_tokens < 150:
        seqs, is_prefill, _ = _step(s)
        assert is_prefill and sum(x.num_scheduled_tokens for x in seqs) <= 64
        sizes.append(long.num_scheduled_tokens)
    assert sizes == [64, 64, 22]
    assert long.num_completion_tokens == 1  # only the last chunk samples a token
    assert short.status == SequenceStatus.RUNNING  # admitted into the last chunk's leftover budget


def test_max_num_seqs():
    s = _scheduler(max_num_seqs=2)
    seqs = [_seq(4, start=10 * i + 1) for i in range(3)]
    for x in seqs:
        s.add(x)
    first, _, _ = _step(s)
    assert first == seqs[:2]
    nxt, is_prefill, _ = _step(s)
    assert not is_prefill and nxt == seqs[:2]  # the third waits for a free slot


def test_finish_on_eos_and_length():
    s = _scheduler()
    a, b = _seq(4, max_tokens=3), _seq(4, start=50, max_tokens=3, ignore_eos=True)
    s.add(a)
    s.add(b)
    _step(s, token=7)
    _, _, finished = _step(s, token=0)  # EOS
    assert finished == [a] and a.finish_reason == "stop"
    _, _, finished = _step(s, token=0)
    assert finished == [b] and b.finish_reason == "length" and b.completion_token_ids == [7, 0, 0]
    assert s.is_finished() and s.block_manager.num_free_blocks == 16


def test_preemption_recomputes_the_newest_sequence():
    s = _scheduler(num_blocks=3)
    a, b = _seq(16, max_tokens=40, ignore_eos=True), _seq(16, start=100, max_tokens=40, ignore_eos=True)
    s.add(a)
    s.add(b)
    _step(s)  # both prefilled: 2 blocks used, each appended one token
    seqs, is_prefill, _ = _step(s)  # each needs a second block; only one is free
    assert not is_prefill and seqs == [a]
    assert b.status == SequenceStatus.WAITING and not b.block_table and s.waiting[0] is b
    assert b.num_tokens == 17  # its sampled token is kept and recomputed later
    assert b.num_cached_tokens == 0 and s.block_manager.num_free_blocks == 1  # its block is back (a holds 2)


def test_preempted_sequence_waits_behind_chunked_prefill():
    s = _scheduler(num_blocks=8, max_tokens=32)
    a = _seq(15, max_tokens=40, ignore_eos=True)
    s.add(a)
    _step(s)
    c = _seq(100, start=200)
    s.add(c)
    _step(s)  # c's first chunk: c now holds blocks at the head of waiting
    assert s.waiting[0] is c and c.block_table
    s.preempt(a)
    assert list(s.waiting) == [c, a]
