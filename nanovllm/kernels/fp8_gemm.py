"""FP8 linear layers on CUDA: activations quantized on the fly, then an fp8 product with the weight's scales. Small
batches read the fp8 weight against x as it is: one 16-bit row (batch-1 decode) in gemv.py's one-row kernel (which
the fused decode step also folds the norms into), 2 to SMALL_ROWS rows, and weight-only checkpoints at any size, in
w8a16 below (at 16 rows of Qwen3-8B it measured faster than gemv.py's 16-row kernel reading fp8 weights did:
docs/quantization.md).

- Per-channel weight scales: x quantized per token (a scale per row), then torch._scaled_mm (cuBLASLt's fp8 GEMM)
  with row-wise scales on both sides.
- Block scales (a scale per output row and group of GROUP input columns): x quantized per token and group. Then
  torch._scaled_mm's block scaling (cuBLASLt's DeepSeek-style GEMM) where the caller passes the scales one per
  128 x 128 block (quantization/fp8.py decides; blockwise_scaled_mm_works says this torch runs it), else the
  Triton kernel below, which adds each group's product times both scales (the DeepSeek/Qwen FP8 recipe).
- Static activation scales (per-channel weights only): x quantized with the layer's one fixed scale, then as per
  channel.
The torch references (quantization/fp8.py's dequantize) are the tests' oracles."""
import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


MAX_TILE = 16384  # columns a quantizer program holds in registers; a longer group is read twice


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_q, stride_s, stride_sg, GROUP: tl.constexpr,
                  GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, STATIC: tl.constexpr):
    """Row pid(0), groups [pid(1) * GROUPS, +GROUPS) of GROUP columns: each group's |max| / 448 its scale (STATIC:
    the one scale at static_ptr), its values divided into fp8. A group that fits BLOCK_G is read once, as a
    [GROUPS, BLOCK_G] tile; a longer one (GROUPS 1) is read BLOCK_G columns at a time, once for its max (not when
    STATIC) and once to divide."""
    row = tl.program_id(0).to(tl.int64)
    if BLOCK_G >= GROUP:
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        c = tl.arange(0, BLOCK_G)
        k = g[:, None] * GROUP + c[None, :]
        mask = (c[None, :] < GROUP) & (k < K)
        x = tl.load(x_ptr + row * stride_x + k, mask=mask, other=0).to(tl.float32)
        if STATIC:
            scale = tl.zeros((GROUPS,), tl.float32) + tl.load(static_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        q = tl.clamp(x / scale[:, None], -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_s + g * stride_sg, scale, mask=g * GROUP < K)
    else:
        group = tl.program_id(1)
        start = group * GROUP
        end = tl.minimum(start + GROUP, K)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros((BLOCK_G,), tl.float32)
            for k0 in range(start, end, BLOCK_G):
                k = k0 + tl.arange(0, BLOCK_G)
                x = tl.load(x_ptr + row * stride_x + k, mask=k < end, other=0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        for k0 in range(start, end, BLOCK_G):
            k = k0 + tl.arange(0, BLOCK_G)
            x = tl.load(x_ptr + row * stride_x + k, mask=k < end, other=0).to(tl.float32)
            q = tl.clamp(x / scale, -448.0, 448.0)
            tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < end)
        tl.store(s_ptr + row * stride_s + group * stride_sg, scale)


def quantize_activations(x: torch.Tensor, group: int | None, column_major: bool = False,
                         static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in fp8, scales [M, groups] float32): per token (group None: one group per row) or per token and group.
    column_major: the scales laid out group by group (strides (1, M)), as _scaled_mm's 1x128 block scaling takes
    them. static_scale: a float32 tensor of one element on x's device (a layer's static activation scale s): x is
    quantized with it, clamp(x / s, -448, 448), and every scale returned is s. It is read on the device (no host
    sync), so a CUDA graph captures the read, not the value."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    group = group or k
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = (torch.empty(groups, m, dtype=torch.float32, device=x.device).t() if column_major
         else torch.empty(m, groups, dtype=torch.float32, device=x.device))
    if m:
        # Each value is read once, held in registers between its group's max and its division: a program takes a
        # whole row per token, or as many groups as make about 2,048 columns.
        block_g = min(triton.next_power_of_2(group), MAX_TILE)
        per = max(1, min(2048 // block_g, triton.next_power_of_2(groups)))
        warps = 4 if per * block_g <= 4096 else 8 if per * block_g <= 16384 else 16
        static = static_scale if static_scale is not None else s  # (unread unless STATIC)
        _quant_kernel[(m, triton.cdiv(groups, per))](x, q, s, static, k, x.stride(0), q.stride(0), s.stride(0),
                                                     s.stride(1), GROUP=group, GROUPS=per, BLOCK_G=block_g,
                                                     STATIC=static_scale is not None, num_warps=warps)
    return q, s


@triton.jit(do_not_specialize=["M"])
def _block_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_a, stride_b, stride_c,
                       stride_sa, stride_sb, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE: tl.constexpr):
    """c [M, N] = sum over K groups of (a_g @ b_g^T) * sa[:, g] * sb[:, g] (+ bias): a [M, K] and b [N, K] in fp8,
    scales float32. BLOCK_K divides GROUP: a group's scales are read for each of its steps."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_band = SWIZZLE * grid_n  # programs that share a band of SWIZZLE row tiles (their a stays in L2)
    band = pid // per_band
    first_m = band * SWIZZLE
    rows_in_band = tl.minimum(grid_m - first_m, SWIZZLE)
    pid_m = first_m + (pid % per_band) % rows_in_band
    pid_n = (pid % per_band) // rows_in_band
    # The tile's first row and column as 64-bit pointer offsets (M * K passes 2^31 at 175k rows of K 12,288), the
    # offsets inside the tile 32-bit.
    a_ptr += (pid_m * BLOCK_M).to(tl.int64) * stride_a
    c_ptr += (pid_m * BLOCK_M).to(tl.int64) * stride_c
    sa_ptr += (pid_m * BLOCK_M).to(tl.int64) * stride_sa
    b_ptr += (pid_n * BLOCK_N).to(tl.int64) * stride_b
    sb_ptr += (pid_n * BLOCK_N).to(tl.int64) * stride_sb
    im, jn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    rn = pid_n * BLOCK_N + jn
    rk = tl.arange(0, BLOCK_K)
    mmask, nmask = pid_m * BLOCK_M + im < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(a_ptr + im[:, None] * stride_a + k[None, :], mask=mmask[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + jn[None, :] * stride_b + k[:, None], mask=nmask[None, :] & (k[:, None] < K), other=0.0)
        g = k0 // GROUP
        sa = tl.load(sa_ptr + im * stride_sa + g, mask=mmask, other=0.0)
        sb = tl.load(sb_ptr + jn * stride_sb + g, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + im[:, None] * stride_c + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def block_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, group: int,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if not m:
        return c
    # Past 64 rows 64 x 128 tiles on 4 warps: each K step's product is scaled before it is added, so the tile's
    # accumulator and the step's product are both live, and larger tiles spill (Qwen3-8B's projections on an H100,
    # 256 and 2,048 rows: 128 x 128 on 8 warps took 1.7x as long).
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    block_k = min(group, 128)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_gemm_kernel[grid](a, b, c, sa, sb, bias if bias is not None else c, m, n, k, a.stride(0), b.stride(0),
                             c.stride(0), sa.stride(0), sb.stride(0), HAS_BIAS=bias is not None, GROUP=group,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWIZZLE=8, num_warps=4, num_stages=4)
    return c


SMALL_ROWS = 16  # up to this many rows (small-batch decode) the product reads W in fp8 and x as it is


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_s, stride_y,
                  GROUP: tl.constexpr, BLOCKED: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y [M, N] = x [M, K] @ (W [N, K] fp8 * scales)^T: program (n, m) streams W's rows [n * BLOCK_N, +BLOCK_N)
    against x's rows [m * BLOCK_M, +BLOCK_M) (decode: one row tile, W read once). fp8 values are exact in x's
    type, so each step's product is exact up to the accumulation; the scales multiply the float32 sums: per group
    of GROUP columns (BLOCKED, BLOCK_K divides GROUP) or per row at the end. A one-dimensional grid, n fastest: the
    second grid dimension would cap row tiles at 65,535."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    rn = tl.program_id(0) % tiles_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first_m = tl.program_id(0) // tiles_n * BLOCK_M
    x_ptr += first_m.to(tl.int64) * stride_x  # (64-bit: weight-only layers take any number of rows)
    y_ptr += first_m.to(tl.int64) * stride_y
    rm = tl.arange(0, BLOCK_M)
    nmask, mmask = rn < N, first_m + rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_w + k[:, None], mask=nmask[None, :] & kmask[:, None],
                    other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:
            part = tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        if BLOCKED:
            part *= tl.load(s_ptr + rn * stride_s + k0 // GROUP, mask=nmask, other=0.0)[None, :]
        acc += part
    if not BLOCKED:
        acc *= tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int | None,
          bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ the fp8 weight's dequantized transpose (+ bias), x's dtype, x unquantized."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return y
    blocked = scale.dim() == 2
    small = m <= SMALL_ROWS
    block_n = (32 if n >= 2048 else 16) if small else 64
    block_m = 16 if small else 64
    _w8a16_kernel[(triton.cdiv(n, block_n) * triton.cdiv(m, block_m),)](
        x, weight, scale, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0), y.stride(0), GROUP=group if blocked else k, BLOCKED=blocked, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=min(group, 128) if blocked else (256 if small else 128),  # (a whole wide group overflows shared memory)
        num_warps=4, num_stages=4 if small else 3)
    return y


def blockwise_scaled_mm_works(device: torch.device) -> bool:
    """Whether this torch's _scaled_mm takes DeepSeek-style block scales (1x128 on x, 128x128 on W) on `device`:
    sm_90 and a torch built on cuBLAS 12.9 or later. Asked once per device, with a [4, 512] x [512, 256] product
    whose scales (x's blocks 1-4; W's [[1, 3, 5, 7], [2, 4, 6, 8]], one row per 128 output columns) only block
    scaling, read the right way round, turns into 6,400 and 7,680. (K is four blocks: cuBLASLt pads W's scale rows
    to four, so a shorter K would read the wrong scales.)"""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _BLOCKWISE:
        try:
            a = torch.ones(4, 512, dtype=FP8, device=device)
            # (float32 spelled out: the engine asks while loading, under a 16-bit default dtype)
            f32 = dict(dtype=torch.float32, device=device)
            sa = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 4, **f32).t().contiguous().t()  # strides (1, 4)
            sb = torch.tensor([[1.0, 3.0, 5.0, 7.0], [2.0, 4.0, 6.0, 8.0]], **f32)  # [N / 128, K / 128]
            y = torch._scaled_mm(a, torch.ones(256, 512, dtype=FP8, device=device).t(), scale_a=sa, scale_b=sb.t(),
                                 out_dtype=torch.bfloat16)
            _BLOCKWISE[key] = bool((y[:, :128] == 6400).all() and (y[:, 128:] == 7680).all())
        except (RuntimeError, ValueError):
            _BLOCKWISE[key] = False
    return _BLOCKWISE[key]


_BLOCKWISE: dict[int, bool] = {}


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int | None,
               bias: torch.Tensor | None, activations: bool = True,
               block_scale: torch.Tensor | None = None, shared_rows: int = 1,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantized(weight)^T (+ bias), x's dtype out; weight fp8 [N, K]; scale [N] (per channel) or [N, groups]
    (per `group` columns). activations: x may be quantized to fp8 (a checkpoint with fp8 activations); False keeps
    it as it is (weight-only checkpoints). block_scale: the same scales one per 128 x 128 block
    ([N / 128, K / 128]; group 128, K / 128 a multiple of 4), for cuBLASLt's block-scaled GEMM where
    blockwise_scaled_mm_works; bfloat16 x only. shared_rows: gemv's WeightScale.rows (one row of x). input_scale:
    a static activation scale ([1] float32 on x's device; per-channel scales only): x is quantized with it instead
    of per token. 1 to SMALL_ROWS 16-bit rows take gemv / w8a16 with x unquantized, static or dynamic alike."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    small = x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= SMALL_ROWS
    if small and x.shape[0] == 1:
        from nanovllm.kernels.gemv import WeightScale, gemv
        y = gemv(x, weight, bias, scale=WeightScale(scale, group, shared_rows))
        return y.reshape(*shape[:-1], weight.shape[0])
    if small or not activations:
        return w8a16(x, weight, scale, group, bias).reshape(*shape[:-1], weight.shape[0])
    if block_scale is not None and x.dtype == torch.bfloat16:  # (the dtype the probe and PyTorch's tests use)
        m = x.shape[0]
        if m % 4:  # (cuBLASLt's block-scaled GEMM takes rows in fours)
            x = torch.cat([x, x.new_zeros(4 - m % 4, x.shape[1])])
        q, s = quantize_activations(x, group, column_major=True)
        y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=block_scale.t(), out_dtype=x.dtype)[:m]
    elif scale.dim() == 1:  # (static: s is input_scale on every row, as _scaled_mm's row-wise scaling takes it)
        q, s = quantize_activations(x, group, static_scale=input_scale)
        y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale[None, :], out_dtype=x.dtype)
    else:
        q, s = quantize_activations(x, group)
        y = block_gemm(q, s, weight, scale, group, bias, x.dtype)
        bias = None  # (added inside)
    if bias is not None:
        y += bias
    return y.reshape(*shape[:-1], weight.shape[0])
