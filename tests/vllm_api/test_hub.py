"""Hugging Face Hub ids, as vLLM takes them: LLM("org/name") and a LoRARequest whose lora_path is an id read the
id's snapshot from the Hugging Face cache (download_dir here), laid out as huggingface_hub lays it out; revision
picks a branch; an id with no snapshot is refused naming it. Nothing here reaches the network: the Hub is put in
offline mode, where huggingface_hub reads its cache only (online it would first ask the Hub for the revision)."""
import os
import pathlib
import shutil

import pytest

from nanovllm import LLM, LoRARequest, SamplingParams
from nanovllm.engine_args import EngineArgs
from tests.tiny_models import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def cache_snapshot(cache, repo_id: str, source: str, commit: str, ref: str = "main") -> str:
    """`source`'s files as the snapshot `commit` of `repo_id` in the Hugging Face cache `cache`, `ref` naming it."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    shutil.copytree(source, snapshot)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", ref), "w") as f:
        f.write(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, qwen3_tied, qwen3_b, lora_attention):
    cache = str(tmp_path_factory.mktemp("hf_cache"))
    cache_snapshot(cache, "nanovllm-test/tiny-qwen3", qwen3_tied, "a" * 40)
    cache_snapshot(cache, "nanovllm-test/tiny-qwen3", qwen3_b, "b" * 40, ref="v2")  # the same repo's branch v2
    cache_snapshot(cache, "nanovllm-test/tiny-lora", lora_attention.lora_path, "c" * 40)
    return cache


def test_a_hub_id_reads_its_snapshot_from_the_cache(hub_cache, qwen3_tied, qwen3_b):
    with LLM("nanovllm-test/tiny-qwen3", download_dir=hub_cache, tokenizer="nanovllm-test/tiny-qwen3",
             kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=128) as llm:
        assert llm.config.model == os.path.join(hub_cache, "models--nanovllm-test--tiny-qwen3", "snapshots", "a" * 40)
        assert llm.llm_engine.model_config.model == "nanovllm-test/tiny-qwen3"  # (vLLM's: the id as given)
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(qwen3_tied,
                                                                                                   PROMPT, 6)
    with LLM("nanovllm-test/tiny-qwen3", download_dir=pathlib.Path(hub_cache), revision="v2", tokenizer_revision="v2",
             kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=128) as llm:
        want = hf_greedy(qwen3_b, PROMPT, 6)
        assert want != hf_greedy(qwen3_tied, PROMPT, 6)
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


def test_data_parallel_replicas_read_the_snapshot(hub_cache, qwen3_b):
    """data_parallel_size=2: the replicas load the snapshot the front resolved, with tokenizer naming the id (vLLM's
    way to say the model's own) and a revision."""
    with LLM("nanovllm-test/tiny-qwen3", download_dir=hub_cache, revision="v2", tokenizer="nanovllm-test/tiny-qwen3",
             data_parallel_size=2, device="cpu", kvcache_block_size=16, num_kvcache_blocks=32,
             max_model_len=128) as llm:
        outs = llm.generate([PROMPT, PROMPT[:3]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(qwen3_b, p, 6) for p in (PROMPT, PROMPT[:3])]


def test_only_what_is_read_is_fetched():
    """Of a repo's files, the download takes the JSON, tokenizer and safetensors files, and not the second copies of
    the weights: Meta's original/ folder, Mistral's consolidated.safetensors (Mistral Small 3.1's repo holds it, 48 GB,
    beside the model-*.safetensors shards its index maps)."""
    from huggingface_hub.utils import filter_repo_objects

    from nanovllm.checkpoint.hub import ALLOW_PATTERNS, IGNORE_PATTERNS
    repo = ["config.json", "generation_config.json", "model.safetensors.index.json", "model-00001-of-00010.safetensors",
            "model-00010-of-00010.safetensors", "consolidated.safetensors", "params.json", "tekken.json",
            "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md", "pytorch_model.bin",
            "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model"]
    assert list(filter_repo_objects(repo, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)) == [
        "config.json", "generation_config.json", "model.safetensors.index.json", "model-00001-of-00010.safetensors",
        "model-00010-of-00010.safetensors", "params.json", "tekken.json", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja"]


def test_engine_args_take_the_hub_options(hub_cache, qwen3_b):
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", "nanovllm-test/tiny-qwen3", "--revision", "v2",
                                                       "--download-dir", hub_cache, "--num-kvcache-blocks", "32",
                                                       "--max-model-len", "128"]))
    assert (args.revision, args.download_dir, args.hf_token) == ("v2", hub_cache, None)
    with args.make_llm() as llm:
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(qwen3_b, PROMPT, 6)


@pytest.mark.parametrize("model, options, match", [
    ("nanovllm-test/absent", {}, r"model 'nanovllm-test/absent' is not a local path, and its Hugging Face Hub "
                                 r"snapshot could not be read.*hf download nanovllm-test/absent"),
    ("nanovllm-test/tiny-qwen3", {"revision": "v9"}, "snapshot at revision 'v9' could not be read"),
    ("/no/such/dir", {}, "model path '/no/such/dir' does not exist; pass a local checkpoint directory"),
    ("nanovllm-test/tiny-qwen3", {"tokenizer_revision": "v2"}, "tokenizer_revision='v2' is not supported"),
])
def test_refused(hub_cache, model, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(model, download_dir=hub_cache, **options)


def test_bad_option_types(hub_cache):
    with pytest.raises(TypeError, match="hf_token must be a str, True or None, got int"):
        LLM("nanovllm-test/tiny-qwen3", download_dir=hub_cache, hf_token=5)
    with pytest.raises(TypeError, match="revision must be a str or None, got int"):
        LLM("nanovllm-test/tiny-qwen3", download_dir=hub_cache, revision=2)


def test_a_mistyped_option_is_refused_before_any_download(monkeypatch):
    """LLM("org/name", max_num_seq=8) raises TypeError naming the option without fetching the snapshot first (a
    model's weights are gigabytes)."""
    import huggingface_hub
    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *args, **kwargs: fetched.append(args))
    with pytest.raises(TypeError, match="unknown option.*max_num_seq;"):
        LLM("nanovllm-test/absent", max_num_seq=8)
    assert fetched == []


def test_a_lora_path_may_be_a_hub_id(hub_cache, qwen3_tied, lora_attention, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hub_cache)  # (the adapter's cache: the default)
    with LLM(qwen3_tied, enable_lora=True, max_loras=2, kvcache_block_size=16, num_kvcache_blocks=32,
             max_model_len=128) as llm:
        local, = llm.generate([PROMPT], GREEDY, lora_request=lora_attention, use_tqdm=False)
        hub, = llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("hub", 2, "nanovllm-test/tiny-lora"),
                            use_tqdm=False)
        assert hub.outputs[0].token_ids == local.outputs[0].token_ids != hf_greedy(qwen3_tied, PROMPT, 6)
        with pytest.raises(ValueError, match="LoRA adapter 'absent' 'nanovllm-test/absent' is not a local path"):
            llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("absent", 3, "nanovllm-test/absent"),
                         use_tqdm=False)
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(qwen3_tied,
                                                                                                   PROMPT, 6)
