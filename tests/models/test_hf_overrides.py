"""vLLM's hf_overrides: config.json changed at load, by a dict or a function, gives what an edited config.json gives."""
import json
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint.hf_overrides import merge_overrides
from nanovllm.config import Config
from nanovllm.engine_args import EngineArgs
from nanovllm.models.decoder import rope_settings
from tests.tiny_models import edit_json, hf_greedy, make_checkpoint

# Qwen's long-context setting, scaled down: YaRN over a 32-token original context, 128 in all
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = list(range(3, 60))  # past the original context
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=32)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    """A Qwen3 checkpoint as transformers 5 saves it: rope_parameters holding rope_theta 1e6."""
    return make_checkpoint(tmp_path_factory.mktemp("hfo"), "qwen3", tie=False, rope_theta=1e6)


@pytest.fixture(scope="module")
def qwen3_yarn(tmp_path_factory) -> str:
    """The same weights with YaRN written into config.json (as transformers 5 saves it: in rope_parameters)."""
    return make_checkpoint(tmp_path_factory.mktemp("hfo_edited"), "qwen3", tie=False, rope_theta=1e6,
                           rope_scaling=YARN)


@pytest.fixture(scope="module")
def yarn_tokens(qwen3_yarn) -> list[int]:
    """transformers' greedy tokens on the same weights with YaRN written into config.json."""
    return hf_greedy(qwen3_yarn, PROMPT, GREEDY.max_tokens)


def _yarn_by_function(config):  # at module level: data-parallel replicas unpickle it
    config.rope_scaling = dict(YARN)  # (on a transformers 5 config this replaces rope_parameters, theta and all)
    return config


def _yarn_parameters(config):
    config.rope_parameters = dict(YARN)  # (transformers 5's own attribute, set without the theta)
    return config


@pytest.mark.parametrize("overrides", [{"rope_scaling": YARN}, {"rope_parameters": YARN}, _yarn_by_function,
                                       lambda config: config.update({"rope_scaling": dict(YARN)}) or config,
                                       _yarn_parameters],
                         ids=["rope_scaling", "rope_parameters", "function", "lambda_update", "function_parameters"])
def test_yarn_by_overrides_equals_an_edited_config(qwen3, yarn_tokens, overrides):
    """Qwen's model cards give YaRN as an override; the checkpoint's rope_theta stays (transformers 5 given a
    rope_scaling beside the file's rope_parameters would take theta 10,000), and the context is YaRN's."""
    with LLM(qwen3, hf_overrides=overrides, max_model_len=None, **OPTIONS) as llm:
        params = llm.config.hf_config.rope_parameters
        assert (params["rope_theta"], params["rope_type"], llm.config.max_model_len) == (1e6, "yarn", 128)
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"] == yarn_tokens
    assert hf_greedy(qwen3, PROMPT, GREEDY.max_tokens) != yarn_tokens, "YaRN should change this prompt's tokens"


def _no_scaling(config):
    config.rope_scaling = None  # (on a transformers 5 config this clears rope_parameters, theta and all)
    return config


@pytest.mark.parametrize("overrides", [{"rope_scaling": None}, {"rope_parameters": None}, _no_scaling,
                                       lambda config: config.update({"rope_parameters": None}) or config],
                         ids=["rope_scaling", "rope_parameters", "function", "lambda_update"])
def test_overriding_the_scaling_with_none_removes_it(qwen3, qwen3_yarn, overrides):
    """A checkpoint saved with YaRN, its scaling overridden with None: plain rope at the checkpoint's rope_theta, as
    config.json without the scaling gives (neither the YaRN it was saved with, nor theta 10,000)."""
    with LLM(qwen3_yarn, hf_overrides=overrides, max_model_len=256, **OPTIONS) as llm:
        assert rope_settings(llm.config.hf_config) == (1e6, None)
        got = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert got == hf_greedy(qwen3, PROMPT, GREEDY.max_tokens)


def test_yarn_override_on_the_older_layout(tmp_path, yarn_tokens):
    """A config.json in transformers 4's layout (rope_theta beside rope_scaling) takes it there."""
    path = make_checkpoint(tmp_path, "qwen3", tie=False, rope_theta=1e6)
    edit_json(os.path.join(path, "config.json"), rope_parameters=None, rope_theta=1e6)
    with LLM(path, hf_overrides={"rope_scaling": YARN}, **OPTIONS) as llm:
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"] == yarn_tokens


def test_plain_fields_and_the_command_line(qwen3):
    """vLLM's data-parallel example shrinks the model so (with random weights); EngineArgs reads the JSON flag."""
    with LLM(qwen3, hf_overrides={"num_hidden_layers": 1}, load_format="dummy", max_model_len=256, **OPTIONS) as llm:
        assert llm.llm_engine.model_config.hf_config.num_hidden_layers == 1
        assert len(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
    config = Config.from_kwargs(qwen3, hf_overrides={"torch_dtype": "float16"}).hf_config
    assert config.dtype == torch.float16  # (config.json says dtype float32: the override's name is the older one)
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", qwen3, "--hf-overrides", json.dumps({"rope_scaling": YARN})])
    assert EngineArgs.from_cli_args(args).hf_overrides == {"rope_scaling": YARN}


def test_merge_rules():
    t5 = {"model_type": "qwen3", "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "head_dim": 8}
    assert merge_overrides(t5, {"rope_scaling": YARN}) == {**t5, "rope_parameters": {"rope_theta": 1e6, **YARN}}
    assert t5["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}, "the input must not change"
    # a rope dict without a type changes the keys it names; with one it replaces the scaling
    scaled = merge_overrides(t5, {"rope_parameters": YARN})
    assert merge_overrides(scaled, {"rope_parameters": {"rope_theta": 5e5}})["rope_parameters"] == {
        "rope_theta": 5e5, **YARN}
    assert merge_overrides(scaled, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})["rope_parameters"] == {
        "rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}
    assert merge_overrides(scaled, {"rope_theta": 5e5})["rope_parameters"] == {"rope_theta": 5e5, **YARN}
    # None: no scaling, the theta kept
    assert merge_overrides(scaled, {"rope_scaling": None})["rope_parameters"] == {"rope_theta": 1e6,
                                                                                  "rope_type": "default"}
    # the dtype under either name (transformers 5 saves dtype, and reads it before torch_dtype)
    for name in ("dtype", "torch_dtype"):
        got = merge_overrides({"dtype": "bfloat16", "torch_dtype": "bfloat16"}, {name: "float16"})
        assert got == {"dtype": "float16", "torch_dtype": "float16"}
    t4 = {"model_type": "llama", "rope_theta": 5e5, "rope_scaling": None}
    assert merge_overrides(t4, {"rope_theta": 1e4}) == {**t4, "rope_theta": 1e4}
    assert merge_overrides(t4, {"rope_parameters": {**YARN, "rope_theta": 1e4}}) == {
        "model_type": "llama", "rope_theta": 1e4, "rope_scaling": YARN}
    # a multimodal checkpoint's text_config is merged into, its rope per layer type
    mm = {"model_type": "gemma3", "text_config": {"hidden_size": 64, "rope_parameters": {
        "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}}}
    out = merge_overrides(mm, {"text_config": {"rope_parameters": {"full_attention": {"rope_type": "linear",
                                                                                       "factor": 8.0}}}})
    assert out["text_config"]["hidden_size"] == 64
    assert out["text_config"]["rope_parameters"] == {
        "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
    for bad in ({"rope_scaling": YARN}, {"rope_theta": 1e4}, {"rope_scaling": None}):
        with pytest.raises(ValueError, match="rope_parameters are per layer type"):
            merge_overrides(mm, {"text_config": bad})


def test_bad_overrides_are_refused(qwen3):
    with pytest.raises(TypeError, match="hf_overrides must be a dict of config fields"):
        LLM(qwen3, hf_overrides="rope_scaling=yarn")
    with pytest.raises(TypeError, match="hf_overrides function returned None"):
        LLM(qwen3, hf_overrides=lambda config: None)
    with pytest.raises(TypeError, match="returned a dict; .* a dict of changes goes as hf_overrides itself"):
        LLM(qwen3, hf_overrides=lambda config: {"rope_theta": 1e6})
    with pytest.raises(ValueError, match="rope scaling type 'dynamic' is not supported"):
        LLM(qwen3, hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, **OPTIONS)


def test_tensor_and_data_parallel(qwen3, yarn_tokens):
    """Tensor-parallel ranks take the overridden config (a lambda need not pickle); data-parallel replicas apply the
    overrides themselves, so a function must pickle."""
    with LLM(qwen3, hf_overrides=lambda config: _yarn_by_function(config), tensor_parallel_size=2, **OPTIONS) as llm:
        assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"] == yarn_tokens
    with pytest.raises(TypeError, match="the hf_overrides function must pickle"):
        LLM(qwen3, hf_overrides=lambda config: config, data_parallel_size=2, **OPTIONS)
    with LLM(qwen3, hf_overrides=_yarn_by_function, data_parallel_size=2, **OPTIONS) as llm:
        outs = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == [yarn_tokens] * 2
