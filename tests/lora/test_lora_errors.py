"""Bad LoRA inputs: each is refused with an error that says what to change, before anything is queued, and the
engine serves the next request (the base model's and an adapter's) correctly."""
import os
import shutil

import pytest

from nanovllm import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import edit_config, make_adapter, peft_greedy
from tests.tiny_models import hf_greedy, make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 17, 300, 42, 9, 8, 77]


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    with LLM(qwen3_tied, enable_lora=True, max_loras=2, max_lora_rank=8, kvcache_block_size=16) as llm:
        yield llm


def still_works(llm, base: str, lora: LoRARequest):
    outs = llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[None, lora], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(base, PROMPT, 8)
    assert outs[1].outputs[0].token_ids == peft_greedy(base, lora.lora_path, PROMPT, 8)
    assert llm.scheduler.is_finished()


def adapter_copy(source: LoRARequest, path, lora_int_id: int = 10, **config) -> LoRARequest:
    shutil.copytree(source.lora_path, path)
    if config:
        edit_config(os.fspath(path), **config)
    return LoRARequest(f"copy{lora_int_id}", lora_int_id, os.fspath(path))


@pytest.fixture(scope="module")
def other_base_adapter(tmp_path_factory) -> LoRARequest:
    """An adapter of a model with a wider MLP than qwen3_tied's (the same layer count and hidden size)."""
    other = make_checkpoint(tmp_path_factory.mktemp("wide_mlp"), "qwen3", tie=True, num_kv_heads=2,
                            intermediate_size=96)
    path = make_adapter(other, tmp_path_factory.mktemp("wide_mlp_lora"), 4, ["up_proj"])
    return LoRARequest("wide", 20, path)


@pytest.fixture(scope="module")
def embedding_adapter(qwen3_tied, tmp_path_factory) -> LoRARequest:
    path = make_adapter(qwen3_tied, tmp_path_factory.mktemp("embed_lora"), 4, ["q_proj", "embed_tokens"])
    return LoRARequest("embed", 21, path)


def test_lora_request_without_enable_lora(qwen3_tied, lora_attention):
    with LLM(qwen3_tied, kvcache_block_size=16) as plain:
        with pytest.raises(ValueError, match="LoRA is not enabled: create the LLM with enable_lora=True"):
            plain.generate([PROMPT], GREEDY, lora_request=lora_attention, use_tqdm=False)
        assert plain.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, PROMPT, 8)
        assert plain.list_loras() == set()


def test_bad_adapters_are_refused_and_the_engine_goes_on(llm, qwen3_tied, lora_attention, lora_mixed, tmp_path,
                                                         other_base_adapter, embedding_adapter):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(lora_attention.lora_path, "adapter_config.json"), no_weights)
    broken = {}  # damaged files: each refused as a ValueError naming the adapter, not a parser's own error
    for name, file, text in [("bad_json", "adapter_config.json", b"{r: 4"), ("list", "adapter_config.json", b"[4]"),
                             ("cut", "adapter_model.safetensors", b"\x10\x00")]:
        broken[name] = adapter_copy(lora_attention, tmp_path / name, 40 + len(broken))
        with open(os.path.join(broken[name].lora_path, file), "wb") as f:
            f.write(text)
    cases = [
        (broken["bad_json"], r"'copy40' \(.*\): adapter_config.json is not valid JSON"),
        (broken["list"], "adapter_config.json must hold a JSON object, got list"),
        (broken["cut"], "adapter_model.safetensors cannot be read"),
        (adapter_copy(lora_attention, tmp_path / "alpha", 43, lora_alpha=-4), "lora_alpha must be a positive number"),
        (adapter_copy(lora_attention, tmp_path / "alpha2", 44, lora_alpha="sixteen"), "lora_alpha must be a positive"),
        (adapter_copy(lora_attention, tmp_path / "alpha3", 59, lora_alpha=float("inf")),
         r"lora_alpha must be a positive number \(finite\), got inf"),
        (adapter_copy(lora_attention, tmp_path / "rs", 45, use_rslora="yes"), "use_rslora must be true or false"),
        (adapter_copy(lora_attention, tmp_path / "experts", 46, target_parameters=["mlp.experts.gate_up_proj"],
                      alpha_pattern={"gate_up_proj": 32}), "LoRA on MoE experts is not supported"),
        (LoRARequest("missing", 30, os.fspath(tmp_path / "nowhere")), "nowhere.* does not exist"),
        (LoRARequest("empty", 31, os.fspath(empty)), "no adapter_config.json"),
        (LoRARequest("no_weights", 32, os.fspath(no_weights)), "no adapter_model.safetensors"),
        (lora_mixed, "rank 16, above max_lora_rank=8; raise max_lora_rank"),
        (other_base_adapter, r"A \[r, 64\] and B \[128, r\]: an adapter made for another base model"),
        (embedding_adapter, "embed_tokens"),
        (adapter_copy(lora_attention, tmp_path / "dora", 33, use_dora=True), "DoRA is not supported"),
        (adapter_copy(lora_attention, tmp_path / "prefix", 34, peft_type="PREFIX_TUNING"),
         "only LoRA adapters are supported"),
        (adapter_copy(lora_attention, tmp_path / "bias", 35, bias="lora_only"), "trained biases are not supported"),
        (adapter_copy(lora_attention, tmp_path / "save", 36, modules_to_save=["lm_head"]), "modules_to_save"),
        # PEFT applies an activated LoRA only from its invocation tokens on
        (adapter_copy(lora_attention, tmp_path / "alora", 37, alora_invocation_tokens=[5, 17]), "activated LoRA"),
        # PiSSA / OLoRA adapters are relative to a base PEFT modifies as it loads them
        (adapter_copy(lora_attention, tmp_path / "pissa", 38, init_lora_weights="pissa_niter_4"),
         "path_initial_model_for_weight_conversion"),
        (adapter_copy(lora_attention, tmp_path / "olora", 39, init_lora_weights="olora"),
         "init_lora_weights='olora'"),
        (adapter_copy(lora_attention, tmp_path / "loftq", 48, init_lora_weights="loftq"),
         "a LoftQ adapter applies to the base model LoftQ saved with it"),
        # LoRA variants whose product is not the plain B A x (their factors' shapes may even look like another base's)
        (adapter_copy(lora_attention, tmp_path / "qalora", 50, use_qalora=True, qalora_group_size=16),
         r"QA-LoRA .* is not supported \(use_qalora=True"),
        (adapter_copy(lora_attention, tmp_path / "kasa", 51, kasa_config={"beta": 1e-4, "gamma": 1e-3}),
         "KaSA .* is not supported"),
        (adapter_copy(lora_attention, tmp_path / "arrow", 52, arrow_config={"top_k": 3}), "Arrow .* is not supported"),
        (adapter_copy(lora_attention, tmp_path / "lora_bias", 53, lora_bias=True), "a trained bias on lora_B"),
        (adapter_copy(lora_attention, tmp_path / "tokens", 54, trainable_token_indices=[3, 4]),
         "trained embedding rows"),
        # a variant from a later PEFT, by PEFT's naming of them
        (adapter_copy(lora_attention, tmp_path / "future", 55, use_foo=True),
         "use_foo=True in adapter_config.json selects a LoRA variant nanovllm does not know"),
        (adapter_copy(lora_attention, tmp_path / "future2", 56, bar_config={"k": 1}),
         "bar_config=.* selects a LoRA variant nanovllm does not know"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[None, request], use_tqdm=False)
        with pytest.raises(ValueError, match=message):
            llm.add_lora(request)
        assert request.lora_int_id not in llm.list_loras()
        still_works(llm, qwen3_tied, lora_attention)


def test_lora_on_stacked_experts_is_refused_as_such(lora_attention, tmp_path):
    """PEFT targets an MoE layer's stacked experts by their parameter names (target_parameters ["gate_up_proj",
    "down_proj"], with an alpha_pattern): the refusal names the experts, not the alpha_pattern."""
    from types import SimpleNamespace

    from nanovllm.lora.peft import read_adapter
    request = adapter_copy(lora_attention, tmp_path / "moe", 49, target_parameters=["gate_up_proj", "down_proj"],
                           alpha_pattern={"gate_up_proj": 32})
    with pytest.raises(ValueError, match=r"\['gate_up_proj', 'down_proj'\] are this MoE model's stacked expert "
                                         "weights: LoRA on MoE experts is not supported"):
        read_adapter(request, SimpleNamespace(num_experts=4), 64)


def test_block_diagonal_lora_is_refused_as_such(llm, qwen3_tied, tmp_path):
    """A BD-LoRA adapter (PEFT's use_bdlora: block-diagonal A or B, stored as [r, in / blocks] or [out, r / blocks])
    is refused as BD-LoRA, not as an adapter of another base model."""
    from peft.tuners.lora.config import BdLoraConfig
    path = make_adapter(qwen3_tied, tmp_path / "bdlora", 4, ["q_proj", "o_proj"], use_bdlora=BdLoraConfig(
        target_modules_bd_a=["q_proj"], target_modules_bd_b=["o_proj"], nblocks=2))
    with pytest.raises(ValueError, match=r"BD-LoRA \(block-diagonal A or B factors\) is not supported"):
        llm.add_lora(LoRARequest("bd", 57, path))


@pytest.mark.parametrize("variant", ["velora", "monteclora"])
def test_variants_that_are_plain_lora_at_inference(llm, qwen3_tied, tmp_path, variant):
    """VeLoRA and MonteCLoRA change only training (a compressed backward; Monte Carlo noise on A): PEFT serves them
    as plain LoRA, and so does nanovllm, skipping the training state they save beside A and B."""
    from peft.tuners.lora.config import MontecloraConfig, VeloraConfig
    extra = {"velora_config": VeloraConfig()} if variant == "velora" else {"monteclora_config": MontecloraConfig()}
    path = make_adapter(qwen3_tied, tmp_path / variant, 4, ["q_proj", "o_proj", "down_proj"], seed=3, **extra)
    still_works(llm, qwen3_tied, LoRARequest(variant, 58, path))
    llm.remove_lora(58)


def test_use_rslora_null_reads_as_false(llm, lora_attention, tmp_path):
    """PEFT writes use_rslora: null for the default and reads it as false: the scale stays lora_alpha / r."""
    import json

    from nanovllm.lora.peft import read_adapter
    null_rslora = adapter_copy(lora_attention, tmp_path / "null_rslora", 47)
    file = os.path.join(null_rslora.lora_path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    with open(file, "w") as f:
        json.dump({**config, "use_rslora": None}, f)
    hf_config = llm.config.hf_config
    plain, null = (read_adapter(r, hf_config, 64).modules for r in (lora_attention, null_rslora))
    assert plain == null and all(scale == config["lora_alpha"] / r for r, scale in null.values())


def test_an_id_reused_for_another_path(llm, qwen3_tied, lora_attention, tmp_path):
    llm.add_lora(lora_attention)
    other = adapter_copy(lora_attention, tmp_path / "copy", lora_attention.lora_int_id)
    with pytest.raises(ValueError, match=f"lora_int_id {lora_attention.lora_int_id} already names adapter "
                                         "'attention'.*give .* another id, or remove_lora the first"):
        llm.generate([PROMPT], GREEDY, lora_request=other, use_tqdm=False)
    still_works(llm, qwen3_tied, lora_attention)
    # removed, the id is free for the other path (and the first adapter's slot is never served for it)
    assert llm.remove_lora(lora_attention.lora_int_id) and not llm.remove_lora(999)
    assert lora_attention.lora_int_id not in llm.list_loras()
    still_works(llm, qwen3_tied, other)
    assert llm.remove_lora(other.lora_int_id)


def test_bad_call_shapes(llm, qwen3_tied, lora_attention):
    with pytest.raises(ValueError, match="got 1 lora_request for 2 prompts; pass one LoRARequest"):
        llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[lora_attention], use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a nanovllm.lora.LoRARequest or None, got dict"):
        llm.generate([PROMPT], GREEDY, lora_request={"lora_name": "x"}, use_tqdm=False)
    with pytest.raises(TypeError, match="add_lora needs a LoRARequest"):
        llm.add_lora(None)
    still_works(llm, qwen3_tied, lora_attention)


@pytest.mark.parametrize("kwargs,message", [
    (dict(lora_name="", lora_int_id=1, lora_path="x"), "lora_name must be a non-empty str"),
    (dict(lora_name="a", lora_int_id=0, lora_path="x"), r"lora_int_id must be an int >= 1 \(0 is the base model\)"),
    (dict(lora_name="a", lora_int_id=True, lora_path="x"), "lora_int_id must be an int"),
    (dict(lora_name="a", lora_int_id=1, lora_path=""), "lora_path must be the adapter's directory"),
])
def test_bad_lora_requests(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(**kwargs)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(max_loras=0), ValueError, "max_loras must be >= 1, got 0"),
    (dict(max_lora_rank=0), ValueError, r"max_lora_rank must be in \[1, 512\], got 0"),
    (dict(max_loras=3, max_cpu_loras=2), ValueError, r"max_cpu_loras \(2\) must be >= max_loras \(3\)"),
    (dict(max_loras="2"), TypeError, "max_loras must be int"),
    (dict(max_cpu_loras=1.5), TypeError, "max_cpu_loras must be int or None"),
])
def test_bad_lora_options(qwen3_tied, kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM(qwen3_tied, enable_lora=True, **kwargs)


def rewrite_weights(request: LoRARequest, path, lora_int_id: int, change) -> LoRARequest:
    """A copy of `request`'s adapter whose tensors are change(tensors)."""
    from safetensors.torch import load_file, save_file
    copy = adapter_copy(request, path, lora_int_id)
    file = os.path.join(copy.lora_path, "adapter_model.safetensors")
    save_file(change(load_file(file)), file)
    return copy


def test_factors_that_are_not_matrices_of_rank_one_or_more(llm, qwen3_tied, lora_attention, tmp_path):
    """A damaged adapter whose A is not a matrix, or whose rank is 0, is refused naming it (it raised a bare
    'not enough values to unpack', or a ZeroDivisionError from alpha / r)."""
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [(lambda t: {**t, key: t[key].flatten()}, r"layer 0 q_proj has A \(\d+,\) .* LoRA needs the matrices"),
             (lambda t: {**t, key: t[key][None]}, r"layer 0 q_proj has A \(1, \d+, \d+\) .* LoRA needs the matrices"),
             (lambda t: {k: v[:0] if "lora_A" in k else v[:, :0] for k, v in t.items()},
              "has rank 0 .*; a LoRA rank must be at least 1")]
    for i, (change, message) in enumerate(cases):
        request = rewrite_weights(lora_attention, tmp_path / str(i), 60 + i, change)
        with pytest.raises(ValueError, match=rf"LoRA adapter 'copy{60 + i}' .*{message}"):
            llm.generate([PROMPT], GREEDY, lora_request=request, use_tqdm=False)
        assert request.lora_int_id not in llm.list_loras()
    still_works(llm, qwen3_tied, lora_attention)


def test_a_layer_index_peft_does_not_write_is_refused_when_added(llm, qwen3_tied, lora_attention, tmp_path):
    """'layers.00.' read as layer 0 passed the checks, and the weights were then looked up as 'layers.0.': the
    adapter's first step failed mid-run (SafetensorError) instead of add_lora refusing it."""
    request = rewrite_weights(lora_attention, tmp_path / "zero", 63,
                              lambda t: {k.replace(".layers.0.", ".layers.00."): v for k, v in t.items()})
    with pytest.raises(ValueError, match=r"weight 'base_model\.model\.model\.layers\.00\..*' is not a LoRA A/B"):
        llm.add_lora(request)
    assert request.lora_int_id not in llm.list_loras()
    still_works(llm, qwen3_tied, lora_attention)
