"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with launch_pdl=True may start while
the kernel before it is still running, once every program of that kernel has called gdc_launch_dependents (or
exited). It must call gdc_wait, which waits for the previous kernel to finish and its writes to be visible, before
it reads anything that kernel wrote or writes anything (a buffer it writes may be one the previous kernel reads).

Launched this way:
- the one-row linear kernel (gemv.py), which loads its slice of W (no kernel writes it) before gdc_wait, so a
  batch-1 step reads the next layer's weights while the current kernel finishes;
- the small kernels between the linear layers (RMSNorm, SiLU-and-mul, q/k norm + rotary) and the general linear
  kernel of gemv.py (2-16 rows, and one row past ROW_MAX_K; the LM head and MoE router too), which wait first
  thing: their launch overlaps the kernel before instead of following it (measured gain: docs/kernels.md);
- decode attention in splits of at most two tiles (batches 1-16 with 8 KV heads, up to a max_model_len of 8,192),
  which asks L2 for its K/V before it waits (decode.launched_early); programs with no keys leave at once;
- the TMA-ring decode attention (decode_tma.py; on Hopper at batches 12-33 with 8 KV heads and a max_model_len up
  to 4,096, where it replaces the one above), which copies the tiles that end before the new token into shared
  memory before it waits; chunks with no keys leave at once.
Each triggers its dependents as it starts (the linear kernels; the rotary kernel past one token, so that decode
attention's requests overlap the qkv projection too), or (RMSNorm, SiLU, rotary at one token, early decode
attention, the TMA-ring decode attention) once its wait is over.
The 2-16-row kernel gains under PDL only where the kernels before it trigger early (else it is slower), and it
loads no W tile before its wait (that is slower too). benchmarks/kernel_chain.py measures a launch's cost on a
GPU. gdc_wait is a no-op in a kernel not launched that way; gdc_launch_dependents there
still lets a kernel after it that is launched under PDL start early (the 1-16-row o_proj after decode attention
that is not launched early: an fp8 or float32 cache, or splits of 3 or more tiles). CUDA graphs keep the launch
attribute."""
import functools

import torch


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """On Hopper and later GPUs."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(on: bool) -> dict:
    """A kernel launch's keyword for programmatic dependent launch: {"launch_pdl": True} when on, else nothing (so
    launches where PDL is off pass Triton no option it may not know)."""
    return {"launch_pdl": True} if on else {}
