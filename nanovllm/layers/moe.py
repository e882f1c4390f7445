"""Mixture-of-experts MLP: a replicated router picks top_k experts per token, each expert is a SiLU-gated MLP.

Expert weights are stacked per layer: gate_up_proj [E, 2 * I, H] (gate rows, then up rows) and down_proj
[E, H, I], the layout transformers keeps in memory. Under tensor parallelism every rank holds every expert's I/tp
slice of both, so a rank's output is a partial sum, all-reduced once per layer as for the dense MLP.

On CUDA the experts run in the fused Triton kernel (kernels/fused_moe.py), in 16 bits or fp8 (`experts.quant`, a
quantization/fp8.Fp8Experts: the stacked weights in fp8 plus their scales); elsewhere in `fused_experts_torch`, which
is also the kernel's test oracle (on CPU fp8 experts are dequantized at load)."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.checkpoint.loader import check_weight_shape
from nanovllm.distributed.group import all_reduce, get_tp_group, get_tp_rank, get_tp_size
from nanovllm.layers.linear import ReplicatedLinear, copy_into, new_weight

GATE, UP = 0, 1  # the parts of gate_up_proj, as shard ids of the per-expert checkpoint tensors


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] float32, expert ids [tokens, top_k] int64): softmax in float32 over the experts,
    the top_k most likely, renormalized to sum to 1 when asked (Mixtral always, Qwen3-MoE with norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token t, in plain torch.

    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_* [T, K]. One pair of matmuls per expert that has tokens (the
    loop transformers runs), summed in float32 in expert order; returns [T, H] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, x.size(1), dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=gate_up.size(0)).tolist()
    pair_weights = topk_weights.flatten().float()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, tokens, y.float() * pair_weights[pairs, None])
    return out.to(x.dtype)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, quant=None) -> torch.Tensor:
    """The experts' weighted sum [T, H], on whatever device x is (see fused_experts_torch for the shapes); quant:
    the experts' Fp8Experts (CUDA), whose scales go with the fp8 weights."""
    if x.is_cuda:  # the Triton kernel: no host syncs, fixed shapes (CUDA graphs)
        from nanovllm.kernels.fused_moe import ExpertScales, fused_moe
        scales = None if quant is None else ExpertScales(quant.gate_up_scale, quant.down_scale, quant.group)
        return fused_moe(x, gate_up, down, topk_weights, topk_ids, scales=scales)
    return fused_experts_torch(x, gate_up, down, topk_weights, topk_ids)


class StackedExperts(nn.Module):
    """Every expert's gate/up and down weights, this rank's slice of the intermediate dimension.

    Loads either the stacked tensors (transformers' in-memory names: experts.gate_up_proj, experts.down_proj) or
    one checkpoint tensor per expert and projection (shard id (expert, GATE | UP) or (expert, 0) for down)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.quant = None  # fp8 experts: their quant method (quantization/fp8.Fp8Experts)
        self.intermediate = intermediate_size // self.tp_size  # this rank's share
        self.gate_up_proj = new_weight(num_experts, 2 * self.intermediate, hidden_size)
        self.down_proj = new_weight(num_experts, hidden_size, self.intermediate)
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        # what require_all checks when the parameter is loaded expert by expert
        self.gate_up_proj.shard_ids = [(e, part) for e in range(num_experts) for part in (GATE, UP)]
        self.down_proj.shard_ids = [(e, 0) for e in range(num_experts)]

    def _rank_slice(self, loaded: torch.Tensor, dim: int, size: int | None = None) -> torch.Tensor:
        size = size or self.intermediate
        return loaded.narrow(dim, self.tp_rank * size, size)

    def expert_index(self, shard_id: tuple[int, int]) -> int:
        """The expert a per-expert shard id names; ValueError for one that does not exist."""
        expert = shard_id[0]
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} does not exist (the config has num_experts={self.num_experts})")
        return expert

    def placements(self, part: str, param: nn.Parameter, loaded: torch.Tensor,
                   shard_id: tuple[int, int] | None = None) -> list[tuple[tuple | slice | int, torch.Tensor]]:
        """Where this rank's part of checkpoint tensor `loaded`, for `part` ("gate_up_proj" or "down_proj": the
        weight, or for fp8 experts its scales), goes: (index into param, the part) pairs. ValueError for a tensor
        of the wrong shape or an expert that does not exist."""
        if part == "gate_up_proj":
            return self._gate_up_placements(param, loaded, shard_id)
        return self._down_placements(param, loaded, shard_id)

    def _gate_up_placements(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None):
        full, size = self.intermediate * self.tp_size, self.intermediate
        if shard_id is None:  # [E, 2 * I, H]: gate rows, then up rows
            check_weight_shape(loaded, (self.num_experts, 2 * full, self.hidden_size))
            return [((slice(None), slice(part * size, (part + 1) * size)),
                     self._rank_slice(loaded.narrow(1, part * full, full), 1)) for part in (GATE, UP)]
        expert, part = self.expert_index(shard_id), shard_id[1]
        check_weight_shape(loaded, (full, *param.shape[2:]))  # (an fp8 weight's scales: [rows(, groups)])
        return [((expert, slice(part * size, (part + 1) * size)), self._rank_slice(loaded, 0))]

    def _down_placements(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None):
        full = self.intermediate * self.tp_size
        if shard_id is None:  # [E, H, I]
            check_weight_shape(loaded, (self.num_experts, self.hidden_size, full))
            return [(slice(None), self._rank_slice(loaded, 2))]
        if param.dim() == 2:  # per-row scales of fp8 weights: [H]
            check_weight_shape(loaded, (self.hidden_size,))
            return [(self.expert_index(shard_id), loaded)]
        cols = param.shape[2]  # I / tp (block scales: its groups)
        check_weight_shape(loaded, (self.hidden_size, cols * self.tp_size))
        return [(self.expert_index(shard_id), self._rank_slice(loaded, 1, cols))]

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None):
        copy_into(param, self._gate_up_placements(param, loaded, shard_id))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None):
        copy_into(param, self._down_placements(param, loaded, shard_id))


class SparseMoeBlock(nn.Module):
    """The MLP of an MoE layer: `gate` (the router) and `experts`, named as in the checkpoints."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.tp_group = get_tp_group()
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, self.experts.quant)
        return all_reduce(out, self.tp_group)
