"""vLLM's LLM(...) options, engine accessors, and the arguments of generate, chat and beam_search: each accepted at
vLLM's default, taken where implemented, refused with an error naming it otherwise; the engine serves after each
refusal."""
import logging
import types
from unittest import mock

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.sampling_params import BeamSearchParams
from nanovllm.vllm_options import DEFAULT_ONLY, NO_EFFECT
from tests.tiny_models import CHAT_TEMPLATE, hf_greedy, make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("vllm_options"), "qwen3", tie=True, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tiny(model):
    with LLM(model, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        yield llm


def _serves(llm, model):
    prompt = [3, 1, 4, 1, 5]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(model, prompt, 6)


def test_lm_eval_style_constructor(model):
    """What lm-evaluation-harness' vLLM backend passes, every vLLM option at its default and vLLM's names for
    nanovllm's options: accepted, and taken where they mean something."""
    defaults = {name: default for name, (default, _) in DEFAULT_ONLY.items()}
    with LLM(model=model, tokenizer=model, trust_remote_code=False, max_model_len=None,
             max_num_seqs=None, max_num_batched_tokens=None, enable_prefix_caching=None, seed=None, dtype="float",
             block_size=16, num_gpu_blocks_override=130, load_format="safetensors", disable_async_output_proc=True,
             disable_log_stats=True, enable_sleep_mode=True, max_logprobs=20, served_model_name="tiny",
             **defaults) as llm:
        cfg = llm.config
        assert cfg.max_model_len == 2048  # None: the model's own limit (its max_position_embeddings)
        assert (cfg.kvcache_block_size, cfg.num_kvcache_blocks, cfg.seed) == (16, 130, 0)
        assert cfg.torch_dtype == torch.float32 and cfg.async_scheduling is False
        assert llm.llm_engine.model_config.max_model_len == 2048
        _serves(llm, model)


@pytest.mark.parametrize("name", sorted(DEFAULT_ONLY))
def test_a_non_default_vllm_option_is_refused_by_name(model, name):
    default = DEFAULT_ONLY[name][0]
    other = {None: "something", False: True, True: False}.get(default) if not isinstance(default, (int, str)) \
        or isinstance(default, bool) else (default + 1 if isinstance(default, int) else default + "-other")
    with pytest.raises(ValueError, match=f"^{name}=.* is not supported: "):
        LLM(model, **{name: other})


def test_vllm_values_that_name_what_nanovllm_does(model):
    """vLLM's task="generate", runner="generate", convert="none", tokenizer_mode="hf" and config_format="hf", and
    an empty dict of overrides, ask for what nanovllm does: accepted as the defaults are; other values are still
    refused, naming both."""
    cfg = Config.from_kwargs(model, task="generate", runner="generate", convert="none", tokenizer_mode="hf",
                             config_format="hf")
    assert cfg.max_model_len == 2048
    # an empty dict overrides nothing (vLLM's default for hf_overrides, which takes others too:
    # tests/models/test_hf_overrides.py; for limit_mm_per_prompt and override_generation_config; CompilationConfig's
    # own defaults)
    empty = ("hf_overrides", "limit_mm_per_prompt", "mm_processor_kwargs", "override_generation_config",
             "compilation_config")
    assert Config.from_kwargs(model, **{name: {} for name in empty}).max_model_len == 2048
    with pytest.raises(ValueError, match=r"^runner='pooling' is not supported: .*'auto' or 'generate' is accepted"):
        Config.from_kwargs(model, runner="pooling")


def test_vllm_optimization_levels(model):
    """vLLM's optimization_level (-O0 to -O3): 0 is no compilation and no CUDA graphs, enforce_eager=True; 1 to 3
    keep CUDA graphs, as by default. enforce_eager=False, its default, keeps -O0 eager, as in vLLM (where it only ever
    turns graphs off). compilation_config=0 names it."""
    assert Config.from_kwargs(model, optimization_level=0).enforce_eager is True
    assert Config.from_kwargs(model, optimization_level=0, enforce_eager=False).enforce_eager is True
    assert [Config.from_kwargs(model, optimization_level=n).enforce_eager for n in (1, 2, 3)] == [False] * 3
    with pytest.raises(ValueError, match="optimization_level must be 0, 1, 2 or 3"):
        Config.from_kwargs(model, optimization_level=4)
    with pytest.raises(ValueError, match=r"^compilation_config=0 is not supported: .*optimization_level=0"):
        Config.from_kwargs(model, compilation_config=0)


def test_expert_parallel(model, tmp_path, caplog):
    """vLLM's enable_expert_parallel=True (its data_parallel.py example passes it, for an MoE model): taken on an MoE
    model, where vLLM only places whole experts on each GPU (the same outputs; on one GPU, all of them, as here),
    saying so where there are several ranks; refused naming why on a model without experts, as vLLM refuses it."""
    moe = make_checkpoint(tmp_path, "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          decoder_sparse_step=1)
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        assert Config.from_kwargs(moe, enable_expert_parallel=True, tensor_parallel_size=2).enable_expert_parallel
    assert "each of the 2 tensor-parallel ranks holds a slice of every expert" in caplog.text
    with LLM(moe, enable_expert_parallel=True, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        _serves(llm, moe)
    with pytest.raises(ValueError, match=r"^enable_expert_parallel=True needs a mixture-of-experts model, and .* "
                                         r"\(Qwen3ForCausalLM\) has no experts \(vLLM refuses it too\)"):
        LLM(model, enable_expert_parallel=True)


@pytest.mark.parametrize("name", NO_EFFECT)
def test_options_without_effect_are_accepted(model, name):
    cfg = Config.from_kwargs(model, **{name: True})
    assert cfg.max_model_len == 2048 and not hasattr(cfg, name)


def test_option_refusals(model):
    with pytest.raises(ValueError, match="tokenizer='other' is not supported"):
        LLM(model, tokenizer="other")
    with pytest.raises(TypeError, match="unknown option.*no_such_option.*vllm_compat"):
        LLM(model, no_such_option=1)
    with pytest.raises(TypeError, match="max_model_len must be int or None"):
        LLM(model, max_model_len="long")
    with pytest.raises(ValueError, match="enable_chunked_prefill=False is not supported"):
        LLM(model, enable_chunked_prefill=False)
    assert Config.from_kwargs(model, enable_chunked_prefill=True).max_model_len == 2048  # (always on)
    with pytest.raises(ValueError, match="load_format must be"):
        LLM(model, load_format="pt")
    with pytest.raises(ValueError, match="dtype must be"):
        LLM(model, dtype="double")
    assert Config.from_kwargs(model, tokenizer=None, tokenizer_mode="auto", quantization=None, enable_lora=False,
                              revision=None, max_num_seqs=None).max_num_seqs == 512  # (the list)
    assert Config.from_kwargs(model, dtype="half").torch_dtype == torch.float16
    assert Config.from_kwargs(model, max_model_len=100000).max_model_len == 2048  # capped at the model's limit
    assert Config.from_kwargs(model).max_model_len == 2048  # 4096 by default, within this model's 2048


def test_a_prompt_past_the_models_limit_is_not_told_to_raise_max_model_len(model):
    # max_model_len above max_position_embeddings is capped at it: raising it further cannot fit a longer prompt
    with LLM(model, max_model_len=100000, kvcache_block_size=16, num_kvcache_blocks=130) as llm:
        with pytest.raises(ValueError, match=r"more than max_model_len=2048: shorten it or use a model with a longer "
                                             r"context \(max_model_len=100000 was capped at this model's "
                                             r"max_position_embeddings=2048\)"):
            llm.generate([[5] * 2049], GREEDY, use_tqdm=False)
    with LLM(model, max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=32) as llm:  # (not capped)
        with pytest.raises(ValueError, match="more than max_model_len=256: shorten it or raise max_model_len$"):
            llm.generate([[5] * 257], GREEDY, use_tqdm=False)


def test_accessors(tiny, model):
    assert tiny.llm_engine.llm is tiny and tiny.get_tokenizer() is tiny.tokenizer
    config = tiny.llm_engine.model_config
    assert (config.model, config.max_model_len, config.dtype) == (model, 256, torch.float32)
    assert config.get_vocab_size() == tiny.config.hf_config.vocab_size and tiny.get_model_config() == config
    assert tiny.get_world_size() == tiny.get_world_size(include_dp=False) == 1
    params = tiny.get_default_sampling_params()
    params.temperature = 0.123
    assert tiny.get_default_sampling_params().temperature == 1.0  # a copy each time


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lora_request=object()), ValueError, "lora_request"),
    (dict(priority=[1]), ValueError, "priority"),
    (dict(priority=2), ValueError, r"^priority=2 is not supported"),
    (dict(tokenization_kwargs={"truncation": True, "max_length": 2}), ValueError,
     "tokenization_kwargs=.* is not supported: .*truncate_prompt_tokens=k"),
    (dict(prompt_token_ids=[[1, 2]]), ValueError, "either prompts or prompt_token_ids"),
])
def test_generate_argument_refusals(tiny, model, kwargs, error, match):
    with pytest.raises(error, match=match):
        tiny.generate([[1, 2, 3]], GREEDY, **kwargs)
    _serves(tiny, model)


def test_generate_arguments(tiny, model):
    with pytest.raises(TypeError, match="needs prompts"):
        tiny.generate()
    one = tiny.generate(prompt_token_ids=[3, 1, 4], sampling_params=GREEDY, lora_request=None, priority=None)
    assert len(one) == 1 and one[0].prompt_token_ids == [3, 1, 4]
    # vLLM's: priorities of 0 (all that first come, first served takes), no tokenization overrides
    two = tiny.generate([[3, 1, 4], [1, 5]], GREEDY, priority=[0, 0], tokenization_kwargs={}, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [one[0].outputs[0].token_ids, hf_greedy(model, [1, 5], 6)]
    # (vLLM reads `priority[i] if priority else 0`: a bare 0 for the call, as some scripts pass it)
    assert [o.outputs[0].token_ids for o in tiny.generate([[3, 1, 4], [1, 5]], GREEDY, priority=0,
                                                          use_tqdm=False)] == [o.outputs[0].token_ids for o in two]
    assert tiny.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, tokenization_kwargs=None,
                     mm_processor_kwargs={})[0].outputs[0].token_ids
    assert tiny.generate({"prompt_token_ids": [3, 1, 4], "prompt": "pi"}, GREEDY)[0].prompt == "pi"


@pytest.mark.parametrize("prompt, error, match", [
    ({"prompt": "a", "multi_modal_data": {}}, ValueError, "multi_modal_data"),
    ({"prompt": "a", "colour": 1}, TypeError, "unknown prompt key"),
    ({}, ValueError, "needs 'prompt'"),
    ({"prompt": 3}, TypeError, "must be a str"),
    ({"prompt_token_ids": "abc"}, TypeError, "list of int"),
])
def test_bad_prompt_dicts(tiny, model, prompt, error, match):
    with pytest.raises(error, match=match):
        tiny.generate([prompt], GREEDY)
    _serves(tiny, model)


def test_chat_arguments(tiny, model):
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "you"}]}]
    out = tiny.chat(conversation, GREEDY, use_tqdm=False, lora_request=None, chat_template_content_format="string")[0]
    assert out.prompt == "<|im_start|>user\nHello \nyou<|im_end|>\n<|im_start|>assistant\n"  # (parts: one per line)
    template = "{% for t in tools %}[{{ t['name'] }}]{% endfor %}{{ messages[-1]['content'] }}"
    out = tiny.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template,
                    tools=[{"name": "search"}], use_tqdm=False)[0]
    assert out.prompt == "[search]hi"
    for kwargs, error, match in [
        (dict(add_generation_prompt=True, continue_final_message=True), ValueError, "cannot both be True"),
        (dict(mm_processor_kwargs={"a": 1}), ValueError, "mm_processor_kwargs"),
        (dict(tokenization_kwargs={"add_special_tokens": True}), ValueError, "tokenization_kwargs"),
        (dict(chat_template_content_format="xml"), ValueError, "chat_template_content_format"),
        (dict(lora_request=object()), ValueError, "lora_request"),
        (dict(chat_template_kwargs=[1]), TypeError, "chat_template_kwargs"),
    ]:
        with pytest.raises(error, match=match):
            tiny.chat(conversation, GREEDY, use_tqdm=False, **kwargs)
    with pytest.raises(ValueError, match="content part"):
        tiny.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], GREEDY)
    _serves(tiny, model)


def test_beam_search_arguments(tiny, model):
    for kwargs, match in [(dict(beam_width=0, max_tokens=3), "beam_width"), (dict(beam_width=2, max_tokens=0),
                                                                            "max_tokens"),
                          (dict(beam_width=2, max_tokens=2, temperature=-1), "temperature"),
                          (dict(beam_width=2, max_tokens=2, length_penalty=float("nan")), "length_penalty"),
                          (dict(beam_width=2, max_tokens=2, temperature=float("nan")), "temperature must be a finite")]:
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**kwargs)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        tiny.beam_search([[1, 2]], GREEDY)
    with pytest.raises(ValueError, match="lora_request"):
        tiny.beam_search([[1, 2]], BeamSearchParams(2, 2), lora_request=object())
    with pytest.raises(ValueError, match="beam_width=201: .* use beam_width <= 200"):  # the vocabulary has 400
        tiny.beam_search([[1, 2]], BeamSearchParams(201, 2))
    out = tiny.beam_search([{"prompt_token_ids": [3, 1, 4]}], BeamSearchParams(beam_width=1, max_tokens=6,
                                                                                ignore_eos=True))[0]
    assert out.sequences[0].tokens == [3, 1, 4] + hf_greedy(model, [3, 1, 4], 6)  # width 1: greedy
    # vLLM's concurrency_limit: the prompts a few at a time, the same beams
    prompts, params = [[3, 1, 4], [2, 7], [1, 8, 2, 8]], BeamSearchParams(beam_width=2, max_tokens=4)
    want = [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in tiny.beam_search(prompts, params)]
    steps, generate = [], tiny.generate  # (the beams each step asks for: of at most two prompts at a time)

    def counted(beams, *args, **kwargs):
        steps.append(len(beams))
        return generate(beams, *args, **kwargs)

    with mock.patch.object(tiny, "generate", counted):
        got = tiny.beam_search(prompts, params, use_tqdm=False, concurrency_limit=2)
    assert [[(s.tokens, pytest.approx(s.cum_logprob)) for s in o.sequences] for o in got] == want
    assert steps[0] == 2 and max(steps) <= 2 * params.beam_width and 1 in steps
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="concurrency_limit must be None or an int >= 1"):
            tiny.beam_search(prompts, params, concurrency_limit=bad)
    # beams that reach max_model_len (256) stop there, as cut by a length
    out = tiny.beam_search([[5] * 250], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))[0]
    assert [(len(s.tokens), s.finish_reason) for s in out.sequences] == [(256, "length")] * 2
    _serves(tiny, model)


def test_profiling_is_refused_saying_what_to_use(tiny, model):
    """vLLM's simple_profiling.py: start_profile / stop_profile (on the LLM and its llm_engine) and profiler_config
    are refused, naming torch.profiler; the engine serves on."""
    for call in (tiny.start_profile, tiny.stop_profile, tiny.llm_engine.start_profile, tiny.llm_engine.stop_profile):
        with pytest.raises(NotImplementedError, match="no built-in profiler.*torch.profiler.profile"):
            call()
    with pytest.raises(ValueError, match="^profiler_config=.* is not supported: .*torch.profiler.profile"):
        Config.from_kwargs(model, profiler_config={"profiler": "torch", "torch_profiler_dir": "./vllm_profile"})
    _serves(tiny, model)


def test_vllm_weight_reloads_name_update_weights(tiny, model):
    """A vLLM RL script's weight loading: the worker methods reload_weights and update_config through
    collective_rpc (vLLM's skip_loading_weights_in_engine_init.py), and newest vLLM's update_weights({"update_info":
    ...}) weight-transfer request, are refused naming what nanovllm's update_weights takes; the engine serves on."""
    for method, args in (("reload_weights", ()), ("update_config", ({"load_config": {"load_format": "auto"}},))):
        with pytest.raises(ValueError, match=rf"^collective_rpc\('{method}'\) is vLLM's worker method, .*"
                                             r"llm\.update_weights\(\): a checkpoint directory \(llm\.config\.model"):
            tiny.collective_rpc(method, args=args)
        with pytest.raises(ValueError, match=rf"^collective_rpc\('{method}'\) is vLLM's worker method"):
            tiny.llm_engine.collective_rpc(method, args=args)
    request = {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}}
    for weights in (request, types.SimpleNamespace(**request)):  # (a dict, or vLLM's WeightTransferUpdateRequest)
        with pytest.raises(TypeError, match=r"^update_weights got newest vLLM's weight-transfer request .* takes the "
                                            r"weights themselves: \(name, tensor\) pairs, a state dict"):
            tiny.update_weights(weights)
    _serves(tiny, model)
    # what the error says to do for vLLM's update_config(load_format="auto") + reload_weights after dummy weights
    with LLM(model, load_format="dummy", kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        llm.update_weights(llm.config.model)
        _serves(llm, model)


def test_vllm_compat_page_names_every_option():
    import os
    page = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "vllm_compat.md")).read()
    assert [name for name in (*DEFAULT_ONLY, *NO_EFFECT) if f"`{name}`" not in page] == []


def test_vocabulary_constraints_on_the_engine_path(tiny):
    """bad_words, allowed_token_ids and logit_bias through the engine as it runs here (on CUDA: decode graphs and
    async scheduling, where bad words make the engine settle each step before sampling the next)."""
    prompt = [7, 7, 7, 7]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = tiny.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    tokenizer = tiny.get_tokenizer()
    # a two-token word of the greedy answer whose text encodes back to those two tokens
    starts = [i for i in range(len(plain) - 1) if tokenizer.encode(tokenizer.decode(plain[i:i + 2]).lstrip(),
                                                                   add_special_tokens=False) == plain[i:i + 2]]
    assert starts, plain
    i = starts[0]
    word = tokenizer.decode(plain[i:i + 2])
    banned = tiny._bad_words_ids([word])
    assert plain[i:i + 2] in banned
    out = tiny.generate([prompt, prompt[:2]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                             bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:i + 1] == plain[:i + 1] and out.token_ids[i + 1] != plain[i + 1]  # its first token stays
    # a prompt ending in the word's first token bans nothing: the word is matched in the output, as vLLM does
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, bad_words=[word])
    assert tiny.generate([prompt + plain[:i + 1]], once, use_tqdm=False)[0].outputs[0].token_ids == [plain[i + 1]]
    for params in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=[word]),
                   SamplingParams(temperature=1.0, seed=0, max_tokens=10, ignore_eos=True, bad_words=[word])):
        ids = tiny.generate([prompt, prompt[:2]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert not any(ids[j:j + len(b)] == b for b in banned for j in range(len(ids)))
    # the word's last token alone is not banned: with its first token never sampled, it is free
    only_last = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, bad_words=[word],
                               allowed_token_ids=[plain[i + 1]])
    assert tiny.generate([prompt], only_last, use_tqdm=False)[0].outputs[0].token_ids == [plain[i + 1]] * 4
    allowed = sorted(set(plain))[:2]
    out = tiny.generate([prompt], SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True,
                                                 allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= set(allowed)
    out = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                 logit_bias={7: 1e4}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [7] * 10
