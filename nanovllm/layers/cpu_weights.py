"""CPU float32 matmuls through oneDNN, with each weight packed once into oneDNN's blocked layout.

MKL reads a row-major [out, in] float32 weight slowly for the skinny products of decode; oneDNN reads a packed one
faster, at one row and at prefill sizes too (benchmarks/cpu_ops.py; measured gain: docs/kernels.md). Packing replaces
the parameter's storage (no second copy): `layer.weight` becomes a new Parameter of the same name, shape and dtype, in
torch's mkldnn layout, which only `linear` below and `unpack` read. The runner unpacks before anything writes weights
(update_weights unpacks just the weights it writes, as it writes them, and packs them again after:
`unpacked_on_write`; sleep level 2 unpacks all before freeing them: the update_weights that brings them back packs
them). A weight that an embedding shares (a tied LM head) stays dense for the lookup; the head then keeps its own
packed copy in `packed` (one more copy of that matrix)."""
from contextlib import contextmanager

import torch
from torch import nn


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and \
        not weight.is_mkldnn and weight.numel() > 0


def pack_tensor(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)  # None: no batch-size hint


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _matmul_modules(model: nn.Module):
    """(module, shared) for every module whose class sets packs_on_cpu (the linear layers, the LM head); shared:
    another kind of module (an embedding) holds the same weight."""
    others = {id(m.weight) for m in model.modules()
              if not getattr(m, "packs_on_cpu", False) and isinstance(getattr(m, "weight", None), torch.Tensor)}
    for m in model.modules():
        if getattr(m, "packs_on_cpu", False):
            yield m, id(m.weight) in others


def _replace_weight(module: nn.Module, data: torch.Tensor):
    # a new Parameter (the layouts differ, so .data cannot be swapped), with the old one's loader
    loader = module.weight.weight_loader
    module.weight = nn.Parameter(data, requires_grad=False)
    module.weight.weight_loader = loader


def pack(model: nn.Module) -> int:
    """Pack every float32 CPU weight of the model's linear layers and LM head; returns how many were packed."""
    if not available():
        return 0
    count = 0
    for module, shared in _matmul_modules(model):
        if not _packable(module.weight) or (shared and getattr(module, "packed", None) is not None):
            continue
        packed = pack_tensor(module.weight.data)
        if shared:  # the embedding keeps the dense weight; the head multiplies by its own copy
            module.packed = packed
        else:
            _replace_weight(module, packed)
        count += 1
    return count


def unpack(model: nn.Module):
    """Dense weights again (exactly the values that were packed): before loading into them or freeing them."""
    for module, _ in _matmul_modules(model):
        if hasattr(module, "packed"):
            module.packed = None
        if module.weight.is_mkldnn:
            _replace_weight(module, module.weight.data.to_dense())


@contextmanager
def unpacked_on_write(model: nn.Module):
    """While it lasts, a weight_loader call on a packed weight (or on the weight a tied head copies) first makes that
    weight dense again; at the end everything dense that packs is packed again, also after a load that failed
    halfway. A weight update that writes a few matrices repacks those, not all (update_weights)."""
    wrapped = []  # (parameter, its own loader)
    for module, shared in _matmul_modules(model):
        weight = module.weight
        if not (weight.is_mkldnn or (shared and getattr(module, "packed", None) is not None)):
            continue
        loader = weight.weight_loader

        def write(param, *args, module=module, shared=shared, loader=loader, **kwargs):
            if shared:
                module.packed = None  # copied again from the new values at the end
            elif module.weight.is_mkldnn:
                _replace_weight(module, module.weight.data.to_dense())
                module.weight.weight_loader = loader
            return loader(module.weight, *args, **kwargs)
        weight.weight_loader = write
        wrapped.append((weight, loader))
    try:
        yield
    finally:
        for weight, loader in wrapped:
            weight.weight_loader = loader
        pack(model)
