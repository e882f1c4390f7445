import copy
import enum
import math
from dataclasses import dataclass, field

from nanovllm.sampling.structured_outputs import StructuredOutputsParams, as_structured_outputs

MIN_SAMPLING_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP: a temperature in (0, 0.01) samples at 0.01


class RequestOutputKind(enum.IntEnum):
    """What LLMEngine.step() returns for a request (vLLM's): its whole output so far each step it advances
    (CUMULATIVE), only what that step added (DELTA), or its output once, when it finishes (FINAL_ONLY).
    LLM.generate and chat return whole outputs whatever the kind, as vLLM's LLM does."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def as_output_kind(kind) -> RequestOutputKind:
    """A RequestOutputKind from ours, vLLM's enum (by name), its name or int value, or None (CUMULATIVE)."""
    if kind is None:
        return RequestOutputKind.CUMULATIVE
    name = kind if isinstance(kind, str) else getattr(kind, "name", None)
    if isinstance(name, str) and name in RequestOutputKind.__members__:
        return RequestOutputKind[name]
    if _is_int(kind) and kind in {k.value for k in RequestOutputKind}:
        return RequestOutputKind(kind)
    raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got {kind!r}")


def check_seed(seed: int, name: str = "seed"):
    """Seeds are 64-bit, as torch.Generator.manual_seed takes them."""
    if not -2**63 <= seed < 2**64:
        raise ValueError(f"{name} must fit in 64 bits ([-2**63, 2**64)), got {seed}")


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample i of a request with n > 1: seed + i (as vLLM), wrapped into the 64-bit range."""
    seed += sample_index
    return seed - 2**64 if seed >= 2**64 else seed


@dataclass
class SamplingParams:
    """Per-request generation options (names as in vLLM).

    temperature 0 means greedy; one in (0, 0.01) is raised to 0.01, as vLLM does. top_k -1 or 0, top_p 1 and min_p 0
    switch those filters off.
    logprobs=k returns, for every generated token, the log-probabilities of the k most likely tokens (k=-1: every
    token of the vocabulary, as in vLLM) plus the sampled one, from the model's distribution before penalties,
    temperature and filtering (after a grammar's mask, with structured_outputs: a token it forbids has logprob -inf);
    LLM(logprobs_mode=...) can make them those of the distribution the token is drawn from, or logits.
    prompt_logprobs=k returns, for every prompt token after the first, its log-probability and the k most
    likely tokens' (k=0: the prompt token's only; k=-1: every token's), from the raw distribution (the raw logits in
    a logits logprobs_mode).
    n: completions per prompt; the prompt is prefilled once and its KV blocks are shared by the samples.
    structured_outputs: a StructuredOutputsParams (or a dict of its fields) constraining the answer to a JSON
    schema, a regex, a choice or a grammar (docs/structured_outputs.md); the grammar decides where the answer ends,
    so min_tokens cannot be combined with it.
    vLLM's further fields: detokenize (False: no text, only token ids), spaces_between_special_tokens (passed to the
    tokenizer's decode), include_stop_str_in_output (the text keeps the stop string that ended it), logit_bias ({token
    id: bias} added to the logits), allowed_token_ids (only these may be sampled), bad_words (words never to generate,
    as token sequences), truncate_prompt_tokens (keep only the last k prompt tokens, a text prompt keeping the special
    tokens its tokenizer adds), flat_logprobs (logprobs and prompt_logprobs as one FlatLogprobs each, read as the
    same list of dicts: far cheaper to make for long prompts), output_kind (a RequestOutputKind, for LLMEngine.step;
    None reads as CUMULATIVE); logits_processors is accepted at its default, extra_args as any dict (kept, read by
    nothing), older vLLM's best_of at None or n. max_tokens defaults
    to 16, as in vLLM; None runs up to max_model_len.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    flat_logprobs: bool = False
    logits_processors: list | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict | None = None
    best_of: int | None = None
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        self.verify()

    def verify(self):
        """Check every field, raising ValueError/TypeError that says what to change, and normalize (top_k 0 -> -1,
        lists for stop and stop_token_ids, as vLLM's). Runs at construction and again when a request is submitted,
        so a field set after construction (an RL loop's `sp.n = k`) is checked as well."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)) and not (name == "max_tokens" and self.max_tokens is None):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("ignore_eos", "skip_special_tokens", "detokenize", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "flat_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1 (completions per prompt), got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:  # (vLLM logs a warning and does the same)
            self.temperature = MIN_SAMPLING_TEMPERATURE
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None: up to max_model_len), got {self.max_tokens}")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None:
            check_seed(self.seed)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(f"{name} must be None, -1 (the whole vocabulary) or an int >= 0, got {value!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop)):
            raise TypeError(f"stop must be a str or a list of str, got {self.stop!r}")
        if stop is not None and any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        self.stop = list(stop or [])  # (a list, as vLLM's: sp.stop reads [] or ["..."])
        self._stop = list(self.stop)
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids)):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")
        self.stop_token_ids = list(ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.structured_outputs = as_structured_outputs(self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides where the "
                             "answer may end (at that point only EOS is allowed); drop min_tokens")
        self._verify_vllm_fields()

    def _verify_vllm_fields(self):
        if self._stop and not self.detokenize:
            raise ValueError("stop strings need the text: drop stop, or keep detokenize=True")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(_is_int(t) and t >= 0 and _is_number(b) and math.isfinite(b)
                                                     for t, b in bias.items()):
                raise ValueError(f"logit_bias must be a dict of token id -> finite number, got {bias!r:.80}")
            self.logit_bias = {int(t): float(b) for t, b in bias.items()}
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a list of non-negative ints, got {ids!r:.80}")
            if not ids:
                raise ValueError("allowed_token_ids must not be empty: it lists the only tokens that may be sampled")
            self.allowed_token_ids = list(ids)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
                raise TypeError(f"bad_words must be a list of non-empty str, got {words!r:.80}")
            self.bad_words = list(words)
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or k < 1):
            raise ValueError(f"truncate_prompt_tokens must be None or an int >= 1, got {k!r}")
        if self.best_of is not None and self.best_of != self.n:  # (best_of = n is older vLLM's default: n samples)
            raise ValueError(f"best_of={self.best_of!r} is not supported (vLLM's V1 engine dropped it too): ask for "
                             "n samples with logprobs=0 and keep the best by cumulative_logprob, or use beam_search")
        if self.logits_processors:
            raise ValueError("logits_processors (callables on the logits) are not supported: nanovllm applies its "
                             "own on the device; use logit_bias, allowed_token_ids, bad_words or structured_outputs")
        self.output_kind = as_output_kind(self.output_kind)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's): changing the copy's fields, lists included, leaves this one as it is."""
        return copy.deepcopy(self)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_filtering(self) -> bool:
        """top-k / top-p / min-p (only meaningful when sampling)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class BeamSearchParams:
    """vLLM's: beam_width beams, each at most max_tokens new tokens; a finished beam's score is its cumulative
    logprob / length ** length_penalty (length: its tokens, prompt included, less a final EOS)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            # (NaN would make every score NaN, and the beams come back in no order)
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
