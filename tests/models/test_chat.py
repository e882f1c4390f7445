"""LLM.chat: conversations through the tokenizer's chat template, then generate."""
import pytest

from nanovllm import LLM, SamplingParams
from tests.tiny_models import CHAT_TEMPLATE, _tokenizer, make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(num_kvcache_blocks=16, kvcache_block_size=16, max_model_len=256)
BOS, IM_START, IM_END = "<s>", "<|im_start|>", "<|im_end|>"
# The tiny ChatML template, written after a BOS (as Llama-style templates do), plus a variable a caller can set
# through chat_template_kwargs.
TEMPLATE = "{{ bos_token }}{% if terse %}Be brief.\n{% endif %}" + CHAT_TEMPLATE


def _chat_checkpoint(path) -> str:
    """A tiny Llama whose tokenizer has ChatML special tokens and, like Llama's, adds a BOS in encode()."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer
    make_checkpoint(path, "llama", tie=False, seed=1, vocab_size=len(_tokenizer()) + 3)  # room for 3 new tokens
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"bos_token": BOS, "additional_special_tokens": [IM_START, IM_END]})
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                              special_tokens=[(BOS, tok.bos_token_id)])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(_chat_checkpoint(tmp_path_factory.mktemp("chat")), **SMALL) as llm:
        yield llm


def _strip(outputs: list[dict]) -> list[dict]:
    """Outputs without num_cached_tokens: a repeated prompt hits the prefix cache."""
    return [{k: v for k, v in o.items() if k != "num_cached_tokens"} for o in outputs]


def _expected_ids(llm, conversation, preamble: str = "") -> list[int]:
    """The prompt written out by hand, not rendered by the template: BOS, the preamble, each message as
    <|im_start|>role\\ncontent<|im_end|>\\n, then <|im_start|>assistant\\n. Special tokens are spliced in by id and
    only the plain text between them is encoded (special tokens split the text, so that is how it tokenizes)."""
    tok = llm.tokenizer
    bos, start, end = tok.convert_tokens_to_ids([BOS, IM_START, IM_END])
    assert None not in (bos, start, end) and len({bos, start, end}) == 3

    def text(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False)
    ids = [bos] + text(preamble)
    for message in conversation:
        ids += [start] + text(f"{message['role']}\n{message['content']}") + [end] + text("\n")
    return ids + [start] + text("assistant\n")


def test_one_conversation_equals_generate_on_its_rendering(llm):
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)
    expected = _expected_ids(llm, conversation)
    assert len(out) == 1 and {"text", "token_ids", "finish_reason"} <= set(out[0])
    assert out[0]["prompt_token_ids"] == expected
    assert _strip(out) == _strip(llm.generate([expected], GREEDY, use_tqdm=False))


def test_template_bos_is_not_doubled(llm):
    """The template writes the BOS; encoding the rendered text must not add the tokenizer's own."""
    bos = llm.tokenizer.convert_tokens_to_ids(BOS)
    assert llm.tokenizer.encode("Hello")[0] == bos  # this tokenizer does add one when asked to
    conversation = [{"role": "user", "content": "Hello world!"}]
    prompt = llm.chat(conversation, GREEDY, use_tqdm=False)[0]["prompt_token_ids"]
    assert prompt[0] == bos and prompt.count(bos) == 1
    assert prompt == _expected_ids(llm, conversation)


def test_several_conversations_and_template_kwargs(llm):
    conversations = [[{"role": "user", "content": "Hello world!"}], [{"role": "user", "content": "How are you?"}]]
    out = llm.chat(conversations, GREEDY, use_tqdm=False, chat_template_kwargs={"terse": True})
    expected = [_expected_ids(llm, c, preamble="Be brief.\n") for c in conversations]  # the kwarg reached it
    assert [o["prompt_token_ids"] for o in out] == expected
    assert _strip(out) == _strip(llm.generate(expected, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("messages", [
    [],
    "Hello",
    [{"content": "hi"}],
    [["not a dict"]],
    [[{"role": "user", "content": "hi"}], []],
])
def test_malformed_messages(llm, messages):
    with pytest.raises(ValueError, match="role"):
        llm.chat(messages, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("message, joined", [
    ({"role": "user", "content": ["Hello", "world!"]}, "Hello\nworld!"),
    ({"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "output_text", "text": "you"}]},
     "Hello\nyou"),
    ({"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}, "No."),
    ({"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm", "closed": True}, "Hi"]}, "Hmm\nHi"),
    ({"role": "user", "content": [{"type": "text", "text": None}, "Hi", {"type": "refusal", "refusal": None}]}, "Hi"),
    ({"role": "user", "content": None}, ""),
    ({"role": "user"}, ""),
])
def test_content_shapes_vllm_accepts(llm, message, joined):
    """vLLM's _parse_chat_message_content_part: plain strs and input_text / output_text / refusal / thinking parts
    are text (a thinking part stays in the content), a text or refusal part without its text is skipped, and no
    content is an empty one."""
    out = llm.chat([message], GREEDY, use_tqdm=False)[0]
    assert out["prompt_token_ids"] == _expected_ids(llm, [{"role": message["role"], "content": joined}])


def test_openai_format_gets_every_text_shape_as_text_parts(llm):
    parts_template = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}"
                      ";{% endfor %}")
    conversation = [{"role": "user", "content": ["a", {"type": "input_text", "text": "b"}]},
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "c"}, {"type": "text"}]},
                    {"role": "user"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=parts_template)[0]
    assert out.prompt == "user:[a][b];assistant:[c];user:;"


def test_message_keys_are_those_vllm_keeps(llm):
    """vLLM hands the template an assistant's `reasoning` as `reasoning_content` too (the name Qwen3's template
    reads), keeps a developer message's tools, and drops the keys it does not keep (reasoning or tools on a user
    message, an unknown key)."""
    template = ("{% for m in messages %}{{ m['role'] }}:{{ m.reasoning_content }}/{{ m.reasoning }}/{{ m.extra }}"
                "/{{ m.name }}/{{ m.tools }};{% endfor %}")
    conversation = [{"role": "user", "content": "hi", "reasoning": "u", "extra": "x", "name": "bob", "tools": ["t"]},
                    {"role": "assistant", "content": "ok", "reasoning": "r", "reasoning_content": "given"},
                    {"role": "developer", "content": "d", "tools": ["f"]}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "user:///bob/;assistant:r/r///;developer:////['f'];"
    # reasoning_content alone (Qwen-Agent's key, the one the template reads): kept, where vLLM would drop it
    conversation[1] = {"role": "assistant", "content": "ok", "reasoning_content": "given"}
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "user:///bob/;assistant:given/given///;developer:////['f'];"


def test_tool_reference_parts(llm):
    """vLLM keeps a tool_reference part (its name) for the template; a tool result holding one stays a list of parts
    with the "openai" format."""
    template = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                "{% for p in m['content'] %}[{{ p['type'] }}:{{ p['text'] or p['name'] }}]{% endfor %}{% endif %};"
                "{% endfor %}")
    conversation = [{"role": "tool", "content": [{"type": "tool_reference", "name": "search"}, "done"]}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template, chat_template_content_format="openai")
    assert out[0].prompt == "[tool_reference:search][text:done];"
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template, chat_template_content_format="string")
    assert out[0].prompt == "search\ndone;"


@pytest.mark.parametrize("message, match", [
    ({"role": "user", "content": 3}, "'content' must be a str"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}, "text prompts only"),
    ({"role": "user", "content": [{"image_url": "http://x/a.png"}]}, "text prompts only"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
     "text prompts only"),
    ({"role": "user", "content": [{"type": "video_url", "video_url": {"url": "http://x/a.mp4"}}]}, "text prompts only"),
    ({"role": "user", "content": [{"type": "html", "html": "<b>"}]}, "unsupported content part"),
    ({"role": "user", "content": [3]}, "unsupported content part"),
    # vLLM skips only text and refusal parts without their text: it joins these Nones (a TypeError)
    ({"role": "user", "content": [{"type": "input_text", "text": None}]}, "needs a str 'text'"),
    ({"role": "assistant", "content": [{"type": "thinking"}]}, "needs a str 'thinking'"),
    ({"role": "assistant", "content": "", "tool_calls": "f()"}, "'tool_calls' must be a list"),
])
def test_content_vllm_refuses(llm, message, match):
    with pytest.raises(ValueError, match=match):
        llm.chat([message], GREEDY, use_tqdm=False)


def test_bad_template_kwargs(llm):
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template_kwargs=["terse"])


def test_model_without_chat_template(tmp_path):
    with LLM(make_checkpoint(tmp_path, "llama"), **SMALL) as llm:
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)


def test_chat_template_kwargs_may_turn_the_generation_prompt_off(llm):
    """add_generation_prompt defaults to True; chat_template_kwargs may set it (to continue a last assistant turn)."""
    conversation = [{"role": "user", "content": "Hello world!"}]
    bare = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})[0]
    generation_prompt = 1 + len(llm.tokenizer.encode("assistant\n", add_special_tokens=False))  # <|im_start|>...
    assert bare["prompt_token_ids"] == _expected_ids(llm, conversation)[:-generation_prompt]
    with pytest.raises(ValueError, match="cannot set 'tokenize'"):
        llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_kwargs={"tokenize": True})


def test_text_parts_are_joined_by_newlines_or_passed_as_parts(llm):
    """vLLM's content formats: "string" (and "auto", for this string template) joins a message's text parts with
    newlines; "openai" hands the template the parts, which a template that adds strings cannot render (a
    ValueError saying to use "string")."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world!"}]}]
    joined = [{"role": "user", "content": "Hello\nworld!"}]
    for content_format in ("auto", "string"):
        out = llm.chat(parts, GREEDY, use_tqdm=False, chat_template_content_format=content_format)[0]
        assert out["prompt_token_ids"] == _expected_ids(llm, joined)
    with pytest.raises(ValueError, match="with chat_template_content_format='openai' it gets each content as a list "
                                         "of parts: use 'string'"):
        llm.chat(parts, GREEDY, use_tqdm=False, chat_template_content_format="openai")
    parts_template = ("{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}")
    out = llm.chat(parts, GREEDY, use_tqdm=False, chat_template=parts_template, chat_template_content_format="openai")
    assert out[0].prompt == "[Hello][world!]"


def test_tool_call_arguments_reach_the_template_as_a_dict(llm):
    """OpenAI's tool calls carry their arguments as a JSON string; templates write `arguments | tojson`, so vLLM
    parses them first (_postprocess_messages): the prompt holds {"x": 1}, not the quoted string "{\\"x\\": 1}"."""
    template = ("{% for m in messages %}{{ m['role'] }}:{% for t in m.tool_calls or [] %}{{ t.function.name }}"
                "{{ t.function.arguments | tojson }}{% endfor %}{{ m['content'] or '' }};{% endfor %}")
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    broken = {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}
    conversation = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [call, broken]},
                    {"role": "tool", "tool_call_id": "1", "content": "2"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template)[0]
    assert out.prompt == 'user:hi;assistant:f{"x": 1}g{};tool:2;'
    assert call["function"]["arguments"] == '{"x": 1}'  # the caller's message is left as it was


def test_openai_format_gives_every_content_as_parts(llm):
    """With chat_template_content_format="openai" vLLM hands the template a str content as one text part too (a
    template that loops over the parts would otherwise loop over the characters and write nothing); a tool result
    stays a str, and an assistant's missing content (a tool call) is empty, "" or no parts, not None."""
    parts_template = ("{% for m in messages %}{{ m['role'] }}:{% if m['content'] is string %}{{ m['content'] }}"
                      "{% else %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %};{% endfor %}")
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=parts_template,
                   chat_template_content_format="openai")[0]
    assert out.prompt == "user:[Hello];assistant:;tool:a\nb;"
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=parts_template,
                   chat_template_content_format="string")[0]
    assert out.prompt == "user:Hello;assistant:;tool:a\nb;"


def test_auto_content_format_follows_the_template(llm):
    """vLLM's "auto" reads the template: one that loops over a message's content gets parts ("openai"), one that
    writes the content as a str gets a str ("string")."""
    parts_template = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    for content in ("Hello", [{"type": "text", "text": "Hello"}]):
        out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False, chat_template=parts_template)
        assert out[0].prompt == "[Hello]"
    # the same through a variable set from messages and a filter, as Gemma's and Llama 4's templates write it
    sliced = ("{% set rest = messages[0:] %}{% for m in rest %}{% for p in m.content | list %}<{{ p.text }}>"
              "{% endfor %}{% endfor %}")
    assert llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, chat_template=sliced)[0].prompt \
        == "<Hi>"
    # a macro given the content that loops over it (Qwen3.5's templates), as vLLM detects it
    macro = ("{% macro render(content) %}{% for p in content %}({{ p.text }}){% endfor %}{% endmacro %}"
             "{% for m in messages %}{{ render(m.content) }}{% endfor %}")
    assert llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False, chat_template=macro)[0].prompt \
        == "(Hi)"


def test_continue_final_message_with_the_generation_prompt_off_in_template_kwargs(llm):
    """The two flags are checked once chat_template_kwargs are merged in: vLLM's LLM.chat updated its arguments with
    chat_template_kwargs and transformers refused only the merged pair."""
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "The answer is"}]
    explicit = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)[0]
    assert explicit.prompt.endswith("The answer is")
    out = llm.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True,
                   chat_template_kwargs={"add_generation_prompt": False})[0]
    assert out.prompt == explicit.prompt
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_kwargs={"continue_final_message": True})
