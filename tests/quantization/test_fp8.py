"""FP8 weights on CPU (float32): checkpoints in Qwen's block-scaled format and compressed-tensors' per-channel
format, made from a tiny random model as the formats specify, give transformers' greedy tokens on the same weights
dequantized (exactly: the CPU path dequantizes at load, the same products in float32); quantization="fp8"
quantizes a 16/32-bit checkpoint per channel; tensor parallelism over gloo shards weights and scales; every format
or tensor nanovllm cannot take is refused, naming it."""
import json
import logging
import os
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from tests.quantization.checkpoints import (
    AUTOFP8_CONFIG,
    CT_CONFIG,
    KV_CACHE_SCHEME,
    QWEN_CONFIG,
    STATIC,
    STATIC_INPUTS,
    add_kv_scales,
    ct_config,
    edit_config,
    edit_tensors,
    make_fp8,
)
from tests.tiny_models import hf_greedy, make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts_of(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """Wide enough for several 128x128 blocks per matrix (q: 256 x 256, gate/up: 512 x 256, down: 256 x 512) and for
    whole blocks per rank under TP=2."""
    return make_checkpoint(tmp_path_factory.mktemp("fp8_base"), "qwen3", tie=True, num_kv_heads=2, num_heads=4,
                           head_dim=64, hidden=256, intermediate_size=512, seed=3)


@pytest.fixture(scope="module", params=["qwen", "compressed-tensors"])
def fp8_pair(request, base, tmp_path_factory) -> tuple[str, str]:
    return make_fp8(base, tmp_path_factory.mktemp(f"fp8_{request.param}"), request.param,
                    tmp_path_factory.mktemp(f"fp8_{request.param}_ref"))


def test_fp8_checkpoints_give_transformers_tokens_on_their_dequantized_weights(fp8_pair, base):
    fp8, reference = fp8_pair
    prompts = prompts_of(0, [3, 40, 17, 90])
    with LLM(fp8, kvcache_block_size=16, max_num_batched_tokens=64) as llm:  # (chunked prefill too)
        assert llm.config.quant is not None
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(reference, prompt, 16)
    # the quantization is real: the fp8 weights are not the original ones
    assert any(hf_greedy(base, p, 16) != hf_greedy(reference, p, 16) for p in prompts)


def test_compressed_tensors_config_named_compression_config(base, tmp_path):
    """Earlier llm-compressor checkpoints name their config compression_config in config.json (vLLM reads it when
    there is no quantization_config): the same checkpoint, the same tokens."""
    fp8, reference = make_fp8(base, tmp_path / "fp8", "compressed-tensors", tmp_path / "reference")
    edit_config(fp8, quantization_config=None, compression_config=CT_CONFIG)
    prompt = prompts_of(8, [9])[0]
    with LLM(fp8, kvcache_block_size=16) as llm:
        assert llm.config.quant is not None
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(reference, prompt, 16)


def test_tensor_parallel_shards_weights_and_scales(fp8_pair):
    fp8, reference = fp8_pair
    prompts = prompts_of(1, [5, 33])
    with LLM(fp8, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(reference, prompt, 16)


def test_online_fp8_quantizes_per_channel(base, tmp_path):
    """quantization="fp8": the checkpoint's weights rounded through fp8 with a scale per output channel (the
    compressed-tensors reference: the same recipe)."""
    _, reference = make_fp8(base, tmp_path / "unused", "compressed-tensors", tmp_path / "reference")
    prompts = prompts_of(2, [4, 30])
    with LLM(base, quantization="fp8", kvcache_block_size=16) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(reference, prompt, 16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_weights_on_cpu_in_16_bits(base, dtype, tmp_path):
    """On CPU in a 16-bit dtype the fp8 weights (a checkpoint's, dense and MoE experts, or quantization="fp8") are
    dequantized to that dtype (float32 weights against 16-bit activations fail in oneDNN: "could not create a primitive
    descriptor"). The tokens are those of the dequantized weights run in the same dtype (online, the checkpoint's
    weights rounded to it first, as the online quantizer reads them)."""
    moe = make_checkpoint(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden=256,
                          head_dim=64, moe_intermediate_size=192, decoder_sparse_step=1, seed=6)
    prompts = prompts_of(3, [5, 40])
    opts = dict(device="cpu", dtype=dtype, kvcache_block_size=16)
    for source in (base, moe):
        name = os.path.basename(source)
        fp8, reference = make_fp8(source, tmp_path / f"{name}-fp8", "qwen", tmp_path / f"{name}-ref")
        rounded = shutil.copytree(source, tmp_path / f"{name}-rounded")
        edit_tensors(rounded, replace={k: v.to(getattr(torch, dtype)).float()
                                       for k, v in load_file(os.path.join(source, "model.safetensors")).items()})
        _, channel = make_fp8(rounded, tmp_path / f"{name}-unused", "compressed-tensors", tmp_path / f"{name}-ch")
        for model, quantization, expected in ((fp8, None, reference), (source, "fp8", channel)):
            runs = []
            for path, q in ((model, quantization), (expected, None)):
                with LLM(path, quantization=q, **opts) as llm:
                    runs.append([o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
            assert runs[0] == runs[1], (os.path.basename(model), quantization)


def test_the_bundled_model_keeps_its_answers_in_fp8(bundled):
    questions = [[{"role": "user", "content": q}] for q in ("What is the capital of France?",
                                                            "What is 2 + 3?", "Name a primary color.")]
    sp = SamplingParams(temperature=0, max_tokens=12)
    with LLM(bundled) as llm:
        plain = [o.outputs[0].text for o in llm.chat(questions, sp, use_tqdm=False)]
    with LLM(bundled, quantization="fp8") as llm:
        fp8 = [o.outputs[0].text for o in llm.chat(questions, sp, use_tqdm=False)]
    assert "Paris" in fp8[0] and "5" in fp8[1]
    assert sum(a == b for a, b in zip(plain, fp8)) >= 2, (plain, fp8)


@pytest.mark.parametrize("model,quantization", [("qwen_fp8", None), ("base", "fp8"), ("moe", "fp8")])
def test_quantized_weights_are_never_allocated_in_16_bits(model, quantization, request, tmp_path, monkeypatch):
    """Building a quantized model makes its quantized layers' weights in fp8 only: no 16/32-bit tensor of a
    quantized weight's shape (q/k/v, o, gate/up, down, the stacked experts) is allocated, so an fp8 model needs only
    its fp8 size to load. The embedding, kept 16-bit, is seen allocated (the recording works)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nanovllm.engine.model_runner import ModelRunner
    from nanovllm.layers.linear import LinearBase, ReplicatedLinear
    from nanovllm.layers.moe import StackedExperts
    if model == "moe":
        path = make_checkpoint(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden=256,
                               head_dim=64, moe_intermediate_size=192, decoder_sparse_step=1, seed=6)
    else:
        path = request.getfixturevalue(model)
    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.device.type != "meta" and out.dtype in (torch.float32,
                                                                                          torch.bfloat16,
                                                                                          torch.float16):
                made.append(tuple(out.shape))
            return out

    build = ModelRunner._build
    monkeypatch.setattr(ModelRunner, "_build", lambda self: _recorded(build, self, Record))
    with LLM(path, quantization=quantization, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=256) as llm:
        net = llm.executor.runner.model
    quantized = set()  # (every projection but the MoE router: these checkpoints' configs ignore none)
    for module in net.modules():
        if isinstance(module, LinearBase) and not isinstance(module, ReplicatedLinear):
            quantized.add(tuple(module.weight.shape))
        elif isinstance(module, StackedExperts):
            quantized |= {tuple(module.gate_up_proj.shape), tuple(module.down_proj.shape)}
    assert len(quantized) >= (4 if model == "moe" else 3)
    assert tuple(net.lm_head.weight.shape) in made
    assert not quantized & set(made)


def _recorded(build, runner, mode):
    with mode():
        return build(runner)


# ---- static activation scales -----------------------------------------------------------------------

@pytest.fixture(scope="module", params=STATIC)
def static_pair(request, base, tmp_path_factory) -> tuple[str, str]:
    return make_fp8(base, tmp_path_factory.mktemp(f"fp8_{request.param}"), request.param,
                    tmp_path_factory.mktemp(f"fp8_{request.param}_ref"))


def test_static_activation_checkpoints_give_transformers_tokens(static_pair):
    """AutoFP8's static format (per-tensor weight scales, 0-dim weight_scale and input_scale) and llm-compressor's
    FP8 preset (compressed-tensors: weights per channel or per tensor, static per-tensor input activations, scales of
    shape [1]) load: each input_scale read and checked, then dropped (CPU does not quantize activations), so the
    tokens are transformers' on the dequantized weights."""
    fp8, reference = static_pair
    prompts = prompts_of(9, [3, 40, 17])
    with LLM(fp8, kvcache_block_size=16, max_num_batched_tokens=64) as llm:
        assert llm.config.quant.static_activations
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(reference, prompt, 16)


def test_static_scales_under_tensor_parallelism(base, tmp_path):
    """Each rank reads every (scalar) input scale whole: TP=2 loads the static checkpoint and gives the same
    tokens."""
    fp8, reference = make_fp8(base, tmp_path / "fp8", "autofp8", tmp_path / "reference")
    prompt = prompts_of(10, [21])[0]
    with LLM(fp8, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(reference, prompt, 16)


def test_compressed_tensors_args_without_a_strategy(base, tmp_path):
    """A config group's weights or input_activations naming no strategy: read as compressed-tensors' QuantizationArgs
    (and vLLM through them) read it, from the group_size: 'tensor' without one, 'channel' with -1, 'group' with a
    positive one. llm-compressor's FP8 preset with no strategy in either loads as per-tensor weights and static
    per-tensor activations, and with group_size -1 in its weights as per-channel ones: transformers' tokens on the
    dequantized weights. A strategy in capitals reads as in lower case; a positive group_size reads as 'group'
    (refused as such); a group_size or block_structure compressed-tensors refuses without a strategy is refused."""
    from types import SimpleNamespace

    from nanovllm.quantization import quant_config
    weights = {k: v for k, v in CT_CONFIG["config_groups"]["group_0"]["weights"].items() if k != "strategy"}
    inputs = {k: v for k, v in STATIC_INPUTS.items() if k != "strategy"}

    def config(weights: dict, inputs: dict = inputs) -> dict:
        group = {**CT_CONFIG["config_groups"]["group_0"], "weights": weights, "input_activations": inputs}
        return {**CT_CONFIG, "config_groups": {"group_0": group}}

    prompts = prompts_of(15, [7, 26])
    for fmt, unnamed in (("ct-static-tensor", weights), ("ct-static-channel", {**weights, "group_size": -1})):
        fp8, reference = make_fp8(base, tmp_path / fmt, fmt, tmp_path / f"{fmt}-reference")
        edit_config(fp8, quantization_config=config(unnamed))
        with LLM(fp8, kvcache_block_size=16) as llm:
            assert llm.config.quant.static_activations and llm.config.quant.block == (1, None)
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [out["token_ids"] for out in outs] == [hf_greedy(reference, prompt, 16) for prompt in prompts], fmt
    capitals = config({**weights, "strategy": "TENSOR"}, {**inputs, "strategy": "Tensor"})
    assert quant_config(SimpleNamespace(quantization_config=capitals), None).static_activations
    for unnamed_weights, unnamed_inputs, message in (
            ({**weights, "group_size": 128}, inputs, "weight strategy 'group' is not supported"),
            (weights, {**inputs, "group_size": 64}, "static input activation scales with strategy 'group' are not "
                                                    "supported"),
            ({**weights, "group_size": 0}, inputs, "weights with group_size 0 and no strategy, which "
                                                   "compressed-tensors refuses"),
            ({**weights, "block_structure": [128, 128]}, inputs, "weights with a block_structure but no strategy")):
        with pytest.raises(ValueError, match=message):
            quant_config(SimpleNamespace(quantization_config=config(unnamed_weights, unnamed_inputs)), None)


@pytest.fixture(scope="module")
def autofp8(base, tmp_path_factory) -> str:
    return make_fp8(base, tmp_path_factory.mktemp("autofp8"), "autofp8", tmp_path_factory.mktemp("autofp8_ref"))[0]


def test_missing_or_bad_input_scales_are_refused(autofp8, qwen_fp8, tmp_path):
    """A quantized layer's input_scale missing (a packed part's or a plain layer's), not finite and positive, or not
    one value: refused, naming the tensor. An input_scale in a checkpoint whose config quantizes activations
    dynamically: refused, saying which configs read one."""
    for name in ("model.layers.0.self_attn.k_proj.input_scale", "model.layers.1.self_attn.o_proj.input_scale"):
        missing = _variant(autofp8, tmp_path / f"missing-{name}")
        edit_tensors(missing, drop=(name,))
        with pytest.raises(ValueError, match=f"lacks weights for: {re.escape(name)}"):
            LLM(missing)
    name = "model.layers.1.mlp.up_proj.input_scale"
    for value in (float("nan"), float("inf"), 0.0, -0.5):
        bad = _variant(autofp8, tmp_path / f"bad-{value}")
        edit_tensors(bad, replace={name: torch.tensor(value)})
        with pytest.raises(ValueError, match=rf"'{name}': input scale {value} is not a finite positive number"):
            LLM(bad)
    wide = _variant(autofp8, tmp_path / "wide")
    edit_tensors(wide, replace={name: torch.full((4,), 0.01)})
    with pytest.raises(ValueError, match=rf"'{name}': input scale of shape \(4,\): a static activation scale is one "
                                         "value per tensor"):
        LLM(wide)
    dynamic = _variant(qwen_fp8, tmp_path / "dynamic")
    edit_tensors(dynamic, replace={"model.layers.0.self_attn.q_proj.input_scale": torch.tensor(0.01)})
    with pytest.raises(ValueError, match=r"q_proj.input_scale' matches no parameter .*: a static activation scale, "
                                         r"which only a layer that quantization_config quantizes with static "
                                         r"activations reads \(quant_method 'fp8' with activation_scheme 'static'"):
        LLM(dynamic)


def test_moe_experts_with_static_input_scales(tmp_path):
    """Qwen3-MoE in AutoFP8's static format: every expert's projections carry an input_scale, read per expert and
    checked (the fused MoE kernel takes 16-bit activations, so they are not used): transformers' tokens on the
    dequantized weights; an expert's scale missing, or negative, refused, named."""
    moe = make_checkpoint(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden=256,
                          head_dim=64, moe_intermediate_size=192, decoder_sparse_step=1, seed=5)
    fp8, reference = make_fp8(moe, tmp_path / "fp8", "autofp8", tmp_path / "reference")
    prompts = prompts_of(11, [4, 33])
    with LLM(fp8, kvcache_block_size=16) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out["token_ids"] for out in outs] == [hf_greedy(reference, prompt, 16) for prompt in prompts]
    missing = "model.layers.1.mlp.experts.2.up_proj.input_scale"
    edit_tensors(fp8, drop=(missing,))
    with pytest.raises(ValueError, match=f"lacks weights for: {re.escape(missing)}"):
        LLM(fp8)
    bad = "model.layers.0.mlp.experts.1.down_proj.input_scale"
    edit_tensors(fp8, replace={missing: torch.tensor(0.01), bad: torch.tensor(-1.0)})
    with pytest.raises(ValueError, match=rf"'{bad}': input scale -1.0 is not a finite positive number"):
        LLM(fp8)


# ---- static KV-cache scales (kv_cache_scheme) ----------------------------------------------------------

@pytest.fixture(scope="module", params=["compressed-tensors", "autofp8"])
def kv_scales(request, base, tmp_path_factory) -> tuple[str, str, str, str]:
    """(format, the fp8 checkpoint with static KV-cache scales, the same without them, its dequantized reference)."""
    fmt = request.param
    plain, reference = make_fp8(base, tmp_path_factory.mktemp(f"kv_{fmt}_plain"), fmt,
                                tmp_path_factory.mktemp(f"kv_{fmt}_ref"))
    kv = add_kv_scales(shutil.copytree(plain, tmp_path_factory.mktemp(f"kv_{fmt}") / "fp8"), fmt)
    return fmt, kv, plain, reference


def test_static_kv_cache_scales_load_and_go_unused(kv_scales, caplog):
    """llm-compressor's FP8-KV checkpoints (kv_cache_scheme: static per-tensor fp8; self_attn.k_scale / v_scale) and
    AutoFP8's kv_cache_scheme 'static' (k/v/q_proj.output_scale, prob_output_scale) load, the scales checked and
    dropped, saying so once: with kv_cache_dtype 'auto' transformers' tokens on the dequantized weights (a 16-bit
    cache, float32 on CPU), with 'fp8' the tokens of the same checkpoint without the scales (nanovllm's own per-token
    scaling either way)."""
    _, kv, plain, reference = kv_scales
    prompts = prompts_of(12, [3, 40, 17])
    with caplog.at_level(logging.INFO, logger="nanovllm"), LLM(kv, kvcache_block_size=16,
                                                                max_num_batched_tokens=64) as llm:
        assert llm.config.quant.kv_scales
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out["token_ids"] for out in outs] == [hf_greedy(reference, prompt, 16) for prompt in prompts]
    notes = [r.getMessage() for r in caplog.records if "static KV-cache scales" in r.getMessage()]
    assert len(notes) == 1 and "checked and not used: the KV cache is float32 (kv_cache_dtype='auto'" in notes[0]
    caplog.clear()
    runs = []
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        for path in (kv, plain):
            with LLM(path, kv_cache_dtype="fp8", kvcache_block_size=16) as llm:
                runs.append([o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs[0] == runs[1]
    notes = [r.getMessage() for r in caplog.records if "static KV-cache scales" in r.getMessage()]
    assert len(notes) == 1 and "the fp8 KV cache scales each token and head as it is written" in notes[0]


def test_bad_static_kv_cache_scales_are_refused(kv_scales, tmp_path):
    """A KV-cache scale that is NaN, infinite, zero or negative, or of more than one value, is refused, naming the
    tensor (compressed-tensors' k_scale and q_scale, AutoFP8's v_proj.output_scale and prob_output_scale); the same
    scales in a checkpoint whose config has no kv_cache_scheme are refused as tensors no layer reads, saying which
    configs read them."""
    fmt, kv, _, _ = kv_scales
    one, wide = (("k_scale", "q_scale") if fmt == "compressed-tensors"
                 else ("v_proj.output_scale", "prob_output_scale"))
    name = f"model.layers.1.self_attn.{one}"
    for value in (float("nan"), float("inf"), 0.0, -0.5):
        bad = _variant(kv, tmp_path / f"bad-{value}")
        edit_tensors(bad, replace={name: torch.tensor(value)})
        with pytest.raises(ValueError, match=rf"'{name}': static KV-cache scale {value} is not a finite positive "
                                             "number"):
            LLM(bad)
    name = f"model.layers.0.self_attn.{wide}"
    bad = _variant(kv, tmp_path / "wide")
    edit_tensors(bad, replace={name: torch.full((2,), 0.01)})
    with pytest.raises(ValueError, match=rf"'{name}': static KV-cache scale of shape \(2,\): a kv_cache_scheme's "
                                         "scale is one value per tensor"):
        LLM(bad)
    config = json.load(open(os.path.join(kv, "config.json")))["quantization_config"]
    unnamed = _variant(kv, tmp_path / "no-scheme", quantization_config={
        k: v for k, v in config.items() if k != "kv_cache_scheme"})
    with pytest.raises(ValueError, match=rf"'model.layers.0.self_attn.{re.escape(KV_NAMES[fmt])}' matches no "
                                         r"parameter .*: a static KV-cache scale, which nanovllm reads \(checks and "
                                         r"does not use\) only on the attention .* where quantization_config has a "
                                         "kv_cache_scheme"):
        LLM(unnamed)


KV_NAMES = {"compressed-tensors": "k_scale", "autofp8": "k_proj.output_scale"}  # (each checkpoint's first)


def test_autofp8_first_kv_scale_format(base, tmp_path):
    """AutoFP8's first FP8-KV checkpoints (mid-2024) hold one self_attn.kv_scale per attention (vLLM reads it as
    k_scale and v_scale alike): checked and dropped like the others, giving transformers' tokens; a bad one is
    refused, named; without a kv_cache_scheme refused saying which configs read it."""
    fp8, reference = make_fp8(base, tmp_path / "fp8", "autofp8", tmp_path / "reference")
    edit_tensors(fp8, replace={f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.02 * (i + 1)) for i in range(2)})
    edit_config(fp8, quantization_config={**AUTOFP8_CONFIG, "kv_cache_scheme": "static"})
    prompt = prompts_of(14, [19])[0]
    with LLM(fp8, kvcache_block_size=16) as llm:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(reference, prompt, 16)
    name = "model.layers.1.self_attn.kv_scale"
    bad = _variant(fp8, tmp_path / "bad")
    edit_tensors(bad, replace={name: torch.tensor(-1.0)})
    with pytest.raises(ValueError, match=rf"'{name}': static KV-cache scale -1.0 is not a finite positive number"):
        LLM(bad)
    unnamed = _variant(fp8, tmp_path / "no-scheme", quantization_config=AUTOFP8_CONFIG)
    with pytest.raises(ValueError, match=r"self_attn.kv_scale' matches no parameter .*: a static KV-cache scale"):
        LLM(unnamed)


# the names vLLM's loader maps onto its attention's KV-cache scales besides the formats' own (KV_SCALES): its own
# attention module's, a fused q/k/v projection's, ModelOpt's (either of k/v_proj with either scale), HunYuan's
OTHER_KV_NAMES = ("attn.k_scale", "attn.v_scale", "attn.q_scale", "attn.prob_scale", "qkv_proj.k_scale",
                  "qkv_proj.v_scale", "k_proj.k_scale", "v_proj.v_scale", "k_proj.v_scale", "v_proj.k_scale",
                  "q.scale", "k_cache.scale", "v_cache.scale")


def test_kv_cache_scales_under_the_other_names_vllm_reads(base, tmp_path):
    """Static KV-cache scales under each other name vLLM's loader maps onto its attention (OTHER_KV_NAMES, in every
    attention module): checked and dropped like the others, giving transformers' tokens; a bad one refused, named;
    without a kv_cache_scheme refused as a tensor no layer reads."""
    plain, reference = make_fp8(base, tmp_path / "plain", "compressed-tensors", tmp_path / "reference")
    kv = add_kv_scales(shutil.copytree(plain, tmp_path / "kv"), "compressed-tensors", OTHER_KV_NAMES)
    prompt = prompts_of(17, [23])[0]
    with LLM(kv, kvcache_block_size=16) as llm:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(reference, prompt, 16)
    for name in OTHER_KV_NAMES:
        bad = _variant(kv, tmp_path / f"bad-{name}")
        edit_tensors(bad, replace={f"model.layers.1.self_attn.{name}": torch.tensor([-1.0])})
        with pytest.raises(ValueError, match=rf"'model.layers.1.self_attn.{re.escape(name)}': static KV-cache scale "
                                             "-1.0 is not a finite positive number"):
            LLM(bad)
    unnamed = _variant(kv, tmp_path / "no-scheme", quantization_config=CT_CONFIG)
    with pytest.raises(ValueError, match=r"self_attn.attn.k_scale' matches no parameter .*: a static KV-cache scale"):
        LLM(unnamed)


def test_static_kv_cache_scales_under_tensor_parallelism(kv_scales):
    """Every rank reads and checks each (scalar) KV-cache scale whole: TP=2 gives transformers' tokens."""
    _, kv, _, reference = kv_scales
    prompt = prompts_of(13, [21])[0]
    with LLM(kv, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(reference, prompt, 16)


def test_quantized_layer_outputs_are_refused_by_name():
    """compressed-tensors' output_activations (each Linear's output quantized, static ones stored as output_scale):
    refused naming the field, not read as KV-cache scales nor run without quantizing the outputs."""
    from types import SimpleNamespace

    from nanovllm.quantization import quant_config
    spec = ct_config(strategy="tensor")
    spec["config_groups"]["group_0"]["output_activations"] = dict(STATIC_INPUTS)
    with pytest.raises(ValueError, match=r"output_activations \(quantized layer outputs\) are not supported"):
        quant_config(SimpleNamespace(quantization_config=spec), None)


def test_what_the_configs_say_about_kv_cache_scales():
    """kv_scales for compressed-tensors' static per-tensor fp8 kv_cache_scheme (its absent fields at
    compressed-tensors' defaults: static, symmetric) with any weight format, and AutoFP8's 'static' with or without
    block-scaled weights; not without a kv_cache_scheme (nor for quantization='fp8')."""
    from types import SimpleNamespace

    from nanovllm.quantization import quant_config
    def kv(spec):
        return quant_config(SimpleNamespace(quantization_config=spec), None).kv_scales
    for spec in (CT_CONFIG, QWEN_CONFIG, AUTOFP8_CONFIG, {**CT_CONFIG, "kv_cache_scheme": None}):
        assert not kv(spec)
    assert not quant_config(SimpleNamespace(), "fp8").kv_scales
    brief = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    for spec in ({**CT_CONFIG, "kv_cache_scheme": KV_CACHE_SCHEME}, {**CT_CONFIG, "kv_cache_scheme": brief},
                 {**ct_config(strategy="tensor"), "kv_cache_scheme": KV_CACHE_SCHEME},
                 {**ct_config(None, strategy="block", block_structure=[128, 128]), "kv_cache_scheme": KV_CACHE_SCHEME},
                 {**AUTOFP8_CONFIG, "kv_cache_scheme": "static"}, {**QWEN_CONFIG, "kv_cache_scheme": "Static"}):
        assert kv(spec), spec


# ---- refusals -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_fp8(base, tmp_path_factory) -> str:
    return make_fp8(base, tmp_path_factory.mktemp("fp8_q"), "qwen", tmp_path_factory.mktemp("fp8_q_ref"))[0]


def _variant(source: str, path, **config) -> str:
    shutil.copytree(source, path)
    return edit_config(os.fspath(path), **config)


def test_transforms_fused_into_the_weights_need_nothing_at_run_time():
    """A transform_config whose rotations are all fused into the stored weights (SpinQuant's R1/R2: weight_input,
    weight_output) loads as a plain checkpoint, as vLLM reads it; only online ones are refused (above)."""
    from types import SimpleNamespace

    from nanovllm.quantization import quant_config
    fused = {"config_groups": {"R1": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "weight_input", "inverse": True},
        {"targets": ["Linear"], "location": "weight_output"}]}}}
    assert quant_config(SimpleNamespace(quantization_config={**CT_CONFIG, "transform_config": fused}), None)


def test_a_dense_sparsity_config_loads_as_it_is():
    """2:4 sparse weights stored whole (sparsity_config format 'dense') are plain fp8 weights with zeros in them;
    only compressed sparse formats are refused (below)."""
    from types import SimpleNamespace

    from nanovllm.quantization import quant_config
    dense = {"format": "dense", "sparsity_structure": "2:4", "targets": ["Linear"], "ignore": ["lm_head"]}
    assert quant_config(SimpleNamespace(quantization_config={**CT_CONFIG, "sparsity_config": dense}), None)


QUIP = {"config_groups": {
    "v": {"type": "hadamard", "randomize": True, "apply": [
        {"targets": ["Linear"], "location": "input", "ignore": ["lm_head"]},
        {"targets": ["Linear"], "location": "weight_input", "inverse": True, "ignore": ["lm_head"]}]},
    "u": {"type": "hadamard", "randomize": True, "apply": [
        {"targets": ["Linear"], "location": "weight_output", "ignore": ["lm_head"]},
        {"targets": ["Linear"], "location": "output", "inverse": True, "ignore": ["lm_head"]}]}}}


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq', which nanovllm does not support"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({**QWEN_CONFIG, "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({**QWEN_CONFIG, "activation_scheme": "static"}, r"activation_scheme 'static' with weight_block_size \[128, 128\] "
                                                     "is not supported"),
    ({**AUTOFP8_CONFIG, "activation_scheme": "per_tensor"}, "activation_scheme 'per_tensor' is not supported"),
    # static input scales other than one per tensor, symmetric, fp8; or with block-scaled weights
    (ct_config({**STATIC_INPUTS, "strategy": "channel"}), "static input activation scales with strategy 'channel' "
                                                          "are not supported"),
    (ct_config({**STATIC_INPUTS, "strategy": "group", "group_size": 128}), "with strategy 'group' are not supported"),
    (ct_config({**STATIC_INPUTS, "strategy": "token"}), "with strategy 'token' are not supported"),
    (ct_config({**STATIC_INPUTS, "symmetric": False}), "asymmetric static input activation scales"),
    (ct_config({**STATIC_INPUTS, "type": "int"}), "input activations of 8 bits, type 'int' are not supported"),
    (ct_config(strategy="block", block_structure=[128, 128]), "static input activation scales with block-scaled "
                                                              "weights are not supported"),
    ({**QWEN_CONFIG, "weight_block_size": [128, 100]}, r"weight_block_size \[128, 100\] is not supported"),
    ({**QWEN_CONFIG, "weight_block_size": [128, 16]}, "the columns' at least 32"),
    # KV-cache scales other than static per-tensor fp8 (AutoFP8's 'static', compressed-tensors' float tensor scheme)
    ({**QWEN_CONFIG, "kv_cache_scheme": "dynamic"}, "kv_cache_scheme 'dynamic' is not supported; only 'static'"),
    ({**CT_CONFIG, "kv_cache_scheme": {**KV_CACHE_SCHEME, "type": "int"}}, "kv_cache_scheme with type 'int' is not "
                                                                         "supported; only static per-tensor fp8"),
    ({**CT_CONFIG, "kv_cache_scheme": {"num_bits": 4, "strategy": "tensor"}}, "kv_cache_scheme with num_bits 4, type "
                                                                              "'int' is not supported"),
    ({**CT_CONFIG, "kv_cache_scheme": {**KV_CACHE_SCHEME, "strategy": "attn_head"}}, "kv_cache_scheme with strategy "
                                                                                    "'attn_head' is not supported"),
    ({**CT_CONFIG, "kv_cache_scheme": {**KV_CACHE_SCHEME, "strategy": "channel"}}, "kv_cache_scheme with strategy "
                                                                                  "'channel' is not supported"),
    ({**CT_CONFIG, "kv_cache_scheme": {**KV_CACHE_SCHEME, "dynamic": True}}, "kv_cache_scheme with dynamic True is "
                                                                            "not supported"),
    ({**CT_CONFIG, "kv_cache_scheme": {**KV_CACHE_SCHEME, "symmetric": False}}, "kv_cache_scheme with symmetric "
                                                                               "False is not supported"),
    ({**CT_CONFIG, "kv_cache_scheme": "static"}, "kv_cache_scheme 'static' is not supported; compressed-tensors' "
                                                 "kv_cache_scheme is a dict"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "format 'pack-quantized' is not supported"),
    ({**CT_CONFIG, "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4",
                                        "targets": ["Linear"], "ignore": ["lm_head"]}},
     "sparsity_config format 'sparse-24-bitmask' \\(compressed sparse weights\\) is not supported"),
    # QuIP's rotations (llm-compressor's template): W is stored rotated, x and y must be rotated at run time
    ({**CT_CONFIG, "transform_config": QUIP}, r"transform_config with online rotations \(v at input, u at output\)"),
    ({**QWEN_CONFIG, "transform_config": QUIP}, r"transform_config with online rotations \(v at input, u at output\)"),
])
def test_unsupported_formats_are_refused(qwen_fp8, tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(_variant(qwen_fp8, tmp_path / "variant", quantization_config=config))


def test_what_the_configs_say_about_activations():
    """Dynamic fp8 activations where the format has them; none for a weight-only compressed-tensors checkpoint
    (its activations stay 16-bit against the fp8 weights on CUDA); static ones for AutoFP8's activation_scheme
    'static' and compressed-tensors' static per-tensor input activations, with either weight strategy."""
    from types import SimpleNamespace

    from nanovllm.quantization import quant_config
    from tests.quantization.checkpoints import CT_CONFIG
    weight_only = {**CT_CONFIG, "config_groups": {"group_0": {**CT_CONFIG["config_groups"]["group_0"],
                                                              "input_activations": None}}}
    assert quant_config(SimpleNamespace(quantization_config=CT_CONFIG), None).activations
    assert not quant_config(SimpleNamespace(quantization_config=weight_only), None).activations
    assert quant_config(SimpleNamespace(quantization_config=QWEN_CONFIG), None).block == (128, 128)
    capitalised = {**QWEN_CONFIG, "activation_scheme": "Dynamic"}  # (transformers lowercases it)
    assert quant_config(SimpleNamespace(quantization_config=capitalised), None).activations
    online = quant_config(SimpleNamespace(), "fp8")
    assert online.online and online.activations and online.block == (1, None)
    assert not online.static_activations
    for dynamic in (CT_CONFIG, weight_only, QWEN_CONFIG):
        assert not quant_config(SimpleNamespace(quantization_config=dynamic), None).static_activations
    for static in (AUTOFP8_CONFIG, {**AUTOFP8_CONFIG, "activation_scheme": "Static"}, ct_config(strategy="channel"),
                   ct_config(strategy="tensor")):
        config = quant_config(SimpleNamespace(quantization_config=static), None)
        assert config.activations and config.static_activations and config.block == (1, None)


def test_bad_quantization_options(base, qwen_fp8, tmp_path):
    with pytest.raises(ValueError, match="quantization must be None or one of 'fp8', 'compressed-tensors', got 'awq'"):
        LLM(base, quantization="awq")
    with pytest.raises(ValueError, match="quantization='compressed-tensors' needs a checkpoint in that format"):
        LLM(base, quantization="compressed-tensors")
    with pytest.raises(ValueError, match="quantization='compressed-tensors', but the checkpoint is quantized with "
                                         "'fp8'"):
        LLM(qwen_fp8, quantization="compressed-tensors")
    awq = _variant(qwen_fp8, tmp_path / "awq", quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'awq', which nanovllm does not support"):  # (not: pass None)
        LLM(awq, quantization="fp8")
    with pytest.raises(TypeError, match="quantization must be a str or None"):
        LLM(base, quantization=8)


def test_missing_or_misshapen_scales_and_fp8_without_a_config_are_refused(qwen_fp8, tmp_path):
    scale = "model.layers.1.mlp.down_proj.weight_scale_inv"
    missing = _variant(qwen_fp8, tmp_path / "missing")
    edit_tensors(missing, drop=(scale,))
    with pytest.raises(ValueError, match="lacks weights for: model.layers.1.mlp.down_proj.weight_scale_inv"):
        LLM(missing)
    misshapen = _variant(qwen_fp8, tmp_path / "misshapen")
    edit_tensors(misshapen, replace={scale: torch.ones(3, 4)})
    with pytest.raises(ValueError, match=rf"{scale}.*scale shape \(3, 4\) does not match the expected \(2, 4\)"):
        LLM(misshapen)
    for bad in (float("nan"), float("inf")):  # (a whole model of NaN or inf logits, without a word)
        damaged = _variant(qwen_fp8, tmp_path / f"damaged-{bad}")
        edit_tensors(damaged, replace={scale: torch.full((2, 4), 1e-3).index_fill_(1, torch.tensor([2]), bad)})
        with pytest.raises(ValueError, match=rf"{scale}.*holds NaN or infinite scales"):
            LLM(damaged)
    # a weight the config quantizes, stored in another dtype (its scale present): copy_ would convert it silently
    weight = "model.layers.1.mlp.down_proj.weight"
    stored = load_file(os.path.join(qwen_fp8, "model.safetensors"))[weight]
    for dtype, why in ((torch.float8_e5m2, "only e4m3 fp8 checkpoints are supported"),
                       (torch.bfloat16, "the checkpoint's quantization_config quantizes this layer")):
        other = _variant(qwen_fp8, tmp_path / str(dtype))
        edit_tensors(other, replace={weight: stored.float().to(dtype)})
        with pytest.raises(ValueError, match=rf"'{weight}': is {dtype} but this layer's weight is float8_e4m3fn: "
                                             rf"{why}"):
            LLM(other)
    bare = _variant(qwen_fp8, tmp_path / "bare", quantization_config=None)
    with pytest.raises(ValueError, match="is torch.float8_e4m3fn but the model's parameter is torch.float32: an fp8 "
                                         "checkpoint needs its quantization_config"):
        LLM(bare)
    # a static KV-cache scale (AutoFP8's k_proj.output_scale) no layer reads: named as one
    kv = _variant(qwen_fp8, tmp_path / "kv-scales")
    edit_tensors(kv, replace={"model.layers.0.self_attn.k_proj.output_scale": torch.tensor(0.01)})
    with pytest.raises(ValueError, match=r"output_scale' matches no parameter .*: a static KV-cache scale"):
        LLM(kv)
    # no weight_block_size: one scale per tensor (weight_scale), as vLLM reads it; transformers assumes 128 x 128
    blockless = _variant(qwen_fp8, tmp_path / "blockless", quantization_config={
        k: v for k, v in QWEN_CONFIG.items() if k != "weight_block_size"})
    with pytest.raises(ValueError, match=r"weight_scale_inv' matches no parameter .*: block scales .*"
                                         r"quantization_config needs its weight_block_size, e\.g\. \[128, 128\]"):
        LLM(blockless)
    # quantization="fp8" quantizes 16/32-bit tensors; fp8 ones (scales or not) are refused, not read unscaled
    unscaled = _variant(qwen_fp8, tmp_path / "unscaled", quantization_config=None)
    edit_tensors(unscaled, drop=tuple(n for n in load_file(os.path.join(unscaled, "model.safetensors"))
                                      if n.endswith("_scale_inv")))
    for path in (bare, unscaled):
        with pytest.raises(ValueError, match="is torch.float8_e4m3fn, but quantization='fp8' quantizes a 16/32-bit "
                                             "checkpoint: an fp8 checkpoint needs its quantization_config"):
            LLM(path, quantization="fp8")


@pytest.mark.parametrize("fmt", ["qwen", "compressed-tensors"])
def test_moe_checkpoints_in_fp8(tmp_path, fmt):
    """Qwen3-MoE in fp8 (experts too, as Qwen3-30B-A3B-FP8): transformers' tokens on the dequantized weights (on
    CPU the experts are dequantized at load; tests/quantization/test_fp8_gpu.py runs them in fp8). An expert without
    its scale, or with a misshapen one, is refused, named."""
    moe = make_checkpoint(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden=256,
                          head_dim=64, moe_intermediate_size=192, decoder_sparse_step=1, seed=5)  # (several blocks)
    fp8, reference = make_fp8(moe, tmp_path / "fp8", fmt, tmp_path / "reference")
    prompts = prompts_of(5, [4, 33])
    with LLM(fp8, kvcache_block_size=16) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = [hf_greedy(reference, prompt, 16) for prompt in prompts]
    assert [out["token_ids"] for out in outs] == expected
    if fmt == "qwen":  # 192 intermediate columns over two ranks: 96 each, not whole 128-column blocks
        with pytest.raises(ValueError, match="split over 2 ranks into 96 columns each, not a whole number of the "
                                             "checkpoint's 128-column scale blocks"):
            LLM(fp8, tensor_parallel_size=2)
    else:  # per-row scales: the experts' weights and scales sliced alike over two ranks
        with LLM(fp8, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
            assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    scale = "weight_scale_inv" if fmt == "qwen" else "weight_scale"
    edit_tensors(fp8, drop=(f"model.layers.1.mlp.experts.2.up_proj.{scale}",))
    with pytest.raises(ValueError, match=f"lacks weights for: model.layers.1.mlp.experts.2.up_proj.{scale}"):
        LLM(fp8)
    down = "model.layers.0.mlp.experts.1.down_proj"
    weight = load_file(os.path.join(fp8, "model.safetensors"))[f"{down}.weight"]
    edit_tensors(fp8, replace={f"{down}.weight": weight.to(torch.bfloat16)})  # (refused, not rounded into fp8)
    with pytest.raises(ValueError, match=f"'{down}.weight': is torch.bfloat16 but this layer's weight is float8"):
        LLM(fp8)
    edit_tensors(fp8, replace={f"{down}.weight": weight, f"{down}.{scale}": torch.ones(3, 5)})
    with pytest.raises(ValueError, match=f"experts.1.down_proj.{scale}'.*scale shape \\(3, 5\\) does not match"):
        LLM(fp8)


def test_online_fp8_quantizes_moe_experts_per_row(tmp_path):
    """quantization="fp8" on an MoE checkpoint: the experts too are rounded through fp8 per row (the
    compressed-tensors reference rounds every projection, experts included, per channel). (Under tensor
    parallelism each rank rounds its own shard, so a row-parallel layer's rows get one scale per rank, as in vLLM:
    not the reference's.)"""
    moe = make_checkpoint(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden=256,
                          head_dim=64, moe_intermediate_size=192, decoder_sparse_step=1, seed=6)
    _, reference = make_fp8(moe, tmp_path / "unused", "compressed-tensors", tmp_path / "reference")
    prompts = prompts_of(6, [4, 30])
    expected = [hf_greedy(reference, prompt, 16) for prompt in prompts]
    with LLM(moe, quantization="fp8", kvcache_block_size=16) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


@pytest.mark.parametrize("fmt,ignore,layers", [
    ("qwen", [f"model.layers.{i}.block_sparse_moe" for i in range(2)], (0, 1)),
    ("compressed-tensors", ["lm_head", r"re:.*layers\.0\.block_sparse_moe\.experts"], (0,))])  # (layer 1's: fp8)
def test_mixtral_fp8_checkpoints_and_their_ignore_lists(tmp_path, fmt, ignore, layers):
    """Mixtral in fp8 (experts stored as block_sparse_moe.experts.<e>.w1/w2/w3, our mlp.experts): transformers'
    tokens on the dequantized weights, and again with experts left 32-bit (both layers', or layer 0's) by an ignore
    list naming them as the checkpoint does; an ignore list naming one expert's w2 alone is refused, naming it;
    32-bit experts the config quantizes and a missing expert are refused, named as the checkpoint names them."""
    mix = make_checkpoint(tmp_path / "mix", "mixtral", tie=False, num_local_experts=4, num_experts_per_tok=2,
                          hidden=256, head_dim=64, seed=5)
    fp8, reference = make_fp8(mix, tmp_path / "fp8", fmt, tmp_path / "reference")
    prompts = prompts_of(7, [5, 29])
    expected = [hf_greedy(reference, prompt, 16) for prompt in prompts]
    with LLM(fp8, kvcache_block_size=16) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    plain = load_file(os.path.join(reference, "model.safetensors"))
    experts = [name for name in load_file(os.path.join(fp8, "model.safetensors"))
               if any(f"layers.{i}.block_sparse_moe.experts." in name for i in layers)]
    edit_tensors(fp8, drop=tuple(experts), replace={n: plain[n] for n in experts if n.endswith(".weight")})
    key = "modules_to_not_convert" if fmt == "qwen" else "ignore"
    config = json.load(open(os.path.join(fp8, "config.json")))["quantization_config"]
    edit_config(fp8, quantization_config={**config, key: ignore})
    with LLM(fp8, kvcache_block_size=16) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    edit_config(fp8, quantization_config={**config, key: ["model.layers.1.block_sparse_moe.experts.3.w2"]})
    with pytest.raises(ValueError, match=r"leaves model.layers.1.block_sparse_moe.experts.3.w2 unquantized but not "
                                         r"the rest of model.layers.1.mlp.experts, .*\(12 checkpoint modules\)"):
        LLM(fp8)
    edit_config(fp8, quantization_config=config)  # 32-bit experts the config quantizes: named as the checkpoint does
    expert = r"model\.layers\.\d\.block_sparse_moe\.experts\.\d\.w\d\.weight"
    with pytest.raises(ValueError, match=f"checkpoint tensor '{expert}'"
                                         r": is torch.float32 but this layer's weight is float8_e4m3fn"):
        LLM(fp8)
    edit_config(fp8, quantization_config={**config, key: ignore})  # a missing expert: named as the checkpoint does
    missing = f"model.layers.{layers[-1]}.block_sparse_moe.experts.3.w3.weight"
    edit_tensors(fp8, drop=(missing,))
    with pytest.raises(ValueError, match=f"lacks weights for: {re.escape(missing)}"):
        LLM(fp8)


# ---- the CUDA kernels, through Triton's interpreter (tests/quantization/test_fp8_gpu.py compiles them) ----------

def _fp8_weight(n: int, k: int, group: int | None):
    from nanovllm.quantization.fp8 import quantize_rows
    w = torch.randn(n, k) * 0.05
    if group is None:
        return quantize_rows(w)
    blocks = w.view(n, k // group, group)
    scale = blocks.abs().amax(-1) / 448.0
    return (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(n, k), scale


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [None, 128, 512])
@pytest.mark.parametrize("rows", [3, 70])
def test_w8a16_fp8_kernel(group, rows):
    """w8a16: 16-bit rows against the fp8 weight, scaled per channel or per 128- or 512-column group (a group wider
    than a step: each step takes its group's scale) plus a bias; one row tile (small-batch decode) and several
    (weight-only checkpoints)."""
    from nanovllm.kernels.fp8_gemm import w8a16
    from nanovllm.quantization.fp8 import dequantize
    torch.manual_seed(0)
    x = torch.randn(rows, 1024).to(torch.float16)
    wq, ws = _fp8_weight(80, 1024, group)
    bias = torch.randn(80).to(torch.float16)
    y = w8a16(x, wq, ws, group, bias)
    expected = x.float() @ dequantize(wq, ws, group).t() + bias.float()
    torch.testing.assert_close(y.float(), expected, atol=3e-3, rtol=3e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("k,group", [(640, None), (5000, None), (20000, None), (384, 128), (2560, 128), (4608, 128),
                                     (300, 64), (480, 96)])
@pytest.mark.parametrize("column_major", [False, True])
def test_activation_quantizer_matches_its_definition(k, group, column_major):
    """Each row (per token) or group of columns: scale |max| / 448 (exactly torch's), values x / scale in e4m3.
    Whole rows past 4,096 columns and past a program's tile (20,000, read in two passes), group counts that are not
    a power of two or span several programs, a ragged last group; rows of very different size make a shared or
    misplaced scale fail. Every code is torch's, or one of the interpreter's own e4m3 roundings (about 3% of these
    draws): a tie rounded away from zero (one step off), a value that rounds up into the next binade halved
    (127.4 -> 64). A value read from the wrong column is neither."""
    from nanovllm.kernels.fp8_gemm import quantize_activations
    torch.manual_seed(k)
    x = (torch.randn(5, k) * torch.logspace(-3, 3, 5)[:, None]).to(torch.float16)
    q, s = quantize_activations(x, group, column_major)
    assert s.stride() == ((1, 5) if column_major else (s.shape[1], 1))
    g = group or k
    blocks = [x[:, i:i + g].float() for i in range(0, k, g)]
    scales = torch.stack([b.abs().amax(-1).clamp_min(1e-12) / 448.0 for b in blocks], 1)
    values = torch.cat([(b / scales[:, i:i + 1]).clamp(-448, 448) for i, b in enumerate(blocks)], 1)
    assert torch.equal(s, scales)
    got, want = q.float(), values.to(torch.float8_e4m3fn).float()
    interpreter_rounding = ((got - want).abs() <= want.abs() / 8 + 2 ** -9) | (got * 2 == want)
    assert ((got == want) | interpreter_rounding).all()
    assert (got == want).float().mean() > 0.95


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [640, 20000])
def test_activation_quantizer_with_a_static_scale(k):
    """static_scale: every row quantized with the one scale given, clamp(x / s, -448, 448) in e4m3 (rows larger than
    448 s saturate), and every scale returned is s; a row in one tile, and one past a program's tile (20,000
    columns: no max pass). Codes within the interpreter's own e4m3 roundings, as above."""
    from nanovllm.kernels.fp8_gemm import quantize_activations
    torch.manual_seed(k)
    x = (torch.randn(5, k) * torch.logspace(-2, 1, 5)[:, None]).to(torch.float16)
    static = torch.tensor([x[2].float().abs().max().item() / 448.0])  # rows 3 and 4 saturate
    q, s = quantize_activations(x, None, static_scale=static)
    assert s.shape == (5, 1) and (s == static).all()
    got, want = q.float(), (x.float() / static).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    interpreter_rounding = ((got - want).abs() <= want.abs() / 8 + 2 ** -9) | (got * 2 == want)
    assert ((got == want) | interpreter_rounding).all()
    assert (got == want).float().mean() > 0.95
    assert (got.abs().amax(1)[3:] == 448).all() and (got.abs().amax(1)[:2] < 448).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [20, 100])
def test_block_scaled_fp8_gemm(rows):
    """block_gemm on fp8 activations (scales per token and group) and block-scaled weights; small-batch and larger
    tiles, ragged in rows and columns."""
    from nanovllm.kernels.fp8_gemm import block_gemm
    from nanovllm.quantization.fp8 import dequantize
    torch.manual_seed(1)
    x = torch.randn(rows, 256)
    xs = x.view(rows, 2, 128).abs().amax(-1) / 448.0
    xq = (x.view(rows, 2, 128) / xs[..., None]).to(torch.float8_e4m3fn).view(rows, 256)
    wq, ws = _fp8_weight(200, 256, 128)
    y = block_gemm(xq, xs, wq, ws, 128, None, torch.float16)
    expected = dequantize(xq, xs, 128) @ dequantize(wq, ws, 128).t()
    torch.testing.assert_close(y.float(), expected, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("fmt,ignore", [("qwen", ["model.layers.0.mlp"]), ("qwen", ["model.layers.0.mlp.*"]),
                                        ("compressed-tensors", ["lm_head", r"re:.*layers\.0\.mlp"])])
def test_modules_the_config_leaves_unquantized(base, tmp_path, fmt, ignore):
    """Layer 0's MLP kept in float32, named as the formats name it: a parent module or a regex matched from the start
    up to a module boundary (transformers' modules_to_not_convert, not a literal name), or a `re:` regex matched
    from the start (compressed-tensors' ignore)."""
    from safetensors.torch import load_file
    fp8, reference = make_fp8(base, tmp_path / "fp8", fmt, tmp_path / "reference")
    plain = load_file(os.path.join(reference, "model.safetensors"))
    mlp = [name for name in load_file(os.path.join(fp8, "model.safetensors")) if "layers.0.mlp" in name]
    edit_tensors(fp8, drop=tuple(mlp), replace={n: plain[n] for n in mlp if n.endswith(".weight")})
    key = "modules_to_not_convert" if fmt == "qwen" else "ignore"
    config = json.load(open(os.path.join(fp8, "config.json")))["quantization_config"]
    edit_config(fp8, quantization_config={**config, key: ignore})
    prompts = prompts_of(4, [6, 30])
    with LLM(fp8, kvcache_block_size=16) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(reference, prompt, 16)


def test_fp8_ignored_layers_come_before_modules_to_not_convert(base, tmp_path):
    """quant_method 'fp8' with both lists: vLLM's Fp8Config reads ignored_layers (AutoFP8's module names), and
    modules_to_not_convert only where ignored_layers is absent or empty. Layer 0's MLP kept float32 by ignored_layers,
    beside a modules_to_not_convert naming layer 1's attention, which the checkpoint holds in fp8 (vLLM quantizes
    it): transformers' tokens on the dequantized weights. The config alone: the list vLLM reads decides, both ways."""
    from types import SimpleNamespace

    from nanovllm.quantization import quant_config
    mlp = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    both = {**QWEN_CONFIG, "ignored_layers": mlp, "modules_to_not_convert": ["model.layers.1.self_attn"]}
    fp8, reference = make_fp8(base, tmp_path / "fp8", "qwen", tmp_path / "reference")
    plain = load_file(os.path.join(reference, "model.safetensors"))
    kept = [name for name in load_file(os.path.join(fp8, "model.safetensors")) if "layers.0.mlp" in name]
    edit_tensors(fp8, drop=tuple(kept), replace={n: plain[n] for n in kept if n.endswith(".weight")})
    edit_config(fp8, quantization_config=both)
    prompts = prompts_of(16, [6, 31])
    with LLM(fp8, kvcache_block_size=16) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out["token_ids"] for out in outs] == [hf_greedy(reference, prompt, 16) for prompt in prompts]
    config = quant_config(SimpleNamespace(quantization_config=both), None)
    assert not config.quantizes("model.layers.0.mlp.down_proj") and config.quantizes("model.layers.1.self_attn.o_proj")
    for none in ([], None):  # (then modules_to_not_convert)
        config = quant_config(SimpleNamespace(quantization_config={**both, "ignored_layers": none}), None)
        assert config.quantizes("model.layers.0.mlp.down_proj")
        assert not config.quantizes("model.layers.1.self_attn.o_proj")


def test_an_ignore_list_that_splits_a_packed_layer_is_refused(qwen_fp8, tmp_path):
    """q_proj ignored but not k/v_proj (one qkv layer here), or one expert's down_proj but not the rest: refused,
    naming what the list leaves out, instead of an error about another tensor's dtype."""
    config = json.load(open(os.path.join(qwen_fp8, "config.json")))["quantization_config"]
    split = _variant(qwen_fp8, tmp_path / "qkv", quantization_config={
        **config, "modules_to_not_convert": ["model.layers.1.self_attn.q_proj"]})
    with pytest.raises(ValueError, match=r"ignore list leaves model.layers.1.self_attn.q_proj unquantized but not the "
                                         r"rest of model.layers.1.self_attn.qkv_proj, .* ignore all of them or none"):
        LLM(split)
    moe = make_checkpoint(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden=256,
                          head_dim=64, moe_intermediate_size=128, decoder_sparse_step=1, seed=5)
    fp8, _ = make_fp8(moe, tmp_path / "fp8", "qwen", tmp_path / "reference")
    ignore = ["model.layers.0.mlp.experts.2.down_proj"]
    edit_config(fp8, quantization_config={**config, "modules_to_not_convert": ignore})
    with pytest.raises(ValueError, match=r"leaves model.layers.0.mlp.experts.2.down_proj unquantized but not the rest "
                                         r"of model.layers.0.mlp.experts, .*\(12 checkpoint modules\)"):
        LLM(fp8)


def test_a_modelopt_checkpoint_is_refused_by_name(qwen_fp8, tmp_path):
    """NVIDIA ModelOpt keeps its quantization config in hf_quant_config.json, none in config.json (vLLM reads the
    file): refused naming it, not as fp8 tensors lacking a quantization_config."""
    modelopt = _variant(qwen_fp8, tmp_path / "modelopt", quantization_config=None)
    with open(os.path.join(modelopt, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}, f)
    for quantization in (None, "fp8"):
        with pytest.raises(ValueError, match="hf_quant_config.json makes this a ModelOpt quantized checkpoint"):
            LLM(modelopt, quantization=quantization)


def test_weight_updates_are_refused_on_fp8_weights(qwen_fp8):
    with LLM(qwen_fp8, kvcache_block_size=16) as llm:
        before = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"]
        with pytest.raises(ValueError, match="update_weights is not supported with quantized weights"):
            llm.update_weights(qwen_fp8)
        with pytest.raises(ValueError, match=r"sleep\(level=2\) is not supported with quantized weights"):
            llm.sleep(level=2)
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"] == before
