"""Prompts in vLLM's shapes: a str, a list of token ids, or a TextPrompt / TokensPrompt dict."""
from collections.abc import Iterable
from typing import TypedDict

# vLLM's prompt-dict keys nanovllm has no use for: refused by name rather than ignored
_UNSUPPORTED = {"multi_modal_data": "nanovllm serves text prompts only (a multimodal checkpoint's language model, "
                                    "without its vision tower)", "mm_processor_kwargs": "no multimodal inputs",
                "cache_salt": "the prefix cache is not salted", "token_type_ids": "no pooling models",
                "multi_modal_uuids": "no multimodal inputs"}


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]  # required
    prompt: str  # optional: the text the ids came from, reported as RequestOutput.prompt


def prompt_parts(prompt) -> tuple[str | None, object]:
    """(the prompt's text or None, what to tokenize: the text or the token ids) of any accepted prompt form;
    TypeError/ValueError saying what to change for a dict nanovllm cannot take."""
    if not isinstance(prompt, dict):
        return (prompt if isinstance(prompt, str) else None), prompt
    unsupported = sorted(k for k in prompt if k in _UNSUPPORTED)
    if unsupported:
        raise ValueError(f"prompt key {unsupported[0]!r} is not supported: {_UNSUPPORTED[unsupported[0]]}")
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise TypeError(f"unknown prompt key(s) {', '.join(map(repr, unknown))}; a prompt dict is a TextPrompt "
                        "{'prompt': str} or a TokensPrompt {'prompt_token_ids': [int, ...]}")
    if "prompt" not in prompt and "prompt_token_ids" not in prompt:
        raise ValueError("a prompt dict needs 'prompt' (text, a TextPrompt) or 'prompt_token_ids' (token ids, a "
                         "TokensPrompt)")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"a prompt dict's 'prompt' must be a str, got {type(text).__name__}")
    if "prompt_token_ids" not in prompt:
        return text, text
    ids = prompt["prompt_token_ids"]  # (with a 'prompt' too, as vLLM's TokensPrompt: that is its text, for outputs)
    if isinstance(ids, str):
        raise TypeError("TokensPrompt['prompt_token_ids'] must be a list of int token ids, got a str")
    return text, ids


def call_prompts(prompts, prompt_token_ids=None, priority=None, tokenization_kwargs=None):
    """A generate() call's prompts from vLLM's arguments: `prompt_token_ids` (older vLLM's keyword, which
    lm-evaluation-harness still passes) in place of `prompts`; `priority` taken at None or all 0 (vLLM's first come,
    first served takes only those), `tokenization_kwargs` at None or {} (the tokenizer's own encoding)."""
    # (vLLM reads `priority[i] if priority else 0`: a bare 0 puts every prompt at 0 too)
    values = priority if isinstance(priority, Iterable) and not isinstance(priority, (str, bytes)) else [priority]
    if priority is not None and any(p != 0 for p in values):
        raise ValueError(f"priority={priority!r:.60} is not supported: requests are scheduled first come, first "
                         "served; pass None (or 0 for every prompt)")
    if tokenization_kwargs:
        raise ValueError(f"tokenization_kwargs={tokenization_kwargs!r:.80} is not supported: prompts are encoded as "
                         "the tokenizer's encode() does by default; to keep a prompt's last k tokens pass "
                         "SamplingParams(truncate_prompt_tokens=k)")
    if prompt_token_ids is None:
        if prompts is None:
            raise TypeError("generate() needs prompts: a str, a list of token ids, a prompt dict or a list of them")
        return prompts
    if prompts is not None:
        raise ValueError("pass either prompts or prompt_token_ids, not both")
    if prompt_token_ids and all(isinstance(t, int) for t in prompt_token_ids):
        return [{"prompt_token_ids": prompt_token_ids}]  # (one prompt, as vLLM took it)
    return [{"prompt_token_ids": ids} for ids in prompt_token_ids]
