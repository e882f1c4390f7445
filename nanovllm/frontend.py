"""What LLM and the data-parallel front share on top of their generate(): chat, beam search, and the accessors vLLM
scripts and tools read (get_tokenizer, get_default_sampling_params, llm_engine.model_config)."""
import copy
import functools
import json
from dataclasses import dataclass

from nanovllm.beam_search import BeamSearchOutput, beam_search
from nanovllm.sampling_params import BeamSearchParams, SamplingParams

Message = dict
Conversation = list[Message]
_CONTENT_FORMATS = ("auto", "string", "openai")
_NO_PROFILER = ("start_profile/stop_profile are not supported: nanovllm has no built-in profiler (vLLM's "
                "profiler_config, VLLM_TORCH_PROFILER_DIR); wrap the generate() calls in torch.profiler.profile() "
                "instead (with tensor_parallel_size=1 and data_parallel_size=1 the engine runs in this process)")


@dataclass(frozen=True)
class ModelConfig:
    """The parts of vLLM's ModelConfig that clients read (lm-evaluation-harness: max_model_len). model and tokenizer:
    the model as given to LLM(...), a Hub id or a path (the engine's own copy is `llm.config.model`, a local path)."""

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
        """vLLM's `llm.llm_engine`: a vllm_engine.LLMEngine over this LLM (add_request(request_id, prompt, params),
        step() -> RequestOutputs, abort_request, model_config)."""
        from nanovllm.vllm_engine import LLMEngine
        return LLMEngine(self)

    @property
    def model_config(self) -> ModelConfig:
        cfg = self.config
        name = cfg.model_id or cfg.model  # (as vLLM's: the Hub id where one was given, else the path)
        return ModelConfig(name, name, cfg.max_model_len, cfg.torch_dtype, cfg.seed, cfg.hf_config)

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_tokenizer(self):
        """The Hugging Face tokenizer the engine encodes prompts and decodes outputs with (None with
        load_format="dummy" and a checkpoint that has none)."""
        return self.tokenizer

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the ranks of one engine (tensor_parallel_size), times data_parallel_size with include_dp."""
        cfg = self.config
        return cfg.tensor_parallel_size * (cfg.data_parallel_size if include_dp else 1)

    def get_default_sampling_params(self) -> SamplingParams:
        """A copy of the defaults generate() uses when given no sampling_params: vLLM's, with what the checkpoint's
        generation_config.json sets (temperature, top_p, top_k, ...)."""
        return copy.deepcopy(self.default_sampling_params)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's profiler hooks: nanovllm has no built-in profiler (NotImplementedError saying what to use)."""
        raise NotImplementedError(_NO_PROFILER)

    def stop_profile(self) -> None:
        raise NotImplementedError(_NO_PROFILER)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request=None, chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None):
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them, as vLLM's LLM.chat.

        Each is rendered with the tokenizer's chat template (or `chat_template`, a Jinja string) and `tools`,
        ending in the assistant's turn (add_generation_prompt), or continuing the last message
        (continue_final_message). A message's content is a str, None (empty), or a list of text parts: plain strs or
        {"type": "text" / "input_text" / "output_text", "text": ...}, {"type": "refusal", "refusal": ...},
        {"type": "thinking", "thinking": ...}, as vLLM reads them; images, audio and video are refused.
        chat_template_kwargs go to the template, e.g. {"enable_thinking": False} for Qwen3. Returns one
        RequestOutput per conversation, as generate() does (tokenization_kwargs: None or {}, as there)."""
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: nanovllm serves text prompts only; pass None")
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
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request,
                             tokenization_kwargs=tokenization_kwargs)

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

    def beam_search(self, prompts: list, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the `params.beam_width` most likely continuations of each prompt (a str, token
        ids, or a TextPrompt / TokensPrompt dict), built a token at a time on generate() (the prefix cache keeps
        each step to the new tokens). concurrency_limit: search at most that many prompts at a time, as vLLM's
        does (the beams are the same)."""
        return beam_search(self, prompts, params, lora_request, concurrency_limit)


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
    """A message as vLLM hands it to the template (its parse_chat_messages): the content parts rendered in the
    content format, and only the other keys vLLM keeps (_message_fields)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be a dict with a str 'role' and a 'content', e.g. "
                         f"{{'role': 'user', 'content': 'Hi'}}; got {message!r:.80}")
    parts = _content_parts(message.get("content"), where)
    return {"role": message["role"], "content": _content(parts, message["role"], content_format),
            **_message_fields(message, where)}


def _content_parts(content, where: str) -> list[dict]:
    """A message's content as a list of {"type": "text", "text": str} and {"type": "tool_reference", "name": str}
    parts. No content (None, or no 'content' key) is no parts, as in vLLM: an empty content, not None, which a
    template would write out as "None"."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}: 'content' must be a str, a list of content parts or None; got {content!r:.80}")
    return [p for p in (_content_part(part, where) for part in content) if p is not None]


# The part types vLLM reads as text, with the key holding the text; vLLM skips a "text" or "refusal" part whose text
# is None (it joins or hands on the others' None, which fails or reaches the template as None, so those are refused).
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
_SKIPPED_WITHOUT_TEXT = ("text", "refusal")


def _content_part(part, where: str) -> dict | None:
    """One content part, normalized as vLLM's _parse_chat_message_content_part does: a plain str and the text-like
    types become a text part (a "thinking" part's text too: vLLM keeps it as text, it does not move it to the
    reasoning), a "tool_reference" keeps its name; None for a part vLLM skips. Anything else (images, audio,
    video, unknown types) is refused: nanovllm serves text prompts only."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS:
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in _SKIPPED_WITHOUT_TEXT:
            return None
        if not isinstance(text, str):
            raise ValueError(f"{where}: a {kind!r} content part needs a str {_TEXT_PARTS[kind]!r}; got {part!r:.80}")
        return {"type": "text", "text": text}
    if kind == "tool_reference" and isinstance(part.get("name"), str):
        return {"type": "tool_reference", "name": part["name"]}
    raise ValueError(f"{where}: unsupported content part {part!r:.80}: nanovllm serves text prompts only; a part is a "
                     f"str or a dict of type {', '.join(map(repr, _TEXT_PARTS))} or 'tool_reference' (with its name)")


def _content(parts: list[dict], role: str, content_format: str) -> str | list[dict]:
    """vLLM's content formats: "string" joins the parts' texts by newlines; "openai" hands the template the parts,
    a str content's one part included (a template that loops over the parts would loop over a str's characters),
    except a tool result of text parts only, which vLLM joins as most templates expect a str there."""
    if content_format == "openai" and not (role == "tool" and all(p["type"] == "text" for p in parts)):
        return parts
    return "\n".join(p["text"] if p["type"] == "text" else p["name"] for p in parts)


def _message_fields(message: dict, where: str) -> dict:
    """The keys besides role and content that vLLM's _parse_chat_message_content copies to the message the template
    gets (it drops the others, so templates see the same message here): an assistant's tool_calls (arguments
    parsed, _tool_calls) and its reasoning (or reasoning_content), as both keys (templates like Qwen3's read the
    latter); a tool result's tool_call_id; a str name or task; a developer message's tools (None where it has none)."""
    role, fields = message["role"], {}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            tool_calls = _tool_calls(message["tool_calls"], where)
            if tool_calls:  # (vLLM's: an empty list keeps the template on the plain assistant path)
                fields["tool_calls"] = tool_calls
        # vLLM reads "reasoning" only and drops "reasoning_content", the key Qwen's and others' templates read and
        # clients such as Qwen-Agent send: it is read too here, rather than lose a turn's reasoning without a word
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if reasoning is not None:
            fields["reasoning"] = fields["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        fields["tool_call_id"] = message["tool_call_id"]
    elif role == "developer":
        fields["tools"] = message.get("tools")
    fields.update({key: message[key] for key in ("name", "task") if isinstance(message.get(key), str)})
    return fields


def _tool_calls(tool_calls, where: str) -> list:
    """An assistant message's tool calls as templates expect them (vLLM's _postprocess_messages): OpenAI's
    `function.arguments` is a JSON string, which templates would write out as a quoted string (`arguments | tojson`),
    so it is parsed into a dict ({} where it is not JSON). Copies: the caller's messages stay as they were."""
    if not isinstance(tool_calls, (list, tuple)):
        raise ValueError(f"{where}: 'tool_calls' must be a list of tool calls; got {tool_calls!r:.80}")
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


@functools.lru_cache(maxsize=16)  # (chat() asks for every call; a template is parsed once)
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
    # a loop over message['content'], or over a variable named content (a macro given the content, as Qwen3.5's)
    return "openai" if any(reads(f.iter, item, "content") for f in loops for item in items) or any(
        reads(f.iter, "content") for f in loops) else "string"
