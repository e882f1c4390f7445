"""Output text and stopping as vLLM gives them: a completion's text reads as it does after its prompt (a SentencePiece
word keeps its leading space), a stop string counts only past min_tokens and of several one step completes the first
listed wins, the tokenizer's EOS ends a sequence, generation_config's max_new_tokens is the default max_tokens, and
max_tokens=None runs up to max_model_len."""
import json
import os
import shutil

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import find_stop
from tests.tiny_models import byte_fallback_tokenizer, make_checkpoint, spm_tokenizer

PROMPT = "The capital of France is"
SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256)


def _tiny_llama(tmp_path_factory, name: str, tokenizer) -> LLM:
    return LLM(make_checkpoint(tmp_path_factory.mktemp(name), "llama", tokenizer=tokenizer), **SMALL)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    with _tiny_llama(tmp_path_factory, "spm", spm_tokenizer()) as llm:
        yield llm


def test_the_first_word_keeps_its_space_after_the_prompt(spm):
    tok = spm.get_tokenizer()
    prompt = tok.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = spm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert tok.convert_ids_to_tokens(out.token_ids[0]).startswith("\u2581")  # a word token, its space in it
    expected = tok.decode(prompt + out.token_ids)[len(tok.decode(prompt)):]
    assert expected.startswith(" ") and out.text == expected  # (decoded alone, the space is dropped)
    assert "".join(d["text"] for d in spm.stream([prompt], params)) == expected
    first = " " + expected.split()[0]  # a stop string at the very start of the completion
    cut = spm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[first]),
                       use_tqdm=False)[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason, cut.text) == ("stop", first, "")


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory):
    with _tiny_llama(tmp_path_factory, "byte_fallback", byte_fallback_tokenizer()) as llm:
        yield llm


def test_a_prompt_ending_in_byte_tokens_leaves_the_completions_text_whole(byte_fallback):
    """Two emojis end the prompt, 8 byte tokens: its last 5 start inside the first emoji. Decoded from there, a
    byte-fallback tokenizer turns the whole run of byte tokens into U+FFFD, the completion's first character with it
    (generate read "\ufffd\ufffd" for "é"), and dropping that context instead lost a word's leading space (streams and
    stop strings read "Hel" for " Hel"). The context starts on a whole character, as vLLM's does."""
    llm, tok = byte_fallback, byte_fallback.get_tokenizer()
    prompt = "Reply with emojis: \U0001f642\U0001f389"
    ids = tok.encode(prompt)
    assert "\ufffd" in tok.decode(ids[-5:])  # (the prompt's last 5 tokens start inside a character)
    e_bytes = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "é".encode()]
    word = tok.convert_tokens_to_ids("\u2581Hel")

    def texts(**options):  # each sample's tokens, and its text from generate, from stream and with a stop string
        fields = dict(n=8, temperature=3.0, seed=1, max_tokens=2, ignore_eos=True, **options)
        outs = llm.generate(prompt, SamplingParams(**fields), use_tqdm=False)[0].outputs
        stopped = llm.generate(prompt, SamplingParams(**fields, stop=["zzz"]), use_tqdm=False)[0].outputs
        streamed = [""] * 8
        for delta in llm.stream(prompt, SamplingParams(**fields)):
            streamed[delta["sample_index"]] += delta["text"]
        return [(out.token_ids, (out.text, text, stop.text)) for out, text, stop in zip(outs, streamed, stopped)]

    whole = [t for token_ids, t in texts(allowed_token_ids=e_bytes) if token_ids == e_bytes]  # (others: bad UTF-8)
    assert whole and all(t == ("é", "é", "é") for t in whole)
    assert all(t == (" Hel Hel",) * 3 for _, t in texts(allowed_token_ids=[word]))


def test_a_completion_cut_inside_a_character_keeps_its_whole_characters(byte_fallback):
    """A length cut inside a character: a byte-fallback tokenizer decodes the whole run of byte tokens as U+FFFD
    ("\ufffd" * 3 for é and the first byte of another, where streams and stop strings read "é" and two). Each path
    reads the whole characters, then one U+FFFD for the incomplete one."""
    llm, tok = byte_fallback, byte_fallback.get_tokenizer()
    e_bytes = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "é".encode()]
    fields = dict(n=16, temperature=3.0, seed=1, max_tokens=3, ignore_eos=True, allowed_token_ids=e_bytes)
    outs = llm.generate("Hi", SamplingParams(**fields), use_tqdm=False)[0].outputs
    stopped = llm.generate("Hi", SamplingParams(**fields, stop=["zzz"]), use_tqdm=False)[0].outputs
    streamed = [""] * 16
    for delta in llm.stream("Hi", SamplingParams(**fields)):
        streamed[delta["sample_index"]] += delta["text"]
    cut = [(out.text, stop.text, text) for out, stop, text in zip(outs, stopped, streamed)
           if out.token_ids == e_bytes + e_bytes[:1]]  # (the other samples are not UTF-8)
    assert cut and all(texts == ("é\ufffd",) * 3 for texts in cut)


# Byte tokens (hex) and words, and their text as SentencePiece 0.2.3 decodes them (a byte-fallback BPE model of
# tests/tiny_models.py's corpus): the whole characters of a run that is not valid UTF-8, and U+FFFD for each byte that
# is no part of one, where Hugging Face's ByteFallback decoder turns every byte of that run into U+FFFD.
INVALID_RUNS = [
    (["43", "67", "04", "E9", "\u2581Hel"], "Cg\x04\ufffd Hel"),
    (["C3", "A9", "E9", "\u2581Hel"], "\u00e9\ufffd Hel"),
    (["E9", "43", "\u2581Hel"], "\ufffdC Hel"),
    (["E2", "82", "41"], "\ufffd\ufffdA"),
    (["C3", "A9", "C3"], "\u00e9\ufffd"),  # (a length cut inside a character)
]


@pytest.mark.parametrize("tokens, text", INVALID_RUNS)
def test_a_run_of_byte_tokens_that_is_not_utf8_reads_the_same_on_every_path(tokens, text):
    """Streams and stop strings (IncrementalDetokenizer) and generate's one decode (decode_after) give one text:
    tokenizer.decode reads the first tokens "\ufffd\ufffd\ufffd\ufffd Hel", and a window's text cut by length (as
    streams cut it) read the second "\u00e9\ufffd\ufffd Hel", a U+FFFD too many."""
    from nanovllm.engine.detokenizer import IncrementalDetokenizer, decode_after
    tok = byte_fallback_tokenizer()
    ids = tok.convert_tokens_to_ids([t if t.startswith("\u2581") else f"<0x{t}>" for t in tokens])
    context = tok.encode("Hi")
    assert tok.decode(ids) != text  # (Hugging Face's decode: every byte of the run as U+FFFD)
    detok = IncrementalDetokenizer(tok, context=context)
    streamed = "".join(detok.add(t) for t in ids) + detok.flush()
    assert (streamed, decode_after(tok, context, ids, skip_special_tokens=True)) == (text, text)
    valid = tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in "\u00e9\U0001f642".encode()])
    assert decode_after(tok, context, valid) == tok.decode(valid) == "\u00e9\U0001f642"


def test_an_output_of_bad_utf8_reads_the_same_through_generate_stream_and_the_engine(byte_fallback):
    """Byte tokens that are not valid UTF-8, sampled: generate, a stream, a stop string and LLMEngine's three output
    kinds give each sample the same text, each byte token reading as itself ("C", or U+FFFD for a lone 0xE9)."""
    from nanovllm.sampling_params import RequestOutputKind
    llm, tok = byte_fallback, byte_fallback.get_tokenizer()
    reading = {tok.convert_tokens_to_ids("<0x43>"): "C", tok.convert_tokens_to_ids("<0xE9>"): "\ufffd",
               tok.convert_tokens_to_ids("\u2581Hel"): " Hel"}
    fields = dict(n=6, temperature=3.0, seed=3, max_tokens=6, ignore_eos=True, allowed_token_ids=list(reading))
    outs = llm.generate("Hi", SamplingParams(**fields), use_tqdm=False)[0].outputs
    expected = ["".join(reading[t] for t in out.token_ids) for out in outs]
    assert any("C\ufffd" in text or "\ufffdC" in text for text in expected)  # (a run of valid and invalid bytes)
    assert [out.text for out in outs] == expected
    assert [out.text for out in llm.generate("Hi", SamplingParams(**fields, stop=["zzz"]), use_tqdm=False)[0].outputs
            ] == expected
    streamed = [""] * 6
    for delta in llm.stream("Hi", SamplingParams(**fields)):
        streamed[delta["sample_index"]] += delta["text"]
    assert streamed == expected
    engine = llm.llm_engine
    for kind in RequestOutputKind:
        engine.add_request(kind.name, "Hi", SamplingParams(**fields, output_kind=kind))
        texts = [""] * 6
        while engine.has_unfinished_requests():
            for out in engine.step():
                for sample in out.outputs:
                    texts[sample.index] = (texts[sample.index] if kind == RequestOutputKind.DELTA else "") + sample.text
        assert texts == expected, kind


def test_of_the_stop_strings_one_step_completes_the_first_listed_wins():
    """vLLM's check_stop_strings: the first string of `stop` found in the text the step added."""
    assert find_stop("abgine", 4, ["ne", "ine"]) == (4, "ne")
    assert find_stop("abgine", 4, ["ine", "ne"]) == (3, "ine")
    assert find_stop("abcd", 4, ["cd", "b"]) == (2, "cd")  # listed first, though "b" ends before it
    assert find_stop("abcd", 1, ["b", "bc"]) is None  # only stop strings ending in the last character count
    assert find_stop("abcd", 2, ["b", "bc"]) == (1, "bc")


def test_stop_strings_count_only_past_min_tokens(llm):
    """As vLLM: a stop string ending in the text of the first min_tokens tokens does not stop the sequence."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    deltas = [d["text"] for d in llm.stream(PROMPT, greedy)]
    full = "".join(deltas)
    stop = deltas[1].strip()  # a word of the second token
    assert stop and all(deltas[:3])
    for min_tokens in (0, 1, 2):
        end = len("".join(deltas[:min_tokens]))
        at = full.find(stop, max(0, end - len(stop) + 1))  # the first occurrence that ends past those tokens
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                  min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
        assert out.text == (full[:at] if at >= 0 else full), min_tokens
        assert out.finish_reason == ("stop" if at >= 0 else "length")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("base"), "qwen3")


def test_the_tokenizers_eos_ends_a_sequence(base, tmp_path):
    """The tokenizer's eos_token is vLLM's primary EOS, though config.json and generation_config.json name
    another (here <|pad|>, id 1, against <|endoftext|>, id 0)."""
    path = shutil.copytree(base, tmp_path / "model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|pad|>"}))
    with LLM(str(path), **SMALL) as llm:
        assert llm.get_tokenizer().eos_token_id == 1 and 0 in llm.config.eos_token_ids
        ended = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, logit_bias={1: 100.0}), use_tqdm=False)[0]
        assert ended.outputs[0].token_ids == [1] and ended.outputs[0].finish_reason == "stop"
        ignored = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, logit_bias={1: 100.0}, ignore_eos=True),
                               use_tqdm=False)[0]
        assert ignored.outputs[0].token_ids == [1] * 8
        assert ended.outputs[0].stop_reason is None
        # another EOS (config.json's here) ends a sequence as one of vLLM's stop_token_ids: stop_reason is its id
        other = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, logit_bias={0: 100.0}), use_tqdm=False)[0]
        assert other.outputs[0].token_ids == [0] and other.outputs[0].stop_reason == 0


def test_min_tokens_bans_eos_under_ignore_eos_too(base):
    """vLLM's min_tokens bans every stop token id, EOS included, whatever ignore_eos says (its all_stop_token_ids):
    with min_tokens = max_tokens and ignore_eos, the fixed-length runs of a benchmark, no EOS is generated."""
    with LLM(base, **SMALL) as llm:
        eos = llm.get_tokenizer().eos_token_id
        params = SamplingParams(max_tokens=6, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
        ids = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert eos not in ids[:3] and ids[3:] == [eos] * 3


def test_max_new_tokens_and_max_tokens_none(base, tmp_path):
    path = shutil.copytree(base, tmp_path / "model")
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 5, "temperature": 0.0}))
    with LLM(str(path), kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=64) as llm:
        assert llm.get_default_sampling_params().max_tokens == 5
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 64 - 3 and out.finish_reason == "length"
        with pytest.raises(ValueError, match="min_tokens=62, but max_model_len=64 leaves 61 output tokens"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=None, min_tokens=62), use_tqdm=False)
        ids = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids  # the checkpoint's defaults
        assert 1 <= len(ids) <= 5
    assert os.path.isdir(path)
