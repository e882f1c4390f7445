"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with launch_pdl=True may start while
the kernel before it is still running, once every program of that kernel has called gdc_launch_dependents (or
exited). It must call gdc_wait, which waits for the previous kernel to finish and its writes to be visible, before
it reads anything that kernel wrote or writes anything (a buffer it writes may be one the previous kernel reads).

Only the one-row linear kernel (gemv.py) is launched this way: it loads its slice of W, which no kernel writes,
before gdc_wait, so a batch-1 step reads the next layer's weights while the current kernel finishes. The kernels
that run before a linear layer (RMSNorm, SiLU-and-mul, decode attention) trigger their dependents
as they start. Both are no-ops in a kernel not launched that way. CUDA graphs keep the launch attribute."""
import functools
import os

import torch


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """On Hopper and later GPUs (NANOVLLM_PDL=0 turns it off, for comparison)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and os.environ.get("NANOVLLM_PDL", "1") != "0")
