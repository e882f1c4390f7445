"""GGUF loading: tiny Llama GGUF files written with gguf's GGUFWriter, compared with transformers on the same file."""
import os
import shutil

import pytest

pytest.importorskip("gguf", reason="GGUF tests need the gguf package: pip install gguf")

from safetensors.torch import load_file  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.checkpoint import gguf as nv_gguf  # noqa: E402
from nanovllm.checkpoint.loader import load_hf_config  # noqa: E402
from tests.tiny_models import CHAT_TEMPLATE, hf_greedy, make_checkpoint, make_gguf  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [40, 41, 200, 17, 3, 99, 120, 7, 7, 250, 31, 64, 11, 180, 90, 2, 77, 300, 150, 45]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = dict(num_kvcache_blocks=16, kvcache_block_size=16, max_model_len=256)


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch) -> str:
    cache = str(tmp_path / "nanovllm-cache")
    monkeypatch.setenv("NANOVLLM_CACHE", cache)
    return cache


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[str, str]:
    """(checkpoint dir, gguf file) of one untied tiny Llama with grouped-query attention."""
    folder = tmp_path_factory.mktemp("gguf_llama")
    checkpoint = make_checkpoint(folder / "hf", "llama", tie=False, seed=1)
    return checkpoint, make_gguf(checkpoint, folder / "tiny-llama.gguf")


VARIANTS = {"tied": dict(arch="llama", tie=True), "head_dim_32": dict(arch="llama", tie=False, head_dim=32),
            "qwen2_bias": dict(arch="qwen2", tie=False)}  # Qwen2: biases, and no q/k permutation in the file


@pytest.mark.parametrize("variant", ["untied", *VARIANTS])
def test_greedy_matches_transformers_on_same_gguf(tmp_path, tiny_llama, variant):
    if variant == "untied":
        path = tiny_llama[1]
    else:
        path = make_gguf(make_checkpoint(tmp_path / "hf", **VARIANTS[variant]), tmp_path / f"{variant}.gguf")
    with LLM(path, **SMALL) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, GREEDY.max_tokens)


def test_conversion_restores_the_original_weights(tiny_llama):
    """llama.cpp's q/k row permutation is undone: the converted tensors are the checkpoint's, bit for bit."""
    checkpoint, path = tiny_llama
    converted = load_file(os.path.join(nv_gguf.gguf_checkpoint_dir(path), "model.safetensors"))
    original = load_file(os.path.join(checkpoint, "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert converted[name].equal(tensor.float()), name


def test_tokenizer_and_chat_template_come_from_the_gguf(tiny_llama):
    from transformers import AutoTokenizer
    path = tiny_llama[1]
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    with LLM(path, **SMALL) as llm:
        assert llm.tokenizer.chat_template == CHAT_TEMPLATE
        text = "Hello world! The capital of France is Paris. café 東京"
        assert llm.tokenizer.encode(text) == reference.encode(text)
        assert llm.config.eos_token_ids == [reference.eos_token_id]
        conversation = [{"role": "user", "content": "Hello world!"}]
        out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    ids = reference.encode(reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)
    assert out["token_ids"] == hf_greedy(path, ids, GREEDY.max_tokens)


def test_cache_is_reused_and_refreshed(tiny_llama, gguf_cache, monkeypatch, tmp_path):
    path = shutil.copy(tiny_llama[1], tmp_path / "copy.gguf")
    first = nv_gguf.gguf_checkpoint_dir(path)
    assert first.startswith(gguf_cache)

    def fail(*args):
        raise AssertionError("converted again although the cache is valid")
    monkeypatch.setattr(nv_gguf, "convert_gguf", fail)
    with LLM(path, **SMALL) as llm:  # config, tokenizer and weights all come from the cache
        cached = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    monkeypatch.setenv("NANOVLLM_CACHE", gguf_cache)

    os.utime(path, ns=(0, 1_000_000_000))  # a changed file converts again, and its stale entry goes
    second = nv_gguf.gguf_checkpoint_dir(path)
    assert second != first and os.path.isdir(second) and not os.path.exists(first)
    assert [n for n in os.listdir(os.path.dirname(second)) if n.startswith(".")] == []  # no leftovers
    with LLM(path, **SMALL) as llm:
        assert llm.generate(PROMPTS, GREEDY, use_tqdm=False) == cached


def test_one_cache_entry_for_the_same_file_in_two_places(tiny_llama, gguf_cache, tmp_path):
    """The bundled model installed in two virtual environments is one file at two paths: one conversion, one entry
    (538 MB each for SmolLM2 in float32). Another file of the same name is converted on its own."""
    first, second = tmp_path / "venv1" / "tiny.gguf", tmp_path / "venv2" / "tiny.gguf"
    for copy in (first, second):
        copy.parent.mkdir()
        shutil.copy2(tiny_llama[1], copy)  # (pip keeps a wheel's file times: copy2 does too)
    entry = nv_gguf.gguf_checkpoint_dir(str(first))
    assert nv_gguf.gguf_checkpoint_dir(str(second)) == entry and len(os.listdir(os.path.dirname(entry))) == 1
    with open(second, "r+b") as f:  # the same name, size and time, other bytes in its last MiB
        f.seek(-8, os.SEEK_END)
        f.write(b"\0" * 8)
    os.utime(second, ns=(os.stat(first).st_atime_ns, os.stat(first).st_mtime_ns))
    assert nv_gguf.gguf_checkpoint_dir(str(second)) != entry


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(missing)
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_config(missing)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(path))


def test_truncated_gguf_file(tiny_llama, gguf_cache, tmp_path):
    with open(tiny_llama[1], "rb") as f:
        data = f.read()
    for cut in (200, len(data) // 2, len(data) - 64):  # inside the metadata, the tensors, the last tensor
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="corrupt or truncated"):
            LLM(str(path))
    root = os.path.join(gguf_cache, "gguf")
    assert not os.path.exists(root) or os.listdir(root) == []  # nothing half-written is left to be reused


@pytest.mark.parametrize("arch,hint", [("gpt2", ""), ("gemma3", " (load Gemma from its Hugging Face checkpoint "
                                                                   "directory)")])
def test_unsupported_gguf_architecture(tmp_path, arch, hint):
    import gguf
    path = str(tmp_path / f"{arch}.gguf")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as err:
        LLM(path)
    assert f"'{arch}' is not supported{hint}; supported: llama, qwen2, qwen3" in str(err.value)


def _metadata_only_gguf(path, skip: tuple[str, ...] = (), **extra) -> str:
    """A Llama GGUF file of model metadata only (no tokenizer, no tensors): enough to reach the config checks.
    skip: GGUFWriter add_* methods not to call; extra: more add_* calls, by method name."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    fields = dict(add_block_count=2, add_context_length=256, add_embedding_length=64, add_feed_forward_length=128,
                  add_head_count=4, add_head_count_kv=2, add_rope_dimension_count=16, add_vocab_size=400, **extra)
    for method, value in fields.items():
        if method not in skip:
            getattr(writer, method)(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("skip, missing", [
    (("add_feed_forward_length", "add_context_length"), "intermediate_size, max_position_embeddings"),
    (("add_embedding_length",), "hidden_size"),
    (("add_embedding_length", "add_rope_dimension_count"), "hidden_size, head_dim"),
])
def test_gguf_without_required_metadata(tmp_path, skip, missing):
    path = _metadata_only_gguf(tmp_path / "incomplete.gguf", skip=skip)
    with pytest.raises(ValueError, match=f"lacks metadata for {missing}; is it a complete llama model file"):
        LLM(path)


def test_gguf_with_rope_scaling_is_refused(tmp_path):
    import gguf
    path = _metadata_only_gguf(tmp_path / "scaled.gguf", add_rope_scaling_type=gguf.RopeScalingType.LINEAR)
    with pytest.raises(ValueError, match="rope scaling 'linear' is not supported"):
        LLM(path)


def test_gguf_tensor_with_no_place_in_the_model(tiny_llama, gguf_cache, tmp_path):
    import numpy as np
    path = make_gguf(tiny_llama[0], tmp_path / "extra.gguf",
                     extra_tensors={"blk.0.attn_extra.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.attn_extra.weight' has no place"):
        LLM(path)
    assert os.listdir(os.path.join(gguf_cache, "gguf")) == []  # no half-converted entry is left to be reused


def test_a_converted_tokenizer_loads_without_autotokenizer(tiny_llama, monkeypatch):
    # The conversion records which class AutoTokenizer builds from the files it wrote; later loads name that class
    # (a generic one) instead of importing AutoTokenizer's registry: the same tokenizer, faster.
    import json

    from transformers import AutoTokenizer

    from nanovllm.checkpoint import loader
    path = tiny_llama[1]
    directory = nv_gguf.gguf_checkpoint_dir(path)
    reference = AutoTokenizer.from_pretrained(directory)
    assert nv_gguf.recorded_tokenizer_class(directory) == type(reference).__name__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("AutoTokenizer was used"))
    tokenizer = loader.load_tokenizer(path)
    assert type(tokenizer) is type(reference) and tokenizer.chat_template == reference.chat_template
    text = "Hello world! The capital of France is Paris. café 東京"
    assert tokenizer.encode(text) == reference.encode(text) and tokenizer.decode(reference.encode(text)) == text
    assert tokenizer.all_special_tokens == reference.all_special_tokens
    assert tokenizer.eos_token_id == reference.eos_token_id and tokenizer.bos_token_id == reference.bos_token_id
    # a record from another transformers version, or naming a class that is not generic: AutoTokenizer decides
    record = os.path.join(directory, nv_gguf.TOKENIZER_RECORD)
    with open(record) as f:
        saved = json.load(f)
    for changed in ({**saved, "transformers": "0.0"}, {**saved, "tokenizer_class": "LlamaTokenizer"}):
        with open(record, "w") as f:
            json.dump(changed, f)
        assert nv_gguf.recorded_tokenizer_class(directory) is None
    with open(record, "w") as f:
        json.dump(saved, f)
