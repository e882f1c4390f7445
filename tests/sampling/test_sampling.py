"""Sampling options, logprobs, stop conditions and streaming."""
import json
import math
import random
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.sampling.sampler import Sampler, SamplingTensors
from tests.compare import assert_logprobs_close
from tests.tiny_models import _tokenizer, hf_greedy, hf_model

N = 16


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    return LLM(qwen3_tied, kvcache_block_size=16)


def _ids(outs):
    return [o["token_ids"] for o in outs]


def test_filters_at_their_limit_equal_greedy(llm, qwen3_tied):
    prompts = _prompts(0, [5, 20, 33])
    greedy = _ids(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False))
    assert greedy == [hf_greedy(qwen3_tied, p, N) for p in prompts]
    for opts in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=3, top_p=1e-6)):
        sp = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, **opts)
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == greedy, opts


def test_seed_is_independent_of_the_batch(llm):
    prompt = _prompts(1, [10])[0]
    seeded = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, seed=1234)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = _prompts(2, [7, 40, 3])
    unseeded = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True)
    batch = llm.generate(others[:2] + [prompt] + others[2:], [unseeded, unseeded, seeded, unseeded], use_tqdm=False)
    assert batch[2]["token_ids"] == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, seed=4321)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0]["token_ids"] != alone
    # the same seed twice in one batch gives the same tokens twice
    twice = llm.generate([prompt, prompt], seeded, use_tqdm=False)
    assert twice[0]["token_ids"] == twice[1]["token_ids"] == alone


def test_seeded_request_is_independent_of_prompt_chunking(llm, qwen3_tied):
    """A prefill chunk that samples nothing draws nothing from a seeded request's generator."""
    prompt = _prompts(15, [40])[0]
    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=77)
    whole = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    # 16 + 16 + 8 prompt tokens; a fixed cache (beside the module's engine on a GPU)
    chunked = LLM(qwen3_tied, kvcache_block_size=16, max_num_batched_tokens=16, num_kvcache_blocks=64,
                  max_model_len=256)
    assert chunked.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"] == whole


def test_stop_strings_cut_the_text(llm):
    prompt = "Once upon a time"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    text = base["text"]
    assert len(text) > 10
    stop = text[6:9]
    cut = text.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "\x00"]),
                       use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["text"] == text[:cut]
    n = len(out["token_ids"])
    assert out["token_ids"] == base["token_ids"][:n] and n < 30
    # the stop string is complete with the last token and not before it
    tok = llm.tokenizer
    assert stop in tok.decode(out["token_ids"]) and stop not in tok.decode(out["token_ids"][:-1])


def test_stop_strings_end_a_request_of_the_step_api(llm):
    # add_request + step() made no detokenizer, so a stop string was never seen: the request ran to max_tokens
    prompt = _prompts(16, [20])[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    stop = base["text"][6:9]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], n=2)
    want = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert want["finish_reason"] == "stop" and len(want["token_ids"]) < 30
    first = llm.add_request(prompt, sp)
    samples = [first, *first.forks]
    while not llm.is_finished():
        llm.step()
    for seq, out in zip(samples, want.outputs):
        assert (seq.completion_token_ids, seq.finish_reason, seq.stop_reason) == \
            (out.token_ids, "stop", stop)


def test_stop_token_ids(llm):
    prompt = _prompts(3, [12])[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
    stop_id = base["token_ids"][4]
    first = base["token_ids"].index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out["token_ids"] == base["token_ids"][: first + 1] and out["finish_reason"] == "stop"


def test_min_tokens_holds_eos_back(llm):
    prompt = _prompts(4, [12])[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
    eos = base["token_ids"][0]
    min_tokens = llm.executor.runner.sampler.min_tokens
    old = llm.scheduler.eos_token_ids, min_tokens.eos_token_ids
    llm.scheduler.eos_token_ids, min_tokens.eos_token_ids = {eos}, [eos]
    try:
        stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
        assert stopped["token_ids"] == [eos] and stopped["finish_reason"] == "stop"
        held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N, min_tokens=6), use_tqdm=False)[0]
        assert len(held["token_ids"]) >= 6 and eos not in held["token_ids"][:6]
        # stop ids are held back too
        held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N, min_tokens=3, ignore_eos=True,
                                                     stop_token_ids=[eos]), use_tqdm=False)[0]
        assert eos not in held["token_ids"][:3]
    finally:
        llm.scheduler.eos_token_ids, min_tokens.eos_token_ids = old


def test_logprobs_match_transformers(llm, qwen3_tied):
    prompt = _prompts(5, [9])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, logprobs=3, seed=7),
                       use_tqdm=False)[0]
    ids = prompt + out["token_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(qwen3_tied)(torch.tensor([ids])).logits[0].float(), -1)
    assert len(out["logprobs"]) == 8
    for i, (token, lp) in enumerate(zip(out["token_ids"], out["logprobs"])):
        row = ref[len(prompt) - 1 + i]
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(lp) and token in lp and len(lp) <= 4
        for tid, value in lp.items():
            assert math.isclose(value, row[tid].item(), abs_tol=1e-4)


def test_logprobs_minus_one_gives_the_whole_vocabulary(llm, qwen3_tied):
    """vLLM's logprobs=-1 / prompt_logprobs=-1: every token's log-probability, as transformers computes them."""
    prompt = _prompts(5, [9])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1,
                                                prompt_logprobs=-1), use_tqdm=False)[0]
    vocab = llm.llm_engine.model_config.get_vocab_size()
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(qwen3_tied)(torch.tensor([prompt + out["token_ids"]])).logits[0].float(), -1)
    rows = [(len(prompt) - 1 + i, lp) for i, lp in enumerate(out["logprobs"])]
    rows += [(i - 1, lp) for i, lp in enumerate(out["prompt_logprobs"]) if lp is not None]
    assert len(rows) == 3 + len(prompt) - 1
    for position, lp in rows:
        assert sorted(lp) == list(range(vocab))
        assert torch.allclose(torch.tensor([lp[t] for t in range(vocab)]), ref[position], atol=1e-4)


def test_logprobs_zero_gives_only_the_sampled_token(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0]
    assert [list(d) for d in out["logprobs"]] == [[t] for t in out["token_ids"]]
    assert all(v <= 0 for d in out["logprobs"] for v in d.values())


def test_repetition_penalty_matches_transformers(llm, qwen3_tied):
    prompt = _prompts(6, [15])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, repetition_penalty=1.8),
                       use_tqdm=False)[0]["token_ids"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf_model(qwen3_tied).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                            min_new_tokens=N, do_sample=False, repetition_penalty=1.8,
                                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref
    assert out != hf_greedy(qwen3_tied, prompt, N)  # the penalty changed something


def _penalized_greedy(path: str, prompt: list[int], presence: float, frequency: float) -> list[int]:
    model, ids, generated = hf_model(path), list(prompt), []
    with torch.no_grad():
        for _ in range(N):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.numel()).float()
            logits = logits - presence * (counts > 0) - frequency * counts
            generated.append(int(logits.argmax()))
            ids.append(generated[-1])
    return generated


# each case repeats tokens (negative values encourage it), so presence (flat) and frequency (per count) differ
@pytest.mark.parametrize("presence, frequency", [(-1.5, 0.0), (0.0, -0.7), (-0.5, 1.0), (1.0, -0.5)])
def test_presence_and_frequency_penalties(llm, qwen3_tied, presence, frequency):
    """Greedy with OpenAI-style penalties on generated tokens: logit - presence*[seen] - frequency*count."""
    prompt = _prompts(7, [10])[0]
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, presence_penalty=presence,
                        frequency_penalty=frequency)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]["token_ids"]
    assert out == _penalized_greedy(qwen3_tied, prompt, presence, frequency)
    # the case tells the two apart: with their roles swapped the tokens differ
    swapped = _penalized_greedy(qwen3_tied, prompt, frequency, presence) if presence != frequency else None
    assert swapped is None or out != swapped


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token whose probability is zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79, 18: 42.31, 19: 43.82}


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest prefix of the sorted tokens whose mass (of what is left, renormalized) reaches top_p."""
    sorted_p, order = (probs / probs.sum()).sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    return torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)


@pytest.mark.parametrize("temperature, opts, expect", [
    (1.0, {}, lambda p: p),
    (0.5, {}, lambda p: p),
    (1.0, {"top_k": 4}, lambda p: p * (p >= p.sort(descending=True).values[3])),
    (1.0, {"top_p": 0.7}, None),
    (1.0, {"min_p": 0.1}, lambda p: p * (p >= 0.1 * p.max())),
    # vLLM's order: min-p first, then top-p over what it kept (2 tokens here; top-p first would keep 3)
    (1.0, {"min_p": 0.3, "top_p": 0.7}, lambda p: _top_p(p * (p >= 0.3 * p.max()), 0.7)),
])
def test_sampled_frequencies_match_the_distribution(temperature, opts, expect):
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    probs = torch.softmax(logits / temperature, -1)
    if expect is not None:
        probs = expect(probs)
    else:
        probs = _top_p(probs, opts["top_p"])
    probs = probs / probs.sum()
    rows = 40000
    st = SamplingTensors(torch.full((rows,), temperature))
    if "top_k" in opts:
        st.top_ks = torch.full((rows,), opts["top_k"])
    if "top_p" in opts:
        st.top_ps = torch.full((rows,), opts["top_p"])
    if "min_p" in opts:
        st.min_ps = torch.full((rows,), opts["min_p"])
    tokens, _ = Sampler()(logits.expand(rows, -1).clone(), st, torch.Generator().manual_seed(1))
    counts = torch.bincount(tokens, minlength=8).float()
    df = int((probs > 0).sum()) - 1
    assert _chi_square(counts, probs) < CHI2_999[df]
    # a wrong distribution is rejected: the same counts against the untempered, unfiltered softmax
    if temperature != 1.0 or opts:
        wrong = torch.softmax(logits, -1)
        with pytest.raises(AssertionError):
            assert _chi_square(counts, wrong) < CHI2_999[7]


def test_streaming_equals_generate(llm):
    prompts = ["Once upon a time", "Hello world"] + _prompts(8, [20])
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=25, ignore_eos=True, seed=3, logprobs=1),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    full = llm.generate(prompts, params, use_tqdm=False)
    texts, ids, finished, logprobs = ["", "", ""], [[], [], []], [None] * 3, [[], [], []]
    for item in llm.generate(prompts, params, use_tqdm=False, stream=True):
        i = item["index"]
        assert finished[i] is None, "no item after the finishing one"
        texts[i] += item["text"]
        ids[i] += item["token_ids"]
        logprobs[i] += item.get("logprobs", [])
        if item["finished"]:
            finished[i] = item["finish_reason"]
    assert texts == [o["text"] for o in full]
    assert ids == [o["token_ids"] for o in full]
    assert finished == [o["finish_reason"] for o in full]
    # the same tokens; logprobs as equal as float32 allows (on CUDA the two runs' steps may round apart)
    assert_logprobs_close(logprobs[1], full[1]["logprobs"])


def test_streaming_with_stop_strings_holds_back_text(llm):
    prompt = "Once upon a time"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    stop = base["text"][8:12]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop)
    expected = llm.generate([prompt], sp, use_tqdm=False)[0]
    streamed = "".join(item["text"] for item in llm.stream([prompt], sp))
    assert streamed == expected["text"] and stop not in streamed


def test_abandoned_stream_leaves_the_engine_clean(llm, qwen3_tied):
    it = llm.stream(_prompts(9, [10, 10]), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(it)
    it.close()
    assert llm.scheduler.is_finished()
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
    prompt = _prompts(10, [6])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 8)


def test_incremental_detokenizer_multibyte():
    tok = _tokenizer()
    text = "Ünïcödé: café 東京 Привет 🙂 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_flush_inside_a_multibyte_character():
    """Tokens that end inside a character: flush releases the held-back bytes as U+FFFD, once."""
    tok = _tokenizer()
    ids = tok.encode("café €")
    assert len(tok.encode("€")) == 3 and ids[-3:] == tok.encode("€")  # one byte per token
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(t) for t in ids[:-1]) == "café "  # the first two bytes of € are held back
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(ids[:-1]) == "café \ufffd"
    assert detok.flush() == "" and detok.text == "café \ufffd"


def test_a_prompt_ending_inside_a_character_gives_one_text_on_both_paths():
    """Decoded after its prompt's last tokens, a completion whose prompt ends inside a character reads the same
    incrementally (streams, stop strings) as decoded at the end: the context is dropped on both paths."""
    from nanovllm.engine.detokenizer import decode_after
    tok = _tokenizer()
    ids = tok.encode("café €x done")
    cut = ids.index(tok.encode("€")[-1])  # the prompt ends with the first two of €'s three byte tokens
    context, completion = ids[max(0, cut - 5):cut], ids[cut:]
    detok = IncrementalDetokenizer(tok, context=context)
    streamed = "".join(detok.add(t) for t in completion) + detok.flush()
    assert streamed == decode_after(tok, context, completion) == tok.decode(completion)


def test_skip_special_tokens_false_keeps_them_in_the_text(llm, qwen3_tied):
    """skip_special_tokens=False keeps special tokens in the text, in generate and in stream; True drops them.
    This prompt's greedy continuation holds the EOS token (ignore_eos runs past it)."""
    prompt = [141, 267, 120, 110, 347, 301, 214, 296, 140, 230, 252, 338, 328, 358, 182, 42, 166, 313, 59]
    tok, eos = llm.tokenizer, "<|endoftext|>"
    params = {skip: SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, skip_special_tokens=skip)
              for skip in (False, True)}
    kept, skipped = (llm.generate([prompt], params[skip], use_tqdm=False)[0] for skip in (False, True))
    assert kept["token_ids"] == skipped["token_ids"] == hf_greedy(qwen3_tied, prompt, 4)
    assert tok.convert_tokens_to_ids(eos) in kept["token_ids"]
    assert kept["text"].count(eos) == 1 and eos not in skipped["text"]
    assert kept["text"].replace(eos, "") == skipped["text"]
    for skip in (False, True):  # streaming decodes incrementally: the same texts
        assert "".join(item["text"] for item in llm.stream([prompt], params[skip])) == (kept, skipped)[skip]["text"]


def test_prompt_token_ids_in_output(llm):
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out["prompt_token_ids"] == llm.tokenizer.encode("Hello world")


def test_defaults_come_from_generation_config(qwen3_tied, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(qwen3_tied, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.7, top_k=1, top_p=0.9)
    (path / "generation_config.json").write_text(json.dumps(gen))
    # a fixed cache (beside the module's engine on a GPU)
    llm = LLM(str(path), kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
    assert (llm.default_sampling_params.temperature, llm.default_sampling_params.top_k) == (0.7, 1)
    prompt = _prompts(11, [8])[0]
    out = llm.generate([prompt], use_tqdm=False)[0]  # top_k=1: greedy whatever the temperature
    assert out["token_ids"] == hf_greedy(str(path), prompt, len(out["token_ids"]))[: len(out["token_ids"])]


@pytest.mark.parametrize("kwargs, error", [
    (dict(top_k=-2), ValueError), (dict(top_p=0.0), ValueError), (dict(top_p=1.5), ValueError),
    (dict(min_p=-0.1), ValueError), (dict(min_p=1.1), ValueError), (dict(seed="x"), TypeError),
    (dict(min_tokens=-1), ValueError), (dict(min_tokens=100, max_tokens=10), ValueError),
    (dict(stop=[1]), TypeError), (dict(stop=""), ValueError), (dict(stop_token_ids=[-1]), ValueError),
    (dict(logprobs=-2), ValueError), (dict(repetition_penalty=0.0), ValueError),
    (dict(presence_penalty=3.0), ValueError), (dict(frequency_penalty=-2.5), ValueError),
    (dict(top_k=1.5), TypeError), (dict(ignore_eos="yes"), TypeError), (dict(seed=2**64), ValueError),
    (dict(seed=-2**70), ValueError),
])
def test_bad_sampling_options(kwargs, error):
    with pytest.raises(error):
        SamplingParams(**kwargs)


def test_penalties_in_a_mixed_batch_with_chunked_prefill_and_preemption(llm, qwen3_tied):
    """The device-side token history follows each request through chunks, preemption and batch changes."""
    penalized = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, repetition_penalty=1.8,
                               frequency_penalty=0.6)
    plain = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    prompts = _prompts(12, [40, 70, 25, 90])
    # each request alone on the module's engine (a second engine sized from free memory would find none left on a
    # GPU while that one lives)
    expected = [llm.generate([p], sp, use_tqdm=False)[0]["token_ids"]
                for p, sp in zip(prompts, [penalized, plain, penalized, plain])]
    tight = LLM(qwen3_tied, kvcache_block_size=16, max_num_batched_tokens=32, num_kvcache_blocks=9,
                max_model_len=144)
    preempted = []
    original = tight.scheduler.preempt
    tight.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
    for _ in range(2):  # twice: rows of finished requests are reused
        outs = tight.generate(prompts, [penalized, plain, penalized, plain], use_tqdm=False)
        assert [o["token_ids"] for o in outs] == expected
    assert preempted, "the test should force preemption"


@pytest.mark.parametrize("temperatures", [[0.0, 0.0, 0.0], [1.0, 0.0, 0.7], [1.0, 2.0, 0.5]])
def test_sampler_greedy_rows_and_host_flags(temperatures):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    temps = torch.tensor(temperatures)
    st = SamplingTensors(temps, any_greedy=0.0 in temperatures, all_greedy=all(t == 0 for t in temperatures))
    tokens, _ = Sampler()(logits, st, torch.Generator().manual_seed(0))
    flagless, _ = Sampler()(logits, SamplingTensors(temps), torch.Generator().manual_seed(0))
    assert tokens.tolist() == flagless.tolist()  # the flags only skip work
    for row, t in enumerate(temperatures):
        if t == 0:
            assert tokens[row] == logits[row].argmax()


def test_seeded_filtered_request_is_independent_of_the_batch(llm):
    """The batch decides between topk and a full sort (max_top_k): a seeded row must not notice."""
    prompt = _prompts(13, [10])[0]
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=N, ignore_eos=True, seed=99)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = [SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=50, max_tokens=N, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)]
    for other in others:
        outs = llm.generate([_prompts(14, [7])[0], prompt], [other, seeded], use_tqdm=False)
        assert outs[1]["token_ids"] == alone, other


def test_logprobs_come_from_the_raw_logits_not_the_penalized_ones():
    """Penalties, min_tokens and temperature change what is sampled, not the logprobs returned (as vLLM's raw
    logprobs): each row's top-k and sampled-token logprobs equal log_softmax of the logits the model gave."""
    from types import SimpleNamespace
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 3
    sampler = Sampler(vocab, eos_token_ids=[int(logits[2].argmax())])
    params = [SamplingParams(temperature=0, logprobs=4, repetition_penalty=20.0),
              SamplingParams(temperature=0.7, logprobs=4, presence_penalty=1.5, frequency_penalty=1.0),
              SamplingParams(temperature=0, logprobs=0, min_tokens=3)]
    history = [int(t) for t in logits[0].topk(3).indices] + [int(logits[1].argmax())] * 2  # penalized tokens
    seqs = [SimpleNamespace(seq_id=i, sampling_params=sp, token_ids=history, num_prompt_tokens=1, num_tokens=5,
                            num_completion_tokens=4 if i < 2 else 0, is_finished=False, sample_index=0,
                            generator=None) for i, sp in enumerate(params)]
    st = sampler.prepare(seqs, [True] * 3, lambda data, dtype: torch.tensor(data, dtype=dtype))
    tokens, (values, ids, chosen, ranks) = sampler(logits.clone(), st, torch.Generator().manual_seed(0))
    reference = torch.log_softmax(logits, -1)
    assert tokens[0] != logits[0].argmax() and tokens[2] != logits[2].argmax()  # the processors did act
    torch.testing.assert_close(values, reference.topk(4).values)
    assert torch.equal(ids, reference.topk(4).indices)
    torch.testing.assert_close(chosen, reference.gather(1, tokens.unsqueeze(1)).squeeze(1))
    assert torch.equal(ranks, (reference >= reference.gather(1, tokens.unsqueeze(1))).sum(-1))  # of the raw logits


def test_topk_path_picks_what_the_sort_path_picks_on_the_same_draws():
    """Seeded rows draw by token id, so with the same draws the top-k path (a softmax over the top candidates alone)
    and the full sort (a softmax over the vocabulary) must pick the same tokens, at every temperature."""
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(3)) * 2
    temps = torch.tensor([0.3, 0.6, 0.8, 1.0, 1.3, 2.0])
    kw = dict(top_ks=torch.tensor([5, 20, 7, 20, 12, 3]), top_ps=torch.tensor([0.9, 1.0, 1.0, 0.95, 0.8, 1.0]),
              min_ps=torch.tensor([0.0, 0.01, 0.0, 0.1, 0.0, 0.0]), any_greedy=False, vocab_size=500)
    picks = {}
    for name, max_top_k in (("fast", 20), ("full", 1 << 62)):
        gens = [torch.Generator().manual_seed(100 + row) for row in range(6)]
        st = SamplingTensors(temps, max_top_k=max_top_k, generators=list(enumerate(gens)), **kw)
        picks[name] = torch.stack([Sampler()(logits, st)[0] for _ in range(200)])
    assert torch.equal(picks["fast"], picks["full"])
    assert all(len(set(picks["fast"][:, row].tolist())) > 1 for row in range(6))


def test_topk_path_matches_the_sort_path():
    """With every row top-k'd the sampler ranks only max_top_k candidates; the distribution is the same."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5))
    temps = torch.full((4,), 0.8)
    kw = dict(top_ks=torch.tensor([5, 10, 20, 3]), top_ps=torch.full((4,), 0.8), any_greedy=False)
    fast = SamplingTensors(temps, max_top_k=20, **kw)
    full = SamplingTensors(temps, **kw)  # max_top_k unset: the full sort
    counts = {}
    for name, st in (("fast", fast), ("full", full)):
        gen = torch.Generator().manual_seed(11)
        draws = torch.stack([Sampler()(logits, st, gen)[0] for _ in range(3000)])
        counts[name] = [torch.bincount(draws[:, r], minlength=300).float() for r in range(4)]
    for r in range(4):
        a, b = counts["fast"][r], counts["full"][r]
        assert set(a.nonzero().flatten().tolist()) == set(b.nonzero().flatten().tolist())
        keep = (a + b) > 0
        chi2 = float(((a[keep] - b[keep]) ** 2 / (a[keep] + b[keep])).sum())  # two-sample chi-square
        assert chi2 < CHI2_999[int(keep.sum()) - 1]


def test_step_seeds_come_from_one_block_aligned_distinct_and_reproducible():
    # a decode step's seed for the race kernel is an element of a block drawn at once (no kernel a step); each
    # starts 16-byte aligned, since Triton compiles a kernel per pointer alignment
    from nanovllm.sampling.sampler import SEED_BLOCK

    def seeds(n, seed=0):
        sampler, gen = Sampler(), torch.Generator().manual_seed(seed)
        out = [sampler._step_seed(gen, torch.device("cpu")) for _ in range(n)]
        assert all(s.numel() == 1 and s.data_ptr() % 16 == 0 for s in out)
        return [s.item() for s in out]
    first = seeds(SEED_BLOCK + 3)
    assert len(set(first)) == len(first)  # a new block past the first, not the same seeds again
    assert seeds(SEED_BLOCK + 3) == first and seeds(5, seed=1) != first[:5]


def test_prepare_sends_the_clamped_temperatures_with_the_temperatures():
    from nanovllm.sampling.sampler import MIN_TEMPERATURE
    copies = []

    def to_device(data, dtype):
        copies.append(dtype)
        return torch.tensor(data, dtype=dtype)
    from nanovllm.engine.sequence import Sequence
    seqs = [Sequence([1, 2, 3], 16, SamplingParams(temperature=t)) for t in (0.0, 0.7, 0.01)]
    st = Sampler().prepare(seqs, [True] * 3, to_device)
    assert copies == [torch.float32]
    assert st.temperatures.tolist() == torch.tensor([0.0, 0.7, 0.01]).tolist()
    assert st.clamped.tolist() == torch.tensor([0.0, 0.7, 0.01]).clamp(min=MIN_TEMPERATURE).tolist()


def test_a_temperature_under_a_hundredth_samples_at_a_hundredth():
    """vLLM raises a temperature in (0, 0.01) to 0.01: two logits 0.01 apart are drawn about 73 / 27 at 1e-3 as at
    0.01 (sampling at 1e-3 itself would give the second one 5e-5 of the draws)."""
    from nanovllm.engine.sequence import Sequence
    logits = torch.tensor([1.0, 0.99, -1.0, -3.0])
    rows = 4000
    for t in (1e-3, 1e-7):
        sp = SamplingParams(temperature=t)
        assert sp.temperature == 0.01 and not sp.greedy
        seqs = [Sequence([1, 2, 3], 16, sp) for _ in range(rows)]
        st = Sampler(4).prepare(seqs, [True] * rows, lambda data, dtype: torch.tensor(data, dtype=dtype))
        tokens, _ = Sampler(4)(logits.expand(rows, -1).clone(), st, torch.Generator().manual_seed(0))
        counts = torch.bincount(tokens, minlength=4).float()
        assert _chi_square(counts, torch.softmax(logits.double() / 0.01, -1).float()) < CHI2_999[1]
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.02).temperature == 0.02
