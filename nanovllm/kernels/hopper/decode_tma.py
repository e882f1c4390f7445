"""Paged decode attention streamed through a TMA ring (Hopper, Gluon): one program per (sequence, KV head, chunk).

The split-K kernel of decode.py reads a split's one or two tiles at once and then waits; at batch 16 its 640
working programs form about one wave that asks for all its bytes together, computes, merges, and leaves DRAM idle
during the ramp and the tail (about half of DRAM peak at 16 x 640). Here each program keeps STAGES
K/V tiles in flight in shared memory (TMA copies completing on an mbarrier per ring slot) and walks up to
CHUNK_TOKENS of its context within the caller's bound (a longer context gets longer chunks, one a program of
the grid), computing on one tile while the next ones arrive. A context within one chunk
(the common case at these batches) is written directly; longer ones write float32 partials that the last chunk to
finish merges (as decode.py's splits do), so one long context among short ones spreads over several SMs. The tiles
that end before the new token (which the kernel before writes into the cache) are requested before gdc_wait,
under programmatic dependent launch (pdl.py).

Math: the GROUP query heads of the KV head, padded to 16 rows, on mma.sync (mma_v2): s = q K^T [16, BLOCK_N] and
acc += p V [16, HEAD_DIM], the softmax sum kept per element and reduced once after the loop. The engine's 16-bit
cache is not zeroed: V rows past the context may hold NaN, and 0 * NaN is NaN, so the last (partial) tile's V is
masked in registers (K's are masked in the scores).

An fp8 cache (QUANT; attention/fp8.py: V token-major, a float32 scale per token and head) takes 128-token tiles, so
a slot holds as many bytes as a 16-bit one, plus the tile's K and V scales, copied on the same mbarrier. The math
is decode.py's for fp8: q in float16, K and V widened to float16 (exact), the scores multiplied by the K scales,
the V scales folded into p over the largest so far (the accumulator in its units). The engine zeroes an fp8 cache,
so V past a context is finite and weighted 0; only its scales are masked (they would raise the running maximum).
Widening keeps one program of 4 warps from streaming fp8 at the SM's share of DRAM, so where every (sequence, KV
head) pair has an SM an fp8 context is cut in short chunks, two programs an SM (chunk_tiles_for).

A sliding window (WINDOW) starts the chunks at the tile holding the window's first key and masks the keys before
it, as decode.py does; soft-capped scores (SOFTCAP) become cap * tanh(s / cap) before the mask.

decode.decode_attention takes it where stages_for says (a rule on shapes and the graph's context bound only, so
captured graphs stay valid) and usable() holds. Against the split-K kernel it is faster or even on batches of similar
contexts, 16-bit and fp8 alike, and slower where one long context sits among short ones (a 1,024-token chunk is 16
tiles in a row on one SM) and below MIN_PROGRAMS, where too few SMs stream (measured: docs/kernels.md).
"""
import functools

import torch

from nanovllm.kernels.hopper.pdl import pdl_enabled, pdl_launch
from nanovllm.kernels.paged_kv import split_partials
from nanovllm.kernels.scratch import split_counters
from nanovllm.layers.attention.fp8 import is_fp8

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, mma_v2, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # Gluon is experimental: Triton 3.6 names the TMA load async_copy_global_to_shared, later ones async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # (likewise)
except (ImportError, AttributeError):  # a Triton without Gluon, or with names unknown here: the split-K kernel
    gluon = None

BLOCK_N = 64  # tokens a tile: 16 KB of K and 16 KB of V at head_dim 128
FP8_BLOCK_N = 128  # an fp8 cache's: 16 KB of K and 16 KB of V, as many bytes a slot as a 16-bit tile's
LOG2E = 1.4426950408889634
CHUNK_TOKENS = 1024  # a program walks at most this many tokens within the bound: longer contexts merge partials
FP8_SHORT_CHUNK_TILES = 3  # an fp8 cache's chunks where every (sequence, KV head) has an SM (chunk_tiles_for)
MIN_PROGRAMS = 96  # fewer (sequence, KV head) programs than this stream on too few SMs: the split-K kernel
MAX_CONTEXT = 4096  # bounds up to 4 chunks a context (no deeper merge has been timed); past it the split-K kernel


if gluon is not None:
    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _issue(k_desc, v_desc, ks_desc, vs_desc, k_smem, v_smem, ks_smem, vs_smem, bars, block, tile, slot, kv_head,
               BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, QUANT: gl.constexpr):
        """Ask TMA for tile `tile` of the context (in cache block `block`) into ring slot `slot`: K and V, and for an
        fp8 cache the tile's K and V scales (V token-major there: the tile is [HEAD_DIM, BLOCK_N])."""
        col = (tile * BLOCK_N) % BLOCK_SIZE
        bar = bars.index(slot)
        if QUANT:
            head_row = block * gl.num_programs(1) + kv_head  # the (block, KV head) row of V and the scales
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes + 2 * ks_desc.block_type.nbytes)
            _tma_load(k_desc, [block * BLOCK_SIZE + col, kv_head * HEAD_DIM], bar, k_smem.index(slot))
            _tma_load(v_desc, [head_row * HEAD_DIM, col], bar, v_smem.index(slot))
            _tma_load(ks_desc, [head_row, col], bar, ks_smem.index(slot))
            _tma_load(vs_desc, [head_row, col], bar, vs_smem.index(slot))
        else:
            mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
            _tma_load(k_desc, [block * BLOCK_SIZE + col, kv_head * HEAD_DIM], bar, k_smem.index(slot))
            _tma_load(v_desc, [block * BLOCK_SIZE + col, kv_head * HEAD_DIM], bar, v_smem.index(slot))

    # (the block-table width changes from batch to batch: one compiled kernel for every width, as in decode.py)
    @gluon.jit(do_not_specialize=["stride_table"])
    def _decode_tma_kernel(q_ptr, o_ptr, k_desc, v_desc, ks_desc, vs_desc, part_m_ptr, part_l_ptr, part_acc_ptr,
                           count_ptr, context_lens_ptr, table_ptr, stride_qb, stride_qh, stride_ob, stride_oh,
                           stride_table, qk_scale, window, softcap, GROUP: gl.constexpr, BLOCK_G: gl.constexpr,
                           BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, CHUNK_TILES: gl.constexpr, PDL: gl.constexpr, QUANT: gl.constexpr,
                           WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False):
        seq = gl.program_id(0)
        kv_head = gl.program_id(1)
        split = gl.program_id(2)  # this program's chunk of the context
        # context lengths and block tables are written before the step (host copies), never by a kernel of it
        context_len = gl.load(context_lens_ptr + seq)
        n_tiles = (context_len + BLOCK_N - 1) // BLOCK_N
        first_key = context_len * 0  # a window: its first key; the chunks cut the tiles from the one holding it
        if WINDOW:
            first_key = gl.maximum(context_len - window, 0)
        origin = first_key // BLOCK_N
        # the window's tiles (else the context's) cut evenly over the grid's chunks, CHUNK_TILES at least (within
        # the bound the grid has enough chunks of CHUNK_TOKENS); a longer context (which the engine never passes)
        # gets longer chunks, so it is still computed whole
        chunk = gl.maximum((n_tiles - origin + gl.num_programs(2) - 1) // gl.num_programs(2), CHUNK_TILES)
        first = origin + split * chunk
        if (first >= n_tiles) & (split > 0):
            return  # (before any wait: this chunk holds no key; split 0 writes a padding row's zeros)
        last = gl.minimum(first + chunk, n_tiles)

        NUM_WARPS: gl.constexpr = gl.num_warps()
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS],
                                                      instr_shape=[16, 8])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, NUM_WARPS], [1, 0])

        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        if QUANT:  # fp8: V token-major ([HEAD_DIM, BLOCK_N] a tile); each tile's K and V scales ([1, BLOCK_N]
            # float32) ride in the same slot
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
            ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_N], ks_desc.layout)
            vs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_N], vs_desc.layout)
            dtype: gl.constexpr = gl.float16  # fp8 widens to float16 exactly (decode.py's QUANT)
        else:
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
            ks_smem = k_smem  # (unused)
            vs_smem = v_smem
            dtype: gl.constexpr = k_desc.dtype
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()  # the initialized barriers are visible to the TMA unit before its first copy

        table_row = table_ptr + seq.to(gl.int64) * stride_table
        # tiles before `ready` end before the new token's row (position context_len - 1, stored by the kernel
        # before): their bytes are final, so they may be requested before gdc_wait
        ready = gl.maximum(context_len - 1, 0) // BLOCK_N
        for i in gl.static_range(STAGES):
            if (first + i < ready) & (first + i < last):
                block = gl.load(table_row + ((first + i) * BLOCK_N) // BLOCK_SIZE)
                _issue(k_desc, v_desc, ks_desc, vs_desc, k_smem, v_smem, ks_smem, vs_smem, bars, block, first + i, i,
                       kv_head, BLOCK_SIZE, BLOCK_N, HEAD_DIM, QUANT)
        if PDL:
            _gdc_wait()
            _gdc_launch_dependents()
        for i in gl.static_range(STAGES):
            if (first + i >= ready) & (first + i < last):
                block = gl.load(table_row + ((first + i) * BLOCK_N) // BLOCK_SIZE)
                _issue(k_desc, v_desc, ks_desc, vs_desc, k_smem, v_smem, ks_smem, vs_smem, bars, block, first + i, i,
                       kv_head, BLOCK_SIZE, BLOCK_N, HEAD_DIM, QUANT)

        offs_g = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(1, blocked))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blocked))
        mask_g = offs_g < GROUP
        heads = kv_head * GROUP + offs_g
        q = gl.load(q_ptr + seq.to(gl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_g[:, None], other=0.0)
        if QUANT:  # (a bfloat16 q past float16's range)
            q = gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
        q = gl.convert_layout(q, a_op)

        m_i = gl.full([BLOCK_G], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
        l_i = gl.zeros([BLOCK_G, BLOCK_N], gl.float32, layout=mma)  # summed along tokens once, after the loop
        acc = gl.zeros([BLOCK_G, HEAD_DIM], gl.float32, layout=mma)  # fp8: in units of v_top (decode.py's fp8_pv)
        v_top = qk_scale * 0.0 + 1e-30  # fp8: the largest V scale so far
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        offs_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blocked))
        for t in range(first, last):
            # the block of the tile this iteration re-queues: its load overlaps the wait below
            later = t + STAGES
            later_block = gl.load(table_row + (later * BLOCK_N) // BLOCK_SIZE, mask=later < last, other=0)
            slot = (t - first) % STAGES
            mbarrier.wait(bars.index(slot), ((t - first) // STAGES) & 1)
            in_context = t * BLOCK_N + offs_n < context_len
            if WINDOW:
                in_context = in_context & (t * BLOCK_N + offs_n >= first_key)
            if QUANT:
                k = k_smem.index(slot).permute((1, 0)).load(b_op).to(dtype)  # [HEAD_DIM, BLOCK_N], exact
                # (scales are >= 0: a max over the one row, whatever copies of it the layout holds)
                k_scale = gl.max(ks_smem.index(slot).load(mma), axis=0)
                v_scale = gl.where(in_context, gl.max(vs_smem.index(slot).load(mma), axis=0), 0.0)
                s = mma_v2(q, k, gl.zeros([BLOCK_G, BLOCK_N], gl.float32, layout=mma))
                s = s * (k_scale * qk_scale)[None, :]
            else:
                k = k_smem.index(slot).permute((1, 0)).load(b_op)  # [HEAD_DIM, BLOCK_N]
                s = mma_v2(q, k, gl.zeros([BLOCK_G, BLOCK_N], gl.float32, layout=mma))
                s = s * qk_scale
            if SOFTCAP:  # cap * tanh(s / cap), the cap in s's log2 units (tanh from one exp2: saturates to +-1;
                # 2.885... is 2 log2(e))
                s = softcap * (1.0 - 2.0 / (gl.exp2(s * 2.8853900817779268 / softcap) + 1.0))
            s = gl.where(in_context[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))  # finite: every tile holds a key
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha[:, None] + p
            if QUANT:
                # V scales folded into p over the largest so far (p stays in [0, 1]); the cache is zeroed, so V past
                # the context is finite and weighted 0. V is token-major: the slot is [HEAD_DIM, BLOCK_N]
                v_new = gl.maximum(v_top, gl.max(v_scale, axis=0))
                v = v_smem.index(slot).permute((1, 0)).load(b_op).to(dtype)
                p = p * (v_scale / v_new)[None, :]
                acc = mma_v2(gl.convert_layout(p.to(dtype), a_op), v, acc * (alpha * (v_top / v_new))[:, None])
                v_top = v_new
            else:
                if (t + 1) * BLOCK_N > context_len:  # the last tile, partial: rows past the context may be NaN
                    v = v_smem.index(slot).load(blocked)
                    v = gl.where((t * BLOCK_N + offs_v < context_len)[:, None], v, 0.0)
                    v = gl.convert_layout(v, b_op)
                else:
                    v = v_smem.index(slot).load(b_op)
                acc = mma_v2(gl.convert_layout(p.to(dtype), a_op), v, acc * alpha[:, None])
            m_i = m_new
            _cta_barrier()  # every warp has read the slot before TMA overwrites it
            if later < last:
                _issue(k_desc, v_desc, ks_desc, vs_desc, k_smem, v_smem, ks_smem, vs_smem, bars, later_block, later,
                       slot, kv_head, BLOCK_SIZE, BLOCK_N, HEAD_DIM, QUANT)

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        if QUANT:
            acc = acc * v_top
        l_sum = gl.sum(l_i, axis=1)
        offs_go = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(1, mma))
        offs_do = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
        heads_o = kv_head * GROUP + offs_go
        used = (n_tiles - origin + chunk - 1) // chunk  # chunks holding keys: at most the grid's, by chunk's choice
        if used <= 1:  # the whole context in this program (or none: a padding row's zeros)
            out = acc / gl.where(l_sum > 0, l_sum, 1.0)[:, None]
            gl.store(o_ptr + seq.to(gl.int64) * stride_ob + heads_o[:, None] * stride_oh + offs_do[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=(offs_go < GROUP)[:, None])
        else:
            # float32 partials [batch, heads, splits] (+ [HEAD_DIM]); the last chunk to arrive merges them
            num_heads = gl.num_programs(1) * GROUP
            num_splits = gl.num_programs(2)
            part = (seq.to(gl.int64) * num_heads + heads_o) * num_splits + split
            gl.store(part_m_ptr + part, m_i, mask=offs_go < GROUP)
            gl.store(part_l_ptr + part, l_sum, mask=offs_go < GROUP)
            gl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_do[None, :], acc, mask=(offs_go < GROUP)[:, None])
            counter = count_ptr + seq * gl.num_programs(1) + kv_head
            _cta_barrier()  # every thread's partials are written before the program counts itself (release)
            if gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                gl.store(counter, 0)  # ready for the next launch
                base = (seq.to(gl.int64) * num_heads + heads) * num_splits  # [BLOCK_G], chunk 0
                m_run = gl.full([BLOCK_G], float("-inf"), gl.float32, layout=gl.SliceLayout(1, blocked))
                l_run = gl.zeros([BLOCK_G], gl.float32, layout=gl.SliceLayout(1, blocked))
                o = gl.zeros([BLOCK_G, HEAD_DIM], gl.float32, layout=blocked)
                for c in range(0, used):  # (written by other SMs: read from L2, never a stale L1 line)
                    m_c = gl.load(part_m_ptr + base + c, mask=mask_g, other=float("-inf"), cache_modifier=".cg")
                    l_c = gl.load(part_l_ptr + base + c, mask=mask_g, other=0.0, cache_modifier=".cg")
                    acc_c = gl.load(part_acc_ptr + (base + c)[:, None] * HEAD_DIM + offs_d[None, :],
                                    mask=mask_g[:, None], other=0.0, cache_modifier=".cg")
                    m_new = gl.where(mask_g, gl.maximum(m_run, m_c), 0.0)  # (padded rows: no -inf - -inf)
                    a = gl.exp2(m_run - m_new)
                    b = gl.exp2(m_c - m_new)
                    l_run = l_run * a + l_c * b
                    o = o * a[:, None] + acc_c * b[:, None]
                    m_run = m_new
                o = o / gl.where(l_run > 0, l_run, 1.0)[:, None]
                gl.store(o_ptr + seq.to(gl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         o.to(o_ptr.dtype.element_ty), mask=mask_g[:, None])


def stages_for(programs: int, max_context_len: int, sm_count: int, fp8: bool = False) -> int:
    """How deep a ring the kernel runs for `programs` (batch x KV heads) under the context bound, or 0 where the
    split-K kernel serves instead: from MIN_PROGRAMS up to two programs an SM, for bounds up to MAX_CONTEXT.
    Four 32 KB slots (133 KB of shared memory) where every program has an SM, three (100 KB, two programs an SM)
    past that: each is the faster depth on its side (docs/kernels.md). An fp8 cache takes three where every pair
    has an SM too: its contexts are then cut in short chunks (chunk_tiles_for), two programs an SM."""
    if gluon is None:
        return 0
    if not MIN_PROGRAMS <= programs <= 2 * sm_count or max_context_len > MAX_CONTEXT:
        return 0
    return 4 if programs <= sm_count and not fp8 else 3


def chunk_tiles_for(programs: int, sm_count: int, fp8: bool = False) -> int:
    """The fewest tiles a chunk holds (a context is cut over the grid's chunks, each at least this long). 16-bit:
    CHUNK_TOKENS, so contexts up to 1,024 tokens are one program. fp8 where every (sequence, KV head) pair has an SM:
    3 tiles (384 tokens), so a context of 385-768 tokens is two programs, two an SM: widening fp8 and the two products
    keep one program of 4 warps from streaming at the SM's share of DRAM, so two programs a pair read faster
    (docs/kernels.md). Past that (two pairs an SM already) a second program a pair would wait for a second wave."""
    if fp8 and programs <= sm_count:
        return FP8_SHORT_CHUNK_TILES
    return CHUNK_TOKENS // (FP8_BLOCK_N if fp8 else BLOCK_N)


RING_BYTES = 4 * 2 * BLOCK_N * 128 * 2 + 4096  # four slots of K and V tiles at head_dim 128, and some scratch


@functools.cache
def _ring_fits(device: torch.device) -> bool:
    """Hopper or later with shared memory for four ring slots a block (not consumer Blackwell's ~99 KB)."""
    props = torch.cuda.get_device_properties(device)
    return props.major >= 9 and getattr(props, "shared_memory_per_block_optin", 0) >= RING_BYTES


def window_bound(window: int, cache_dtype: torch.dtype) -> int:
    """The most tokens a windowed program's chunks cut: the window's keys from the start of the tile holding the
    first (stages_for's and the grid's bound under a window, whatever the context bound)."""
    return window + block_n_for(cache_dtype) - 1


def block_n_for(cache_dtype: torch.dtype) -> int:
    """Tokens a tile: FP8_BLOCK_N for an fp8 cache (a slot then holds as many bytes as a 16-bit one), else BLOCK_N."""
    return FP8_BLOCK_N if is_fp8(cache_dtype) else BLOCK_N


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> bool:
    """The tensors and GPU the kernel serves: Hopper or later with room for the ring, head_dim 64 or 128 (the
    ring's shared memory), blocks a multiple of the tile's tokens, at most 16 query heads per KV head (the padded
    rows of one mma), and either a 16-bit cache (q of the same type) with V d-contiguous, or an fp8 cache as the
    engine stores it (attention/fp8.py: V token-major, contiguous scales [blocks, kv_heads, block_size]) with a
    16-bit q."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if not (gluon is not None and q.is_cuda and _ring_fits(q.device) and head_dim in (64, 128)
            and k_cache.is_contiguous() and block_size % block_n_for(k_cache.dtype) == 0
            and q.size(1) // num_kv_heads <= 16):
        return False
    if is_fp8(k_cache.dtype):
        return (q.dtype in (torch.bfloat16, torch.float16) and v_cache.dtype == k_cache.dtype
                and v_cache.permute(0, 2, 3, 1).is_contiguous() and k_scale is not None and v_scale is not None
                and k_scale.is_contiguous() and v_scale.is_contiguous())
    return k_cache.dtype in (torch.bfloat16, torch.float16) and q.dtype == k_cache.dtype and v_cache.is_contiguous()


_GL_TYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv",
             torch.float8_e5m2: "float8e5"}


def _descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> tuple:
    """TMA descriptors (K, V, K scales, V scales). K as [tokens, kv_heads * head_dim]: a tile is a block_n rows of
    one head's head_dim columns. A 16-bit V likewise (the scales' places then hold K's and V's again, unused); an
    fp8 V, token-major, as [blocks * kv_heads * head_dim, block_size] (a tile is head_dim rows of block_n tokens),
    and the scales as [blocks * kv_heads, block_size] (a tile is one row of block_n).
    Made at each launch (a CUDA graph keeps the launch's copy; holding them would hold the caches past sleep())."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    block_n = block_n_for(k_cache.dtype)
    dtype = getattr(gl, _GL_TYPES[k_cache.dtype])
    layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], dtype)
    k_desc = TensorDescriptor(k_cache, [num_blocks * block_size, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1],
                              [block_n, head_dim], layout)
    if not is_fp8(k_cache.dtype):
        v_desc = TensorDescriptor(v_cache, [num_blocks * block_size, num_kv_heads * head_dim],
                                  [num_kv_heads * head_dim, 1], [block_n, head_dim], layout)
        return k_desc, v_desc, k_desc, v_desc
    v_layout = gl.NVMMASharedLayout.get_default_for([head_dim, block_n], dtype)
    v_desc = TensorDescriptor(v_cache, [num_blocks * num_kv_heads * head_dim, block_size], [block_size, 1],
                              [head_dim, block_n], v_layout)
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # (a row of 4 * block_n bytes)
    k_sdesc, v_sdesc = (TensorDescriptor(t, [num_blocks * num_kv_heads, block_size], [block_size, 1], [1, block_n],
                                         s_layout) for t in (k_scale, v_scale))
    return k_desc, v_desc, k_sdesc, v_sdesc


def decode_attention_tma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
                         block_tables: torch.Tensor, scale: float, stages: int = 4,
                         out: torch.Tensor | None = None, max_context_len: int | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                         chunk_tiles: int | None = None, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """decode.decode_attention's contract for the cases usable() accepts. Grid (batch, kv_heads, chunks): the bound
    (default: the table's width in tokens) over CHUNK_TOKENS fixes the chunk count, so a captured graph stays
    valid; a context is cut evenly over them, each chunk at least chunk_tiles tiles (chunk_tiles_for; default
    CHUNK_TOKENS' worth), so one long context among short ones is spread over several SMs. An fp8 cache comes
    with its scales. window: a query sees its last `window` keys only (the chunks then cut those, from the tile
    holding the first, and the bound is taken as at most window_bound()); softcap: scores s become
    softcap * tanh(s / softcap)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    block_n = block_n_for(k_cache.dtype)
    descs = _descriptors(k_cache, v_cache, k_scale, v_scale)
    if max_context_len is None:
        max_context_len = block_tables.size(1) * block_size
    if window:
        max_context_len = min(max_context_len, window_bound(window, k_cache.dtype))
    num_splits = max(1, -(-max_context_len // CHUNK_TOKENS))
    part_m, part_l, part_acc = split_partials(out, num_splits)
    counters = split_counters(q.device, batch * num_kv_heads)
    pdl = pdl_enabled(q.device)
    _decode_tma_kernel[(batch, num_kv_heads, num_splits)](
        q, out, *descs, part_m, part_l, part_acc, counters, context_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), scale * LOG2E, window or 0,
        (softcap or 0.0) * LOG2E, WINDOW=bool(window), SOFTCAP=bool(softcap), GROUP=group, BLOCK_G=16,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, HEAD_DIM=head_dim, STAGES=stages,
        CHUNK_TILES=chunk_tiles or CHUNK_TOKENS // block_n, PDL=pdl, QUANT=is_fp8(k_cache.dtype), num_warps=4,
        **pdl_launch(pdl))
    return out
