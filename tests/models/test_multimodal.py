"""Multimodal checkpoints served as their language model, for text prompts: tiny random
Gemma3ForConditionalGeneration (SigLIP tower; three sliding-window layers to one global) and
Mistral3ForConditionalGeneration (Pixtral tower) checkpoints, saved by transformers, give transformers' own model's
greedy tokens in float32, in both tensor layouts; the vision tower is never read; image tokens in a prompt are
refused; a missing tensor is named; weight updates take the multimodal model's names; LoRA adapters PEFT made on the
multimodal model apply to its language model (the tower's weights skipped), and are refused on a text-only model."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from tests.tiny_models import hf_greedy, hf_model, load_hf_model, make_multimodal_checkpoint, random_prompts

WINDOW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MODELS = {
    # Gemma 3: q/k norms, 16-token windows on layers 0-2, layer 3 global with its own rope base; tied LM head
    "gemma3": dict(arch="gemma3", head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    # Mistral Small's shape: no window, an LM head of its own (config.json: untied at both levels)
    "mistral3": dict(arch="mistral3", tie=False, num_hidden_layers=2),
}
OTHER_PARTS = ("vision_tower.", "multi_modal_projector.")
# transformers 5's module names (model.language_model.*, lm_head.*), from the layout save_pretrained writes
IN_MEMORY = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
             "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory) -> str:
    return make_multimodal_checkpoint(tmp_path_factory.mktemp(request.param), seed=7, **MODELS[request.param])


def renamed(path: str, target, rename: dict[str, str], drop: tuple[str, ...] = (),
            file: str = "model.safetensors") -> str:
    """A copy of checkpoint (or adapter) `path` with its tensors' name prefixes replaced by `rename` and `drop` (the
    new names) left out."""
    target = shutil.copytree(path, target)
    out = {}
    for name, tensor in load_file(os.path.join(path, file)).items():
        prefix = next((p for p in rename if name.startswith(p)), None)
        out[name if prefix is None else rename[prefix] + name[len(prefix):]] = tensor
    save_file({k: v for k, v in out.items() if k not in drop}, os.path.join(target, file))
    return os.fspath(target)


def check(llm: LLM, reference: str, batch: list[list[int]]):
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        assert out["token_ids"] == hf_greedy(reference, prompt, GREEDY.max_tokens), len(prompt)


def test_language_model_gives_transformers_tokens(model, monkeypatch):
    """Prompts past the window, prefilled in 24-token chunks, two sharing a 40-token prefix (a prefix-cache hit):
    transformers' multimodal model's greedy tokens on text-only prompts. The loader reads every language-model tensor
    and none of the vision tower's or the projector's."""
    import safetensors
    names = load_file(os.path.join(model, "model.safetensors"))
    assert any(n.startswith(OTHER_PARTS) for n in names) and any(n.startswith("language_model.") for n in names)
    assert not any(n.startswith("model.") for n in names)  # (transformers 5.25 saves the original layout)
    read = []
    opened = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = opened(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    shared = random_prompts(2, [40])[0]
    batch = random_prompts(1, [3, 40, 97]) + [shared + p for p in random_prompts(3, [5, 30])]
    with LLM(model, kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=24,
             enable_chunked_prefill=True) as llm:
        monkeypatch.undo()
        assert llm.config.hf_config.architectures == [json.load(open(os.path.join(model, "config.json")))
                                                       ["architectures"][0]]
        check(llm, model, batch[:4])
        outs = llm.generate(batch[4:], GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens >= 32
    assert outs[0]["token_ids"] == hf_greedy(model, batch[4], GREEDY.max_tokens)
    assert sorted(read) == sorted(n for n in names if n.startswith("language_model.")
                                  and not (n.endswith("lm_head.weight") and llm.config.hf_config.tie_word_embeddings))


def test_transformers_module_names_load_the_same(model, tmp_path):
    """The layout of transformers 5's modules (model.language_model.*, lm_head.weight, model.vision_tower.*), as some
    uploads and any state_dict name the tensors: the same tokens."""
    other = renamed(model, tmp_path / "renamed", IN_MEMORY)
    assert set(load_file(os.path.join(other, "model.safetensors"))) >= \
        set(n for n in load_hf_model(model).state_dict() if not n.endswith("lm_head.weight"))
    with LLM(other, kvcache_block_size=16, max_model_len=256) as llm:
        check(llm, model, random_prompts(4, [7, 60]))


def test_image_tokens_are_refused_and_the_engine_serves_on(model):
    """A prompt holding a token that stands for an image (the image token; Gemma's begin-of-image token) needs the
    vision tower: refused when submitted, naming the config field; the next request is served. Chat image parts are
    refused too. vLLM's text-only setting, limit_mm_per_prompt={"image": 0}, is taken; a limit above 0 is not."""
    config = json.load(open(os.path.join(model, "config.json")))
    fields = ["image_token_index"] + (["boi_token_index"] if "boi_token_index" in config else [])
    with pytest.raises(ValueError, match="limit_mm_per_prompt=.* is not supported: nanovllm serves text prompts only"):
        LLM(model, limit_mm_per_prompt={"image": 1})
    with LLM(model, kvcache_block_size=16, max_model_len=256, limit_mm_per_prompt={"image": 0}) as llm:
        for field in fields:
            token = config[field]
            for prompt in ([5, token, 6], {"prompt_token_ids": [token]}):
                with pytest.raises(ValueError, match=f"prompt holds token id {token}, this multimodal checkpoint's "
                                                     f"{field} .* without the vision tower"):
                    llm.generate([[5, 6, 7], prompt], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="unsupported content part"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}],
                     chat_template="{{ messages }}")
        # (Gemma's end-of-image token alone is an ordinary token)
        check(llm, model, [[5, 6, 7], [9, config.get("eoi_token_index", 8), 3]])


def test_tensor_and_data_parallel_engines(tmp_path):
    """TP=2 (gloo): each rank loads its shards under the multimodal names; DP=2: the replicas serve the language model
    and the front refuses an image token."""
    path = make_multimodal_checkpoint(tmp_path / "gemma3", seed=7, **MODELS["gemma3"])
    batch = random_prompts(7, [40, 9])
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        check(llm, path, batch)
    token = json.load(open(os.path.join(path, "config.json")))["image_token_index"]
    with LLM(path, data_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        with pytest.raises(ValueError, match=f"prompt holds token id {token}"):
            llm.generate([[4, token]], GREEDY, use_tqdm=False)
        check(llm, path, batch)


def test_a_missing_language_model_tensor_is_named(model, tmp_path):
    """In either layout, a missing tensor of the language model is refused under the checkpoint's name for it; one of
    the vision tower missing is nothing to the language model."""
    layer = "layers.1.mlp.down_proj.weight"
    cases = [(renamed(model, tmp_path / "original", {}, drop=(f"language_model.model.{layer}",)),
              f"language_model.model.{layer}"),
             (renamed(model, tmp_path / "in_memory", IN_MEMORY, drop=(f"model.language_model.{layer}",)),
              f"model.language_model.{layer}")]
    for path, name in cases:
        with pytest.raises(ValueError, match=f"lacks weights for: {name}$"):
            LLM(path, kvcache_block_size=16, max_model_len=256)
    vision = next(n for n in load_file(os.path.join(model, "model.safetensors")) if n.startswith("vision_tower."))
    with LLM(renamed(model, tmp_path / "no_vision", {}, drop=(vision,)), kvcache_block_size=16,
             max_model_len=256) as llm:
        check(llm, model, random_prompts(5, [20]))


def test_mistral3_lm_head_missing_and_tied_only_at_the_top_level(tmp_path):
    """transformers' Mistral3Config ties at the top level by default while its text_config (Mistral Small's) says
    untied: nanovllm unties where either says so, so such a checkpoint without an LM head of its own is refused naming
    it, never run on the embedding."""
    path = make_multimodal_checkpoint(tmp_path / "tied_top", arch="mistral3", tie=True, num_hidden_layers=2)
    assert not any("lm_head" in n for n in load_file(os.path.join(path, "model.safetensors")))
    with pytest.raises(ValueError, match="lacks weights for: lm_head.weight"):
        LLM(path, kvcache_block_size=16, max_model_len=256)


def test_update_weights_with_the_multimodal_models_names(model, tmp_path):
    """update_weights takes transformers' multimodal model's state_dict (model.language_model.*, the vision tower's
    skipped) and a multimodal checkpoint directory; after sleep(level=2), every language-model weight is required and
    given by the state_dict. A name that is no part of the language model is refused."""
    arch = json.load(open(os.path.join(model, "config.json")))["model_type"]
    other = make_multimodal_checkpoint(tmp_path / "other", seed=8, **MODELS[arch])
    batch = random_prompts(6, [4, 50])
    with LLM(model, kvcache_block_size=16, max_model_len=256) as llm:
        state = hf_model(other).state_dict()
        assert any(n.startswith("model.vision_tower.") for n in state)
        llm.update_weights(state)
        check(llm, other, batch)
        llm.update_weights(model)  # (a directory: language_model.model.*, the vision tower's unread)
        check(llm, model, batch)
        llm.sleep(level=2)
        with pytest.raises(ValueError, match="lacks weights for: model.language_model.layers.0"):
            llm.update_weights({n: t for n, t in state.items() if ".layers.0." not in n})
        llm.update_weights(state)
        llm.wake_up(["kv_cache"])
        check(llm, other, batch)
        with pytest.raises(ValueError, match="'model.language_model.layers.0.extra.weight' matches no parameter"):
            llm.update_weights({"model.language_model.layers.0.extra.weight": torch.zeros(2)})


def test_fp8_language_models(tmp_path):
    """A compressed-tensors FP8 checkpoint of the multimodal model (its vision tower quantized too, and skipped) whose
    ignore list names one language-model layer as the checkpoint does (language_model.model.layers.0.mlp.down_proj,
    stored float32) gives transformers' tokens on the dequantized weights; quantization="fp8" quantizes the language
    model at load as it does a text model."""
    from tests.quantization.checkpoints import CT_CONFIG, edit_config, edit_tensors, make_fp8
    base = make_multimodal_checkpoint(tmp_path / "base", seed=7, **MODELS["gemma3"])
    fp8, reference = make_fp8(base, tmp_path / "fp8", "compressed-tensors", tmp_path / "reference")
    batch = random_prompts(9, [5, 40])
    with LLM(base, quantization="fp8", kvcache_block_size=16, max_model_len=256) as llm:
        check(llm, reference, batch)
    kept = "language_model.model.layers.0.mlp.down_proj"
    weight = load_file(os.path.join(base, "model.safetensors"))[f"{kept}.weight"]
    edit_tensors(fp8, drop=(f"{kept}.weight_scale",), replace={f"{kept}.weight": weight})
    reference = os.fspath(shutil.copytree(reference, tmp_path / "reference_kept"))  # (hf_greedy caches by path)
    edit_tensors(reference, replace={f"{kept}.weight": weight})
    edit_config(fp8, quantization_config={**CT_CONFIG, "ignore": ["lm_head", "re:vision_tower.*",
                                                                  "re:multi_modal_projector.*", kept]})
    with LLM(fp8, kvcache_block_size=16, max_model_len=256) as llm:
        assert llm.config.quant is not None
        check(llm, reference, batch)
    assert any(hf_greedy(base, p, GREEDY.max_tokens) != hf_greedy(reference, p, GREEDY.max_tokens) for p in batch)


# An adapter PEFT made on the multimodal model names its modules under the multimodal module tree; transformers
# before 4.52 had another one (the language model a ...ForCausalLM of its own, the vision tower at the top)
OLDER_TREE = {"base_model.model.model.language_model.": "base_model.model.language_model.model.",
              "base_model.model.model.vision_tower.": "base_model.model.vision_tower.",
              "base_model.model.model.multi_modal_projector.": "base_model.model.multi_modal_projector."}
TEXT_MODEL = {"base_model.model.model.language_model.": "base_model.model.model."}
LORA_WEIGHTS = "adapter_model.safetensors"


def tower_weights(adapter: str) -> list[str]:
    return [n for n in load_file(os.path.join(adapter, LORA_WEIGHTS)) if ".vision_tower." in n
            or ".multi_modal_projector." in n]


def test_lora_adapters_made_on_the_multimodal_model(model, tmp_path, caplog):
    """Adapters PEFT made on the multimodal model (the usual fine-tune of gemma-3-4b-it) name the language model's
    layers model.language_model.layers.<n>, and the vision tower's (and Mistral's projector's) modules where
    target_modules reach them: targets of the attention and the MLP, and "all-linear". Each gives transformers +
    PEFT's greedy tokens on text prompts (PeftModel on the ...ForConditionalGeneration, float32), its tower's and
    projector's weights skipped, with one log line per adapter saying how many. The older module tree's names
    (language_model.model.layers.<n>) and the text model's (model.layers.<n>) give the same tokens. An adapter of the
    tower alone, or one naming its layers two ways, is refused."""
    pytest.importorskip("peft")
    import logging

    from nanovllm import LoRARequest
    from tests.lora.adapters import make_adapter, peft_greedy
    arch = json.load(open(os.path.join(model, "config.json")))["model_type"]
    targets = make_adapter(model, tmp_path / "targets", 4, ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"],
                           scale=3.0)
    everything = make_adapter(model, tmp_path / "all_linear", 8, "all-linear", scale=3.0, seed=1)
    assert all(tower_weights(a) for a in (targets, everything))
    if arch == "mistral3":  # (Gemma 3's projector is a bare matrix, no linear layer: PEFT reaches none of it)
        assert any(".multi_modal_projector." in n for n in tower_weights(everything))
    older = renamed(everything, tmp_path / "older", OLDER_TREE, file=LORA_WEIGHTS)
    text = renamed(targets, tmp_path / "text", TEXT_MODEL, drop=tuple(tower_weights(targets)), file=LORA_WEIGHTS)
    assert not tower_weights(text)
    # (name, adapter, the adapter whose PEFT tokens it must give)
    cases = [("targets", targets, targets), ("all", everything, everything), ("older", older, everything),
             ("text", text, targets)]
    requests = [LoRARequest(name, i + 1, path) for i, (name, path, _) in enumerate(cases)]
    batch = random_prompts(10, [6, 40])
    caplog.set_level(logging.INFO, logger="nanovllm")
    with LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8, kvcache_block_size=16, max_model_len=256) as llm:
        outs = llm.generate(batch * len(cases), GREEDY, lora_request=[r for r in requests for _ in batch],
                            use_tqdm=False)
        tower_only = make_adapter(model, tmp_path / "tower_only", 4,
                                  ["fc1", "fc2"] if arch == "gemma3" else ["linear_1", "linear_2"])
        mixed = renamed(targets, tmp_path / "mixed", {"base_model.model.model.language_model.layers.0.":
                                                      "base_model.model.model.layers.0."}, file=LORA_WEIGHTS)
        for path, message in [(tower_only, "holds LoRA weights of the vision tower and the multimodal projector only"),
                              (mixed, "names decoder layers both as base_model.model.model.layers.<n> and as "
                                      "base_model.model.model.language_model.layers.<n>")]:
            with pytest.raises(ValueError, match=message):
                llm.generate(batch, GREEDY, lora_request=LoRARequest("bad", 9, path), use_tqdm=False)
        assert llm.generate(batch[:1], GREEDY, use_tqdm=False)[0]["token_ids"] == \
            hf_greedy(model, batch[0], GREEDY.max_tokens)
    for i, (name, path, reference) in enumerate(cases):
        wants = [peft_greedy(model, reference, prompt, GREEDY.max_tokens) for prompt in batch]
        assert [out["token_ids"] for out in outs[i * len(batch):(i + 1) * len(batch)]] == wants, name
        assert any(want != hf_greedy(model, prompt, GREEDY.max_tokens) for prompt, want in zip(batch, wants)), name
        logged = [r.getMessage() for r in caplog.records if f"LoRA adapter {name!r}" in r.getMessage()]
        skipped = len(tower_weights(path))
        assert logged == ([f"LoRA adapter {name!r} ({path}): {skipped} LoRA weights of the vision tower and the "
                           f"multimodal projector skipped ({skipped // 2} modules): nanovllm serves this checkpoint's "
                           "language model for text prompts, where the tower never runs, so they change nothing"]
                          if skipped else []), name


def test_multimodal_lora_adapters_are_refused_on_a_text_only_model(tmp_path):
    """An adapter PEFT made on the multimodal Gemma 3, on a text-only Gemma 3 (Gemma3ForCausalLM) with the language
    model's shapes: refused naming a weight as a multimodal model's, whichever part it names; the engine serves on."""
    pytest.importorskip("peft")
    from nanovllm import LoRARequest
    from tests.lora.adapters import make_adapter
    from tests.tiny_models import make_checkpoint
    base = make_multimodal_checkpoint(tmp_path / "base", seed=7, **MODELS["gemma3"])
    text_base = make_checkpoint(tmp_path / "text_base", "gemma3", layers=4, seed=7,
                                **{k: v for k, v in MODELS["gemma3"].items() if k != "arch"})
    adapter = make_adapter(base, tmp_path / "lora", 4, "all-linear", scale=3.0)
    tower = renamed(adapter, tmp_path / "tower", {}, drop=tuple(n for n in load_file(os.path.join(
        adapter, LORA_WEIGHTS)) if ".language_model." in n), file=LORA_WEIGHTS)
    older = renamed(adapter, tmp_path / "older", OLDER_TREE, file=LORA_WEIGHTS)
    batch = random_prompts(11, [6, 30])
    with LLM(text_base, enable_lora=True, kvcache_block_size=16, max_model_len=256) as llm:
        for i, (path, key, part) in enumerate([
                (adapter, r"base_model\.model\.model\.language_model\.layers\.0\.", "language model"),
                (older, r"base_model\.model\.language_model\.model\.layers\.0\.", "language model"),
                (tower, r"base_model\.model\.model\.vision_tower\.", "vision tower")]):
            with pytest.raises(ValueError, match=f"weight '{key}.*' is a multimodal model's \\(its {part}, as PEFT "
                                                 r"names the modules of a \.\.\.ForConditionalGeneration\), but this "
                                                 r"base model \(Gemma3ForCausalLM\) is text-only: serve the multimodal "
                                                 "checkpoint the adapter was made on"):
                llm.generate(batch, GREEDY, lora_request=LoRARequest("mm", i + 1, path), use_tqdm=False)
        check(llm, text_base, batch)


def test_the_language_model_config():
    """What the engine reads of a multimodal config: the text_config, naming the multimodal architecture, with the top
    level's quantization config and dtype where it has none, its EOS ids first, and untied where either level says
    so; the image tokens; a text_config of another family, and other multimodal architectures, refused."""
    from transformers import Gemma3Config, LlavaConfig, Mistral3Config

    from nanovllm.models import check_model_config, language_model_config
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, num_hidden_layers=2)
    gemma = Gemma3Config(text_config=small, architectures=["Gemma3ForConditionalGeneration"], dtype="bfloat16",
                         eos_token_id=[1, 106], quantization_config=quant, boi_token_index=60, image_token_index=62)
    text, images = language_model_config(gemma)
    assert text is not gemma.text_config and gemma.text_config.architectures is None
    assert (text.architectures, text.dtype, text.quantization_config, text.eos_token_id, text.tie_word_embeddings) == \
        (["Gemma3ForConditionalGeneration"], torch.bfloat16, quant, [1, 106], True)
    assert images == {62: "image_token_index", 60: "boi_token_index"}
    assert check_model_config(text) == [gemma.text_config.sliding_window]
    gemma.tie_word_embeddings = False
    assert language_model_config(gemma)[0].tie_word_embeddings is False
    mistral = Mistral3Config(text_config={"model_type": "mistral", **small},
                             architectures=["Mistral3ForConditionalGeneration"])
    text, images = language_model_config(mistral)
    assert (mistral.tie_word_embeddings, text.tie_word_embeddings, images) == (True, False, {10: "image_token_index"})
    mistral.text_config.model_type = "ministral3"
    with pytest.raises(ValueError, match="text_config has model_type 'ministral3': nanovllm serves its language "
                                         "model for text_config model_type 'mistral' only"):
        language_model_config(mistral)
    llava = LlavaConfig(text_config={"model_type": "llama", **small}, architectures=["LlavaForConditionalGeneration"])
    assert language_model_config(llava) == (llava, {})
    with pytest.raises(ValueError, match="nests a text_config, as a multimodal checkpoint's does: nanovllm serves the "
                                         "language model of Gemma3ForConditionalGeneration and "
                                         "Mistral3ForConditionalGeneration checkpoints"):
        check_model_config(llava)
