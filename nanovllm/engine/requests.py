"""What a request must be before it is queued: prompts tokenized and checked, SamplingParams checked against the
model. One engine and the data-parallel front check with the same code, so a bad request is refused before any
replica works on a call."""
from collections.abc import Callable
from copy import copy
from dataclasses import dataclass, field
from numbers import Integral

from nanovllm.inputs import TextPrompt, TokensPrompt, prompt_parts
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int] | TextPrompt | TokensPrompt


def as_request_lists(prompts, sampling_params, lora_request=None) -> tuple[list, list, list]:
    """The call's prompts, one sampling_params and one lora_request entry per prompt (a single value repeated),
    shapes checked."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of str, token-id lists or prompt dicts, got {type(prompts).__name__}")
    if prompts and all(isinstance(p, int) for p in prompts):
        raise TypeError("prompts is a flat list of ints: wrap one token-id prompt in a list, [[...]]")
    return list(prompts), _per_prompt(sampling_params, prompts, "sampling_params", "SamplingParams"), \
        _per_prompt(lora_request, prompts, "lora_request", "LoRARequest (or None)")


def _per_prompt(value, prompts: list, name: str, what: str) -> list:
    if not isinstance(value, (list, tuple)):
        return [value] * len(prompts)
    if len(value) != len(prompts):
        raise ValueError(f"got {len(value)} {name} for {len(prompts)} prompts; pass one {what} or exactly one per "
                         "prompt")
    return list(value)


def fork_copies(num_tokens: int, n: int, block_size: int) -> int:
    """Blocks the n - 1 forks of a prompt take when its prefill ends: a copy each of a partly filled last block."""
    return n - 1 if num_tokens % block_size else 0


def _truncate_text(tokenizer, text: str, token_ids: list[int], keep: int) -> list[int]:
    """A text prompt's tokens cut to `keep` as vLLM cuts them (the tokenizer truncating on the left): the special
    tokens the tokenizer adds (a BOS) stay, and the text's last tokens fill the rest. ValueError where `keep` is
    fewer than those special tokens (the tokenizer would leave the prompt whole)."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    added = len(token_ids) - len(plain)
    if keep < added:
        raise ValueError(f"truncate_prompt_tokens={keep} is fewer than the {added} special tokens the tokenizer adds "
                         f"to a text prompt; keep at least {added}")
    start = next((a for a in range(added + 1) if token_ids[a:a + len(plain)] == plain), None)
    if start is None:  # (the specials are not around the text: its tokens merge with them)
        return token_ids[-keep:]
    return token_ids[:start] + plain[len(plain) - (keep - added):] + token_ids[start + len(plain):]


@dataclass
class RequestChecker:
    """Checks requests against one model and cache. `compile_grammar` (optional) compiles a structured-outputs
    spec, raising ValueError for one that cannot be enforced."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_kvcache_blocks: int
    tokenizer: object | None
    model: str
    compile_grammar: Callable | None = None
    longer: str = "raise max_model_len"  # how a longer prompt would fit (the error's advice)
    # a multimodal checkpoint's tokens that stand for an image, {id: its config field}: refused in a prompt
    image_token_ids: dict[int, str] = field(default_factory=dict)

    def tokenize(self, prompt: Prompt, truncate: int | None = None) -> list[int]:
        """The prompt's token ids (its last `truncate`, where given: _truncate_text for a text prompt), checked
        against the model."""
        _, prompt = prompt_parts(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model!r} has no tokenizer: pass prompts as token-id lists")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:  # the usual case, fast
            token_ids = list(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, Integral) and not isinstance(t, bool)
                                                       for t in prompt):
            token_ids = [int(t) for t in prompt]  # numpy and torch integers too
        else:
            raise TypeError(f"a prompt must be a str, a list of int token ids or a prompt dict (TextPrompt, "
                            f"TokensPrompt), got {type(prompt).__name__}")
        if truncate is not None and len(token_ids) > truncate:
            token_ids = (_truncate_text(self.tokenizer, prompt, token_ids, truncate) if isinstance(prompt, str)
                         else token_ids[-truncate:])
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:  # (one pass each in C, not a Python loop)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if self.image_token_ids and not self.image_token_ids.keys().isdisjoint(token_ids):
            token = next(t for t in token_ids if t in self.image_token_ids)
            raise ValueError(f"prompt holds token id {token}, this multimodal checkpoint's "
                             f"{self.image_token_ids[token]} (a token that stands for an image): nanovllm serves its "
                             "language model, for text prompts, without the vision tower (vLLM needs the image too, "
                             "as multi_modal_data, which nanovllm does not take); remove the image's tokens")
        # (The engine refuses at start a cache of fewer than max_model_len tokens, so such a prompt always fits.)
        max_len = self.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_len}: "
                             f"shorten it or {self.longer}")
        if len(token_ids) == max_len:  # prompt + output must fit in max_model_len
            raise ValueError(f"prompt has {len(token_ids)} tokens: max_model_len={max_len} leaves no room for an "
                             f"output token; shorten it or {self.longer}")
        return token_ids

    def check_params(self, sampling_params: SamplingParams) -> SamplingParams:
        """A checked copy of the request's SamplingParams: fields set after construction are checked here too, and
        the caller may change its object afterwards (an RL loop's `sp.n = k`) without touching this request."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        sp = copy(sampling_params)
        sp.verify()
        bad = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(sp, name) == -1:  # (vLLM's: the whole vocabulary)
                setattr(sp, name, self.vocab_size)
            if (getattr(sp, name) or 0) > self.vocab_size:
                raise ValueError(f"{name}={getattr(sp, name)} exceeds the vocabulary size {self.vocab_size}")
        if sp.n > self.max_num_seqs:
            raise ValueError(f"n={sp.n} samples run side by side, more than max_num_seqs={self.max_num_seqs}: "
                             "lower n or raise max_num_seqs")
        if sp.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        if sp.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this model has none; use logit_bias")
        for name, ids in (("logit_bias", sp.logit_bias or {}), ("allowed_token_ids", sp.allowed_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return sp

    def check(self, prompt: Prompt, sampling_params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids (its last truncate_prompt_tokens, where set) and a checked copy of its
        SamplingParams; ValueError/TypeError saying what to change for anything the engine would refuse or could not
        serve."""
        sp = self.check_params(sampling_params)
        token_ids = self.tokenize(prompt, sp.truncate_prompt_tokens)
        if sp.max_tokens is None:  # (vLLM's: as many as max_model_len leaves)
            sp.max_tokens = self.max_model_len - len(token_ids)
            if sp.min_tokens > sp.max_tokens:
                raise ValueError(f"min_tokens={sp.min_tokens}, but max_model_len={self.max_model_len} leaves "
                                 f"{sp.max_tokens} output tokens after this prompt")
        blocks = -(-len(token_ids) // self.block_size)
        needed = blocks + fork_copies(len(token_ids), sp.n, self.block_size)
        if needed > self.num_kvcache_blocks:
            raise ValueError(f"the prompt and its n={sp.n} samples need {needed} KV blocks to start, but the cache "
                             f"has {self.num_kvcache_blocks}: lower n or give the KV cache more room")
        if sp.structured_outputs is not None and self.compile_grammar is not None:
            self.compile_grammar(sp.structured_outputs)  # a spec that cannot be enforced raises now
        return token_ids, sp
