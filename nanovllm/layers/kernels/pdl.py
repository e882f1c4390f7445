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
import triton
import triton.language as tl


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """On Hopper and later GPUs (NANOVLLM_PDL=0 turns it off, for comparison)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and os.environ.get("NANOVLLM_PDL", "1") != "0")


@triton.jit
def prefetch_rows_l2(ptr, rows, row_stride_bytes, row_bytes):
    """Ask L2 for `rows` rows of row_bytes bytes each, row_stride_bytes apart from ptr (a PDL-launched kernel's
    slice of W, before gdc_wait): thread r of the program issues one bulk prefetch (sm_90's
    cp.async.bulk.prefetch.L2) for row r. Addresses and sizes must be multiples of 16 bytes (the caller checks)."""
    tl.inline_asm_elementwise(
        """{
        .reg .u32 t;
        .reg .u64 off, addr;
        .reg .pred p;
        mov.u32 t, %tid.x;
        setp.lt.u32 p, t, $2;
        mul.wide.u32 off, t, $3;
        add.u64 addr, $1, off;
        @p cp.async.bulk.prefetch.L2.global [addr], $4;
        mov.u32 $0, 0;
        }""",
        "=r,l,r,r,r", [ptr.to(tl.int64), rows, row_stride_bytes, row_bytes], dtype=tl.int32, is_pure=False, pack=1)
