"""The sampler's race kernel (kernels/race.py: the Gumbel-style race over exponential noise, the noise drawn in the
kernel or given, seeded rows keyed by their own key and stream) against the torch race, its draws against
softmax(logits / T), and the sampler with it (seeded rows alone and in batches). Interpreted on CPU; compiled on a
GPU (marked gpu)."""
import math

import pytest
import torch
import triton
import triton.language as tl

from nanovllm.kernels.race import _exp1, _uniforms
from tests.kernels.helpers import DTYPES, SeqStub


def check_race(batch: int, vocab: int, dtype, device="cpu"):
    """The race kernel picks exactly what the torch race picks on the same logits and noise (ties and -inf too);
    with a batch under 4 rows a SM each row is split into vocabulary chunks (kernels/race.py's race_chunks)."""
    from nanovllm.kernels.race import race
    from nanovllm.sampling.sampler import race_in_log_space
    logits = (torch.randn(batch, vocab, device=device) * 3).to(dtype)
    noise = torch.empty(batch, vocab, device=device).exponential_(1)
    logits[0, : vocab // 2] = float("-inf")  # a masked half
    logits[-1] = 1.0  # every logit equal: the noise decides
    if batch > 2:  # an exact tie between two chunks, and in one lane of the kernel's block: the first index wins
        logits[1], noise[1] = -5.0, 1.0
        for i in (100, 100 + 1024, 100 + 4096, vocab - 3):
            logits[1, min(i, vocab - 3)] = 4.0
    temps = torch.rand(batch, 1, device=device) + 0.3
    picks = race(logits, temps, noise)
    assert torch.equal(picks, race_in_log_space(logits, temps, noise))
    if batch > 2:
        assert picks[1] == 100


def check_race_draws(dtype, device="cpu", rows: int = 4000, vocab: int = 3000):
    """The race kernel drawing its own noise: each row's pick follows softmax(logits / T) (counts within 5 standard
    deviations over `rows` rows; the candidates spread over the vocabulary chunks of a small batch), -inf logits
    are never picked, the same seed picks the same tokens whether or not the rows are split."""
    from nanovllm.kernels.decode import sm_count
    from nanovllm.kernels.race import PROGRAMS_PER_SM, race, race_chunks
    values = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5, 3.0, -2.0])
    where = torch.linspace(0, vocab - 1, len(values)).long()
    logits = torch.full((vocab,), float("-inf"))
    logits[where] = values
    logits = logits.to(device=device, dtype=dtype)
    seed = torch.tensor([12345], dtype=torch.int64, device=device)
    dev = torch.device(device)
    whole = max(rows, PROGRAMS_PER_SM * sm_count(dev))  # rows enough for one program a row
    assert race_chunks(whole, vocab, dev)[0] == 1 and race_chunks(3, vocab, dev)[0] > 1
    temps = torch.full((whole, 1), 0.7, device=device)
    picks = race(logits.expand(whole, -1).contiguous(), temps, seed=seed)
    if dev.type != "cpu":  # (the interpreter runs one program at a time: a rerun has nothing to race, and took 30 s)
        assert torch.equal(picks, race(logits.expand(whole, -1).contiguous(), temps, seed=seed))
    assert torch.equal(picks[:3], race(logits.expand(3, -1).contiguous(), temps[:3], seed=seed))  # split rows
    picks, temps = picks[:rows], temps[:rows]
    assert torch.isin(picks, where.to(device)).all()
    counts = torch.bincount(picks.cpu(), minlength=vocab).double()[where]
    p = torch.softmax(values.double() / 0.7, 0)
    assert counts[4] == 0
    assert ((counts - rows * p).abs() <= 5 * (rows * p * (1 - p)).sqrt() + 1).all(), (counts, rows * p)
    # 64 rows again (split into chunks, unlike the first call): the same seed draws the same tokens, another seed
    # other ones (64 rows all alike by chance: about 2e-15, sum(p^2)^64)
    few = min(rows, 64)
    assert torch.equal(picks[:few], race(logits.expand(few, -1).contiguous(), temps[:few], seed=seed))
    other = race(logits.expand(few, -1).contiguous(), temps[:few], seed=seed + 1)
    assert not torch.equal(picks[:few], other)


@triton.jit
def _exp1_probe(seed_ptr, u_ptr, e_ptr, lanes_ptr):
    """The race kernel's uniform draws of tokens 0-7 for one row key, its Exp(1) draws from them (base 2), and the
    four Philox lanes of counters 0 and 1 (lanes_ptr [4, 2])."""
    offs = tl.arange(0, 8)
    u = _uniforms(tl.load(seed_ptr), 0, 8)
    tl.store(u_ptr + offs, u)
    tl.store(e_ptr + offs, _exp1(u))
    c = tl.arange(0, 2)
    u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr), c)
    tl.store(lanes_ptr + c, u0)
    tl.store(lanes_ptr + 2 + c, u1)
    tl.store(lanes_ptr + 4 + c, u2)
    tl.store(lanes_ptr + 6 + c, u3)


def check_race_draws_small_uniform(dtype, device="cpu"):
    """A tiny uniform draw gives a tiny Exp(1) draw, not 0. Row key 13261905 draws U = 52 * 2^-31 for token 4 (lane 0
    of Philox counter 1; found by searching Triton's Philox, the probe pins it): E = 2.4e-8, so token 4 (logit -22)
    scores -22 + 17.5 (in nats) and loses to token 0. With E = -log(1 - U) in float32, 1 - U rounds to 1, E = 0
    (log E = -inf) and token 4 wins: a 1e-10 token picked with probability 3e-8 per token and step. Token 4k + j
    draws lane j of counter k."""
    from nanovllm.kernels.race import race
    seed = torch.tensor([13261905], dtype=torch.int64, device=device)
    u, e, lanes = (torch.empty(8, device=device) for _ in range(3))
    _exp1_probe[(1,)](seed, u, e, lanes)
    assert u[4].item() == pytest.approx(52 * 2.0 ** -31, rel=1e-6), u  # else Triton's Philox changed: find another key
    assert torch.equal(u, lanes.view(4, 2).t().reshape(8)), (u, lanes)
    exact = -torch.log1p(-u.double()) / math.log(2)
    assert ((e.double() - exact).abs() <= 1e-6 * exact).all(), (e, exact)
    logits = torch.full((1, 8), float("-inf"), device=device)
    logits[0, 0], logits[0, 4] = 0.0, -22.0
    assert race(logits.to(dtype), torch.ones(1, 1, device=device), seed=seed).item() == 0


def check_race_keys(dtype, device="cpu", vocab: int = 5000):
    """Seeded rows: keyed by their own key and stream, their picks do not depend on the batch, its step seed or the
    vocabulary split; unseeded rows (stream 0) pick as without keys; exp_draws gives the kernel's own draws, also
    gathered by token id."""
    from nanovllm.kernels.race import exp_draws, race
    from nanovllm.sampling.sampler import race_in_log_space
    logits = (torch.randn(6, vocab, device=device) * 2).to(dtype)
    temps = torch.rand(6, 1, device=device) + 0.5
    seed = torch.tensor([777], dtype=torch.int64, device=device)
    keys = torch.tensor([0, 5, -3, 0, 2**63 - 1, 5], dtype=torch.int64, device=device)
    streams = torch.tensor([0, 9, 1, 0, 4, 10], dtype=torch.int64, device=device)
    picks = race(logits, temps, seed=seed, keys=keys, streams=streams)
    plain = race(logits, temps, seed=seed)
    unseeded = streams == 0
    assert torch.equal(picks[unseeded], plain[unseeded])
    for row in (1, 2, 4, 5):  # alone, with another step seed: the same token
        alone = race(logits[row:row + 1], temps[row:row + 1], seed=seed + 99, keys=keys[row:row + 1],
                     streams=streams[row:row + 1])
        assert alone.item() == picks[row].item(), row
    # (the kernel scores in base 2, the reference in nats: a near-tie could differ; none does on this data)
    noise = exp_draws(seed, (6, vocab), keys=keys, streams=streams)
    assert torch.equal(picks, race_in_log_space(logits, temps, noise))
    assert torch.equal(plain, race_in_log_space(logits, temps, exp_draws(seed, (6, vocab))))
    ids = torch.stack([torch.randperm(vocab, device=device)[:300] for _ in range(6)])
    assert torch.equal(exp_draws(seed, (6, 300), ids, keys, streams), noise.gather(1, ids))
    # the stream is the counter's high word: two positions' draws share no values (a stream in the low word would
    # shift them by 4 tokens), and a seeded row with stream 1 draws apart from an unseeded row of the same key
    one_key = torch.full((2,), 5, dtype=torch.int64, device=device)
    near = exp_draws(seed, (2, vocab), keys=one_key, streams=torch.tensor([1, 2], device=device))
    assert torch.isin(near[0], near[1]).float().mean() < 0.01
    unseeded = exp_draws(torch.tensor([5], device=device), (1, vocab))
    assert torch.isin(near[0], unseeded[0]).float().mean() < 0.01
    # one key: every stream its own draws; the same stream the same draws
    flat = torch.zeros(1, vocab, device=device, dtype=dtype)
    one = dict(keys=torch.tensor([5], device=device), streams=torch.tensor([9], device=device))
    firsts = {race(flat, temps[:1], seed=seed, keys=one["keys"], streams=one["streams"] + s).item() for s in range(8)}
    assert len(firsts) == 8, firsts
    with pytest.raises(ValueError, match="both or neither"):
        race(logits, temps, seed=seed, keys=keys)
    with pytest.raises(ValueError, match="int64"):
        race(logits, temps, seed=seed, keys=keys.int(), streams=streams)


def check_race_keys_follow_softmax(device="cpu", rows: int = 300):
    """One key over `rows` streams (a seeded request's positions): the picks follow softmax(logits / T)."""
    from nanovllm.kernels.race import race
    values = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    vocab = 600
    where = torch.linspace(0, vocab - 1, len(values)).long()
    logits = torch.full((rows, vocab), float("-inf"), device=device)
    logits[:, where.to(device)] = values.to(device)
    temps = torch.full((rows, 1), 0.8, device=device)
    seed = torch.tensor([1], dtype=torch.int64, device=device)
    keys = torch.full((rows,), 4242, dtype=torch.int64, device=device)
    streams = torch.arange(1, rows + 1, device=device)
    picks = race(logits, temps, seed=seed, keys=keys, streams=streams).cpu()
    counts = torch.bincount(picks, minlength=vocab).double()[where]
    p = torch.softmax(values.double() / 0.8, 0)
    assert counts[4] == 0 and counts.sum() == rows
    assert ((counts - rows * p).abs() <= 5 * (rows * p * (1 - p)).sqrt() + 1).all(), (counts, rows * p)
    same = race(logits, temps, seed=seed, keys=keys, streams=torch.full_like(streams, 3)).cpu()
    assert (same == same[0]).all()


def check_sampler_seeded_rows(device="cpu", vocab: int = 3000, positions: int = 20):
    """The sampler with the race kernel: a seeded row's token is the same alone and in a batch whatever the other
    rows ask for (top-k / top-p or not, another seed, greedy), on both paths (the kernel's race; exp_draws for the
    filtered path); its sample index and its position change it. Over `positions` positions (each about 27 sampler
    calls)."""
    from nanovllm.sampling.sampler import Sampler
    from nanovllm.sampling_params import SamplingParams
    sampler = Sampler(vocab, device=device, triton=True)
    to_device = lambda data, dtype: torch.tensor(data, dtype=dtype, device=device)  # noqa: E731
    logits = torch.randn(4, vocab, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50),
              SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=8, top_p=0.8)]

    def pick(rows, seeded, positions, sample_index=0):
        """The seeded row's token; it always reads logits[0], the other row logits[1]."""
        seqs = [SeqStub(sp, 10, sample_index if sp is seeded else 0, i) for i, sp in enumerate(rows)]
        st = sampler.prepare(seqs, [True] * len(rows), to_device, positions)
        at = rows.index(seeded)
        batch = logits[:1] if len(rows) == 1 else logits[:2] if at == 0 else logits[[1, 0]]
        return sampler(batch, st, gen)[0][at].item()
    pos_range = range(10, 10 + positions)
    for seeded in (SamplingParams(temperature=1.0, seed=123), SamplingParams(temperature=1.0, seed=123, top_k=40),
                   SamplingParams(temperature=1.0, seed=123, top_p=0.9)):
        alone = [pick([seeded], seeded, [p]) for p in pos_range]
        assert len(set(alone)) > 3, alone  # every position its own draws
        for other in others:
            assert [pick([other, seeded], seeded, [5, p]) for p in pos_range] == alone, other
        assert [pick([seeded, others[1]], seeded, [p, 5]) for p in pos_range] == alone
        assert [pick([seeded], seeded, [p], sample_index=1) for p in pos_range] != alone
    # seeds wrap into 64 bits: sample 1 of seed 2**64 - 1 is sample 0 of seed 0; seed 2**63 is key -2**63
    wrapped = SamplingParams(temperature=1.0, seed=2**64 - 1)
    zero = SamplingParams(temperature=1.0, seed=0)
    at = [pick([zero], zero, [p]) for p in range(10, 20)]
    assert [pick([wrapped], wrapped, [p], sample_index=1) for p in range(10, 20)] == at
    assert [pick([wrapped], wrapped, [p]) for p in range(10, 20)] != at
    high = SamplingParams(temperature=1.0, seed=2**63)
    assert len({pick([high], high, [p]) for p in range(10, 20)}) > 1


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_race_kernel(dtype):
    check_race(4, 9000, dtype)  # split: nine vocabulary chunks per row
    check_race(140, 5000, dtype)  # three chunks a row, two blocks each
    check_race(528, 4200, dtype)  # one program per row (batch >= 4 x the SM count), two blocks each


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_race_kernel_draws(dtype):
    # the draws do not depend on the logits' type (loaded, then float32): the full count for one, a smaller one for
    # the other (a row is one program, slow in the interpreter: 1,000 rows took 63 s)
    check_race_draws(dtype, rows=1000 if dtype == torch.float32 else 200)
    check_race_draws_small_uniform(dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_race_kernel_keys(dtype):
    check_race_keys(dtype)


@pytest.mark.interpreter
def test_race_keys_follow_softmax():
    check_race_keys_follow_softmax()


@pytest.mark.interpreter
def test_race_sampler_seeded_rows():
    check_sampler_seeded_rows(positions=8)  # (20 on the GPU; 8 took the interpreter from 69 to about 30 s)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300, 16384])
def test_gpu_race(tokens):
    check_race(min(tokens, 600), 151936, torch.bfloat16, device="cuda")  # 600 rows: one program a row (unsplit)
    check_race(3, 151936, torch.bfloat16, device="cuda")  # split rows
    if tokens == 1:
        check_race_draws(torch.bfloat16, device="cuda", rows=20000, vocab=151936)


@pytest.mark.gpu
def test_gpu_seeded_race_and_sampler():
    """Seeded rows keyed in the race and in exp_draws, and the sampler's seeded rows: Qwen3's vocabulary, bf16
    logits."""
    check_race_keys(torch.bfloat16, device="cuda", vocab=151936)
    check_race_keys_follow_softmax(device="cuda", rows=20000)
    check_sampler_seeded_rows(device="cuda", vocab=151936)
