"""LLM.chat: conversations through the tokenizer's chat template, then generate (shared by LLM and the
data-parallel front)."""
from nanovllm.sampling_params import SamplingParams

Message = dict[str, str]
Conversation = list[Message]


class ChatMixin:
    """Needs `tokenizer`, `config` and `generate` from the class it is mixed into."""

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[dict]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them.

        Each is rendered with the tokenizer's chat template, ending in the assistant's turn
        (add_generation_prompt=True); chat_template_kwargs go to the template, e.g. {"enable_thinking": False}
        for Qwen3. Returns one dict per conversation, as generate() does."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        prompts = [self._render_chat(c, chat_template_kwargs or {}) for c in _conversations(messages)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _render_chat(self, conversation: Conversation, template_kwargs: dict) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.config.model!r} has no chat template; use generate() with "
                             "plain prompts for a base model")
        if "tokenize" in template_kwargs or "conversation" in template_kwargs:
            raise ValueError("chat_template_kwargs cannot set 'tokenize' or 'conversation': the engine renders the "
                             "conversation to text itself")
        # add_generation_prompt defaults to True; chat_template_kwargs may turn it off (a final assistant turn to
        # continue)
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  **{"add_generation_prompt": True, **template_kwargs})
        # The template already wrote any BOS it wants; encoding must not add another.
        return self.tokenizer.encode(text, add_special_tokens=False)


def _conversations(messages) -> list[Conversation]:
    """One conversation or a list of them, validated, as a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts, "
                         f"or a list of such lists; got {messages!r:.80}")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"conversation {i} must be a non-empty list of {{'role', 'content'}} dicts, "
                             f"got {conversation!r:.80}")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise ValueError(f"message {j} of conversation {i} must be a dict with str 'role' and 'content', "
                                 f"e.g. {{'role': 'user', 'content': 'Hi'}}; got {message!r:.80}")
    return [list(c) for c in conversations]
