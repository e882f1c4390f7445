"""LoRA adapters on CPU in float32: the base model and PEFT adapters of different ranks and targets in one
generate() call give transformers + PEFT's greedy tokens for each, with chunked prefill, the prefix cache, slot
turnover (more adapters than max_loras), preemption, n > 1, streams and async scheduling; a failed step leaves no
stale slot. TP=2 is in tests/distributed/test_tensor_parallel.py, bad inputs in test_lora_errors.py."""
import random
from unittest import mock

import pytest

from nanovllm import LLM, SamplingParams
from tests.lora.adapters import peft_greedy
from tests.tiny_models import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts_of(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(400) for _ in range(n)] for n in lengths]


def expected(base: str, prompt: list[int], lora, max_tokens: int = 12) -> list[int]:
    return hf_greedy(base, prompt, max_tokens) if lora is None else peft_greedy(base, lora.lora_path, prompt,
                                                                                  max_tokens)


def check(llm, base, prompts, loras, sp=GREEDY):
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(prompts, loras if isinstance(loras, list) else [loras] * len(prompts), outs):
        assert out.lora_request == lora
        for sample in out.outputs:
            assert sample.token_ids == expected(base, prompt, lora, sp.max_tokens), (lora, prompt)
    return outs


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    with LLM(qwen3_tied, enable_lora=True, max_loras=2, max_lora_rank=16, kvcache_block_size=16) as llm:
        yield llm


def test_the_adapters_change_the_output(qwen3_tied, lora_attention, lora_mixed):
    """(What makes the other tests able to fail: each adapter's tokens differ from the base model's.)"""
    for prompt in prompts_of(0, [5, 30]):
        base = hf_greedy(qwen3_tied, prompt, 12)
        assert expected(qwen3_tied, prompt, lora_attention) != base
        assert expected(qwen3_tied, prompt, lora_mixed) != base


def test_base_and_two_adapters_in_one_call(llm, qwen3_tied, lora_attention, lora_mixed):
    loras = [None, lora_attention, lora_mixed, lora_attention, None, lora_mixed, lora_mixed]
    check(llm, qwen3_tied, prompts_of(1, [5, 40, 17, 33, 3, 70, 1]), loras)
    check(llm, qwen3_tied, prompts_of(2, [9]), lora_mixed)  # one LoRARequest for every prompt
    assert llm.list_loras() == {1, 2}


def test_chunked_prefill(qwen3_tied, lora_attention, lora_mixed):
    with LLM(qwen3_tied, enable_lora=True, max_loras=2, kvcache_block_size=16, max_num_batched_tokens=24,
             max_model_len=128) as llm:
        check(llm, qwen3_tied, prompts_of(3, [60, 50, 8, 45]), [lora_mixed, None, lora_attention, lora_attention])


def test_the_prefix_cache_never_shares_blocks_between_adapters(llm, qwen3_tied, lora_attention, lora_mixed):
    prompt = prompts_of(4, [50])[0]
    # identical prompts under three models in one call: each computes its own blocks
    outs = check(llm, qwen3_tied, [prompt] * 3, [lora_attention, lora_mixed, None])
    assert all(out.num_cached_tokens == 0 for out in outs)
    # and later calls: each model finds its own blocks, and only its own
    for lora in (lora_mixed, None, lora_attention):
        (out,) = check(llm, qwen3_tied, [prompt], [lora])
        assert out.num_cached_tokens == 48
    (out,) = check(llm, qwen3_tied, [prompt[:20] + [7] * 30], [lora_attention])
    assert out.num_cached_tokens == 16  # a shared first block under the same adapter


def test_more_adapters_than_slots_wait_for_one(qwen3_tied, lora_attention, lora_mixed, lora_third):
    """max_loras=1: requests of three adapters and the base model in one call; each adapter's requests wait until
    the slot is free, then refill it (and the host cache, max_cpu_loras=2, rereads the one it dropped)."""
    with LLM(qwen3_tied, enable_lora=True, max_loras=1, max_cpu_loras=2, kvcache_block_size=16) as llm:
        loras = [lora_attention, lora_mixed, None, lora_third, lora_attention, lora_mixed, None, lora_third]
        check(llm, qwen3_tied, prompts_of(5, [12, 7, 30, 20, 5, 44, 9, 16]), loras)
        check(llm, qwen3_tied, prompts_of(6, [10, 10]), [lora_third, lora_attention])


def test_preemption(qwen3_tied, lora_attention, lora_mixed):
    """A KV cache too small for every sequence at once: preempted sequences come back under their adapter."""
    with LLM(qwen3_tied, enable_lora=True, max_loras=2, kvcache_block_size=16, num_kvcache_blocks=9,
             max_model_len=64) as llm:
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        check(llm, qwen3_tied, prompts_of(7, [20, 25, 18, 30]), [lora_attention, None, lora_mixed, lora_mixed], sp)


def test_n_samples_streams_and_beams(llm, qwen3_tied, lora_mixed):
    prompt = prompts_of(8, [15])[0]
    want = expected(qwen3_tied, prompt, lora_mixed)
    (out,) = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True),
                          lora_request=lora_mixed, use_tqdm=False)
    assert [s.token_ids for s in out.outputs] == [want] * 3
    streamed = [t for item in llm.generate([prompt], GREEDY, stream=True, lora_request=lora_mixed)
                for t in item["token_ids"]]
    assert streamed == want
    from nanovllm import BeamSearchParams
    (beams,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=1, max_tokens=6),
                               lora_request=lora_mixed)
    assert beams.sequences[0].tokens[len(prompt):] == want[:6]
    assert beams.sequences[0].lora_request == lora_mixed


def test_async_scheduling(qwen3_tied, lora_attention, lora_mixed):
    with LLM(qwen3_tied, enable_lora=True, max_loras=1, kvcache_block_size=16, async_scheduling=True) as llm:
        check(llm, qwen3_tied, prompts_of(9, [12, 30, 7, 22]), [lora_attention, None, lora_mixed, lora_attention])


def test_a_failed_step_leaves_no_stale_slot(qwen3_tied, lora_attention, lora_mixed):
    """A step that fails after the scheduler gave out a slot (its load never ran): the next call loads again."""
    with LLM(qwen3_tied, enable_lora=True, max_loras=1, kvcache_block_size=16) as llm:
        prompt = prompts_of(10, [20])
        with mock.patch.object(llm.executor, "run", side_effect=RuntimeError("device lost")):
            with pytest.raises(RuntimeError, match="device lost"):
                llm.generate(prompt, GREEDY, lora_request=lora_attention, use_tqdm=False)
        check(llm, qwen3_tied, prompt, [lora_attention])
        check(llm, qwen3_tied, prompt, [lora_mixed])


def test_an_adapter_removed_rewritten_and_added_again_is_the_new_one(qwen3_tied, lora_attention, tmp_path):
    """The usual fine-tuning loop: save to the same directory, remove_lora, add it again under the same id. Neither
    the host cache of read adapters nor the prefix cache may serve the old one."""
    import shutil

    from nanovllm import LoRARequest
    from tests.lora.adapters import make_adapter
    path = tmp_path / "adapter"
    shutil.copytree(lora_attention.lora_path, path)
    first = LoRARequest("tuned", 7, str(path))
    prompt = prompts_of(11, [40])
    with LLM(qwen3_tied, enable_lora=True, max_loras=1, max_cpu_loras=2, kvcache_block_size=16) as llm:
        check(llm, qwen3_tied, prompt, [first])
        assert llm.remove_lora(7)
        shutil.rmtree(path)
        make_adapter(qwen3_tied, path, 8, ["q_proj", "v_proj", "down_proj"], seed=9)  # retrained, same place
        from tests.lora import adapters
        adapters._peft_model.cache_clear()  # (the reference reads the new files too)
        assert llm.add_lora(first)
        (out,) = check(llm, qwen3_tied, prompt, [first])
        assert out.num_cached_tokens == 0  # the old adapter's blocks are not this one's


def test_outputs_echo_the_callers_request_and_add_request_takes_one(llm, qwen3_tied, lora_attention):
    from nanovllm import LoRARequest
    renamed = LoRARequest("renamed", lora_attention.lora_int_id, lora_attention.lora_path)
    (out,) = check(llm, qwen3_tied, prompts_of(12, [9]), [renamed])
    assert out.lora_request.lora_name == "renamed"
    prompt = prompts_of(13, [21])[0]
    seq = llm.add_request(prompt, GREEDY, lora_request=lora_attention)
    while not llm.is_finished():
        llm.step()
    assert seq.completion_token_ids == expected(qwen3_tied, prompt, lora_attention)


def test_vllm_engine_requests_run_under_their_adapters(llm, qwen3_tied, lora_attention, lora_mixed):
    """llm.llm_engine.add_request(request_id, prompt, params, lora_request=...), vLLM's engine API."""
    engine, prompts, loras = llm.llm_engine, prompts_of(14, [7, 19, 11]), [lora_attention, None, lora_mixed]
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora_request=lora)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        out = finished[f"r{i}"]
        assert out.lora_request == lora and out.outputs[0].token_ids == expected(qwen3_tied, prompt, lora)


def test_a_refused_call_registers_no_adapter(llm, qwen3_tied, lora_third):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 6], [10**6]], GREEDY, lora_request=[lora_third, None], use_tqdm=False)
    assert lora_third.lora_int_id not in llm.list_loras()


def test_after_a_failed_step_the_running_adapters_are_loaded_again(qwen3_tied, lora_attention):
    """A step that fails (its loads may not have run) leaves no slot trusted: the next step, a decode step too,
    loads the running sequences' adapters again."""
    with LLM(qwen3_tied, enable_lora=True, max_loras=1, kvcache_block_size=16) as llm:
        llm.add_request(prompts_of(14, [12])[0], GREEDY, lora_request=lora_attention)
        llm.step()  # the prefill (loads the adapter), then a decode step that fails
        with mock.patch.object(llm.executor, "run", side_effect=RuntimeError("device lost")):
            with pytest.raises(RuntimeError):
                llm.step()
        batches = []
        with mock.patch.object(llm.executor, "run", side_effect=lambda batch: batches.append(batch) or 1 / 0):
            with pytest.raises(ZeroDivisionError):
                llm.step()
        assert not batches[0].is_prefill and [slot for slot, _ in batches[0].lora_loads] == [0]
        assert batches[0].lora_loads[0][1].request == lora_attention


def test_a_chunked_prefill_whose_first_chunk_failed_goes_on_under_its_adapter(qwen3_tied, lora_attention, lora_mixed):
    """max_loras=1, the slot holding another adapter: a step fails on the first chunk of a prompt prefilled in
    chunks, before its adapter's load is known to have run. The prompt stays at the head of waiting with its blocks
    and slot, and the next steps load its adapter again: its tokens are its adapter's, not the slot's last one's."""
    with LLM(qwen3_tied, enable_lora=True, max_loras=1, kvcache_block_size=16, max_num_batched_tokens=32) as llm:
        llm.generate([prompts_of(16, [5])[0]], GREEDY, lora_request=lora_attention, use_tqdm=False)
        prompt = prompts_of(17, [70])[0]
        seq = llm.add_request(prompt, GREEDY, lora_request=lora_mixed)
        with mock.patch.object(llm.executor, "run", side_effect=RuntimeError("device lost")):
            with pytest.raises(RuntimeError):
                llm.step()
        assert seq.block_table and llm.scheduler.waiting[0] is seq
        while not llm.is_finished():
            llm.step()
        assert seq.completion_token_ids == expected(qwen3_tied, prompt, lora_mixed)
        assert expected(qwen3_tied, prompt, lora_mixed) != expected(qwen3_tied, prompt, lora_attention)


def test_requests_behind_one_waiting_for_a_slot_go_first(qwen3_tied, lora_attention, lora_mixed):
    """max_loras=1: the second adapter's request waits for the slot, and the base-model requests behind it are
    admitted meanwhile (vLLM skips such a request too); then everything finishes with the right tokens."""
    with LLM(qwen3_tied, enable_lora=True, max_loras=1, kvcache_block_size=16) as llm:
        prompts = prompts_of(15, [10, 12, 14, 16])
        loras = [lora_attention, lora_mixed, None, None]
        seqs = [llm.add_request(p, GREEDY, lora_request=lora) for p, lora in zip(prompts, loras)]
        llm.step()
        assert list(llm.scheduler.waiting) == [seqs[1]]
        assert all(seq in llm.scheduler.running for seq in (seqs[0], seqs[2], seqs[3]))
        while not llm.is_finished():
            llm.step()
        for seq, prompt, lora in zip(seqs, prompts, loras):
            assert seq.completion_token_ids == expected(qwen3_tied, prompt, lora)


def test_a_stream_made_before_remove_lora_runs_under_its_own_adapter(qwen3_tied, lora_attention, lora_mixed):
    """stream() registers its adapters, but holds the engine only from its first item: a remove_lora in between
    made reading it raise a bare KeyError, and an add_lora giving the id to another adapter made it run under that
    one, silently. It reads its adapter again, or is refused naming the id."""
    from nanovllm import LoRARequest
    prompt = prompts_of(18, [11])[0]
    with LLM(qwen3_tied, enable_lora=True, max_loras=1, kvcache_block_size=16) as llm:
        stream = llm.stream([prompt], GREEDY, lora_request=lora_attention)
        assert llm.remove_lora(lora_attention.lora_int_id)
        tokens = [t for item in stream for t in item["token_ids"]]
        assert tokens == expected(qwen3_tied, prompt, lora_attention)
        stream = llm.stream([prompt], GREEDY, lora_request=lora_attention)
        assert llm.remove_lora(lora_attention.lora_int_id)
        other = LoRARequest("other", lora_attention.lora_int_id, lora_mixed.lora_path)
        assert llm.add_lora(other)
        with pytest.raises(ValueError, match=f"lora_int_id {other.lora_int_id} already names adapter 'other'"):
            next(stream)
        check(llm, qwen3_tied, [prompt], [other])  # (the engine unharmed)
