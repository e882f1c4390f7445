"""nanovllm.ray: the options checked before any actor starts, the module without Ray, and the Ray Data runs (in
a fresh interpreter: tests/distributed/ray_checks.py)."""
import importlib.util
import os
import subprocess
import sys

import pytest

from nanovllm.ray import build_processor
from tests.tiny_models import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("ray_model"), "qwen3", tie=True)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason='needs pip install "nanovllm[ray]"')
def test_ray_data_on_a_local_cluster():
    cmd = [sys.executable, "-m", "pytest", "tests/distributed/ray_checks.py", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-8000:]}\n{done.stderr[-3000:]}"
    assert "5 passed" in done.stdout


def test_bad_options_fail_before_any_actor(model):
    with pytest.raises(TypeError, match="unknown engine option\\(s\\) max_len; valid options are"):
        build_processor(model, engine_kwargs={"max_len": 10})
    with pytest.raises(TypeError, match="temp"):
        build_processor(model, sampling_params={"temp": 0.5})
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        build_processor(model, sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="concurrency must be an int >= 1"):
        build_processor(model, concurrency=0)
    with pytest.raises(ValueError, match="num_gpus must be >= 0"):
        build_processor(model, num_gpus=float("nan"))
    with pytest.raises(ValueError, match="each replica runs on 2 GPUs .* num_gpus=1 gives it fewer: pass num_gpus=2"):
        build_processor(model, engine_kwargs={"tensor_parallel_size": 2}, num_gpus=1)
    build_processor(model, num_gpus=0.5)  # (two one-GPU actors sharing a GPU, as Ray places them)



def test_vllm_engine_option_names_are_taken_as_llm_takes_them(model):
    """engine_kwargs written for Ray's vLLM processor: vLLM's names map as LLM() maps them (they were refused as
    unknown), and seed=None (vLLM's "no seed") is dropped, so each actor still gets its own seed (with None every
    actor's engine took seed 0 and unseeded rows drew alike on all of them)."""
    proc = build_processor(model, engine_kwargs={"block_size": 16, "enable_chunked_prefill": True,
                                                 "trust_remote_code": True, "seed": None})
    assert proc.engine_kwargs == {"kvcache_block_size": 16, "device": "cpu"}
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported"):
        build_processor(model, engine_kwargs={"pipeline_parallel_size": 2})

def test_without_ray_the_module_imports_and_says_how_to_install(model, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    proc = build_processor(model, engine_kwargs=ENGINE)
    with pytest.raises(ImportError, match='pip install "nanovllm\\[ray\\]"'):
        proc(object())


def test_chat_rows_read_the_content_format_from_the_template(model, tmp_path, monkeypatch):
    """A row's messages are rendered as chat() renders them with chat_template_content_format "auto": a template that
    loops over a message's content gets text parts (a str content looped as characters would write nothing)."""
    import shutil

    from transformers import AutoTokenizer

    import nanovllm.ray as nray
    path = tmp_path / "parts"
    shutil.copytree(model, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    tok.save_pretrained(path)
    monkeypatch.setattr(nray, "_actor_id", lambda: None)  # (built here, outside any Ray actor)
    actor = nray.NanoVLLMActor(str(path), ENGINE, {"max_tokens": 2})
    try:
        prompt = actor._request(0, {"messages": [{"role": "user", "content": "Hello"}]})[0]
        assert prompt["prompt"] == "[Hello]"
        assert actor.llm.chat([{"role": "user", "content": "Hello"}], use_tqdm=False)[0].prompt == "[Hello]"
    finally:
        actor.llm.exit()


def test_an_actor_restarted_with_its_id_draws_afresh(model, monkeypatch):
    """Ray restarts a dead actor with the same actor id: its engine seed must not come from the id alone, or the
    batches it retries draw the samples its first batches drew (unseeded rows repeated)."""
    import nanovllm.ray as nray
    monkeypatch.setattr(nray, "_actor_id", lambda: "8735332d779de3a45570ae6301000000")
    seeds = []
    for _ in range(2):
        actor = nray.NanoVLLMActor(model, ENGINE, {"max_tokens": 2})
        seeds.append(actor.llm.config.seed)
        actor.llm.exit()
    assert seeds[0] != seeds[1]


def test_a_chat_ending_in_the_assistants_message_is_continued(model, tmp_path, monkeypatch):
    """As Ray's ChatTemplateUDF: a row whose messages end in the assistant's (a prefill) continues that message; it
    was closed and a new assistant turn opened, so the model answered after the prefill instead of continuing it."""
    import shutil

    from transformers import AutoTokenizer

    import nanovllm.ray as nray
    from tests.tiny_models import CHAT_TEMPLATE
    path = tmp_path / "chat"
    shutil.copytree(model, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    monkeypatch.setattr(nray, "_actor_id", lambda: None)
    actor = nray.NanoVLLMActor(str(path), ENGINE, {"max_tokens": 2})
    try:
        user = {"role": "user", "content": "Capital of France?"}
        prompt = actor._request(0, {"messages": [user, {"role": "assistant", "content": "The capital is"}]})[0]
        assert prompt["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\nThe capital is")
        prompt = actor._request(0, {"messages": [user]})[0]
        assert prompt["prompt"].endswith("<|im_start|>assistant\n")
    finally:
        actor.llm.exit()


def test_a_rows_model_column_names_its_lora_adapter(model, tmp_path, monkeypatch):
    """Ray's per-row LoRA: a row whose `model` is not the processor's runs under that adapter (it was ignored: the
    row ran on the base model without a word); without enable_lora such a row is refused, named."""
    import pyarrow as pa

    import nanovllm.ray as nray
    from nanovllm import LLM, SamplingParams
    from nanovllm.lora.request import LoRARequest
    from tests.lora.adapters import make_adapter
    adapter = make_adapter(model, tmp_path / "adapter", 8, ["q_proj", "v_proj"])
    monkeypatch.setattr(nray, "_actor_id", lambda: None)
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    rows = pa.Table.from_pylist([{"id": 0, "prompt": "Hello", "model": adapter},
                                 {"id": 1, "prompt": "Hello", "model": model}, {"id": 2, "prompt": "Hello"}])
    engine = {**ENGINE, "enable_lora": True, "max_lora_rank": 8}
    with LLM(model, **engine) as llm:
        want = [llm.generate(["Hello"], SamplingParams(**greedy), use_tqdm=False, lora_request=lora)[0]["token_ids"]
                for lora in (LoRARequest("a", 1, adapter), None)]
    assert want[0] != want[1]
    actor = nray.NanoVLLMActor(model, engine, greedy)
    try:
        assert actor(rows).column("generated_token_ids").to_pylist() == [want[0], want[1], want[1]]
    finally:
        actor.llm.exit()
    actor = nray.NanoVLLMActor(model, ENGINE, greedy)
    try:
        with pytest.raises(ValueError, match="row 0 of its batch \\(id=0\\): its model .* enable_lora=True"):
            actor(rows)
    finally:
        actor.llm.exit()
