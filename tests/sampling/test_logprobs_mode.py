"""vLLM's logprobs_mode: raw_logprobs (the default), raw_logits, processed_logprobs (the distribution each token is
drawn from: after penalties, temperature, min-p, top-k and top-p; what RL trainers take importance ratios against)
and processed_logits. References are computed here in float64 from the definitions, not with the sampler's code."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import BeamSearchParams
from tests.tiny_models import hf_model

VOCAB = 60


def _to_device(data, dtype):
    return torch.tensor(data, dtype=dtype)


def _seqs(params: list[SamplingParams], history: list[int]):
    return [SimpleNamespace(seq_id=i, sampling_params=sp, token_ids=history, num_prompt_tokens=1,
                            num_tokens=len(history), num_completion_tokens=len(history) - 1, is_finished=False,
                            sample_index=0, generator=None) for i, sp in enumerate(params)]


def _reference(logits: torch.Tensor, sp: SamplingParams, history: list[int]) -> torch.Tensor:
    """One row's processed logits in float64: vLLM's repetition penalty over the history, the temperature (1 for
    greedy), then min-p, top-k and top-p (over what those kept, renormalized) as -inf."""
    x = logits.double().clone()
    if sp.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(history)))
        x[seen] = torch.where(x[seen] > 0, x[seen] / sp.repetition_penalty, x[seen] * sp.repetition_penalty)
    if sp.temperature == 0:
        return x
    x = x / sp.temperature
    p = torch.softmax(x, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if sp.min_p > 0:
        keep &= p >= sp.min_p * p.max()
    if sp.top_k > 0:
        keep &= p >= p.sort(descending=True).values[sp.top_k - 1]
    if sp.top_p < 1:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        order = q.argsort(descending=True)
        before = q[order].cumsum(0) - q[order]
        keep[order[before >= sp.top_p]] = False
    return x.masked_fill(~keep, -math.inf)


# every row top-k'd (the sampler ranks max_top_k candidates alone), and rows without one (the full sort)
MIXED = [SamplingParams(temperature=0, top_p=0.5),  # a greedy row's filters are off: its logprobs are the logits'
         SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.8),
         SamplingParams(temperature=1.3, top_p=0.6),
         SamplingParams(temperature=0.5, min_p=0.2, top_k=9),
         SamplingParams(temperature=0.9)]
TOP_K_ONLY = [SamplingParams(temperature=0.6, top_k=4), SamplingParams(temperature=1.5, top_k=12, top_p=0.8)]


def check_modes(params: list[SamplingParams], mode: str, device: str = "cpu", triton: bool = False,
                dtype=torch.float32):
    """Each row's top 12 and drawn token's values and rank against _reference, over 20 draws."""
    logits = (torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    history = [3, 7, 7, int(logits[1].argmax())]
    k = 12
    params = [dataclasses.replace(sp, logprobs=k) for sp in params]
    to_device = lambda data, dtype: torch.tensor(data, dtype=dtype, device=device)  # noqa: E731
    for draw in range(20):  # (a new sampler each time: its penalties keep count of the tokens drawn)
        sampler = Sampler(VOCAB, device=device, triton=triton, logprobs_mode=mode)
        st = sampler.prepare(_seqs(params, history), [True] * len(params), to_device)
        gen = torch.Generator(device=device).manual_seed(draw)
        tokens, stats = sampler(logits.to(device), st, gen)
        tokens, (values, ids, chosen, ranks) = tokens.cpu(), (t.cpu() for t in stats)
        for row, sp in enumerate(params):
            ref = logits[row].double() if mode == "raw_logits" else _reference(logits[row], sp, history)
            if mode == "processed_logprobs":
                ref = torch.log_softmax(ref, -1)
            token = int(tokens[row])
            assert math.isfinite(ref[token]), f"row {row} drew token {token}, which its filters removed"
            torch.testing.assert_close(chosen[row].double(), ref[token], rtol=0, atol=1e-4)
            top = ref.topk(k)
            torch.testing.assert_close(values[row].double(), top.values, rtol=0, atol=1e-4)
            finite = top.values.isfinite()  # (ids among tied -inf entries are not specified)
            assert set(ids[row][finite].tolist()) == set(top.indices[finite].tolist())
            assert int(ranks[row]) == int((ref >= ref[token]).sum())


MODES = ["processed_logprobs", "processed_logits", "raw_logits"]


@pytest.mark.parametrize("params", [MIXED, TOP_K_ONLY], ids=["mixed", "all-top-k"])
@pytest.mark.parametrize("mode", MODES)
def test_sampler_modes_against_the_definitions(params, mode):
    check_modes(params, mode)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", MODES)
def test_sampler_modes_with_the_triton_race_and_logprobs_kernel(mode):
    check_modes(MIXED, mode, triton=True)


@pytest.mark.gpu
@pytest.mark.parametrize("params", [MIXED, TOP_K_ONLY], ids=["mixed", "all-top-k"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_sampler_modes(params, mode):
    check_modes(params, mode, device="cuda", dtype=torch.bfloat16)


def test_sampled_frequencies_follow_the_processed_logprobs():
    """The point of processed logprobs: exp of them is the distribution the tokens are drawn from."""
    rows = 30000
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    sp = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05, logprobs=-1)
    sampler = Sampler(VOCAB, device="cpu", logprobs_mode="processed_logprobs")
    st = sampler.prepare(_seqs([sp] * rows, [1]), [True] * rows, _to_device)
    st.num_logprobs = VOCAB  # (the engine turns logprobs=-1 into the vocabulary's size)
    tokens, (values, ids, _, _) = sampler(logits.expand(rows, -1).clone(), st, torch.Generator().manual_seed(0))
    probs = torch.zeros(VOCAB, dtype=torch.float64).scatter_(0, ids[0], values[0].double().exp())
    assert math.isclose(probs.sum().item(), 1.0, abs_tol=1e-5) and 2 < int((probs > 0).sum()) <= 8
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert counts[probs == 0].sum() == 0
    live = probs > 0
    chi2 = float(((counts[live] - probs[live] * rows) ** 2 / (probs[live] * rows)).sum())
    assert chi2 < 24.32  # chi-square at p = 0.001, 7 degrees of freedom at most
    raw = torch.softmax(logits.double(), -1)  # the raw distribution is not what is drawn from
    assert float(((counts[live] - raw[live] / raw[live].sum() * rows) ** 2 / (raw[live] * rows)).sum()) > 100


@pytest.fixture(scope="module")
def engines(qwen3_tied):
    made = {mode: LLM(qwen3_tied, device="cpu", logprobs_mode=mode, max_model_len=128)
            for mode in ("processed_logprobs", "raw_logits")}
    yield made
    for llm in made.values():
        llm.exit()


def test_engine_processed_logprobs_match_transformers(engines, qwen3_tied):
    """Each output token's processed logprobs are log_softmax(transformers' logits / T) over the top 3 tokens, -inf
    elsewhere; prompt_logprobs, which no sampling option touches, stay transformers' raw ones."""
    prompt = [5, 17, 3, 44, 9, 12]
    sp = SamplingParams(temperature=0.5, top_k=3, logprobs=5, prompt_logprobs=2, max_tokens=6, ignore_eos=True,
                        seed=3)
    out = engines["processed_logprobs"].generate([prompt], sp, use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf_model(qwen3_tied)(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].double()
    for i, (token, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = logits[len(prompt) - 1 + i] / 0.5
        top3 = row.topk(3).indices
        ref = torch.log_softmax(row[top3], -1)
        assert len(lp) == 5 and token in top3.tolist()
        for tid, value in zip(top3.tolist(), ref.tolist()):
            assert math.isclose(lp[tid].logprob, value, abs_tol=1e-4)
        assert sorted(v.logprob for t, v in lp.items() if t not in top3.tolist()) == [-math.inf] * 2
        assert math.isclose(sum(math.exp(v.logprob) for v in lp.values()), 1.0, abs_tol=1e-4)
    raw = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert math.isclose(lp[prompt[i]].logprob, raw[i - 1, prompt[i]].item(), abs_tol=1e-4)


def test_engine_raw_logits_are_transformers_logits(engines, qwen3_tied):
    prompt = [5, 17, 3, 44, 9, 12]
    sp = SamplingParams(temperature=0, logprobs=3, prompt_logprobs=1, max_tokens=4, ignore_eos=True,
                        repetition_penalty=1.5)  # (processing changes the tokens, not raw logits)
    out = engines["raw_logits"].generate([prompt], sp, use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf_model(qwen3_tied)(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].double()
    for i, lp in enumerate(out.outputs[0].logprobs):
        for tid, value in lp.items():
            assert math.isclose(value.logprob, logits[len(prompt) - 1 + i, tid].item(), abs_tol=1e-4)
    assert any(v.logprob > 0 for lp in out.outputs[0].logprobs for v in lp.values())  # logits, not logprobs
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert math.isclose(lp[prompt[i]].logprob, logits[i - 1, prompt[i]].item(), abs_tol=1e-4)


def test_logits_modes_refuse_what_needs_logprobs(engines):
    with pytest.raises(ValueError, match="beam search ranks beams by logprobs.*raw_logits"):
        engines["raw_logits"].beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2))


def test_unknown_logprobs_mode_is_refused_naming_the_valid_ones(qwen3_tied):
    with pytest.raises(ValueError, match="logprobs_mode must be one of 'raw_logprobs', 'raw_logits', "
                                         "'processed_logprobs', 'processed_logits', got 'processed'"):
        LLM(qwen3_tied, device="cpu", logprobs_mode="processed")
