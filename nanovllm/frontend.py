"""What LLM and the data-parallel front share on top of their generate(): chat, beam search, and the accessors vLLM
scripts and tools read (get_tokenizer, get_default_sampling_params, llm_engine.model_config)."""
import copy
import json
from dataclasses import dataclass

from nanovllm.beam_search import BeamSearchOutput, beam_search
from nanovllm.sampling_params import BeamSearchParams, SamplingParams

Message = dict
Conversation = list[Message]
_CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass(frozen=True)
class ModelConfig:
    """The parts of vLLM's ModelConfig that clients read (lm-evaluation-harness: max_model_len)."""

    model: str
    tokenizer: str
    max_model_len: int
    dtype: object  # torch.dtype
    seed: int
    hf_config: object

    @property
    def hf_text_config(self):
        return self.hf_config

    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_config.hidden_size


class Frontend:
    """Needs `tokenizer`, `config`, `default_sampling_params` and `generate` from the class it is mixed into."""

    @property
    def llm_engine(self):
        """vLLM's `llm.llm_engine`: here the LLM itself, which is its own engine (add_request, step, model_config)."""
        return self

    @property
    def model_config(self) -> ModelConfig:
        cfg = self.config
        return ModelConfig(cfg.model, cfg.model, cfg.max_model_len, cfg.torch_dtype, cfg.seed, cfg.hf_config)

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_tokenizer(self):
        """The Hugging Face tokenizer the engine encodes prompts and decodes outputs with (None with
        load_format="dummy" and a checkpoint that has none)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A copy of the defaults generate() uses when given no sampling_params: vLLM's, with what the checkpoint's
        generation_config.json sets (temperature, top_p, top_k, ...)."""
        return copy.deepcopy(self.default_sampling_params)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request=None, chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None):
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them, as vLLM's LLM.chat.

        Each is rendered with the tokenizer's chat template (or `chat_template`, a Jinja string) and `tools`,
        ending in the assistant's turn (add_generation_prompt), or continuing the last message
        (continue_final_message). A message's content is a str or a list of {"type": "text", "text": ...} parts.
        chat_template_kwargs go to the template, e.g. {"enable_thinking": False} for Qwen3. Returns one
        RequestOutput per conversation, as generate() does."""
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs is not supported: nanovllm serves text-only models; pass None")
        if chat_template_content_format not in _CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(map(repr, _CONTENT_FORMATS))}, "
                             f"got {chat_template_content_format!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        if chat_template is not None:
            options["chat_template"] = chat_template
        if tools is not None:
            options["tools"] = tools
        options.update(chat_template_kwargs or {})
        # checked once merged: chat_template_kwargs may set either (vLLM's LLM.chat updated its arguments with
        # chat_template_kwargs, and transformers refused the pair)
        if options["add_generation_prompt"] and options["continue_final_message"]:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True: pass "
                             "add_generation_prompt=False to continue the last message")
        if chat_template_content_format == "auto":
            chat_template_content_format = self._content_format(chat_template, tools)
        prompts = [self._render_chat(c, options) for c in _conversations(messages, chat_template_content_format)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _render_chat(self, conversation: Conversation, options: dict) -> dict:
        """The conversation as a TokensPrompt with its text."""
        if "chat_template" not in options and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.config.model!r} has no chat template; pass chat_template, or "
                             "use generate() with plain prompts for a base model")
        if "tokenize" in options or "conversation" in options:
            raise ValueError("chat_template_kwargs cannot set 'tokenize' or 'conversation': the engine renders the "
                             "conversation to text itself")
        options = {"add_generation_prompt": True, **options}
        from jinja2.exceptions import TemplateError  # (transformers renders templates with jinja2)
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, **options)
        except TemplateError as e:  # a template's raise_exception (roles that must alternate...): it says the fix
            raise ValueError(f"the chat template refused the conversation: {e}") from e
        except TypeError as e:  # (a template that adds strings, given content as parts)
            raise ValueError(f"the chat template could not render the conversation ({e}); with "
                             "chat_template_content_format='openai' it gets each content as a list of parts: use "
                             "'string' for a template that expects text") from e
        # The template already wrote any BOS it wants; encoding must not add another.
        return {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False), "prompt": text}

    def _content_format(self, chat_template: str | None, tools: list | None) -> str:
        """vLLM's "auto" content format: "openai" for a template that loops over a message's content parts, else
        "string" (and "string" where there is no template to read: rendering then says what is missing)."""
        try:
            template = self.tokenizer.get_chat_template(chat_template, tools=tools)
        except (ValueError, TypeError, AttributeError):
            return "string"
        return _detect_content_format(template)

    def beam_search(self, prompts: list, params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the `params.beam_width` most likely continuations of each prompt (a str, token
        ids, or a TextPrompt / TokensPrompt dict), built a token at a time on generate() (the prefix cache keeps
        each step to the new tokens)."""
        return beam_search(self, prompts, params, lora_request)


def _conversations(messages, content_format: str = "auto") -> list[Conversation]:
    """One conversation or a list of them, validated, as a list of conversations: a message's text parts joined by
    newlines (vLLM's "string" content format; chat() resolves "auto" from the template), or as a list of parts for
    the template ("openai")."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts, "
                         f"or a list of such lists; got {messages!r:.80}")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    out = []
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"conversation {i} must be a non-empty list of {{'role', 'content'}} dicts, "
                             f"got {conversation!r:.80}")
        out.append([_message(m, f"message {j} of conversation {i}", content_format)
                    for j, m in enumerate(conversation)])
    return out


def _message(message, where: str, content_format: str) -> Message:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be a dict with a str 'role' and a 'content', e.g. "
                         f"{{'role': 'user', 'content': 'Hi'}}; got {message!r:.80}")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: text only
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: a content part must be {{'type': 'text', 'text': str}} (nanovllm serves "
                                 f"text-only models); got {part!r:.80}")
        texts = [part["text"] for part in content]
    elif isinstance(content, str):
        texts = [content]
    elif content is None and message.get("tool_calls"):
        texts = []  # (vLLM's: no content is an empty one, "" or no parts; a template would write None as "None")
    else:
        raise ValueError(f"{where} must have a str 'content' (or a list of text parts); got {message!r:.80}")
    # vLLM's content formats: "string" joins the text parts by newlines; "openai" hands the template every content as
    # parts, a str one included (a template that loops over the parts would loop over a str's characters), except a
    # tool result's, which vLLM keeps a str as most templates expect
    if content_format == "openai" and message["role"] != "tool":
        message = {**message, "content": [{"type": "text", "text": text} for text in texts]}
    else:
        message = {**message, "content": "\n".join(texts)}
    if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
        message = {**message, "tool_calls": _tool_calls(message["tool_calls"], where)}
        if not message["tool_calls"]:
            del message["tool_calls"]  # (vLLM's: an empty list keeps the template on the plain assistant path)
    return message


def _tool_calls(tool_calls: list, where: str) -> list:
    """An assistant message's tool calls as templates expect them (vLLM's _postprocess_messages): OpenAI's
    `function.arguments` is a JSON string, which templates would write out as a quoted string (`arguments | tojson`),
    so it is parsed into a dict ({} where it is not JSON). Copies: the caller's messages stay as they were."""
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f"{where}: a tool call must be a dict with a 'function' dict, e.g. {{'type': 'function', "
                             f"'function': {{'name': 'f', 'arguments': '{{}}'}}}}; got {call!r:.80}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _detect_content_format(template: str) -> str:
    """"openai" where the template loops over the content of a message, `{% for part in message['content'] %}`, with
    `message` a loop variable over `messages` (or over a variable set from it, like `loop_messages`), as vLLM's
    _detect_content_format reads the template; "string" otherwise, or where the template does not parse."""
    from jinja2 import TemplateError, nodes
    try:  # transformers' environment: its extensions parse its own tags ({% generation %})
        from transformers.utils.chat_template_utils import _compile_jinja_template
        environment = _compile_jinja_template(template).environment
    except (ImportError, TemplateError):  # (a private helper: a later transformers may lack it)
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        ast = environment.parse(template)
    except TemplateError:
        return "string"

    def reads(node, name: str, key: str | None = None) -> bool:
        """node reads `name` (key None) or `name[key]` / `name.key`, through filters, tests and slices."""
        while isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                                and isinstance(node.arg, nodes.Slice)):
            node = node.node
        if key is None:
            return isinstance(node, nodes.Name) and node.name == name
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == key and reads(node.node, name)
        return isinstance(node, nodes.Getattr) and node.attr == key and reads(node.node, name)

    lists = {"messages"}  # messages and the variables set from it
    grew = True
    while grew:
        found = {a.target.name for a in ast.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)
                 and any(reads(a.node, name) for name in lists)}
        grew = not found <= lists
        lists |= found
    loops = list(ast.find_all(nodes.For))
    items = {f.target.name for f in loops if isinstance(f.target, nodes.Name)
             and any(reads(f.iter, name) for name in lists)}
    return "openai" if any(reads(f.iter, item, "content") for f in loops for item in items) else "string"
