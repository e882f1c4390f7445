"""Is a persistent decode kernel worth building? The linear chain of a batch-16 decode step (28 layers of qkv, o,
gate_up, SiLU-and-mul, down; Qwen3-0.6B shapes; no norms, rotary or attention) two ways, us a layer:

- separate: the engine's kernels (kernels/gemv.py's 2-16-row kernel, the SiLU kernel) in one CUDA graph,
  under programmatic dependent launch as in the engine;
- persistent: one Gluon kernel (Hopper), one program per SM, a grid-wide barrier between phases. Each program
  streams every weight tile it will use, in order, through a ring of shared-memory slots by TMA, ahead of the
  barriers: the next phase's weights arrive while the current phase and its barrier run, which the separate
  kernels cannot do (each waits for the one before). Activations come from L2 after each barrier; split-K phases
  add their partials with float32 atomics.

    python benchmarks/persistent_chain.py [--layers 28] [--stages 16] [--tile-k 128] [--check] [--diag 1 4 7]

A measurement, not an engine path: how much a whole-forward persistent kernel (norms, rotary and attention too)
could gain at batch 16 (issue #14's batch-16 row). On one H200 (2026-12-04, docs/benchmarks.md): separate 20.2
us a layer; persistent 27.2-32.7 before the staged activations' loads went three chunks ahead (tile K 128-256),
29.2 after (tile K 128); a grid barrier 0.97-0.99 us; with the tiles' products, the activations' staging and the
refill barrier all left out (diag 7, wrong answers) 15.9, the floor of this design."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm.kernels.hopper import decode_tma  # noqa: E402  (the Gluon names, resolved across Triton versions)

ROWS, TN = 16, 32  # batch rows; weight rows (output columns) of one tile (its K: --tile-k)
# phase: (weight rows N, K read, column tiles, K-splits); Qwen3-0.6B: hidden 1,024, q 2,048 + k/v 1,024, inter 3,072
PHASES = [(4096, 1024, 128, 1), (1024, 2048, 32, 4), (6144, 1024, 192, 1), (1024, 3072, 32, 4)]

if decode_tma.gluon is not None:
    gluon, gl = decode_tma.gluon, decode_tma.gl
    mbarrier, mma_v2, fence_async_shared = decode_tma.mbarrier, decode_tma.mma_v2, decode_tma.fence_async_shared
    _tma_load, _cta_barrier = decode_tma._tma_load, decode_tma._cta_barrier

    @gluon.jit
    def _issue(d0, d1, d2, d3, table_ptr, g, w_smem, bars, STAGES: gl.constexpr):
        """Tile g of this program's list (weight, row, column) into ring slot g % STAGES."""
        _issue_entry(d0, d1, d2, d3, gl.load(table_ptr + g * 3), gl.load(table_ptr + g * 3 + 1),
                     gl.load(table_ptr + g * 3 + 2), g % STAGES, w_smem, bars)

    @gluon.jit
    def _issue_entry(d0, d1, d2, d3, wid, row, col, slot, w_smem, bars):
        bar = bars.index(slot)
        mbarrier.expect(bar, d0.block_type.nbytes)
        if wid == 0:
            _tma_load(d0, [row, col], bar, w_smem.index(slot))
        elif wid == 1:
            _tma_load(d1, [row, col], bar, w_smem.index(slot))
        elif wid == 2:
            _tma_load(d2, [row, col], bar, w_smem.index(slot))
        else:
            _tma_load(d3, [row, col], bar, w_smem.index(slot))

    @gluon.jit
    def _grid_sync(counter_ptr, target, error_ptr):
        """Every program's writes before it are seen by every program after it (release / acquire at GPU scope)."""
        _cta_barrier()
        gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        spins = 0
        arrived = gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while (arrived < target) & (spins < 1_000_000):  # (a program that never arrives: no hang, a flag)
            arrived = gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        if arrived < target:
            gl.store(error_ptr, 1)
        _cta_barrier()

    @gluon.jit
    def _chunk(in_ptr, in_stride, offs_m, offs_k, k0, c: gl.constexpr, BK: gl.constexpr, SILU: gl.constexpr,
               INTER: gl.constexpr):
        """Chunk c of a unit's activations [ROWS, BK] as loaded (and its up half, SILU), not yet waited for."""
        ptrs = in_ptr + offs_m[:, None] * in_stride + (k0 + c * BK + offs_k)[None, :]
        x = gl.load(ptrs, cache_modifier=".cg")
        up = x
        if SILU:
            up = gl.load(ptrs + INTER, cache_modifier=".cg")
        return x, up

    @gluon.jit
    def _store_chunk(a_smem, c: gl.constexpr, x, up, SILU: gl.constexpr):
        if SILU:
            gate = x.to(gl.float32)
            x = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16) * up.to(gl.bfloat16)
        a_smem.index(c).store(x.to(gl.bfloat16))

    @gluon.jit
    def _phase(d0, d1, d2, d3, table_ptr, w_smem, a_smem, bars, g, total, p_ok, p_wid, p_row, p_col, in_ptr,
               in_stride, out_ptr, out_stride, pid, P: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
               TILES: gl.constexpr, SPLITS: gl.constexpr, SILU: gl.constexpr, INTER: gl.constexpr,
               ATOMIC: gl.constexpr, STAGES: gl.constexpr, TN: gl.constexpr, BK: gl.constexpr,
               ROWS: gl.constexpr, DIAG: gl.constexpr):
        """This program's units of one phase: out[:, n0:n0 + TN] (+)= act[:, k0:k0 + K / SPLITS] @ W[n0:n0 + TN]^T.
        p_*: a refill not yet asked for (its list entry). Returns the next tile index of the list and the pending
        refill."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 2], instr_shape=[16, 8])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [2, 2], [1, 0])
        KU: gl.constexpr = K // SPLITS
        CHUNKS: gl.constexpr = KU // BK
        offs_m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blocked))
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, blocked))
        offs_on = gl.arange(0, TN, layout=gl.SliceLayout(1, mma))
        offs_om = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
        for u in range(pid, TILES * SPLITS, P):
            tile = u % TILES
            k0 = (u // TILES) * KU
            # the unit's activations into shared memory (from L2: .cg). Each load is issued three chunks before its
            # store: a chunk stored as soon as it is loaded kept one L2 round trip in flight at a time (10.5 us a
            # layer of 32.5)
            if (DIAG & 4) == 0:
                x0, u0 = _chunk(in_ptr, in_stride, offs_m, offs_k, k0, 0, BK, SILU, INTER)
                x1, u1 = _chunk(in_ptr, in_stride, offs_m, offs_k, k0, 1, BK, SILU, INTER)
                x2, u2 = _chunk(in_ptr, in_stride, offs_m, offs_k, k0, 2, BK, SILU, INTER)
                for c in gl.static_range(CHUNKS):
                    if c + 3 < CHUNKS:
                        x3, u3 = _chunk(in_ptr, in_stride, offs_m, offs_k, k0, c + 3, BK, SILU, INTER)
                    _store_chunk(a_smem, c, x0, u0, SILU)
                    x0, u0, x1, u1 = x1, u1, x2, u2
                    if c + 3 < CHUNKS:
                        x2, u2 = x3, u3
            _cta_barrier()
            acc = gl.zeros([TN, ROWS], gl.float32, layout=mma)
            for c in range(CHUNKS):
                slot = g % STAGES
                # the slot freed one iteration ago is refilled now, from the list entry read then: no memory round
                # trip on this iteration's path (a read and its use in one iteration cost about 0.8 us each)
                if p_ok:
                    _issue_entry(d0, d1, d2, d3, p_wid, p_row, p_col, (g + STAGES - 1) % STAGES, w_smem, bars)
                p_ok = g + STAGES < total
                entry = table_ptr + (g + STAGES) * 3
                p_wid = gl.load(entry, mask=p_ok, other=0)
                p_row = gl.load(entry + 1, mask=p_ok, other=0)
                p_col = gl.load(entry + 2, mask=p_ok, other=0)
                mbarrier.wait(bars.index(slot), (g // STAGES) & 1)
                if (DIAG & 1) == 0:
                    w = w_smem.index(slot).load(a_op)  # [TN, BK]
                    xt = a_smem.index(c).permute((1, 0)).load(b_op)  # [BK, ROWS]
                    acc = mma_v2(w, xt, acc)
                if (DIAG & 2) == 0:
                    _cta_barrier()  # every warp has read the slot before TMA refills it (next iteration)
                g += 1
            out = out_ptr + offs_om[None, :] * out_stride + (tile * TN + offs_on)[:, None]
            if ATOMIC:
                gl.atomic_add(out, acc, sem="relaxed", scope="gpu")
            else:
                gl.store(out, acc.to(out_ptr.dtype.element_ty))
            _cta_barrier()  # (a_smem is rewritten by the next unit)
        return g, p_ok, p_wid, p_row, p_col

    @gluon.jit
    def _chain_kernel(d0, d1, d2, d3, table_ptr, width, counts_ptr, y1, y2, y3, y4, counter_ptr, error_ptr, LAYERS,
                      P: gl.constexpr, STAGES: gl.constexpr, TN: gl.constexpr, BK: gl.constexpr,
                      ROWS: gl.constexpr, A_LAYOUT: gl.constexpr, BARRIERS_ONLY: gl.constexpr = False,
                      DIAG: gl.constexpr = 0):
        pid = gl.program_id(0)
        table_ptr += pid * width * 3
        total = gl.load(counts_ptr + pid)
        w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TN, BK], d0.layout)
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [1024 // BK, ROWS, BK], A_LAYOUT)  # a unit's K: 1,024 at most
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        for i in gl.static_range(STAGES):
            if i < total:
                _issue(d0, d1, d2, d3, table_ptr, i, w_smem, bars, STAGES)
        zero_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        zeros = gl.zeros([128], gl.float32, layout=zero_l)
        offs_z = gl.arange(0, 128, layout=zero_l)
        g = 0
        step = 0
        p_ok = pid < 0  # a refill pending (_phase): none yet (run-time values, carried through the loops)
        p_wid = pid * 0
        p_row = pid * 0
        p_col = pid * 0
        for _layer in range(LAYERS):
            for z in range(pid * 128, ROWS * 1024, P * 128):  # y2: gate_up of the layer before read it; o adds to it
                gl.store(y2 + z + offs_z, zeros)
            if not BARRIERS_ONLY:
                g, p_ok, p_wid, p_row, p_col = _phase(d0, d1, d2, d3, table_ptr, w_smem, a_smem, bars, g, total,
                                                      p_ok, p_wid, p_row, p_col, y4, 1024, y1, 4096, pid, P,
                                                      4096, 1024, 128, 1, False, 0, False, STAGES, TN, BK, ROWS, DIAG)
            step += 1
            _grid_sync(counter_ptr, step * P, error_ptr)
            for z in range(pid * 128, ROWS * 1024, P * 128):  # y4: qkv read it above; down adds to it
                gl.store(y4 + z + offs_z, zeros)
            if not BARRIERS_ONLY:
                g, p_ok, p_wid, p_row, p_col = _phase(d0, d1, d2, d3, table_ptr, w_smem, a_smem, bars, g, total,
                                                      p_ok, p_wid, p_row, p_col, y1, 4096, y2, 1024, pid, P,
                                                      1024, 2048, 32, 4, False, 0, True, STAGES, TN, BK, ROWS, DIAG)
            step += 1
            _grid_sync(counter_ptr, step * P, error_ptr)
            if not BARRIERS_ONLY:
                g, p_ok, p_wid, p_row, p_col = _phase(d0, d1, d2, d3, table_ptr, w_smem, a_smem, bars, g, total,
                                                      p_ok, p_wid, p_row, p_col, y2, 1024, y3, 6144, pid, P,
                                                      6144, 1024, 192, 1, False, 0, False, STAGES, TN, BK, ROWS, DIAG)
            step += 1
            _grid_sync(counter_ptr, step * P, error_ptr)
            if not BARRIERS_ONLY:
                g, p_ok, p_wid, p_row, p_col = _phase(d0, d1, d2, d3, table_ptr, w_smem, a_smem, bars, g, total,
                                                      p_ok, p_wid, p_row, p_col, y3, 6144, y4, 1024, pid, P,
                                                      1024, 3072, 32, 4, True, 3072, True, STAGES, TN, BK, ROWS, DIAG)
            step += 1
            _grid_sync(counter_ptr, step * P, error_ptr)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))


def tile_lists(layers: int, programs: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[programs, tiles, 3] int32: each program's weight tiles (weight, row, column) in the order it uses them,
    padded to the longest list; and each list's length."""
    lists = [[] for _ in range(programs)]
    for layer in range(layers):
        for wid, (n, k, tiles, splits) in enumerate(PHASES):
            ku = k // splits
            for u in range(tiles * splits):
                tile, split = u % tiles, u // tiles
                for c in range(ku // bk):
                    lists[u % programs].append((wid, layer * n + tile * TN, split * ku + c * bk))
    longest = max(len(x) for x in lists)  # (gate_up's 192 column tiles: some programs take two)
    counts = torch.tensor([len(x) for x in lists], dtype=torch.int32)
    return torch.tensor([x + [(0, 0, 0)] * (longest - len(x)) for x in lists], dtype=torch.int32), counts


def weights(layers: int, device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return [(torch.randn(layers * n, k, device=device, generator=gen) / k ** 0.5).to(torch.bfloat16)
            for n, k, _, _ in PHASES]


def persistent(ws: list[torch.Tensor], x: torch.Tensor, layers: int, stages: int, programs: int, bk: int = 128,
               barriers_only: bool = False, diag: int = 0):
    """A runnable closure of the persistent chain; returns y4 (the last layer's output, float32) after a call.
    barriers_only: the same kernel with its grid barriers and zeroing alone (what the phases cost is the rest).
    diag (timing only, wrong answers): bit 1 skips the tile's operand loads and product, bit 2 the CTA barrier
    before a slot's refill, bit 4 the activations' staging."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout.get_default_for([TN, bk], gl.bfloat16)
    descs = [TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [TN, bk], layout) for w in ws]
    a_layout = gl.NVMMASharedLayout.get_default_for([ROWS, bk], gl.bfloat16)
    table, counts = (t.to(x.device) for t in tile_lists(layers, programs, bk))
    width = table.size(1)
    dev = x.device
    y1 = torch.empty(ROWS, 4096, dtype=torch.bfloat16, device=dev)
    y2 = torch.zeros(ROWS, 1024, dtype=torch.float32, device=dev)
    y3 = torch.empty(ROWS, 6144, dtype=torch.bfloat16, device=dev)
    y4 = torch.empty(ROWS, 1024, dtype=torch.float32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    error = torch.zeros(1, dtype=torch.int32, device=dev)

    if barriers_only:
        counts.zero_()  # (no weight tile asked for)

    def run():
        y4.copy_(x)
        counter.zero_()
        _chain_kernel[(programs,)](*descs, table, width, counts, y1, y2, y3, y4, counter, error, layers, P=programs,
                                   STAGES=stages, TN=TN, BK=bk, ROWS=ROWS, A_LAYOUT=a_layout,
                                   BARRIERS_ONLY=barriers_only, DIAG=diag, num_warps=4)
        return y4
    return run, error


def separate(ws: list[torch.Tensor], x: torch.Tensor, layers: int):
    from nanovllm.kernels.activation import silu_and_mul
    from nanovllm.kernels.gemv import gemv
    per_layer = [[w[i * n:(i + 1) * n] for w, (n, _, _, _) in zip(ws, PHASES)] for i in range(layers)]
    xb = x.to(torch.bfloat16)

    def run():
        h = xb
        for wq, wo, wgu, wd in per_layer:
            y1 = gemv(h, wq)
            y2 = gemv(y1[:, :2048], wo)
            y3 = gemv(y2, wgu)
            h = gemv(silu_and_mul(y3), wd)
        return h
    return run


def reference(ws: list[torch.Tensor], x: torch.Tensor, layers: int) -> torch.Tensor:
    """float32 products of bfloat16 operands, rounded where the persistent kernel rounds."""
    h = x
    for i in range(layers):
        wq, wo, wgu, wd = (w[i * n:(i + 1) * n].float() for w, (n, _, _, _) in zip(ws, PHASES))
        y1 = (h.to(torch.bfloat16).float() @ wq.T).to(torch.bfloat16).float()
        y2 = y1[:, :2048] @ wo.T
        y3 = (y2.to(torch.bfloat16).float() @ wgu.T).to(torch.bfloat16)
        a = (torch.nn.functional.silu(y3[:, :3072].float()).to(torch.bfloat16) * y3[:, 3072:]).float()
        h = a @ wd.T
    return h


def timed(fn, iters: int = 50) -> float:
    """us a call: fn captured in a CUDA graph, replayed, CUDA events around `iters` replays (median of 5)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(times)[2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--stages", type=int, nargs="+", default=[16], help="ring slots (of 8 KB at --tile-k 128)")
    p.add_argument("--tile-k", type=int, nargs="+", default=[128], choices=[64, 128, 256],
                   help="K of a weight tile")
    p.add_argument("--programs", type=int, default=128, help="one an SM, at most the GPU's SM count")
    p.add_argument("--check", action="store_true", help="against float32 torch on 2 layers first")
    p.add_argument("--diag", type=int, nargs="*", default=[], choices=range(8),
                   help="timing variants (persistent()'s diag bits)")
    args = p.parse_args()
    if args.layers < 1 or min(args.stages) < 1 or args.programs < 1:
        p.error("--layers, --stages and --programs must be at least 1")
    # the ring and the staged activations (1,024 columns of 16 rows) in Hopper's 227 KB of shared memory a block
    too_big = [(k, s) for k in args.tile_k for s in args.stages if s * TN * k * 2 + ROWS * 1024 * 2 > 227 * 1024]
    if too_big:
        p.error(f"--stages x --tile-k past Hopper's shared memory: {too_big} (e.g. 16 slots at 128, 8 at 256)")
    if decode_tma.gluon is None or not torch.cuda.is_available():
        sys.exit("needs a Hopper GPU and a Triton with Gluon")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if args.programs > sms:  # the grid barrier needs every program resident at once
        p.error(f"--programs {args.programs} is more than this GPU's {sms} SMs")
    x = torch.randn(ROWS, 1024, device=dev)
    configs = [(bk, stages) for bk in args.tile_k for stages in args.stages]
    if args.check:
        ws = weights(2, dev)
        want = reference(ws, x, 2)
        sep = separate(ws, x, 2)().float()
        print(f"check separate: max error {((sep - want).abs().max() / want.abs().max()).item():.2e} of the "
              f"largest value", flush=True)
        for bk, stages in configs:
            run, error = persistent(ws, x, 2, stages, args.programs, bk)
            got = run().clone()
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(f"check tile K {bk}, {stages} slots: {err:.2e}, error flag {error.item()}", flush=True)
    ws = weights(args.layers, dev)
    sep_us = timed(separate(ws, x, args.layers))
    print(f"separate kernels: {sep_us:8.1f} us a step, {sep_us / args.layers:5.2f} a layer", flush=True)
    for bk, stages in configs:
        run, error = persistent(ws, x, args.layers, stages, args.programs, bk)
        us = timed(run)
        print(f"persistent, tile K {bk}, {stages} slots: {us:8.1f} us a step, {us / args.layers:5.2f} a layer "
              f"(error flag {error.item()})", flush=True)
    for diag in args.diag:
        run, error = persistent(ws, x, args.layers, args.stages[0], args.programs, args.tile_k[0], diag=diag)
        us = timed(run)
        print(f"persistent, tile K {args.tile_k[0]}, {args.stages[0]} slots, diag {diag}: {us / args.layers:5.2f} us a "
              f"layer (error flag {error.item()})", flush=True)
    run, error = persistent(ws, x, args.layers, 4, args.programs, 128, barriers_only=True)
    us = timed(run)
    print(f"its barriers alone: {us:8.1f} us a step, {us / args.layers:5.2f} a layer, {us / args.layers / 4:5.2f} a "
          f"barrier (error flag {error.item()})", flush=True)

if __name__ == "__main__":
    main()
