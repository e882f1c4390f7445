"""Model families: greedy tokens equal transformers in float32 for every registered architecture."""
import json
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.tiny_models import hf_greedy, make_checkpoint

PROMPTS = [[5, 6, 7, 8], [40, 41, 200, 17, 3, 99, 120, 7, 7, 250, 31, 64, 11, 180, 90, 2, 77, 300, 150, 45]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # Qwen's long-context setting

# name -> make_checkpoint arguments
FAMILIES = {
    "qwen2_untied_bias": dict(arch="qwen2", tie=False),  # make_checkpoint gives the q/k/v biases nonzero values
    "qwen2_tied_mha": dict(arch="qwen2", tie=True, num_kv_heads=4),
    "llama_tied": dict(arch="llama", tie=True),
    "llama_untied": dict(arch="llama", tie=False, seed=1),
    "llama_head_dim_32": dict(arch="llama", tie=False, head_dim=32),  # 4 heads x 32 != hidden 64
    "llama_biases": dict(arch="llama", tie=False, attention_bias=True, mlp_bias=True),
    "llama3_rope_scaling": dict(arch="llama", tie=False, rope_scaling=LLAMA3_ROPE),
    "qwen3_yarn": dict(arch="qwen3", tie=False, rope_scaling=YARN_ROPE),
    "llama_yarn_mscale": dict(arch="llama", tie=False, rope_scaling={**YARN_ROPE, "mscale": 2.0,
                                                                      "mscale_all_dim": 1.0, "beta_fast": 16}),
    "mistral": dict(arch="mistral", tie=False, sliding_window=None),
    "mistral_window_4096": dict(arch="mistral", tie=False, num_kv_heads=1),  # MistralConfig's default window
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers(tmp_path_factory, name):
    path = make_checkpoint(tmp_path_factory.mktemp(name), **FAMILIES[name])
    with LLM(path, num_kvcache_blocks=16, kvcache_block_size=16, max_model_len=256) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, GREEDY.max_tokens), name


def test_llama3_rope_frequencies_match_transformers(tmp_path):
    """The scaled cos/sin tables themselves, so a scaling bug cannot hide behind short prompts."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    from nanovllm.models.decoder import head_dim_of, rope_settings
    config = AutoConfig.from_pretrained(make_checkpoint(tmp_path, "llama", rope_scaling=LLAMA3_ROPE, head_dim=32))
    theta, scaling = rope_settings(config)
    assert scaling["rope_type"] == "llama3"
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = RotaryEmbedding(head_dim_of(config), 512, theta, scaling).cos_sin_cache
    freqs = torch.outer(torch.arange(512, dtype=torch.float), inv_freq.float())
    torch.testing.assert_close(ours, torch.cat([freqs.cos(), freqs.sin()], -1), rtol=1e-5, atol=1e-5)
    plain = RotaryEmbedding(head_dim_of(config), 512, theta, None).cos_sin_cache
    assert not torch.allclose(ours, plain), "the test scaling should change the frequencies"


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 0.8}, {"beta_fast": 8, "beta_slow": 2},
                                   {"truncate": False}, {"mscale": 1.5, "mscale_all_dim": 0.5}, {"factor": 1.0}])
def test_yarn_rope_tables_match_transformers(tmp_path, extra):
    """YaRN's frequencies and the attention factor its cos/sin carry, against transformers' own, for each of the
    settings it reads."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    from nanovllm.models.decoder import head_dim_of, rope_settings
    config = AutoConfig.from_pretrained(make_checkpoint(tmp_path, "qwen3", head_dim=32, rope_theta=1e6,
                                                        rope_scaling={**YARN_ROPE, **extra}))
    theta, scaling = rope_settings(config)
    assert (theta, scaling["rope_type"]) == (1e6, "yarn")
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = RotaryEmbedding(head_dim_of(config), 512, theta, scaling).cos_sin_cache
    freqs = torch.outer(torch.arange(512, dtype=torch.float), inv_freq.float())
    torch.testing.assert_close(ours, torch.cat([freqs.cos(), freqs.sin()], -1) * attention, rtol=1e-5, atol=1e-5)
    if scaling["factor"] > 1:
        plain = RotaryEmbedding(head_dim_of(config), 512, theta, None).cos_sin_cache
        assert not torch.allclose(ours, plain), "the test scaling should change the table"


# (architecture, max_position_embeddings, rope_scaling, how a too-long prompt's error names the limit): 128 each
SCALED_CONTEXTS = {
    "linear": ("llama", 64, {"rope_type": "linear", "factor": 2.0},
               "max_position_embeddings=64 x its linear rope factor, 128"),
    "yarn": ("qwen3", 80, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
             "YaRN context, original_max_position_embeddings=64 x factor 2 = 128"),
}


@pytest.mark.parametrize("kind", list(SCALED_CONTEXTS))
def test_rope_scaling_stretches_the_context(tmp_path, kind):
    """The context vLLM reckons for scaled rope: linear scaling divides positions by its factor, so it is
    max_position_embeddings times the factor; YaRN's is the original context times its factor (Qwen's cards:
    32,768 x 4 = 131,072, past max_position_embeddings 40,960). A prompt past max_position_embeddings runs, with
    transformers' tokens; one past the context is refused, naming it."""
    arch, max_pos, scaling, limit = SCALED_CONTEXTS[kind]
    path = make_checkpoint(tmp_path, arch, tie=False, max_position_embeddings=max_pos, rope_scaling=scaling)
    prompt = list(range(3, 103))  # 100 tokens: past max_position_embeddings, within 128
    with LLM(path, max_model_len=None, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        assert llm.llm_engine.model_config.max_model_len == 128
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert out[0]["token_ids"] == hf_greedy(path, prompt, 8)
    with LLM(path, max_model_len=4096, kvcache_block_size=16, num_kvcache_blocks=32) as llm:
        with pytest.raises(ValueError, match=f"capped at this model's {limit}"):
            llm.generate([list(range(3, 203))], use_tqdm=False)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 2.0,
                                             "original_max_position_embeddings": 64}])
def test_rotary_on_part_of_each_head_is_refused(tmp_path, scaling):
    """partial_rotary_factor < 1 (vLLM's get_rope rotates only that part of each head; transformers' Qwen3 and Llama
    rotate the whole head without scaling and fail with it) is refused, in config.json or as an override, where it was
    ignored: the whole head rotated without a word."""
    path = make_checkpoint(tmp_path, "qwen3", tie=False, rope_theta=1e6,
                           **({"rope_scaling": scaling} if scaling else {}))
    options = dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=32)
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5"):
        LLM(path, hf_overrides={"partial_rotary_factor": 0.5}, **options)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["rope_parameters"]["partial_rotary_factor"] = 0.5
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5"):
        LLM(path, **options)


def test_a_layout_copy_on_the_meta_device_skips_the_rotary_tables():
    # check_weights builds the model on the meta device for its names and shapes: the rotary cache there is an empty
    # meta tensor of the real shape (computing it went through torch._refs: 2.3 s of a first update_weights)
    from nanovllm.engine.model_runner import _default_dtype
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    with torch.device("meta"), _default_dtype(torch.bfloat16):  # as ModelRunner builds a layout copy
        meta = RotaryEmbedding(16, 64, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    real = RotaryEmbedding(16, 64, 10000.0)
    assert meta.cos_sin_cache.is_meta and meta.cos_sin_cache.shape == real.cos_sin_cache.shape == (64, 16)
    assert meta.cos_sin_cache.dtype == real.cos_sin_cache.dtype == torch.float32
    with pytest.raises(ValueError, match="rope scaling type 'dynamic' is not supported"), torch.device("meta"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_eos_list_in_generation_config_stops(tmp_path):
    path = make_checkpoint(tmp_path, "llama", tie=False, seed=1)
    prompt = PROMPTS[1]
    reference = hf_greedy(path, prompt, 12)
    stop_at = next(i for i in range(2, 12) if reference[i] not in reference[:i])
    # The list's first id never appears in the reference; its second one ends generation.
    unused = next(i for i in range(2, 400) if i not in reference)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [unused, reference[stop_at]]}, f)
    with LLM(path, num_kvcache_blocks=16, kvcache_block_size=16, max_model_len=256) as llm:
        assert reference[stop_at] in llm.config.eos_token_ids
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out["token_ids"] == reference[:stop_at + 1]
    assert out["finish_reason"] == "stop"


def test_unknown_architecture_lists_supported(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        LLM(path)
    for arch in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM",
                 "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration"):
        assert arch in str(err.value)


def test_windows_per_layer():
    # Mistral windows every layer, Qwen2 the layers its layer_types name, Gemma 2 alternates; LlamaForCausalLM has
    # no sliding window, so a stray sliding_window field in its config is ignored
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    from nanovllm.models import build_model
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, num_hidden_layers=3)
    cases = [(MistralConfig(sliding_window=8, architectures=["MistralForCausalLM"], **small), [8, 8, 8]),
             (Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                          architectures=["Qwen2ForCausalLM"], **small), [None, 8, 8]),
             (Gemma2Config(sliding_window=8, architectures=["Gemma2ForCausalLM"], **small), [8, None, 8]),
             (LlamaConfig(architectures=["LlamaForCausalLM"], **small), [None] * 3)]
    cases[-1][0].sliding_window = 8
    for config, windows in cases:
        model = build_model(config)
        assert [layer.self_attn.attn.window for layer in model.model.layers] == windows, type(config).__name__


def test_bad_layer_types_and_other_multimodal_checkpoints_are_refused(tmp_path):
    from tests.tiny_models import edit_json
    path = make_checkpoint(tmp_path, "gemma3", query_pre_attn_scalar=16, sliding_window=8)
    edit_json(os.path.join(path, "config.json"), layer_types=["sliding_attention"] * 3)
    with pytest.raises(Exception, match="layer_types"):  # (transformers refuses it first, with its own error)
        LLM(path)
    # a layer type transformers' config accepts and nanovllm does not implement (not to be run as full attention)
    edit_json(os.path.join(path, "config.json"), layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="layer_types has 'chunked_attention', which nanovllm does not implement"):
        LLM(path)
    edit_json(os.path.join(path, "config.json"), layer_types=["sliding_attention", "full_attention"])
    for window in (0, -1):  # (not full attention for 0, nor every key masked for -1)
        edit_json(os.path.join(path, "config.json"), sliding_window=window)
        with pytest.raises(ValueError, match=f"sliding_window {window} is not a number of tokens"):
            LLM(path)
    # a multimodal config (its text model's fields nested in text_config) of an architecture nanovllm does not serve,
    # even one that names a text class too (tests/models/test_multimodal.py: those it serves)
    text = json.load(open(os.path.join(path, "config.json")))
    json.dump({"architectures": ["PaliGemmaForConditionalGeneration", "Gemma3ForCausalLM"], "model_type": "paligemma",
               "text_config": {**text, "sliding_window": 8}}, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="nests a text_config, as a multimodal checkpoint's does: nanovllm serves the "
                                         "language model of Gemma3ForConditionalGeneration and"):
        LLM(path)


def test_checkpoint_names_route_by_whole_segments():
    """Packed q/k/v and gate/up are found by whole trailing module segments, never by substring: an expert's
    gate_proj (MoE) or a module whose name merely contains gate_proj stays itself."""
    from nanovllm.checkpoint.loader import route_weight
    from nanovllm.models.decoder import DecoderForCausalLM
    packed = DecoderForCausalLM.packed_modules_mapping
    assert route_weight("model.layers.3.self_attn.k_proj.bias", packed) == \
        ("model.layers.3.self_attn.qkv_proj.bias", "k")
    assert route_weight("model.layers.0.mlp.up_proj.weight", packed) == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    for name in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.shared_gate_proj.weight",
                 "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.cross_attn.q_proj.weight"):
        assert route_weight(name, packed) == (name, None)


def test_gemma_configs_in_transformers_4_layout():
    # transformers 4's Gemma configs: no layer_types (Gemma 2's odd layers and every sliding_window_pattern-th layer
    # of Gemma 3 are global) and Gemma 3's local rope base in rope_local_base_freq: the same layers and rope tables
    # as transformers 5's layout of the same model
    from types import SimpleNamespace

    from transformers import Gemma2Config, Gemma3TextConfig

    from nanovllm.models import build_model
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=16)
    gemma3 = Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], sliding_window_pattern=3, rope_theta=1e6,
                              rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}, **small)
    old3 = SimpleNamespace(**{**small, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 3,
                              "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
                              "max_position_embeddings": 64})
    gemma2 = Gemma2Config(architectures=["Gemma2ForCausalLM"], **small)
    old2 = SimpleNamespace(**{**small, "architectures": ["Gemma2ForCausalLM"], "rope_theta": 10000.0,
                              "rms_norm_eps": 1e-6, "max_position_embeddings": 64})
    for new, old in ((gemma3, old3), (gemma2, old2)):
        new.max_position_embeddings = 64
        a, b = (build_model(c).model.layers for c in (new, old))
        assert [x.self_attn.attn.window for x in a] == [x.self_attn.attn.window for x in b]
        assert len({x.self_attn.attn.window for x in a}) == 2  # local and global layers both there
        for x, y in zip(a, b):
            assert torch.equal(x.self_attn.rotary_emb.cos_sin_cache, y.self_attn.rotary_emb.cos_sin_cache)
