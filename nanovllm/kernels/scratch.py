"""Device buffers that kernels share from launch to launch: the split counters of the decode and linear kernels'
last-one-merges (each launch leaves them zero again) and the linear kernel's split partials. One buffer per
(device, name), grown when a launch needs more and never inside CUDA graph capture: the first step of a size runs
eagerly before its graph is captured (largest first). Launches on one stream overlap only under PDL
(hopper/pdl.py), where a kernel touches these buffers only after gdc_wait, when the launches before it are done:
so one buffer serves every layer."""
import torch

_buffers: dict[tuple[torch.device, str], torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def scratch(device: torch.device, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """At least n elements of the (device, name) buffer, zeroed when allocated."""
    buf = _buffers.get((device, name))
    if buf is not None and buf.dtype != dtype:
        raise TypeError(f"kernel scratch buffer {name!r} holds {buf.dtype}, asked for {dtype}")
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kernel scratch buffer {name!r} first needed inside CUDA graph capture: run the "
                               "batch size eagerly first")
        if buf is not None:  # graphs captured with the old buffer still address it: keep it alive
            _retired.append(buf)
        buf = _buffers[(device, name)] = torch.zeros(max(n, 1 << 16), dtype=dtype, device=device)
    return buf


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 counters for the splits' last-one-merges, shared by every layer: the decode kernels'
    (decode.py, decode_tma.py) and the linear kernel's K-splits (gemv.py)."""
    return scratch(device, "split_counters", n, torch.int32)
