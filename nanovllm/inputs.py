"""Prompts in vLLM's shapes: a str, a list of token ids, or a TextPrompt / TokensPrompt dict."""
from typing import TypedDict

# vLLM's prompt-dict keys nanovllm has no use for: refused by name rather than ignored
_UNSUPPORTED = {"multi_modal_data": "nanovllm serves text-only models", "mm_processor_kwargs": "no multimodal models",
                "cache_salt": "the prefix cache is not salted", "token_type_ids": "no pooling models",
                "multi_modal_uuids": "no multimodal models"}


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


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
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids' (token ids)")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"TextPrompt['prompt'] must be a str, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"], prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, str):
        raise TypeError("TokensPrompt['prompt_token_ids'] must be a list of int token ids, got a str")
    return None, ids
