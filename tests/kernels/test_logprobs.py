"""The logprobs kernel (kernels/logprobs.py: each row's logsumexp and its k largest logits) against torch, and the
sampler's logprobs with it against its torch path. Interpreted on CPU; compiled on a GPU (marked gpu)."""
import pytest
import torch

from tests.kernels.helpers import DTYPES, SeqStub


def check_logprob_stats(batch: int, vocab: int, k: int, dtype, device="cpu", ties: bool = False,
                        masked: float = 0.0, keep: int = 0):
    """The logprobs kernel against torch: each row's logsumexp (close), its k largest logits (the same values, in
    order; the ids hold them, none twice); ties (rounded logits) and -inf logits (a grammar's mask); keep: only ids
    5 .. 5 + keep - 1 finite (a grammar allowing fewer than k tokens: the rest of the top k is -inf)."""
    from nanovllm.kernels.logprobs import logprob_stats
    x = torch.randn(batch, vocab, device=device) * 4
    if ties:
        x = x.round()
    if masked:
        x[torch.rand(batch, vocab, device=device) < masked] = float("-inf")
    if keep:
        x[:, :5] = float("-inf")
        x[:, 5 + keep:] = float("-inf")
    x = x.to(dtype)
    lse, values, ids = logprob_stats(x, k)
    xf = x.float()
    torch.testing.assert_close(lse, torch.logsumexp(xf, -1), atol=1e-5, rtol=1e-6)
    if not k:
        assert values is None and ids is None
        return
    assert torch.equal(values, xf.topk(k, -1).values), (values, xf.topk(k, -1).values)
    assert ids.dtype == torch.int64 and torch.equal(xf.gather(1, ids), values)
    assert all(len(set(row)) == k for row in ids.tolist()), "an id twice"


def logprob_stats_empty() -> bool:
    """A batch of no rows: empty results, no launch."""
    from nanovllm.kernels.logprobs import logprob_stats
    lse, values, ids = logprob_stats(torch.empty(0, 3000), 5)
    return lse.shape == (0,) and values.shape == ids.shape == (0, 5) and ids.dtype == torch.int64


def check_sampler_logprobs(device="cpu", vocab: int = 3000):
    """The sampler's logprobs with the kernel and with torch (its reference), on the same logits and tokens
    (greedy rows): top ids of the same logits, values close; with a penalty too (float32 logits), and past MAX_K
    (torch on both)."""
    import unittest.mock

    from nanovllm.kernels import logprobs as logprobs_kernel
    from nanovllm.kernels.logprobs import MAX_K, logprob_stats
    from nanovllm.sampling.sampler import Sampler
    from nanovllm.sampling_params import SamplingParams
    to_device = lambda data, dtype: torch.tensor(data, dtype=dtype, device=device)  # noqa: E731
    logits = (torch.randn(3, vocab, device=device) * 3).to(torch.bfloat16)
    for params in (SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0, logprobs=0),
                   SamplingParams(temperature=0, logprobs=MAX_K + 1),
                   SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.3)):
        out = []
        for compiled in (True, False):
            sampler = Sampler(vocab, device=device, triton=compiled)
            seqs = [SeqStub(params, 10, 0, i) for i in range(3)]
            st = sampler.prepare(seqs, [True] * 3, to_device)
            with unittest.mock.patch.object(logprobs_kernel, "logprob_stats", side_effect=logprob_stats) as kernel:
                out.append(sampler(logits, st, None))
            assert kernel.call_count == (compiled and params.logprobs <= MAX_K), (compiled, params)  # its path
        (tokens, (values, ids, chosen, ranks)), (ref_tokens, (ref_values, ref_ids, ref_chosen, ref_ranks)) = out
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(chosen, ref_chosen, atol=1e-5, rtol=1e-6)
        # a rank counts the tokens at least as likely (vLLM's): greedy rows tie only with equal logits
        expected = (logits.float() >= logits.float().gather(1, tokens[:, None])).sum(-1)
        assert torch.equal(ranks, expected) and torch.equal(ref_ranks, expected)
        if params.logprobs:  # ids of the same logits (16-bit logits tie often: either id of a tie)
            assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids)), (ids, ref_ids)
            torch.testing.assert_close(values, ref_values, atol=1e-5, rtol=1e-6)
        else:
            assert values is None and ids is None and ref_values is None


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_logprob_stats_kernel(dtype):
    check_logprob_stats(3, 5000, 5, dtype)  # five vocabulary chunks a row
    check_logprob_stats(2, 4099, 20, dtype, masked=0.5)  # 4 chunks, the last takes the 3 ids left over; half -inf
    check_logprob_stats(2, 2000, 32, dtype, ties=True)  # MAX_K, many ties
    check_logprob_stats(2, 3000, 1, dtype)
    check_logprob_stats(2, 3000, 0, dtype)  # the logsumexp alone
    check_logprob_stats(2, 5000, 12, dtype, keep=10)  # fewer finite logits than k
    # one program a row (528 rows: 4 a SM of an H200; few finite logits, so few insertions: fast in the interpreter)
    check_logprob_stats(528, 1100, 20, dtype, keep=3)
    assert logprob_stats_empty()


@pytest.mark.interpreter
def test_sampler_logprobs_kernel():
    check_sampler_logprobs()


@pytest.mark.gpu
def test_gpu_logprobs():
    """The logprobs kernel and the sampler's logprobs with it: Qwen3's vocabulary, bf16 and float32 logits."""
    for batch, k in ((1, 5), (16, 20), (256, 5), (256, 0), (7, 32)):
        for dtype in (torch.bfloat16, torch.float32):
            check_logprob_stats(batch, 151936, k, dtype, device="cuda")
    check_logprob_stats(16, 151936, 8, torch.bfloat16, device="cuda", ties=True, masked=0.3)
    check_sampler_logprobs(device="cuda", vocab=151936)
