"""Shared Triton helper: where key/value rows of one sequence live, in packed tensors or the paged cache."""
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
