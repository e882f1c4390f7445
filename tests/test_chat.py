"""LLM.chat: conversations through the tokenizer's chat template, then generate."""
import pytest

from nanovllm import LLM, SamplingParams
from tests.tiny_models import CHAT_TEMPLATE, make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(num_kvcache_blocks=16, kvcache_block_size=16, max_model_len=256)
# The tiny template, plus a variable a caller can set through chat_template_kwargs.
TEMPLATE = "{% if terse %}Be brief.\n{% endif %}" + CHAT_TEMPLATE


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("chat"), "llama", tie=False, seed=1, chat_template=TEMPLATE)
    with LLM(path, **SMALL) as llm:
        yield llm


def _strip(outputs: list[dict]) -> list[dict]:
    """Outputs without num_cached_tokens: a repeated prompt hits the prefix cache."""
    return [{k: v for k, v in o.items() if k != "num_cached_tokens"} for o in outputs]


def _ids(llm, conversation, **kwargs) -> list[int]:
    text = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_one_conversation_equals_generate_on_its_rendering(llm):
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert len(out) == 1 and {"text", "token_ids", "finish_reason"} <= set(out[0])
    assert _strip(out) == _strip(llm.generate([_ids(llm, conversation)], GREEDY, use_tqdm=False))


def test_several_conversations_and_template_kwargs(llm):
    conversations = [[{"role": "user", "content": "Hello world!"}], [{"role": "user", "content": "How are you?"}]]
    out = llm.chat(conversations, GREEDY, use_tqdm=False, chat_template_kwargs={"terse": True})
    rendered = [_ids(llm, c, terse=True) for c in conversations]
    assert rendered[0] != _ids(llm, conversations[0])  # the kwarg reached the template
    assert _strip(out) == _strip(llm.generate(rendered, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("messages", [
    [],
    "Hello",
    [{"role": "user"}],
    [{"role": "user", "content": 3}],
    [["not a dict"]],
    [[{"role": "user", "content": "hi"}], []],
])
def test_malformed_messages(llm, messages):
    with pytest.raises(ValueError, match="role"):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_bad_template_kwargs(llm):
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template_kwargs=["terse"])


def test_model_without_chat_template(tmp_path):
    with LLM(make_checkpoint(tmp_path, "llama"), **SMALL) as llm:
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
