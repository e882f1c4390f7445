"""Mixture-of-experts models (Qwen3-MoE, Mixtral).

CPU: tiny random checkpoints made with transformers give transformers' greedy tokens in float32 (default, chunked
prefill, preemption, prefix hit), TP=2 over gloo equals TP=1; expert weights load from per-expert and stacked names;
unsupported configs raise naming the field. GPU (marked): the engine with graphs equals eager and transformers.
The fused MoE kernel's own tests are in tests/kernels/test_fused_moe.py (and its sm_90 compile in
tests/kernels/test_hopper_compile.py)."""
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.tiny_models import hf_greedy, hf_model, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
QWEN3_30B = ROOT / "benchmarks" / "configs" / "qwen3-30b-a3b"

# name -> make_checkpoint arguments: 8 experts, top-2, GQA
MODELS = {
    # layer 1 dense (mlp_only_layers), with intermediate_size 128 against the experts' 32
    "qwen3_moe": dict(arch="qwen3_moe", tie=False, layers=3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True),
    # decoder_sparse_step 2: layers 1 and 3 have experts; weights not renormalized; 4 query heads per KV head
    "qwen3_moe_step2": dict(arch="qwen3_moe", tie=True, layers=4, num_kv_heads=1, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=2,
                            norm_topk_prob=False, seed=1),
    "mixtral": dict(arch="mixtral", tie=False, layers=2, num_local_experts=8, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make_checkpoint(root / name, **kwargs) for name, kwargs in MODELS.items()}


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


def _check_exact(path: str, outputs: list[dict], prompts: list[list[int]], max_tokens: int = GREEDY.max_tokens):
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, max_tokens), f"prompt of {len(prompt)} tokens"


# ---- the model against transformers ------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers(checkpoints, name):
    path = checkpoints[name]
    prompts = _prompts(0, [3, 16, 17, 70, 300])
    with LLM(path) as llm:  # the default block size, 256
        _check_exact(path, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_chunked_prefill_in_blocks_of_16(checkpoints, name):
    path = checkpoints[name]
    prompts = _prompts(1, [120, 7, 49, 51, 200])
    with LLM(path, kvcache_block_size=16, max_num_batched_tokens=50) as llm:  # prompts split over several steps
        _check_exact(path, llm.generate(prompts, GREEDY, use_tqdm=False), prompts)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_preemption(checkpoints, name):
    path = checkpoints[name]
    prompts = _prompts(2, [30, 35, 40, 20, 45, 33])
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=192) as llm:
        preempted = []
        original = llm.scheduler.preempt
        llm.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
        outs = llm.generate(prompts, sp, use_tqdm=False)
    assert preempted, "the test should force preemption"
    _check_exact(path, outs, prompts, 30)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_prefix_cache_hit(checkpoints, name):
    path = checkpoints[name]
    base = _prompts(3, [50])[0]
    longer = base + _prompts(4, [20])[0]
    with LLM(path, kvcache_block_size=16) as llm:
        assert llm.generate([base], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 0
        out = llm.generate([longer], GREEDY, use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 48
    _check_exact(path, [out], [longer])


def test_tensor_parallel_equals_one_rank(checkpoints):
    """TP=2 over gloo: each rank holds half of every expert's intermediate dimension (and of the dense layer's)."""
    prompts = _prompts(5, [3, 17, 90])
    options = dict(kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=32)
    n = torch.get_num_threads()
    try:
        for name in ("qwen3_moe", "mixtral"):
            path = checkpoints[name]
            with LLM(path, tensor_parallel_size=2, **options) as llm:
                [a, b] = llm.collective_rpc("describe")
                outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            with LLM(path, **options) as single:
                assert [o["token_ids"] for o in outs] == \
                    [o["token_ids"] for o in single.generate(prompts, GREEDY, use_tqdm=False)], name
                whole = single.collective_rpc("describe")[0]["num_parameters"]
            assert a["num_parameters"] == b["num_parameters"] < whole, "experts should be sharded"
            _check_exact(path, outs, prompts)
    finally:
        torch.set_num_threads(n)


# ---- layers, weights and configs ------------------------------------------------------------------

def _config(path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def _build(config, device: str = "meta"):
    from nanovllm.models import build_model
    with torch.device(device):
        return build_model(config)


def test_layers_follow_the_config(checkpoints):
    from nanovllm.layers.moe import SparseMoeBlock
    for name, moe_layers in (("qwen3_moe", [0, 2]), ("qwen3_moe_step2", [1, 3]), ("mixtral", [0, 1])):
        config = _config(checkpoints[name])
        model = _build(config)
        assert [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)] == moe_layers
        hf = hf_model(checkpoints[name])
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters()), name
    dense = _config(checkpoints["qwen3_moe"])
    dense.mlp_only_layers = [0, 1, 2]
    assert not any(isinstance(m, SparseMoeBlock) for m in _build(dense).modules())


def test_router_and_torch_experts_match_transformers(checkpoints):
    """route() equals transformers' routers; the torch experts equal transformers' MoE block, uneven loads and all."""
    from nanovllm.layers.moe import fused_experts_torch, route
    for name in ("qwen3_moe", "qwen3_moe_step2", "mixtral"):
        hf = hf_model(checkpoints[name])
        block = next(m for m in hf.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
        x = torch.randn(37, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            _, hf_weights, hf_ids = block.gate(x)
            weights, ids = route(torch.nn.functional.linear(x, block.gate.weight), hf.config.num_experts_per_tok,
                                 renormalize=getattr(hf.config, "norm_topk_prob", True))
            assert torch.equal(ids, hf_ids), name
            torch.testing.assert_close(weights, hf_weights.float(), rtol=1e-6, atol=1e-7)
            assert len(ids.unique()) == hf.config.num_experts, "every expert should get tokens"
            ours = fused_experts_torch(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
            torch.testing.assert_close(ours, block(x[None])[0], rtol=1e-5, atol=1e-5)
            skewed = torch.zeros_like(ids)  # every token to expert 0 (and its second choice to expert 0 too)
            expected = torch.stack([weights.sum(1)[t] * block.experts(x[t:t + 1], skewed[t:t + 1, :1],
                                                                      torch.ones(1, 1))[0] for t in range(37)])
            torch.testing.assert_close(fused_experts_torch(x, block.experts.gate_up_proj, block.experts.down_proj,
                                                           weights, skewed), expected, rtol=1e-4, atol=1e-5)


def test_expert_weights_from_per_expert_and_stacked_names(checkpoints):
    """A checkpoint stores one tensor per expert and projection (gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2
    under block_sparse_moe); transformers keeps them stacked in memory (experts.gate_up_proj): both load, and the
    stacked layout is transformers' own."""
    from nanovllm.checkpoint.loader import iter_weights, load_named_weights
    for name in ("qwen3_moe", "mixtral"):
        path = checkpoints[name]
        names = [n for n, _ in iter_weights(path)]
        assert any(".experts.3." in n for n in names) and not any("gate_up_proj" in n for n in names)
        hf_state = hf_model(path).state_dict()
        model = _build(_config(path), "cpu")
        load_named_weights(model, iter_weights(path), path)
        ours = dict(model.named_parameters())
        for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                    "model.layers.0.mlp.gate.weight"):
            assert torch.equal(ours[key], hf_state[key]), (name, key)
        stacked = {k: v * 2 for k, v in hf_state.items() if ".experts." in k}
        load_named_weights(model, stacked.items(), "update", require_all=False)
        for key, value in stacked.items():
            assert torch.equal(ours[key], value)


def test_expert_weight_errors(checkpoints):
    from nanovllm.checkpoint.loader import iter_weights, load_named_weights
    path = checkpoints["qwen3_moe"]
    weights = dict(iter_weights(path))

    def load(tensors):
        load_named_weights(_build(_config(path)), tensors.items(), path)
    missing = {k: v for k, v in weights.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks weights for: model.layers.2.mlp.experts.5.up_proj.weight"):
        load(missing)
    with pytest.raises(ValueError, match="expert 8 does not exist.*num_experts=8"):
        load({**weights, "model.layers.0.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(ValueError, match=r"experts.2.down_proj.weight.*shape \(64, 16\).*\(64, 32\)"):
        load({**weights, "model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(64, 16)})


def _with_config(src: str, dst: Path, **changes) -> str:
    """A copy of checkpoint `src`'s config.json (and nothing else) with fields changed: errors come before weights."""
    dst.mkdir()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(dst / "config.json", "w") as f:
        json.dump(config, f)
    return os.fspath(dst)


@pytest.mark.parametrize("name, changes, field", [
    ("qwen3_moe", dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),  # Qwen2-MoE's
    ("qwen3_moe", dict(n_shared_experts=2), "n_shared_experts"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok"),
    ("mixtral", dict(num_experts_per_tok=0), "num_experts_per_tok"),
    ("qwen3_moe", dict(scoring_func="sigmoid"), "scoring_func"),
    ("mixtral", dict(topk_method="noaux_tc", n_group=8, topk_group=4), "topk_method"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen3_moe", dict(architectures=["Qwen2MoeForCausalLM"]), "Qwen2MoeForCausalLM"),
])
def test_unsupported_moe_configs_raise(checkpoints, tmp_path, name, changes, field):
    with pytest.raises(ValueError, match=field):
        LLM(_with_config(checkpoints[name], tmp_path / "changed", **changes))


def test_tensor_parallel_needs_divisible_experts(checkpoints, tmp_path):
    from nanovllm.config import Config
    from nanovllm.distributed.tensor_parallel import check_tensor_parallel
    path = _with_config(checkpoints["qwen3_moe"], tmp_path / "odd", moe_intermediate_size=33)
    shutil.copy(os.path.join(checkpoints["qwen3_moe"], "tokenizer.json"), path)
    with pytest.raises(ValueError, match="moe_intermediate_size=33 is not divisible by tensor_parallel_size=2"):
        check_tensor_parallel(Config(path, tensor_parallel_size=2))


def test_dummy_weights_route_to_every_expert(checkpoints):
    """load_format="dummy" (bench.py --dummy) fills the experts and a router that spreads tokens over them."""
    from nanovllm.layers.moe import SparseMoeBlock, route
    with LLM(checkpoints["qwen3_moe"], load_format="dummy", kvcache_block_size=16, num_kvcache_blocks=16,
             max_model_len=256) as llm:
        out = llm.generate(_prompts(6, [40]), GREEDY, use_tqdm=False)[0]
        model = llm.executor.runner.model
    assert len(out["token_ids"]) == GREEDY.max_tokens
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert block.experts.gate_up_proj.std() > 0.01
    hidden = torch.randn(400, block.gate.weight.size(1), generator=torch.Generator().manual_seed(0))
    _, ids = route(block.gate(hidden), block.top_k, block.renormalize)
    share = torch.bincount(ids.flatten(), minlength=8) / ids.numel()
    assert share.min() > 0.02 and share.max() < 0.4, f"routing should be roughly uniform: {share.tolist()}"


def test_qwen3_30b_a3b_config():
    """The benchmark config builds the 30B-A3B shape: 48 MoE layers of 128 experts, about 30.5B parameters
    (61 GB in bf16)."""
    from nanovllm.layers.moe import SparseMoeBlock
    from nanovllm.models import check_model_config
    config = _config(os.fspath(QWEN3_30B))
    check_model_config(config)
    model = _build(config)
    blocks = [layer.mlp for layer in model.model.layers]
    assert len(blocks) == 48 and all(isinstance(b, SparseMoeBlock) for b in blocks)
    assert blocks[0].top_k == 8 and blocks[0].renormalize
    assert blocks[0].experts.gate_up_proj.shape == (128, 1536, 2048)
    assert 30.4e9 < sum(p.numel() for p in model.parameters()) < 30.6e9


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_gpu_engine_graphs_and_eager_match_transformers(checkpoints, name, no_tf32):
    """float32 on CUDA: the Triton experts in eager mode and in decode graphs give transformers' tokens."""
    path = checkpoints[name]
    prompts = _prompts(7, [3, 17, 70, 300, 40, 9, 120])
    for eager in (True, False):
        with LLM(path, device="cuda", dtype="float32", enforce_eager=eager, kvcache_block_size=16, max_num_seqs=16,
                 num_kvcache_blocks=128, max_model_len=512, max_num_batched_tokens=256) as llm:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert (llm.executor.runner.graphs is None) == eager
        _check_exact(path, outs, prompts)


@pytest.mark.gpu
def test_gpu_engine_bf16_graphs_equal_eager(checkpoints):
    """bf16: graphs (batch padded to a bucket) against eager, token by token for 16 tokens: the chosen tokens'
    logprobs within 0.1 nats; at the first difference, if any, both tokens are near-ties (within 0.1 nats, each in
    the other's top 2)."""
    path = checkpoints["qwen3_moe"]
    prompts = _prompts(8, [5, 40, 100, 7, 64, 250, 31])
    # (Over 32 tokens, on an H200 on 2026-12-02, three prompts first differed at steps 24-27, their chosen tokens'
    # logprobs having drifted up to 0.32 nats apart before that, and one token's 1 nat at the difference: the two
    # kernel families' roundings, fed back through the cache and the experts' routing, outgrow near-ties. Over 16
    # tokens this test passed there.)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    results = []
    for eager in (True, False):
        with LLM(path, device="cuda", dtype="bfloat16", enforce_eager=eager, max_num_seqs=64, max_model_len=512,
                 num_kvcache_blocks=16) as llm:
            results.append(llm.generate(prompts, sp, use_tqdm=False))
    identical = 0
    for a, b in zip(*results):
        for i, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"])):
            la, lb = a["logprobs"][i], b["logprobs"][i]
            if ta != tb:
                assert ta in lb and tb in la and abs(la[ta] - la[tb]) < 0.1, f"step {i}: {ta} vs {tb}"
                break
            assert abs(la[ta] - lb[tb]) < 0.1  # bf16 through other kernels (eager: torch ops; graphs: Triton)
        else:
            identical += 1
    # Eager runs the torch norm/rope/SiLU ops, graphs the Triton kernels (and the MoE kernel picks its tiles from the
    # padded batch): in bf16 a random tiny model meets near-ties often (measured on an H200: 3 of 7 prompts identical
    # for 32 tokens in an earlier session; 6 of 7 for 16 tokens on 2026-12-02), so what must hold is the near-tie at
    # each first difference, checked above.
    assert identical >= 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tensor_parallel_equals_one_rank(checkpoints, no_tf32):
    path = checkpoints["qwen3_moe"]
    prompts = _prompts(9, [3, 17, 90])
    options = dict(device="cuda", dtype="float32", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=32)
    with LLM(path, tensor_parallel_size=2, **options) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check_exact(path, outs, prompts)
