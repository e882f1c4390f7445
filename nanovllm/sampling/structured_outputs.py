"""Structured outputs, with vLLM's names: `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`
constrains an answer to a JSON schema, any JSON object, a regex, one of several strings, or an EBNF or Lark grammar.

StructuredOutputsParams is plain data (it travels pickled to data-parallel replicas and comes as a dict from Ray
rows). GrammarCompiler turns it into an xgrammar grammar, compiled once per distinct spec, and gives every sequence
(every sample of n) a matcher of its own. xgrammar is an optional dependency (`pip install "nanovllm[structured]"`),
imported only when a constrained request arrives. The per-step host work, advancing the matchers and filling the
bitmask, runs on several threads (accept_tokens, fill_bitmasks); the bitmask is applied by
sampling/logits_processors.py's GrammarProcessor."""
import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, fields
from typing import TypeVar

from nanovllm.sampling.json_schema import check_schema

INSTALL_HINT = 'structured outputs need xgrammar: pip install "nanovllm[structured]"'
KINDS = ("json", "json_object", "regex", "choice", "grammar")
T = TypeVar("T")


def require_xgrammar():
    """The xgrammar module, or an ImportError that says how to install it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return xgrammar


@dataclass
class StructuredOutputsParams:
    """Exactly one of:
    json: a JSON schema (dict or str), or a pydantic model class (its schema is taken here);
    json_object: True for any JSON object;
    regex: the whole answer matches this regular expression;
    choice: the answer is exactly one of these strings;
    grammar: an EBNF grammar as xgrammar reads it (GBNF-like, the root rule named `root`), or a Lark grammar (rules
    written `name: ...`, the start rule named `start`).
    disable_any_whitespace: JSON without free whitespace between tokens (compact separators); small models given
    free whitespace may fill an answer with blank lines."""

    json: dict | str | type | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be True, False or None, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError(f"disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r}")
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of {', '.join(KINDS)}; got "
                             f"{' and '.join(given) if given else 'none'}")
        if self.json is not None:
            self.json = _schema(self.json)
            check_schema(self.json)  # a keyword xgrammar would not enforce raises, naming it
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
            if value == "":
                raise ValueError(f"{name} must not be empty")
            if value is not None:
                _check_text(name, value)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise TypeError(f"choice must be a list of str, got {self.choice!r:.80}")
            if not self.choice:
                raise ValueError("choice must list at least one string")
            self.choice = list(self.choice)
            for i, option in enumerate(self.choice):
                _check_text(f"choice[{i}]", option)

    def _given(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]

    @property
    def kind(self) -> str:
        return self._given()[0]

    @property
    def key(self) -> tuple:
        """What tells two specs apart (equal keys compile to the same grammar). Key order stays: it is the order in
        which a JSON schema's properties are generated."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            value = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return self.kind, value, self.disable_any_whitespace


def _check_text(name: str, text: str):
    """Text an answer can be made of: UTF-8 encodable (a lone surrogate such as "\\ud800" is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"structured_outputs.{name} holds {text[e.start:e.end]!r}, a lone surrogate that no text "
                         "can contain; pass a valid Unicode string") from None


def _schema(value) -> dict:
    """A JSON schema as a dict: parsed from a str, taken from a pydantic model class, or a dict as given."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # pydantic v2, without importing pydantic
        return value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"json must be a JSON schema; the str given is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"json must be a JSON schema object, got the JSON value {value!r:.80}")
        return value
    if isinstance(value, dict):
        try:  # a copy: the caller's dict may change later, the request's schema does not
            return json.loads(json.dumps(value))
        except (TypeError, ValueError) as e:
            raise TypeError(f"json: the schema dict must hold JSON values only: {e}") from None
    raise TypeError(f"json must be a JSON schema (dict or str) or a pydantic model class, got {type(value).__name__}")


# A Lark rule definition: "name:", "?name:", "!name:" or "name.2:" at the start of a line
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_]\w*(\.-?\d+)?\s*:", re.MULTILINE)


_COMMENT = re.compile(r"(#|//).*$", re.MULTILINE)


def is_lark(grammar: str) -> bool:
    """Whether a grammar is Lark rather than EBNF: EBNF rules are written with ::=, Lark's with a colon (a ::= in
    a comment says nothing, as vLLM reads it)."""
    code = _COMMENT.sub("", grammar)
    return "::=" not in code and _LARK_RULE.search(code) is not None


def as_structured_outputs(value) -> "StructuredOutputsParams | None":
    """SamplingParams.structured_outputs as given: None, a StructuredOutputsParams, or a dict of its fields (Ray rows,
    where a field a row lacks comes as None)."""
    if value is None:
        return value
    if isinstance(value, StructuredOutputsParams):  # rebuilt: a field set after construction is checked too
        return StructuredOutputsParams(**{f.name: getattr(value, f.name) for f in fields(value)})
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown structured_outputs field(s) {', '.join(unknown)}; valid: {', '.join(KINDS)}, "
                            "disable_any_whitespace")
        return StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None})
    raise TypeError(f"structured_outputs must be StructuredOutputsParams (or a dict of its fields), got "
                    f"{type(value).__name__}")


# xgrammar's messages start with a log prefix: "[08:44:18] /project/cpp/regex_converter.cc:94: "
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


@dataclass
class SequenceGrammar:
    """One sequence's constraint (rank 0): its xgrammar matcher, at the sequence's settled tokens, and the width of
    the vocabulary its bitmask covers (the tokenizer's; the model's ids past it are never allowed)."""

    matcher: object  # xgrammar.GrammarMatcher
    vocab_size: int
    stop_token: int = 0  # what a row whose grammar allows nothing more samples (see fill_bitmasks)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; each distinct spec once (the MAX_CACHED most recently
    used are kept). One per engine, made with its first constrained request."""

    MAX_CACHED = 256

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.xgr = xgr = require_xgrammar()
        # The grammar knows the tokenizer's ids only. The model's vocabulary may be wider (padded); its ids past the
        # tokenizer's are never allowed, and the processor forbids them with one device op. Told the model's width,
        # xgrammar would take each padded id for a special token and visit them all for every row at every fill and
        # accept (102,784 of them for SmolLM2's tokenizer on Qwen3-0.6B's shape: 9/10 of the host work).
        tokenizer_size = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
        self.vocab_size = min(vocab_size, max([tokenizer_size] + [i + 1 for i in stop_token_ids]))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # (the cache is ours, keyed by the spec)
        self.stop_token = stop_token_ids[0] if stop_token_ids else 0
        self.compiled: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # stream() checks requests outside the engine's lock: the cache is shared
        self.num_compiled = 0

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; ValueError naming the problem when xgrammar refuses the spec."""
        key = params.key
        with self._lock:
            if key in self.compiled:
                self.compiled.move_to_end(key)
                return self.compiled[key]
        try:
            compiled = self._compile(params)
        except RuntimeError as e:  # xgrammar reports every bad schema, regex or grammar as a RuntimeError
            message = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: {message}") from None
        if not self._allows_a_start(compiled):
            raise ValueError(f"no text satisfies structured_outputs.{params.kind} (its grammar allows no first token, "
                             "not even the end of the answer); fix the constraint")
        with self._lock:
            self.num_compiled += 1
            self.compiled[key] = compiled
            if len(self.compiled) > self.MAX_CACHED:
                self.compiled.popitem(last=False)
        return compiled

    def _allows_a_start(self, compiled) -> bool:
        """Whether a fresh matcher allows any token (an empty language, such as regex "[^\\s\\S]", allows none)."""
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def _compile(self, params: StructuredOutputsParams):
        compiler, kind = self.compiler, params.kind
        any_whitespace = not params.disable_any_whitespace
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(params.json), any_whitespace=any_whitespace)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":  # EBNF string literals take JSON's escapes
            options = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return compiler.compile_grammar(f"root ::= {options}")
        if is_lark(params.grammar):  # vLLM takes Lark grammars too (its structured-outputs examples use them)
            if not hasattr(compiler, "compile_lark"):
                raise ValueError("a Lark grammar (rules written 'name: ...') needs xgrammar 0.2.6 or later: pip "
                                 "install -U xgrammar, or write it in EBNF ('root ::= ...')")
            return compiler.compile_lark(params.grammar)
        return compiler.compile_grammar(params.grammar)

    def matcher(self, params: StructuredOutputsParams) -> SequenceGrammar:
        """A fresh matcher for one sequence; it allows the stop tokens only where the grammar may end, and
        terminates when it accepts one."""
        return SequenceGrammar(self.xgr.GrammarMatcher(self.compile(params)), self.vocab_size, self.stop_token)


# ---- the per-step host work: many matchers at once ----------------------------------------------------------

# Threads for advance + fill at most: past a few, handing rows over costs more than the work it spreads (256 rows
# with a tokenizer-wide grammar are fastest on about 4; benchmarks/grammar_host.py measures it)
MAX_THREADS = 4
MIN_CHUNK = 16  # rows a thread takes at least: a smaller chunk costs more to hand over than to do


def grammar_threads(device: str) -> int:
    """Threads for the per-step matcher work, at most MAX_THREADS. With a GPU, the CPUs this process may use: the
    host has nothing else to do while the device computes the forward pass. On CPU, torch's thread count: the cores
    the forward pass was given (OMP_NUM_THREADS, or data and tensor parallelism splitting the machine, set it)."""
    if device == "cpu":
        import torch
        available = torch.get_num_threads()
    else:
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(available, MAX_THREADS))


@functools.cache
def _pool(pid: int, workers: int) -> ThreadPoolExecutor:
    # keyed by the process too: a forked child inherits the executor but not its threads
    return ThreadPoolExecutor(workers, thread_name_prefix="nanovllm-grammar")


def in_chunks(fn: Callable[[range], T], n: int, threads: int) -> list[T]:
    """fn over rows [0, n) split into contiguous chunks, one per thread (of at least MIN_CHUNK rows), in parallel:
    xgrammar releases the GIL inside its calls. The calling thread takes the first chunk; the results come in row
    order."""
    num_chunks = min(threads, n // MIN_CHUNK)
    if num_chunks <= 1:
        return [fn(range(n))] if n else []
    size = -(-n // num_chunks)
    chunks = [range(start, min(start + size, n)) for start in range(0, n, size)]
    pool = _pool(os.getpid(), threads - 1)  # one per thread count, whatever the batch size
    futures = [pool.submit(fn, chunk) for chunk in chunks[1:]]
    try:
        first = fn(chunks[0])
    finally:
        wait(futures)  # no chunk may still touch the matchers when this returns or raises
    return [first] + [f.result() for f in futures]


def accept_tokens(matchers: list, tokens: list[int], threads: int) -> list[str | None]:
    """Advance each matcher by its sequence's new token, on several threads. Per row: "stop" where the matcher
    terminated with it (a stop token where the grammar may end), "error" where it refused it, None otherwise (a
    matcher that had terminated before is left alone)."""
    batch = require_xgrammar().BatchGrammarMatcher
    live = [i for i, matcher in enumerate(matchers) if not matcher.is_terminated()]

    def accept(rows: range) -> list[bool]:  # one call into xgrammar per chunk: each call takes the GIL back
        return batch.batch_accept_token([matchers[live[j]] for j in rows], [tokens[live[j]] for j in rows])
    accepted = [ok for chunk in in_chunks(accept, len(live), threads) for ok in chunk]
    reasons: list[str | None] = [None] * len(matchers)
    for i, ok in zip(live, accepted):
        reasons[i] = "stop" if ok and matchers[i].is_terminated() else None if ok else "error"
    return reasons


def fill_bitmasks(matchers: list, bitmask, threads: int, stop_token: int = 0) -> bool:
    """Row i of `bitmask` (int32 [len(matchers), words] on the host) <- the tokens matchers[i] allows next, on
    several threads; every token where matchers[i] is None or has terminated (a row nobody reads). A matcher that
    allows nothing (its constraint reached a point no text continues, e.g. regex "a[^\\s\\S]" after "a") gets
    `stop_token` alone, so its row samples a real token, which the matcher then refuses: the request ends with
    finish_reason "error" (engine) instead of sampling from all -inf. Returns whether any row was filled from a
    matcher."""
    xgr = require_xgrammar()
    live, dead = [], []
    for i, matcher in enumerate(matchers):
        (dead if matcher is None or matcher.is_terminated() else live).append(i)
    if dead:
        bitmask[dead] = -1  # all 32 bits of every word set

    def fill(rows: range):  # one call into xgrammar per chunk, as above
        indices = [live[j] for j in rows]
        xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask([matchers[i] for i in indices], bitmask, indices)
    in_chunks(fill, len(live), threads)
    if live:
        empty = [live[j] for j in (~bitmask[live].any(dim=1)).nonzero().flatten().tolist()]
        if empty:
            word, bit = divmod(stop_token, 32)
            bitmask[empty] = 0
            bitmask[empty, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # (as an int32)
    return bool(live)
