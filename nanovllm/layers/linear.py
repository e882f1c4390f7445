"""Tensor-parallel linear layers. Each parameter carries a weight_loader that takes the full
checkpoint tensor and copies this rank's shard into it. Sizes divide evenly by the number of ranks: the engine
checks that once, before any process starts (tensor_parallel.check_tensor_parallel)."""
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.checkpoint.loader import check_weight_shape
from nanovllm.distributed.group import all_reduce, get_tp_group, get_tp_rank, get_tp_size
from nanovllm.layers import cpu_weights

SMALL_BATCH_ROWS = 16  # up to this many rows the small-batch kernel (kernels/gemv.py's MAX_ROWS) beats cuBLAS


def small_batch_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the small-batch kernel takes x @ weight^T: 1-16 unit-stride rows of a 16-bit model."""
    return (x.dim() == 2 and 0 < x.shape[0] <= SMALL_BATCH_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1 and weight.stride(1) == 1)


CPU_TRANSPOSED_ROWS = 64  # on CPU, 2 to this many float32 rows are multiplied as (W @ x^T)^T (linear below)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the fastest path for the device:
    - CUDA, 1-16 rows of a 16-bit model (small-batch decode): the Triton kernel of kernels/gemv.py, a read of W that
      cuBLAS does slower at these shapes;
    - CPU: a weight the runner packed for oneDNN (layers/cpu_weights.py); else 2-64 float32 rows (decode) as
      (W @ x^T)^T, which MKL runs as a tall-skinny product that streams W faster than F.linear's (measured gain:
      docs/kernels.md)."""
    if x.is_cuda:
        if small_batch_rows(x, weight):
            from nanovllm.kernels.gemv import gemv
            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)
    if weight.is_mkldnn:
        return cpu_weights.linear(x, weight, bias)
    if x.dim() == 2 and 1 < x.shape[0] <= CPU_TRANSPOSED_ROWS and x.dtype == torch.float32:
        y = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x.t())
        return y.t().contiguous()
    return F.linear(x, weight, bias)


_deferred = False  # (deferred_weights) weights created now are shapes only


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Linear and expert weights created in this scope are shapes only (meta tensors): a quantized model's layers
    are then given their weights in the form they keep (quantization/fp8.py's quantize_model, then
    allocate_deferred), so its 16-bit weights never exist all at once."""
    global _deferred
    outer, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = outer


def new_weight(*shape: int) -> nn.Parameter:
    """An uninitialized weight for a weight_loader to fill (meta inside deferred_weights)."""
    return nn.Parameter(torch.empty(*shape, device="meta" if _deferred else None), requires_grad=False)


def allocate_deferred(model: nn.Module):
    """Allocate every parameter of `model` still on meta on the current default device (its attributes, such as
    weight_loader, kept)."""
    device = torch.get_default_device()
    if device.type == "meta":
        return
    allocated: dict[int, nn.Parameter] = {}  # (a parameter shared by two modules stays shared)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in allocated:
                    new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
                    new.__dict__.update(param.__dict__)
                    allocated[id(param)] = new
                module._parameters[name] = allocated[id(param)]


def copy_into(param: nn.Parameter, placements: list[tuple]):
    """Copy each (index, part) of a layer's `placements` into param (the weight loaders' last step). ValueError for
    a tensor that is not fp8 e4m3 into an fp8 weight: copy_ would convert it silently (e5m2 saturating, 16-bit values
    rounded and then multiplied by a scale meant for fp8 ones)."""
    for index, part in placements:
        if param.dtype == torch.float8_e4m3fn and part.dtype != param.dtype:
            kind = ("only e4m3 fp8 checkpoints are supported" if part.dtype.is_floating_point and part.itemsize == 1
                    else "the checkpoint's quantization_config quantizes this layer: store it as fp8 e4m3 with its "
                    "scale, or name the layer in the config's ignore list (quant_method 'fp8': ignored_layers, or "
                    "modules_to_not_convert where there is none; compressed-tensors: ignore)")
            raise ValueError(f"is {part.dtype} but this layer's weight is float8_e4m3fn: {kind}")
        param.data[index].copy_(part)


class LinearBase(nn.Module):
    packs_on_cpu = True  # layers/cpu_weights.py packs the weight for oneDNN (float32 on CPU)

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.tp_group = get_tp_group()
        self.lora = None  # a LoRAStack (lora/stack.py) with enable_lora: each token's adapter update added to y
        self.quant = None  # a quant method (quantization/fp8.py) for quantized weights: it computes x @ W^T
        self.weight = new_weight(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias): the quant method's product for quantized weights, else `linear`."""
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        return linear(x, self.weight, bias)

    def placements(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard_id=None) -> list[tuple[tuple | slice, torch.Tensor]]:
        """Where this rank's part of checkpoint tensor `loaded` goes: (index into param, the part) pairs, each index
        ints and slices (param.data[index] is a view to copy into). ValueError for a tensor of the wrong shape."""
        full = list(param.shape)  # the unsharded shape the checkpoint holds
        sharded = self.tp_dim is not None and param.dim() > self.tp_dim
        if sharded:
            full[self.tp_dim] *= self.tp_size
        check_weight_shape(loaded, full)
        if sharded:
            size = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        return [(slice(None), loaded)]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        copy_into(param, self.placements(param, loaded, shard_id))


def _check_part(shard_id, parts: str):
    if shard_id is None:
        raise ValueError(f"this layer packs several checkpoint tensors: load {parts} by their own names, not one "
                         "fused tensor")


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank (an MoE router: each rank routes every token itself)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Splits the output dimension; each rank returns its slice of the outputs."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size // get_tp_size(), bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up); shard_id indexes output_sizes."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def placements(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None):
        _check_part(shard_id, "its parts (gate_proj and up_proj)")
        check_weight_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        return [(slice(offset, offset + size), loaded.narrow(0, self.tp_rank * size, size))]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; each rank holds its query heads and KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def placements(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None):
        _check_part(shard_id, "q_proj, k_proj and v_proj")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        check_weight_shape(loaded, (size * self.tp_size, *param.shape[1:]))
        return [(slice(offset, offset + size), loaded.narrow(0, self.tp_rank * size, size))]


class RowParallelLinear(LinearBase):
    """Splits the input dimension; partial outputs are summed across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size // get_tp_size(), output_size, bias, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None  # rank 0 alone adds it: the all-reduce adds it once
        y = self.matmul(x, bias)
        if self.lora is not None:  # each rank's update from its share of x: the all-reduce sums them too
            y = self.lora.apply(x, y)
        return all_reduce(y, self.tp_group)
