"""SamplingParams' vLLM fields on the bundled model: detokenize, stop strings and stop tokens (stop_reason,
include_stop_str_in_output), logit_bias, allowed_token_ids, bad_words, spaces_between_special_tokens,
truncate_prompt_tokens, the max_tokens default; and each refusal, after which the engine still serves."""
import pytest

from nanovllm import SamplingParams

PROMPT = "The capital of France is"


def _greedy(llm, prompt=PROMPT, **kwargs):
    return llm.generate(prompt, SamplingParams(temperature=0, **kwargs), use_tqdm=False)[0].outputs[0]


def test_max_tokens_defaults_to_16_as_in_vllm(llm):
    assert SamplingParams().max_tokens == 16
    assert len(_greedy(llm, ignore_eos=True).token_ids) == 16


def test_detokenize_false_gives_token_ids_only(llm):
    plain = _greedy(llm, max_tokens=6, logprobs=1)
    raw = _greedy(llm, max_tokens=6, logprobs=1, detokenize=False)
    assert raw.token_ids == plain.token_ids and raw.text == "" and plain.text
    assert all(lp.decoded_token is None for step in raw.logprobs for lp in step.values())
    assert all(lp.decoded_token is not None for step in plain.logprobs for lp in step.values())


def test_stop_string_and_stop_reason(llm):
    text = _greedy(llm, max_tokens=12, ignore_eos=True).text
    stop = text.split()[2]  # a word in the middle of the answer
    cut = _greedy(llm, max_tokens=12, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]
    kept = _greedy(llm, max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[:text.index(stop) + len(stop)] and kept.stop_reason == stop


def test_stop_token_and_eos_stop_reasons(llm):
    ids = _greedy(llm, max_tokens=12, ignore_eos=True).token_ids
    out = _greedy(llm, max_tokens=12, ignore_eos=True, stop_token_ids=[ids[3]])
    end = ids.index(ids[3]) + 1
    assert out.finish_reason == "stop" and out.stop_reason == ids[3] and out.token_ids == ids[:end]
    # as vLLM: the stop token's text is left out of the text (kept with include_stop_str_in_output), on both text
    # paths: decoded at the end, and decoded as it grows (with stop strings, and streaming)
    decode = llm.get_tokenizer().decode
    for extra in ({}, {"stop": ["never said"]}):
        assert _greedy(llm, max_tokens=12, ignore_eos=True, stop_token_ids=[ids[3]], **extra).text == \
            decode(ids[:end - 1])
        assert _greedy(llm, max_tokens=12, ignore_eos=True, stop_token_ids=[ids[3]], include_stop_str_in_output=True,
                       **extra).text == decode(ids[:end])
    streamed = "".join(d["text"] for d in llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                                            ignore_eos=True, stop_token_ids=[ids[3]])))
    assert streamed == decode(ids[:end - 1])
    eos = llm.get_tokenizer().eos_token_id
    ended = _greedy(llm, max_tokens=4, logit_bias={eos: 100.0})  # EOS at once
    assert ended.finish_reason == "stop" and ended.stop_reason is None and ended.token_ids == [eos]
    listed = _greedy(llm, max_tokens=4, logit_bias={eos: 100.0}, stop_token_ids=[eos])  # EOS is checked first
    assert listed.finish_reason == "stop" and listed.stop_reason is None and listed.token_ids == [eos]
    assert _greedy(llm, max_tokens=2, ignore_eos=True).stop_reason is None  # a length


def test_logit_bias(llm):
    token = llm.get_tokenizer().encode(" banana")[0]
    out = _greedy(llm, max_tokens=5, ignore_eos=True, logit_bias={token: 100.0})
    assert out.token_ids == [token] * 5
    sampled = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=5, logit_bias={token: 100.0}),
                           use_tqdm=False)[0].outputs[0]
    assert sampled.token_ids == [token] * 5


def test_allowed_token_ids(llm):
    tokenizer = llm.get_tokenizer()
    allowed = [tokenizer.encode(w)[0] for w in (" yes", " no", " maybe")]
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)):
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6 and set(out.token_ids) <= set(allowed)


def test_bad_words(llm):
    tokenizer = llm.get_tokenizer()
    plain = _greedy(llm, max_tokens=8, ignore_eos=True)
    assert "Paris" in plain.text
    banned = _greedy(llm, max_tokens=8, ignore_eos=True, bad_words=["Paris"])
    assert "Paris" not in banned.text
    # a word of several tokens is banned as a sequence: its last token only after the others
    words = [w for w in plain.text.split() if len(tokenizer.encode(" " + w)) > 1]
    if not words:
        pytest.skip("no multi-token word in the greedy answer")
    word_ids = tokenizer.encode(" " + words[0])
    out = _greedy(llm, max_tokens=8, ignore_eos=True, bad_words=[words[0]])
    ids = out.token_ids
    assert all(ids[i:i + len(word_ids)] != word_ids for i in range(len(ids)))
    assert out.token_ids[:plain.token_ids.index(word_ids[0]) + 1] == plain.token_ids[:plain.token_ids.index(
        word_ids[0]) + 1]  # the prefix of the word is still allowed


@pytest.mark.parametrize("stop", [None, ["never said"]])  # (a stop string: the text is decoded as it grows)
@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_goes_to_decode(llm, spaces, stop, monkeypatch):
    """Passed to the tokenizer's decode (a fast tokenizer, as the bundled one, ignores it: vLLM's fast path too)."""
    tokenizer = llm.get_tokenizer()
    special = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    calls, decode = [], tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **kw: calls.append(kw) or decode(*a, **kw))
    out = _greedy(llm, max_tokens=4, ignore_eos=True, allowed_token_ids=special, skip_special_tokens=False,
                  spaces_between_special_tokens=spaces, stop=stop)
    monkeypatch.undo()
    assert calls and all(kw.get("spaces_between_special_tokens", True) == spaces for kw in calls)
    assert set(out.token_ids) <= set(special)
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=False)


def test_truncate_prompt_tokens(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=3),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-3:]
    assert out.outputs[0].token_ids == _greedy(llm, {"prompt_token_ids": ids[-3:]}, max_tokens=3).token_ids


def test_truncate_prompt_tokens_keeps_the_bos_a_tokenizer_adds(tmp_path):
    """A text prompt is cut as vLLM cuts it, by its tokenizer truncating on the left: a BOS the tokenizer adds stays
    (Llama- and Gemma-style tokenizers), and the text's last tokens fill the rest; token-id prompts keep their last
    ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from nanovllm import LLM
    from tests.tiny_models import CORPUS, make_checkpoint
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = make_checkpoint(tmp_path, "llama", tokenizer=PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"))
    left = AutoTokenizer.from_pretrained(path, truncation_side="left")
    text = "Once upon a time there was a small engine that could generate text quickly."
    assert left.encode(text)[0] == 0
    with LLM(path, kvcache_block_size=16, max_model_len=128) as llm:
        for keep in (1, 2, 6):
            sp = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=keep)
            out = llm.generate(text, sp, use_tqdm=False)[0]
            assert out.prompt_token_ids == left.encode(text, truncation=True, max_length=keep), keep
            assert llm.generate({"prompt_token_ids": left.encode(text)}, sp,
                                use_tqdm=False)[0].prompt_token_ids == left.encode(text)[-keep:]


def test_truncation_keeps_a_bos_and_an_eos_and_refuses_fewer_tokens_than_they_are():
    from nanovllm.engine.requests import _truncate_text

    class BosEos:  # (a tokenizer adding <s> = 0 and </s> = 1 around a text's tokens)
        def encode(self, text, add_special_tokens=True):
            ids = [ord(c) for c in text]
            return [0, *ids, 1] if add_special_tokens else ids
    full = BosEos().encode("abcd")
    assert _truncate_text(BosEos(), "abcd", full, 3) == [0, ord("d"), 1]
    assert _truncate_text(BosEos(), "abcd", full, 2) == [0, 1]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=1 is fewer than the 2 special tokens"):
        _truncate_text(BosEos(), "abcd", full, 1)


def test_stop_lists_and_clone_as_in_vllm():
    """vLLM's SamplingParams reads stop and stop_token_ids back as lists, and clone() is a deep copy."""
    assert (SamplingParams().stop, SamplingParams(stop="x").stop, SamplingParams(stop=("a", "b")).stop) == (
        [], ["x"], ["a", "b"])
    sp = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}, seed=7)
    copied = sp.clone()
    assert copied == sp and copied is not sp
    copied.stop.append("y")
    copied.logit_bias[4] = 2.0
    copied.verify()
    assert (sp.stop, sp.stop_strings, sp.logit_bias) == (["x"], ["x"], {3: 1.0})
    assert copied.stop_strings == ["x", "y"]


def test_best_of_at_older_vllms_default():
    """Older vLLM's best_of defaulted to n: None or n asks for nothing more, and is accepted."""
    assert SamplingParams(n=2, best_of=2).n == SamplingParams(best_of=None).n + 1


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(logits_processors=[lambda ids, logits: logits]), ValueError, "logits_processors"),
    (dict(output_kind="SOMETIMES"), ValueError, "output_kind"),
    (dict(output_kind=3), ValueError, "output_kind"),
    (dict(logit_bias={"a": 1.0}), ValueError, "logit_bias"),
    (dict(logit_bias={5: float("inf")}), ValueError, "logit_bias"),
    (dict(allowed_token_ids=[]), ValueError, "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), ValueError, "allowed_token_ids"),
    (dict(bad_words=["ok", 3]), TypeError, "bad_words"),
    (dict(bad_words=[""]), TypeError, "bad_words"),
    (dict(truncate_prompt_tokens=0), ValueError, "truncate_prompt_tokens"),
    (dict(stop=["x"], detokenize=False), ValueError, "detokenize"),
    (dict(detokenize="no"), TypeError, "detokenize"),
    (dict(include_stop_str_in_output=1), TypeError, "include_stop_str_in_output"),
    (dict(spaces_between_special_tokens=None), TypeError, "spaces_between_special_tokens"),
    (dict(extra_args=[1]), TypeError, "extra_args"),
    (dict(n=2, best_of=5), ValueError, "best_of=5 is not supported .*cumulative_logprob.*beam_search"),
])
def test_bad_fields_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(logit_bias={10**9: 1.0}), "vocab"),
    (dict(allowed_token_ids=[10**9]), "vocab"),
])
def test_ids_outside_the_vocabulary_are_refused_at_submission(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPT, SamplingParams(**kwargs), use_tqdm=False)
    assert _greedy(llm, max_tokens=2).token_ids  # the engine still serves
