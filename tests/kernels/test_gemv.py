"""The small-batch linear kernels (kernels/gemv.py): gemv (one row; 2-16 rows, split over K, swapped), gemv_folded
(SiLU-and-mul or RMSNorm folded in), gemv_add_norm and gemv_normed (the norm between two projections), against
F.linear and the torch ops in float32; the rules that pick them and the arguments they refuse (plain CPU).
Interpreted on CPU; compiled on a GPU (marked gpu), with the one-row kernel's chain under PDL and in a CUDA graph."""
import pytest
import torch

from tests.kernels.helpers import DTYPES, assert_close, check_fused_step


def check_gemv(m: int, n: int, k: int, dtype, bias: bool, device="cpu", config=None):
    """The small-batch linear kernel (each row layout: one row, a 16-row dot) against F.linear in float32."""
    from nanovllm.kernels.gemv import gemv
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = gemv(x, w, b, config=config)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, ref, dtype, f"gemv m={m} n={n} k={k} bias={bias}")


def fp8_weight(n: int, k: int, group: int | None, device="cpu", block_rows: int = 1):
    """(fp8 W [n, k], its WeightScale, W dequantized in float32): per-row scales (group None) or per row and group
    of `group` columns (the last group may be short); block_rows: one scale per block of that many rows and `group`
    columns, repeated over its rows, as a checkpoint's 128 x 128 blocks (the last block may be short)."""
    from nanovllm.kernels.gemv import WeightScale, shared_rows
    from nanovllm.quantization.fp8 import dequantize, quantize_rows
    w = torch.randn(n, k, device=device) * torch.exp(torch.randn(n, 1, device=device)) * k ** -0.5
    if group is None:
        q, scales = quantize_rows(w)
    else:
        groups = -(-k // group)
        padded = torch.nn.functional.pad(w, (0, groups * group - k)).view(n, groups, group)
        scales = padded.abs().amax(-1).clamp(min=1e-12) / 448.0
        if block_rows > 1:  # each block's largest row scale, over its rows
            blocks = torch.nn.functional.pad(scales, (0, 0, 0, -n % block_rows)).view(-1, block_rows, groups)
            scales = blocks.amax(1).repeat_interleave(block_rows, 0)[:n].contiguous()
        q = (padded / scales[..., None]).to(torch.float8_e4m3fn).view(n, -1)[:, :k].contiguous()
    return q, WeightScale(scales, group, shared_rows(scales)), dequantize(q, scales, group)


def check_gemv_fp8(m: int, n: int, k: int, group: int | None, dtype, device="cpu", config=None, block_rows=1):
    """gemv on one row and an fp8 W with its scales (x as it is) against F.linear on the dequantized W in float32,
    then folded with the norm and residual add; 2-16 rows are refused (fp8_gemm.w8a16 takes them)."""
    from nanovllm.kernels.gemv import gemv, gemv_folded
    from nanovllm.layers import layernorm
    q, scale, w = fp8_weight(n, k, group, device, block_rows)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    if m > 1:
        with pytest.raises(ValueError, match="takes one row of x; 2-16 rows take fp8_gemm.w8a16"):
            gemv(x, q, b, config=config, scale=scale)
        return
    what = f"fp8 gemv n={n} k={k} group={group}"
    assert_close(gemv(x, q, b, config=config, scale=scale), torch.nn.functional.linear(x.float(), w, b.float()),
                 dtype, what)
    nw = (torch.rand(k, device=device) + 0.5).to(dtype)
    residual = (torch.randn(m, k, device=device) * 3).to(dtype)
    y, new_residual = gemv_folded(x, q, norm=(nw, 1e-6), residual=residual, scale=scale)
    normed, ref_residual = layernorm.add_rms_norm(x, residual, nw, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    assert_close(y, torch.nn.functional.linear(normed.float(), w), dtype, what + ", folded")


def check_gemv_fused(m: int, n: int, k: int, dtype, device="cpu"):
    """The small-batch kernel with the op before the layer: silu_and_mul (gated), RMSNorm with and without the
    residual add (folded into the one-row kernel, else separate kernels first), against the separate torch ops
    then F.linear in float32; the new residual exact."""
    from nanovllm.kernels.gemv import gemv_folded
    from nanovllm.layers import activation, layernorm
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    h = (torch.randn(m, 2 * k, device=device) * 2).to(dtype)
    ref = torch.nn.functional.linear(activation.silu_and_mul(h).float(), w.float())
    assert_close(gemv_folded(h, w, gated=True), ref, dtype, f"gated gemv m={m} n={n} k={k}")
    x, residual = ((torch.randn(m, k, device=device) * 3).to(dtype) for _ in range(2))
    nw = (torch.rand(k, device=device) + 0.5).to(dtype)
    y = gemv_folded(x, w, norm=(nw, 1e-6))
    ref = torch.nn.functional.linear(layernorm.rms_norm(x, nw, 1e-6).float(), w.float())
    assert_close(y, ref, dtype, f"normed gemv m={m} n={n} k={k}")
    y, new_residual = gemv_folded(x, w, norm=(nw, 1e-6), residual=residual)
    normed, ref_residual = layernorm.add_rms_norm(x, residual, nw, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    assert_close(y, torch.nn.functional.linear(normed.float(), w.float()), dtype, f"add-normed gemv m={m} k={k}")


def check_gemv_add_norm(m: int, n: int, k: int, n_next: int, dtype, configs=(None, None), device="cpu"):
    """The RMSNorm folded between two small-batch linear layers (gemv's add_norm, then normed): h = x @ W^T +
    residual and rms_norm(h) * nw @ W2^T + b2 against layernorm.add_rms_norm and F.linear in float32."""
    from nanovllm.kernels.gemv import gemv_add_norm, gemv_normed
    from nanovllm.layers import layernorm
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    residual = (torch.randn(m, n, device=device) * 3).to(dtype)
    nw = (torch.rand(n, device=device) + 0.5).to(dtype)
    w2 = (torch.randn(n_next, n, device=device) * n ** -0.5).to(dtype)
    b2 = torch.randn(n_next, device=device).to(dtype)
    h, rows = gemv_add_norm(x, w, None, residual, nw, 1e-6, config=configs[0])
    y = gemv_normed(rows, w2, b2, config=configs[1])
    ref_y = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
    ref_normed, ref_h = layernorm.add_rms_norm(ref_y, residual, nw, 1e-6)
    what = f"gemv add_norm m={m} n={n} k={k} configs={configs}"
    assert_close(h, ref_h.float(), dtype, what + ", h")
    assert_close(rows.x, (ref_h.float() * nw.float()), dtype, what + ", h * nw")
    ref_next = torch.nn.functional.linear(ref_normed.float(), w2.float(), b2.float())
    assert_close(y, ref_next, dtype, what + ", next")
    if n_next % 2 == 0:  # the next layer an MLP's [gate; up], SiLU-and-mul in its epilogue: as the SiLU kernel
        # after the same layer (against ref_next a 1-ulp difference in gate or up can exceed the tolerance)
        from nanovllm.layers.activation import silu_and_mul
        act = gemv_normed(rows, w2, b2, gated_out=True, config=configs[1])
        assert_close(act, silu_and_mul(y).float(), dtype, what + ", next gated")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias", [(1, 64, 1024, False), (1, 37, 300, True), (1, 20, 5000, True),
                                        (3, 64, 1024, True), (16, 100, 2048, False)])
def test_gemv_kernel(m, n, k, bias, dtype):
    # even shapes (unmasked loads of W) and ragged ones (a partial tile of W rows and of K); one row: the one-row
    # kernel up to K = 4096, the general one past it
    check_gemv(m, n, k, dtype, bias)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias,config", [(5, 40, 400, True, (16, 64, 4, 2, 3)),
                                               (16, 64, 1000, False, (32, 128, 4, 2, 4)),
                                               (2, 64, 1024, False, (16, 256, 4, 2, 2)),
                                               (16, 192, 512, False, (64, 128, 4, 4, 1, True)),
                                               (3, 100, 1000, True, (64, 128, 4, 4, 1, True)),
                                               (7, 64, 1000, True, (64, 128, 4, 4, 3, True))])
def test_gemv_split_k(m, n, k, bias, config, dtype):
    # K cut over programs (the last split shorter: 400 = 192 + 192 + 16, 1000 = 3 x 256 + 232 or 2 x 384 + 232),
    # the last to arrive adds the partials; the swapped product (y^T = W x^T) whole, ragged, and split; run twice:
    # each launch leaves the counters at zero for the next
    for _ in range(2):
        check_gemv(m, n, k, dtype, bias, config=config)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 64, 1024), (1, 37, 300), (1, 40, 5000)])
def test_gemv_fused_kernel(m, n, k, dtype):
    # one row: folded into the one-row kernel; past its K: the separate kernels, then the layer
    check_gemv_fused(m, n, k, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,n_next,configs", [
    (2, 64, 512, 96, (None, None)),
    (16, 256, 512, 384, ((64, 128, 4, 2, 2, True), (32, 128, 4, 2))),  # a split, swapped producer; plain consumer
    (7, 96, 200, 80, ((32, 64, 4, 2, 3), (64, 64, 4, 2, 2, True))),  # ragged: masked columns, rows, K; split both
])
def test_gemv_add_norm(m, n, k, n_next, configs, dtype):
    check_gemv_add_norm(m, n, k, n_next, dtype, configs)


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("m,n,k,config", [(1, 48, 1000, None), (1, 40, 5000, None), (1, 96, 384, (32, 128, 4, 2, 3)),
                                          (1, 32, 512, (32, 64, 4, 2)), (5, 64, 512, None), (16, 96, 384, None)])
def test_gemv_on_fp8_weights(m, n, k, config, group):
    # fp8 W, scales per row or per row and 128 columns: the one-row kernel (ragged K: a short last group), the
    # general kernel with one row past ROW_MAX_K, split over K, and with K steps narrower than a group (64 of 128: a
    # step's group is k0 // 128, not k0 // 64); 2-16 rows refused
    check_gemv_fp8(m, n, k, group, torch.float16, config=config)


@pytest.mark.interpreter
def test_gemv_one_fp8_row_with_groups_wider_than_its_steps():
    # one row past ROW_MAX_K steps 1,024 columns: 2,048-column scale groups span two steps
    check_gemv_fp8(1, 16, 8192, 2048, torch.float16)


@pytest.mark.interpreter
@pytest.mark.parametrize("n,k,block_rows,shares", [(48, 1000, 16, True), (40, 1000, 16, True), (40, 5000, 8, True),
                                                   (40, 5000, 16, True), (48, 1000, 8, False),
                                                   (40, 5000, 4, False)])
def test_gemv_one_fp8_row_with_block_scales(n, k, block_rows, shares):
    # 128-column groups whose scales repeat over blocks of rows (a checkpoint's 128 x 128 blocks; the last block
    # short): where each program's rows (16 in the one-row kernel at K 1,000, 8 in the general one past ROW_MAX_K)
    # share their scales they scale x once, else each product, as with per-row scales
    from nanovllm.kernels.gemv import _shares, gemv_config, row_config
    block_n = row_config(n, k)[0] if k <= 4096 else gemv_config(1, n, k, itemsize=1)[0]
    assert _shares(fp8_weight(n, k, 128, block_rows=block_rows)[1], 1, block_n) == shares
    check_gemv_fp8(1, n, k, 128, torch.float16, block_rows=block_rows)


@pytest.mark.interpreter
def test_gemv_one_fp8_row_with_block_scales_in_k_splits():
    # the general kernel's K split over three programs per tile, the last tile of rows short (72 = 4 x 16 + 8)
    check_gemv_fp8(1, 72, 5000, 128, torch.float16, config=(8, 256, 4, 1, 3), block_rows=8)


def test_shared_rows():
    # the longest aligned power-of-two run of rows whose scales do not change, up to 128: per-row scales 1; 128-row
    # blocks 128 (a short last block too); a packed layer whose 64-row part starts a new block mid-run 64
    from nanovllm.kernels.gemv import shared_rows
    blocks = torch.rand(5, 3)
    assert shared_rows(torch.rand(256, 3)) == 1 and shared_rows(torch.rand(256)) == 1
    assert shared_rows(blocks.repeat_interleave(128, 0)) == 128
    assert shared_rows(blocks.repeat_interleave(128, 0)[:600]) == 128
    packed = torch.cat([blocks[:2].repeat_interleave(128, 0), blocks[2:4].repeat_interleave(64, 0)])
    assert shared_rows(packed) == 64
    assert shared_rows(blocks.repeat_interleave(128, 0), most=16) == 16


def test_gemv_split_choice():
    # H200 shape, 132 SMs. The swapped product for Qwen3-0.6B's gate_up (96 programs of 64 columns), o_proj and
    # down (K 2,048 and 3,072) at 2-16 rows, not for qkv (64 programs, K 1,024), the LM head or one row. K-splits
    # only where the columns leave most SMs idle: o_proj (4 splits of 512) and down (4 of 768); the count is the one
    # launched, after rounding to whole tiles
    from nanovllm.kernels.gemv import gemv_config, gemv_split_k, swapped
    shapes = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024))
    cpu = torch.device("cpu")

    def split(m, n, k):
        swap = swapped(m, n, k, cpu)
        return gemv_split_k(m, n, k, *gemv_config(m, n, k, swap)[:2], cpu, swap)
    assert [swapped(16, n, k, cpu) for n, k in shapes] == [False, True, True, True, False]
    assert [split(16, n, k) for n, k in shapes] == [1, 4, 1, 4, 1]
    assert split(2, 1024, 3072) == 4 and split(1, 1024, 3072) == 1
    assert not swapped(1, 6144, 1024, cpu) and swapped(2, 6144, 1024, cpu)
    assert not swapped(16, 6144, 1024, cpu, torch.float32)  # (its tile would not fit in shared memory)
    # Qwen3-8B: every projection swapped, none split (64-96 programs; 4 splits of o_proj took 15.5 us, unsplit 12.6)
    assert [split(16, n, k) for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))] == [1] * 4


def test_small_batch_linear_rule():
    # On CUDA, layers/linear.linear sends 1-16 unit-stride rows of a 16-bit model to the Triton kernel, everything
    # else (more rows, float32, strided rows) to F.linear
    from nanovllm.layers.linear import small_batch_rows
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    for rows, dtype, strided, expect in ((1, torch.bfloat16, False, True), (16, torch.float16, False, True),
                                         (17, torch.bfloat16, False, False), (4, torch.float32, False, False),
                                         (4, torch.bfloat16, True, False)):
        x = torch.randn(rows, 64 if strided else 32).to(dtype)
        x = x[:, ::2] if strided else x
        assert small_batch_rows(x, w.to(dtype)) == expect, (rows, dtype, strided)


def test_gemv_refuses_the_one_row_kernel_for_more_rows():
    # the one-row kernel writes row 0 of y alone: forcing it on more rows (a benchmark's row_kernel=True) must fail
    # before any launch, not return rows of torch.empty
    from nanovllm.kernels.gemv import gemv, gemv_folded
    with pytest.raises(ValueError, match="row_kernel: one row"):
        gemv(torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16), row_kernel=True)
    with pytest.raises(ValueError, match="one row of K"):
        gemv_folded(torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16), gated=True)
    fp8 = torch.randn(8, 32).to(torch.float8_e4m3fn)  # (2-16 rows of an fp8 W take fp8_gemm.w8a16)
    with pytest.raises(ValueError, match="2-16 rows take a weight of x's dtype"):
        gemv(torch.randn(3, 32, dtype=torch.bfloat16), fp8)


def test_gemv_refuses_a_norm_fold_it_cannot_run():
    # add_norm and normed run in the general kernel on 2-16 rows; a residual unlike y would be read out of bounds
    from nanovllm.kernels.gemv import NormedRows, gemv_add_norm, gemv_normed
    x, w = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16)
    nw = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2-16 rows, a contiguous residual"):
        gemv_add_norm(x[:1], w, None, torch.zeros(1, 8, dtype=torch.bfloat16), nw, 1e-6)
    with pytest.raises(ValueError, match="2-16 rows, a contiguous residual"):
        gemv_add_norm(x, w, None, torch.zeros(3, 16, dtype=torch.bfloat16)[:, :8], nw, 1e-6)
    with pytest.raises(ValueError, match="2-16 rows, a contiguous residual"):
        gemv_add_norm(x, w, None, torch.zeros(3, 8, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="an even N"):
        gemv_normed(NormedRows(x, torch.zeros(16, 16), 1, 1e-6), w[:7], gated_out=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_gpu_gemv(rows):
    # the Qwen3-0.6B shapes (qkv, o, gate_up, down, LM head), and a ragged one with a bias
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)):
        check_gemv(rows, n, k, torch.bfloat16, False, device="cuda")
    check_gemv(rows, 1000, 1000, torch.bfloat16, True, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("group,block_rows", [(None, 1), (128, 1), (128, 128)])
def test_gpu_gemv_on_fp8_weights(group, block_rows):
    # one row on the Qwen3-8B shapes (qkv, o, gate_up, down) with fp8 weights, in bf16 against float32; 128 x 128
    # blocks (Qwen's FP8 checkpoints: one row scales x)
    torch.manual_seed(block_rows)
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        check_gemv_fp8(1, n, k, group, torch.bfloat16, device="cuda", block_rows=block_rows)


@pytest.mark.gpu
def test_gpu_gemv_add_norm():
    # the norm folded between the Qwen3-0.6B projections at 16 and 9 rows: o_proj -> gate_up, down -> qkv, in
    # bf16 against float32
    torch.manual_seed(0)
    for rows in (16, 9):
        check_gemv_add_norm(rows, 1024, 2048, 6144, torch.bfloat16, device="cuda")
        check_gemv_add_norm(rows, 1024, 3072, 4096, torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_gpu_gemv_row_chain(pdl, monkeypatch):
    # the one-row kernel with and without programmatic dependent launch, with the norm / residual add / SiLU folded
    # in: each call reads what the one before wrote, eager and replayed as a CUDA graph: the same bits
    from nanovllm.kernels import gemv, norm
    monkeypatch.setattr(gemv, "pdl_enabled", lambda device: pdl)
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (1000, 1000)):
        check_gemv(1, n, k, torch.bfloat16, n == 1000, device="cuda")
        check_gemv_fused(1, n, k, torch.bfloat16, device="cuda")
    check_fused_step(1, torch.bfloat16, device="cuda")

    def weight(n, k):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    w_a, w_b, w_c = weight(2048, 1024), weight(6144, 2048), weight(1024, 3072)
    nw = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5
    x, res = (torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def chain():
        h, r = norm.add_rms_norm(x, res, nw, 1e-6)
        for _ in range(3):
            h = gemv.gemv_folded(gemv.gemv(gemv.gemv(h, w_a), w_b), w_c, gated=True)
            h, r = gemv.gemv_folded(h, w_a[:1024].contiguous(), norm=(nw, 1e-6), residual=r)
        return h, r
    eager = chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
