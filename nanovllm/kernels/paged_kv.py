"""Shared Triton helpers: where key/value rows of one sequence live, in packed tensors or the paged cache, and the
fp8 cache's p @ V step that the decode and prefill kernels both take; the split decode kernels' partials."""
import torch
import triton
import triton.language as tl


@triton.jit
def kv_rows(table_row_ptr, n0, offs_n, mask_n, k_start,
            PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(block, row), both int64, of key rows offs_n = n0 + arange(BLOCK_N) of one sequence: the row lives at
    block * stride_block + row * stride_token (+ head and dim offsets).

    PAGED: block = block_table[n // BLOCK_SIZE], row = n % BLOCK_SIZE; n0 is a multiple of BLOCK_N and lies inside
    the sequence. Table entries past the sequence's last block are -1 and only rows in mask_n read the table.
    Not PAGED: rows are packed, block = 0 and row = k_start + n.
    """
    if PAGED:
        if BLOCK_N <= BLOCK_SIZE:  # the whole tile lies in one cache block: one table read
            block = tl.load(table_row_ptr + n0 // BLOCK_SIZE).to(tl.int64)
        else:
            block = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = (offs_n % BLOCK_SIZE).to(tl.int64)
    else:
        block = tl.zeros([], dtype=tl.int64)
        row = (k_start + offs_n).to(tl.int64)
    return block, row  # one return: triton wants one return type across branches


@triton.jit
def token_major_rows(n0, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows n0 % BLOCK_SIZE + arange(BLOCK_N) of a tile that lies in one block, declared contiguous: the loads of a
    token-major V (each head's tokens contiguous) then vectorize."""
    return tl.max_contiguous(tl.multiple_of(n0 % BLOCK_SIZE + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)


@triton.jit
def fp8_pv(acc, p, v, alpha, v_scale, v_top, PRECISION: tl.constexpr):
    """acc * alpha + p @ (V scales x v) with acc in units of v_top, the largest V scale so far: sum_n p_n v_scale_n v_n
    = v_top * sum_n (p_n v_scale_n / v_top) v_n, and p v_scale / v_top <= 1 stays in float16's range. p [rows,
    BLOCK_N] float32, v [BLOCK_N, HEAD_DIM] widened from fp8, v_scale [BLOCK_N]. Returns (acc, the new v_top)."""
    v_new = tl.maximum(v_top, tl.max(v_scale, 0))
    acc = tl.dot((p * (v_scale / v_new)[None, :]).to(v.dtype), v, acc * (alpha * (v_top / v_new))[:, None],
                 input_precision=PRECISION)
    return acc, v_new


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 partials of a decode kernel that splits each context (running max, sum, [batch, heads, splits];
    unnormalised output, [batch, heads, splits, head_dim]) for out [batch, heads, head_dim]; with one split, out
    itself three times (unused)."""
    if num_splits <= 1:
        return out, out, out
    batch, num_heads, head_dim = out.shape
    part_m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=out.device)
    part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
    return part_m, torch.empty_like(part_m), part_acc
