"""The adapters on the device: for each linear layer LoRA reaches, every slot's A and B stacked (LoRAStack), and
per rank the set of them with a host cache of read adapters (LoRAWeights). A linear layer with a stack adds its
update after its own product (layers/linear.py); the step's Context says which slot each token uses."""
from collections import OrderedDict

import torch
from torch import nn

from nanovllm.layers.context import get_context
from nanovllm.lora.peft import Adapter

RANK_BLOCK = 16  # stacks are this many ranks wide at least, in multiples of it (the kernels' tiles)

# our linear -> the checkpoint modules that are its parts, in output order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
         "down_proj": ("down_proj",)}


class LoRAStack:
    """One linear layer's slots. Part i of a packed layer (q, k, v; gate, up) uses shrink columns
    [i * max_rank, i * max_rank + r): A [slots, width, in] and B [slots, out, width] hold each part's matrices in its
    block (zeros elsewhere), so one shrink and one expand serve every part and every adapter of a step."""

    def __init__(self, linear: nn.Module, part_sizes: list[int], max_loras: int, max_rank: int, dtype: torch.dtype):
        weight = linear.weight  # (its shape and device; an fp8 weight's adapters are in the model's dtype)
        self.part_sizes = part_sizes  # this rank's output rows of each part
        self.max_rank = max_rank
        self.row_parallel = linear.tp_dim == 1  # input split over ranks: A is split with it, B is whole
        self.tp_rank, self.tp_size = linear.tp_rank, linear.tp_size
        width = -(-len(part_sizes) * max_rank // RANK_BLOCK) * RANK_BLOCK
        self.a = torch.zeros(max_loras, width, weight.shape[1], dtype=dtype, device=weight.device)
        self.b = torch.zeros(max_loras, weight.shape[0], width, dtype=dtype, device=weight.device)

    def load(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]):
        """Put an adapter's (A [r, in], B [out, r]) of each part (None: not targeted) into `slot`: this rank's
        shard of each."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        offset = 0
        for i, (part, size) in enumerate(zip(parts, self.part_sizes)):
            if part is not None:
                a, b = part
                r = a.shape[0]
                if self.row_parallel:
                    cols = self.a.shape[2]
                    a = a[:, self.tp_rank * cols:(self.tp_rank + 1) * cols]
                else:
                    b = b[self.tp_rank * size:(self.tp_rank + 1) * size]
                block = slice(i * self.max_rank, i * self.max_rank + r)
                self.a[slot, block] = a.to(self.a.dtype)
                self.b[slot, offset:offset + size, block] = b.to(self.b.dtype)
            offset += size

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each token's adapter update of x (tokens of slot -1: none); y when the step uses no adapter."""
        context = get_context()
        slots = context.lora_slots
        if slots is None:
            return y
        if x.is_cuda:
            from nanovllm.kernels.lora import lora_expand_, lora_shrink
            order = context.lora_order
            return lora_expand_(y, lora_shrink(x, self.a, slots, order), self.b, slots, order)
        return lora_reference(x, y, self.a, self.b, slots)


def step_slots(seq_slots: list[int], counts: list[int]) -> tuple[list[int], list[int]]:
    """A step's Context.lora_slots and lora_order from each sequence's slot and token count: every token's slot, and
    the tokens grouped by slot (each sequence's together, in step order within a slot), so that the kernels' tiles
    mostly hold one adapter."""
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    slots = [slot for slot, n in zip(seq_slots, counts) for _ in range(n)]
    by_slot = sorted(range(len(seq_slots)), key=seq_slots.__getitem__)
    return slots, [t for i in by_slot for t in range(starts[i], starts[i + 1])]


def lora_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """y + x @ a[slot]^T @ b[slot]^T for each token's slot (-1: none), the tokens of each slot in turn, in float32: the
    CPU path and the kernels' oracle (kernels/lora.py)."""
    y = y.clone()
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        s = x[rows].float() @ a[slot].float().t()
        y[rows] += (s @ b[slot].float().t()).to(y.dtype)
    return y


class LoRAWeights:
    """One rank's adapters: a LoRAStack on every linear layer LoRA reaches (set as the layer's `lora`), slots filled
    on the scheduler's word (ScheduledBatch.lora_loads), and the adapters read from disk kept on the host, the most
    recently used max_cpu_loras."""

    def __init__(self, model: nn.Module, config):
        from nanovllm.models.decoder import DecoderAttention, DecoderMLP
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(attn, DecoderAttention):
                continue
            sizes = {"qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size], "o_proj": [attn.o_proj.weight.shape[0]]}
            linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
            if isinstance(mlp, DecoderMLP):
                inter = mlp.gate_up_proj.weight.shape[0] // 2
                sizes.update(gate_up_proj=[inter, inter], down_proj=[mlp.down_proj.weight.shape[0]])
                linears.update(gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj)
            for name, linear in linears.items():
                linear.lora = self.stacks[i, name] = LoRAStack(linear, sizes[name], config.max_loras, self.max_rank,
                                                               config.torch_dtype)
        self.host: OrderedDict[tuple[int, str], dict] = OrderedDict()

    def load(self, slot: int, adapter: Adapter):
        """Put `adapter` (checked by the engine's LoRAManager) into device slot `slot` on this rank."""
        key = (adapter.request.lora_int_id, adapter.generation)
        tensors = self.host.pop(key, None)
        if tensors is None:
            tensors = adapter.tensors()
        self.host[key] = tensors  # most recently used last
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        for (layer, name), stack in self.stacks.items():
            stack.load(slot, [tensors.get((layer, part)) for part in PARTS[name]])
