"""The decode graphs' inputs staged in one copy (cuda_graph.StaticInputs, DecodeGraphs.stage) hold exactly the step,
padded to its bucket, and nothing of an earlier step, on CPU: the graphs themselves need CUDA, their buffers do
not."""
import random
from types import SimpleNamespace

import numpy as np
import torch

from nanovllm.engine.cuda_graph import DecodeGraphs, StaticInputs, bucket_for
from nanovllm.layers.attention.torch_ref import TorchAttention
from nanovllm.lora.stack import step_slots


def _graphs(max_num_seqs=20, max_model_len=1000, block_size=64, lora=False):
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_model_len=max_model_len, tensor_parallel_size=1,
                             hf_config=SimpleNamespace(hidden_size=8), torch_dtype=torch.float32)
    runner = SimpleNamespace(config=config, device=torch.device("cpu"), backend=TorchAttention(), model=None,
                             forward=None, block_size=block_size, lora=object() if lora else None)
    return DecodeGraphs(runner)


def test_static_inputs_are_views_of_one_buffer_aligned_and_initialized():
    inputs = StaticInputs({"a": torch.arange(3, dtype=torch.int64), "b": torch.full((5,), -1, dtype=torch.int32),
                           "c": torch.zeros(4, 3, dtype=torch.float32)}, torch.device("cpu"))
    base = inputs.buffer.data_ptr()
    for name, view in inputs.views.items():
        assert view.untyped_storage().data_ptr() == inputs.buffer.untyped_storage().data_ptr()
        assert (view.data_ptr() - base) % 16 == 0, name
    assert inputs.views["a"].tolist() == [0, 1, 2] and inputs.views["b"].tolist() == [-1] * 5
    inputs.views["b"].fill_(7)
    inputs.views["c"].fill_(3.0)
    for step in range(2 * inputs.HOST_IMAGES):  # every host image in turn, each rebuilt from the initial values

        def write(views, step=step):
            assert views["a"].dtype == np.int64 and views["c"].shape == (4, 3)
            views["a"][step % 3] = 9 + step
            views["c"][1] = step
        inputs.stage(2, write)  # the last tensor: only its first 2 rows are sent
        a = [0, 1, 2]
        a[step % 3] = 9 + step
        assert inputs.views["a"].tolist() == a
        assert inputs.views["b"].tolist() == [-1] * 5  # the initial value again, not 7
        assert inputs.views["c"].tolist() == [[0.0] * 3, [float(step)] * 3, [3.0] * 3, [3.0] * 3]


def test_staged_step_inputs_hold_the_step_padded_and_nothing_from_an_earlier_step():
    graphs = _graphs(lora=True)
    rng = random.Random(0)
    for bs in (7, 3, 16, 1, 20, 5):
        width = rng.randint(1, 16)
        ids = [rng.randrange(1000) for _ in range(bs)]
        positions = [rng.randrange(1000) for _ in range(bs)]
        rows = [rng.randrange(-1, 20) for _ in range(bs)] if bs % 2 else None
        slots = [rng.randrange(5000) for _ in range(bs)]
        lens = [rng.randint(1, 1000) for _ in range(bs)]
        tables = [[rng.randrange(80) for _ in range(width)] for _ in range(bs)]
        lora = step_slots([rng.randrange(-1, 4) for _ in range(bs)], [1] * bs) if bs % 3 else None  # or no LoRA
        input_ids, pos, context, rows_view = graphs.stage(ids, positions, rows, slots, lens, tables, lora)
        bucket = bucket_for(graphs.buckets, bs)
        # LoRA steps carry each row's slot and the rows' order (padding rows and steps without adapters: slot -1,
        # no update, each row in its own place)
        lora_slots, order = lora or ([-1] * bs, list(range(bs)))
        assert graphs.lora_slots[:bucket].tolist() == lora_slots + [-1] * (bucket - bs)
        assert graphs.lora_order[:bucket].tolist() == order + list(range(bs, bucket))
        if lora is None:
            assert context.lora_slots is None and context.lora_order is None
        else:
            assert context.lora_slots.data_ptr() == graphs.lora_slots.data_ptr() and context.lora_slots.numel() == bs
            assert context.lora_order.data_ptr() == graphs.lora_order.data_ptr() and context.lora_order.numel() == bs
        # padding rows up to the bucket write nothing (slot -1) and read nothing (context 0)
        assert graphs.metadata.slot_mapping[:bucket].tolist() == slots + [-1] * (bucket - bs)
        assert graphs.metadata.context_lens[:bucket].tolist() == lens + [0] * (bucket - bs)
        assert input_ids.data_ptr() == graphs.input_ids.data_ptr() and input_ids.tolist() == ids
        assert pos.tolist() == positions and graphs.positions[:bs].tolist() == positions
        assert rows_view.tolist() == (rows or [])
        got = graphs.metadata.block_tables
        assert got[:bs, :width].tolist() == tables
        assert (got[:bs, width:] == -1).all() and (got[bs:bucket] == -1).all()  # nothing of an earlier step
        assert graphs.input_ids[bs:].tolist() == [0] * (graphs.input_ids.numel() - bs)
        assert context.slot_mapping.data_ptr() == graphs.metadata.slot_mapping.data_ptr()
        assert context.block_tables.shape[0] == bs
