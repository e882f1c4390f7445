"""What the CPU path does differently: oneDNN-packed float32 weights (layers/cpu_weights.py) and the torch decode
attention's length groups (layers/attention/torch_ref.py)."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.layers import cpu_weights
from nanovllm.layers.attention.fp8 import cache_layout, quantize, token_major
from nanovllm.layers.attention.torch_ref import TorchAttention, gather_kv
from nanovllm.layers.context import Context
from tests.tiny_models import hf_greedy, hf_model

needs_onednn = pytest.mark.skipif(not cpu_weights.available(), reason="this torch has no oneDNN linear ops")


@needs_onednn
def test_pack_round_trip_and_linear():
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 40), torch.randn(96), torch.randn(7, 40)
    packed = cpu_weights.pack_tensor(w)
    assert packed.is_mkldnn and packed.shape == w.shape and torch.equal(packed.to_dense(), w)
    torch.testing.assert_close(cpu_weights.linear(x, packed, b), F.linear(x, w, b))
    torch.testing.assert_close(cpu_weights.linear(x.t().contiguous().t(), packed), x @ w.t())  # strided rows
    assert cpu_weights.linear(x[:0], packed).shape == (0, 96)


def _runner(llm):
    return llm.executor.runner


@needs_onednn
def test_the_engine_packs_its_linear_weights_and_a_tied_head_keeps_the_embedding_dense(qwen3_tied, qwen3_b):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    model = _runner(llm).model
    params = dict(model.named_parameters())
    linear = [name for name in params if name.endswith("proj.weight")]
    assert linear and all(params[name].is_mkldnn for name in linear)
    embed = model.model.embed_tokens.weight
    assert not embed.is_mkldnn and model.lm_head.weight is embed  # still tied
    assert model.lm_head.packed is not None and torch.equal(model.lm_head.packed.to_dense(), embed)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_tied, prompt, 10)

    # update_weights unpacks, loads, packs again: the new weights are the ones used, still packed
    llm.update_weights(hf_model(qwen3_b).state_dict())
    assert all(dict(model.named_parameters())[name].is_mkldnn for name in linear)
    assert torch.equal(model.lm_head.packed.to_dense(), model.model.embed_tokens.weight)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_b, prompt, 10)

    # an update that fails halfway (past the engine's checks: straight to the runner) leaves every weight packed,
    # the tensors before the bad one loaded, and the head's copy equal to the embedding
    other = hf_model(qwen3_tied).state_dict()
    bad = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError):
        _runner(llm).update_weights([("model.embed_tokens.weight", other["model.embed_tokens.weight"]),
                                     (bad, torch.zeros(3, 3))])
    assert all(dict(model.named_parameters())[name].is_mkldnn for name in linear)
    assert torch.equal(model.model.embed_tokens.weight, other["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.packed.to_dense(), model.model.embed_tokens.weight)
    llm.update_weights(hf_model(qwen3_b).state_dict())
    assert llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"] == hf_greedy(qwen3_b, prompt, 10)

    # a few matrices: just those are unpacked and packed again (the others keep their packed Parameters), the
    # q shard lands in its rows of qkv_proj, and the engine computes with them
    before = dict(model.named_parameters())
    update = {"model.layers.1.self_attn.q_proj.weight": other["model.layers.1.self_attn.q_proj.weight"],
              "model.layers.0.mlp.down_proj.weight": other["model.layers.0.mlp.down_proj.weight"]}
    llm.update_weights(list(update.items()))
    after = dict(model.named_parameters())
    changed = {name for name in linear if after[name] is not before[name]}
    assert changed == {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    assert all(after[name].is_mkldnn for name in linear)
    q_rows = update["model.layers.1.self_attn.q_proj.weight"].shape[0]
    qkv = after["model.layers.1.self_attn.qkv_proj.weight"].to_dense()
    assert torch.equal(qkv[:q_rows], update["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv[q_rows:], before["model.layers.1.self_attn.qkv_proj.weight"].to_dense()[q_rows:])
    # the embedding alone: the tied head's packed copy follows it, no linear weight is touched
    before = dict(model.named_parameters())
    llm.update_weights([("model.embed_tokens.weight", other["model.embed_tokens.weight"])])
    assert all(dict(model.named_parameters())[name] is before[name] for name in linear)
    assert torch.equal(model.lm_head.packed.to_dense(), other["model.embed_tokens.weight"])
    llm.update_weights(hf_model(qwen3_b).state_dict())

    cpu_weights.unpack(model)  # the dense weights are the checkpoint's, exactly
    reference = hf_model(qwen3_b).state_dict()
    dense = dict(model.named_parameters())
    assert model.lm_head.packed is None and not any(p.is_mkldnn for p in dense.values())
    assert torch.equal(dense["model.layers.0.mlp.down_proj.weight"], reference["model.layers.0.mlp.down_proj.weight"])


def test_a_bfloat16_model_is_not_packed(qwen3_tied):
    llm = LLM(qwen3_tied, dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    assert not any(p.is_mkldnn for p in _runner(llm).model.parameters())


def _naive_decode(q, k_cache, v_cache, lens, tables, scale, k_scale=None, v_scale=None):
    """One sequence at a time, every head on its own: the definition the grouped decode must equal."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    group = q.size(1) // k_cache.size(2)
    for s, n in enumerate(lens):
        if n == 0:
            continue
        k = gather_kv(k_cache, tables[s], n, k_scale).float()
        v = gather_kv(v_cache, tables[s], n, v_scale).float()
        for h in range(q.size(1)):
            p = torch.softmax((k[:, h // group] @ q[s, h].float()) * scale, 0)
            out[s, h] = p @ v[:, h // group]
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_decode_equals_one_sequence_at_a_time(fp8):
    """19 sequences (three groups of up to 8, in length order, not batch order), lengths 0 to 70 over 16-token
    blocks, 6 query heads on 2 KV heads; NaN in the cache past every context must not leak in."""
    torch.manual_seed(0)
    lens = [5, 70, 0, 33, 16, 17, 1, 64, 48, 2, 69, 31, 9, 50, 15, 40, 3, 66, 22]
    block, kv_heads, heads, dim = 16, 2, 6, 8
    need = [(n + block - 1) // block for n in lens]
    num_blocks = sum(need) + 2
    kv = torch.full((2, num_blocks, block, kv_heads, dim), float("nan"))
    perm, tables, start = torch.randperm(num_blocks).tolist(), torch.full((len(lens), max(need) + 1), -1), 0
    for s, (n, b) in enumerate(zip(lens, need)):
        tables[s, :b] = torch.tensor(perm[start:start + b])
        rows = torch.randn(2, b * block, kv_heads, dim)
        rows[:, n:] = float("nan")
        kv[:, tables[s, :b]] = rows.view(2, b, block, kv_heads, dim)
        start += b
    extra = {}
    k_cache, v_cache = kv[0], kv[1]
    if fp8:
        values, scales = quantize(kv.nan_to_num(0.0), torch.float8_e4m3fn)
        k_cache, v_cache = values[0], token_major(values[1])
        extra = dict(k_scale=cache_layout(scales)[0], v_scale=cache_layout(scales)[1])
    q = torch.randn(len(lens), heads, dim)
    context = Context(False, context_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables.int())
    out = TorchAttention().decode(q, k_cache, v_cache, context, dim ** -0.5, **extra)
    ref = _naive_decode(q, k_cache, v_cache, lens, tables, dim ** -0.5, **extra)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # no context: zeros


def test_sleep_drops_the_decode_gather_buffers(qwen3_tied):
    llm = LLM(qwen3_tied, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=256)
    llm.generate([[3, 1, 4, 1, 5], [2, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    backend = _runner(llm).backend  # (two sequences: one alone could be read in place, without the buffers)
    assert all(buf is not None for buf in backend._buffers) and backend._rows is not None
    llm.sleep(level=1)
    assert backend._buffers == [None, None] and backend._rows is None and backend._slots is None
    llm.wake_up()
    out = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(qwen3_tied, [3, 1, 4, 1, 5], 4)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tables", [[3, 4, 5], [5, 3, 4]])
def test_one_sequence_reads_its_rows_in_place_when_its_blocks_are_consecutive(tables, fp8):
    """Batch 1 (a group of one): consecutive blocks are read as a slice of the cache, others gathered; both equal
    the reference, and only the slice aliases the cache."""
    torch.manual_seed(1)
    block, kv_heads, heads, dim, length = 16, 2, 4, 8, 40
    kv = torch.randn(2, 8, block, kv_heads, dim)
    k_cache, v_cache, extra = kv[0], kv[1], {}
    if fp8:
        values, scales = quantize(kv, torch.float8_e4m3fn)
        k_cache, v_cache = values[0], token_major(values[1])
        extra = dict(k_scale=cache_layout(scales)[0], v_scale=cache_layout(scales)[1])
    table = torch.tensor([tables + [-1]])
    context = Context(False, context_lens=torch.tensor([length], dtype=torch.int32), block_tables=table.int())
    q = torch.randn(1, heads, dim)
    backend = TorchAttention()
    out = backend.decode(q, k_cache, v_cache, context, dim ** -0.5, **extra)
    torch.testing.assert_close(out, _naive_decode(q, k_cache, v_cache, [length], table, dim ** -0.5, **extra),
                               atol=1e-5, rtol=1e-5)
    start = backend._rows[2][0][-1]
    assert start == (3 * block if tables == [3, 4, 5] else None)
