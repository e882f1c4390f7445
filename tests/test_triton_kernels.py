"""Triton attention kernels: interpreted on CPU (subprocess), compiled for Hopper without a GPU, and on a real GPU.

The interpreter must be switched on (TRITON_INTERPRET=1) before triton is first imported, and other tests in
this process may import triton without it, so the CPU numerics checks run in a fresh interpreter process:
tests/triton_kernel_checks.py, one pytest subprocess per kernel group. In a whole-suite run they start with the
session (tests/conftest.py), on all cores but one, while the other tests run on the last; this module's
test_kernels_interpreted then collects them (on CI's 2 cores the five groups take about 5 minutes on one core,
most of it before the suite reaches this module). Run alone, the module starts them itself, on every core.
"""
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHECKS = "tests/triton_kernel_checks.py"
HOPPER_SHARED_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90


# disjoint -k groups that together select every check in CHECKS, the longest first (on CI's 2 cores the race
# checks take one core while the others run on the second)
KERNEL_GROUPS = ["race", "prefill", "rope or silu or norm or gemv or penalties or logprob", "decode and not prefill",
                 "store and not rope"]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def interpreted_groups(items) -> list[str]:
    """The kernel groups of the test_kernels_interpreted items among items, in order."""
    return [item.callspec.params["kernel"] for item in items
            if getattr(item, "originalname", "") == "test_kernels_interpreted"
            and getattr(item.module, "__name__", None) == __name__]


class _Interpreted:
    """The selected groups' subprocesses, all queued at once and run `workers` at a time (default: as many as there
    are cores); close() cancels the queued ones and kills the running ones (pytest -x, a failed test, Ctrl-C)."""

    def __init__(self, groups: list[str], workers: int | None = None):
        self.lock, self.closed, self.procs = threading.Lock(), False, []
        self.pool = ThreadPoolExecutor(max(1, min(len(groups), workers or cores())))
        self.runs = {group: self.pool.submit(self._run, group) for group in groups}

    def _run(self, group: str) -> tuple[list[str], int, str, str]:
        cmd = [sys.executable, "-m", "pytest", CHECKS, "-q", "-p", "no:cacheprovider", "--noconftest", "-k", group]
        with self.lock:
            if self.closed:
                return cmd, -1, "", "not run: closed"
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return cmd, proc.returncode, out, err

    def close(self):
        with self.lock:
            self.closed = True
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in self.procs:
                proc.kill()  # (a no-op for one that has ended)


@pytest.fixture(scope="module")
def interpreted(request):
    started = getattr(request.config, "interpreted_kernels", None)  # by tests/conftest.py at the session's start
    if started is not None:
        yield started
        return
    runs = _Interpreted(interpreted_groups(request.session.items))
    yield runs
    runs.close()


@pytest.mark.parametrize("kernel", KERNEL_GROUPS)
def test_kernels_interpreted(kernel, interpreted):
    cmd, returncode, out, err = interpreted.runs[kernel].result()
    assert returncode == 0, f"{' '.join(cmd)} failed:\n{out[-8000:]}\n{err[-4000:]}"


def _compile_for_hopper(fn, pointer_types: dict[str, str], constexprs: dict, **options):
    """Compile a @triton.jit kernel for sm_90 with no GPU present: catches code-generation errors (and shared-memory
    overflows) that the interpreter never sees. Pointers and strides are marked 16-divisible as a launch would."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = pointer_types.get(name, "fp32" if name == "qk_scale" else "i32")
        if name in pointer_types or (name.startswith("stride_") and name != "stride_table"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, (fn.__name__, constexprs, kernel.metadata.shared)


def test_compile_tally_counts_a_compile(monkeypatch):
    # the start-up log's Triton tally (engine/warmup.py): one kernel compiled or found on disk; a listener set before
    # hears it too and is put back; a Triton without a listener says so instead of counting 0
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from triton import knobs

    from nanovllm.engine.warmup import counting_compiles
    from nanovllm.kernels import activation
    heard = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: heard.append(kw["cache_hit"]))
    before = knobs.compilation.listener
    with counting_compiles() as tally:
        _compile_for_hopper(activation._silu_and_mul_kernel, {"x_ptr": "*fp16", "out_ptr": "*fp16"},
                            dict(BLOCK=256, PDL=False), num_warps=2)
    assert tally.compiled + tally.cached == 1 and len(heard) == 1, (tally, heard)
    assert tally.seconds > 0 if tally.compiled else tally.seconds == 0
    assert knobs.compilation.listener is before
    assert "kernels compiled" in str(tally)
    monkeypatch.setattr(knobs, "compilation", SimpleNamespace())  # (Triton before 3.4)
    with pytest.raises(KeyError) as raised, counting_compiles() as tally:
        raise KeyError("the start-up's own error")
    assert not tally.counted and "not counted" in str(tally)
    assert raised.value.__context__ is None  # not chained to the missing listener


def test_compile_ahead_compiles_on_threads_and_launches_nothing(monkeypatch, tmp_path):
    # the start-up's parallel compiles (engine/warmup.py's compile_ahead), on CPU: a stand-in for the CUDA driver
    # gives Triton an sm_90 target, so launches inside compile for Hopper (a real launch would fail here)
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "AsyncCompileMode"):
        pytest.skip("this Triton has no AsyncCompileMode (before 3.5)")
    import threading

    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from nanovllm.engine.warmup import compile_ahead, counting_compiles
    from nanovllm.kernels import activation

    class NoGpu:  # what JITFunction.run asks of the driver before it compiles
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(driver, "_active", NoGpu())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found on disk
    kernel = activation._silu_and_mul_kernel
    monkeypatch.setattr(kernel, "device_caches", type(kernel.device_caches)(kernel.create_binder))
    threads = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: threads.append(
        threading.current_thread().name))
    reached = []  # the launches that reach Triton (compile_ahead wraps what it finds: this)
    run = JITFunction.run

    def counted(self, *args, **kwargs):
        reached.append(kwargs["warmup"])
        return run(self, *args, **kwargs)
    monkeypatch.setattr(JITFunction, "run", counted)
    launch = JITFunction.run
    outs = []

    def forward():
        for inter, block in ((64, 64), (256, 256), (256, 256)):  # two variants, the second asked for twice
            x = torch.ones(2, 2 * inter, dtype=torch.float16)
            outs.append(torch.full((2, inter), 7.0, dtype=torch.float16))
            kernel[(2, 1)](x, outs[-1], x.stride(0), inter, inter, BLOCK=block, PDL=False, num_warps=4)
    with counting_compiles() as tally:
        compile_ahead(forward)
    assert JITFunction.run is launch
    assert all((out == 7.0).all() for out in outs)  # nothing ran
    assert tally.compiled == 2 and len(threads) == 2, (tally, threads)
    assert reached == [True, True], reached  # as warm-ups; the repeated launch skipped (nothing new in it)
    assert all(name.startswith("triton-compile") for name in threads), threads
    compiled = list(kernel.device_caches[0][0].values())  # the JIT's own cache holds the finished kernels
    assert len(compiled) == 2 and all(type(k).__name__ == "CompiledKernel" for k in compiled), compiled

    def broken():  # a compile error comes out of compile_ahead, and launches are launches again
        x = torch.ones(2, 128, dtype=torch.float16)
        kernel[(2, 1)](x, x, x.stride(0), 64, 64, BLOCK=96, PDL=False, num_warps=4)  # not a power of two
    with pytest.raises(Exception, match="power of 2|power of two"):
        compile_ahead(broken)
    assert JITFunction.run is launch
    from triton.runtime import _async_compile
    assert _async_compile.active_mode.get() is None  # (left on by Triton 3.5-3.6 after a failed compile)
    other = []  # another thread's launch, during a pass, is a launch (here it fails: no GPU)

    def from_another_thread():
        t = threading.Thread(target=lambda: other.append(_try_launch(kernel)))
        t.start()
        t.join()
    compile_ahead(from_another_thread)
    assert other == ["launched"], other


def _try_launch(kernel) -> str:
    x = torch.ones(2, 128, dtype=torch.float16)
    try:
        kernel[(2, 1)](x, x, x.stride(0), 64, 64, BLOCK=64, PDL=False, num_warps=4)
    except AttributeError:  # the stand-in driver has no launcher: a real launch was tried
        return "launched"
    return "compiled only"


def test_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    from nanovllm.kernels import decode, prefill, store_kvcache

    # (q dtype, KV cache pointer type or None for a 16-bit cache like q's)
    for dtype, head_dim, paged, kv in [(torch.bfloat16, 128, False, None), (torch.bfloat16, 128, True, None),
                                       (torch.bfloat16, 64, True, None), (torch.float32, 128, True, None),
                                       (torch.bfloat16, 128, True, "*fp8e4nv"), (torch.bfloat16, 64, True, "*fp8e5")]:
        t = "bf16" if dtype == torch.bfloat16 else "fp32"
        block_m, block_n, warps, stages = prefill._prefill_config(head_dim, dtype, 4096)
        _compile_for_hopper(
            prefill._prefill_kernel, {n: f"*{t}" for n in ("q_ptr", "o_ptr")}
            | {n: kv or f"*{t}" for n in ("k_ptr", "v_ptr")}
            | {n: "*fp32" for n in ("k_scale_ptr", "v_scale_ptr")}
            | {n: "*i32" for n in ("cu_q_ptr", "cu_k_ptr", "table_ptr")},
            dict(GROUP=2, PAGED=paged, BLOCK_SIZE=16 if head_dim == 64 else 256, BLOCK_M=block_m, BLOCK_N=block_n,
                 HEAD_DIM=head_dim, PRECISION="ieee" if dtype == torch.float32 else "tf32", QUANT=kv is not None,
                 V_TOKEN_MAJOR=kv is not None and paged),
            num_warps=warps, num_stages=stages)
    for dtype, head_dim, group, kv in [(torch.bfloat16, 128, 2, None), (torch.bfloat16, 128, 8, None),
                                       (torch.float32, 64, 1, None), (torch.bfloat16, 128, 2, "*fp8e4nv"),
                                       (torch.bfloat16, 128, 2, "*fp8e5")]:
        t = "bf16" if dtype == torch.bfloat16 else "fp32"
        for v_token_major, batch in ((False, 256), (True, 256), (True, 16)) if kv else ((False, 256), (False, 16),
                                                                                      (False, 1)):
            # (the engine's fp8 V is token-major; the small-batch tile and split too)
            block_n, warps, stages = decode._decode_config(head_dim, dtype, kv is not None, v_token_major, batch)
            split_tiles = decode.decode_splits(batch, 8, 4096, block_n, torch.device("cpu"), quant=kv is not None)[1]
            _compile_for_hopper(
                decode._decode_kernel, {n: f"*{t}" for n in ("q_ptr", "o_ptr")}
                | {n: kv or f"*{t}" for n in ("k_cache_ptr", "v_cache_ptr")}
                | {n: "*fp32" for n in ("part_m_ptr", "part_l_ptr", "part_acc_ptr", "k_scale_ptr", "v_scale_ptr")}
                | {n: "*i32" for n in ("context_lens_ptr", "table_ptr", "count_ptr")},
                dict(GROUP=group, BLOCK_G=max(16, group), BLOCK_SIZE=256, BLOCK_N=block_n, HEAD_DIM=head_dim,
                     PRECISION="ieee" if dtype == torch.float32 else "tf32", QUANT=kv is not None,
                     V_TOKEN_MAJOR=v_token_major, PDL=True,  # early (the L2 prefetch) as launched_early says:
                     EARLY=batch <= 16 and not kv and dtype != torch.float32,
                     PREFETCH_TILES={1: 2, 16: 1}.get(batch, 0) if not kv and dtype != torch.float32 else 0,
                     **decode.split_constants(group, 256, block_n, split_tiles)),
                num_warps=warps, num_stages=stages)
    for kv, fp8_max in ((None, 1.0), ("*fp8e4nv", 448.0), ("*fp8e5", 57344.0)):
        _compile_for_hopper(store_kvcache._store_kvcache_kernel,
                            {n: "*bf16" for n in ("k_ptr", "v_ptr")} | {n: kv or "*bf16" for n in ("k_cache_ptr",
                                                                                                  "v_cache_ptr")}
                            | {n: "*fp32" for n in ("k_scale_ptr", "v_scale_ptr")} | {"slot_ptr": "*i32"},
                            dict(BLOCK_SIZE=256, BLOCK_T=16, HEAD_DIM=128, QUANT=kv is not None, FP8_MAX=fp8_max,
                                 V_TOKEN_MAJOR=kv is not None),
                            num_warps=4)


def test_elementwise_kernels_compile_for_hopper():
    triton = pytest.importorskip("triton")
    from nanovllm.kernels import activation, rope
    for norm, store, quant, heads in ((True, True, False, 0), (True, False, False, 0), (False, True, False, 0),
                                      (True, True, True, 0), (True, True, False, 2), (True, True, True, 1)):
        cache = "*fp8e4nv" if quant else "*bf16"
        _compile_for_hopper(rope._qk_norm_rope_kernel,
                            {n: "*bf16" for n in ("q_ptr", "k_ptr", "q_w_ptr", "k_w_ptr", "v_ptr")}
                            | {"k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": "*fp32",
                               "v_scale_ptr": "*fp32", "positions_ptr": "*i64", "cache_ptr": "*fp32",
                               "slot_ptr": "*i32", "eps": "fp32"},
                            dict(NORM=norm, BLOCK_HQ=heads or 16, BLOCK_HK=heads or 8, HALF=64, STORE=store,
                                 BLOCK_SIZE=256, QUANT=quant, FP8_MAX=448.0, PDL=True),
                            num_warps=max(1, heads // 2) if heads else 4, launch_pdl=True)
    _compile_for_hopper(activation._silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"},
                        dict(BLOCK=1024, PDL=True), num_warps=4, launch_pdl=True)
    from nanovllm.kernels import norm, race
    for add in (True, False):
        _compile_for_hopper(norm._rms_norm_kernel, {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr",
                                                                          "res_out_ptr")} | {"eps": "fp32"},
                            dict(ADD=add, BLOCK=1024, PDL=True), num_warps=4, launch_pdl=True)
    from nanovllm.kernels import gemv
    # (qkv as it was; o_proj, gate_up and down swapped, o_proj and down split over K)
    # (16 rows: with the norm folded as DecoderModel.forward_rows does: o_proj and down hand it on, qkv and gate_up
    # take it)
    for rows, n, k, fold in ((1, 4096, 1024, ""), (16, 4096, 1024, ""), (16, 1024, 2048, ""), (16, 6144, 1024, ""),
                             (16, 1024, 3072, ""), (16, 1024, 2048, "add"), (16, 1024, 3072, "add"),
                             (16, 4096, 1024, "scale"), (16, 6144, 1024, "scale"), (16, 6144, 1024, "scale gated")):
        swap = gemv.swapped(rows, n, k)
        block_n, block_k, warps, stages = gemv.gemv_config(rows, n, k, swap)
        _compile_for_hopper(gemv._gemv_kernel, {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "res_ptr",
                                                                     "xn_ptr", "nw_ptr")}
                            | {"part_ptr": "*fp32", "count_ptr": "*i32", "sumsq_ptr": "*fp32", "eps": "fp32"},
                            dict(BLOCK_M=1 if rows == 1 else 16, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False,
                                 EVEN=True, SPLIT=gemv.gemv_split_k(rows, n, k, block_n, block_k,
                                                                    torch.device("cpu"), swap) > 1,
                                 SWAP=swap, PDL=True, ADD_NORM=fold == "add", SCALE_ROWS=fold.startswith("scale"),
                                 PARTS=16, GATED_OUT=fold.endswith("gated")),
                            num_warps=warps, num_stages=stages)
    row_ptrs = {n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "res_ptr", "nw_ptr", "res_out_ptr")}
    for k in (1024, 2048, 3072):
        block_n, block_k, warps = gemv.row_config(4096, k)
        variants = [(False, False, False, True), (False, False, False, False), (True, False, False, True),
                    (False, True, True, True), (False, True, False, True)]  # (gated, normed, add, pdl)
        for gated, normed, add, pdl in variants:
            _compile_for_hopper(gemv._gemv_row_kernel, row_ptrs | {"eps": "fp32"},
                                dict(BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=True, GATED=gated, NORM=normed,
                                     ADD=add, PDL=pdl), num_warps=warps, launch_pdl=pdl)
    for draw, keyed in ((False, False), (True, False), (True, True)):
        for split in (False, True):
            _compile_for_hopper(race._race_kernel, {"logits_ptr": "*bf16", "temps_ptr": "*fp32", "noise_ptr": "*fp32",
                                                    "seed_ptr": "*i64", "keys_ptr": "*i64", "streams_ptr": "*i64",
                                                    "out_ptr": "*i64", "best_ptr": "*fp32"},
                                dict(BLOCK=1024 if split else 4096, DRAW=draw, KEYED=keyed, SPLIT=split, FAST=True),
                                num_warps=4 if split else 8)
    for keyed in (False, True):
        for ids in (False, True):
            _compile_for_hopper(race._draws_kernel, {"seed_ptr": "*i64", "keys_ptr": "*i64", "streams_ptr": "*i64",
                                                     "ids_ptr": "*i64", "out_ptr": "*fp32"},
                                dict(KEYED=keyed, IDS=ids, BLOCK=1024, FAST=True), num_warps=4)
    from nanovllm.kernels import penalties
    for rep, add in ((True, False), (False, True), (True, True)):
        _compile_for_hopper(penalties._penalties_kernel, {"logits_ptr": "*fp32", "out_ptr": "*fp32", "rows_ptr": "*i64",
                                                          "seen_ptr": "*u8", "counts_ptr": "*fp32", "rep_ptr": "*fp32",
                                                          "pres_ptr": "*fp32", "freq_ptr": "*fp32"},
                            dict(REP=rep, ADD=add, BLOCK=penalties.BLOCK), num_warps=8)
    from nanovllm.kernels import logprobs
    for dtype in ("*bf16", "*fp32"):
        _compile_for_hopper(logprobs._logprob_stats_kernel, {"logits_ptr": dtype, "max_ptr": "*fp32",
                                                             "sum_ptr": "*fp32", "top_v_ptr": "*fp32",
                                                             "top_i_ptr": "*i64"},
                            dict(BLOCK=1024, KB=logprobs.MAX_K), num_warps=4)
    from nanovllm.sampling.sampler import MAX_LOGPROBS_FUSED
    assert MAX_LOGPROBS_FUSED == logprobs.MAX_K  # the sampler's bound of the kernel's k
    _compile_for_hopper(race._race_pick_kernel, {"best_ptr": "*fp32", "idx_ptr": "*i64", "out_ptr": "*i64"},
                        dict(CHUNKS=triton.next_power_of_2(race.PROGRAMS_PER_SM * race.sm_count(torch.device("cpu")))),
                        num_warps=1)  # the engine's bound (an H200's SMs off-GPU)


# GPU: the compiled kernels on real shapes, against the torch reference computed in float32.
GPU_DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_store(block_size, dtype):
    from tests.triton_kernel_checks import check_store
    for runs in (False, True):
        check_store(block_size, 8, 128, dtype, device="cuda", runs=runs)
        check_store(block_size, 8, 128, dtype, device="cuda", v_token_major=True, runs=runs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 4, 64), (8, 8, 256)])
def test_gpu_prefill_fresh(heads, kv_heads, head_dim, dtype):
    from tests.triton_kernel_checks import check_prefill
    check_prefill([1, 17, 300, 2048, 129], None, 16, heads, kv_heads, head_dim, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 16, 8, 128), (256, 16, 8, 128),
                                                               (32, 32, 4, 64)])
def test_gpu_prefill_history(block_size, heads, kv_heads, head_dim, dtype):
    from tests.triton_kernel_checks import check_prefill
    check_prefill([40, 1, 17, 512, 3, 1000], [3000, 70, 17, 1536, 65, 1000], block_size, heads, kv_heads, head_dim,
                  dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 16, 8, 128), (256, 16, 8, 128),
                                                               (256, 32, 4, 64), (32, 8, 8, 256)])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_decode(batch, block_size, heads, kv_heads, head_dim, dtype):
    from tests.triton_kernel_checks import check_decode
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    lens[0] = 4096
    if batch > 1:
        lens[1], lens[-1] = 1, 0  # shortest context and a CUDA-graph padding row
    check_decode(lens, block_size, heads, kv_heads, head_dim, dtype, device="cuda")


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_store_fp8(block_size, kv_dtype):
    from tests.triton_kernel_checks import check_store_fp8
    for runs in (False, True):  # scattered slots, and prefill-like runs (the kernel's contiguous path)
        check_store_fp8(block_size, 8, 128, torch.bfloat16, kv_dtype, device="cuda", runs=runs)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_prefill_history_fp8(block_size, kv_dtype):
    from tests.triton_kernel_checks import check_prefill
    check_prefill([40, 1, 17, 512, 3, 1000], [3000, 70, 17, 1536, 65, 1000], block_size, 16, 8, 128, torch.bfloat16,
                  device="cuda", kv_dtype=kv_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_fp8(batch, block_size, kv_dtype):
    from tests.triton_kernel_checks import check_decode
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    lens[0] = 4096
    if batch > 1:
        lens[1], lens[-1] = 1, 0
    check_decode(lens, block_size, 16, 8, 128, torch.bfloat16, device="cuda", kv_dtype=kv_dtype)


@pytest.mark.gpu
# the split-K kernel; the TMA ring on Hopper (two 1,024-token chunks of a 1,280-token bound: 1,200 is merged)
@pytest.mark.parametrize("batch,block_size", [(8, 16), (16, 64)])
def test_gpu_decode_cuda_graph(batch, block_size, monkeypatch):
    """Captured once, replayed with other context lengths, tables and queries: the grid must not depend on them."""
    from nanovllm.kernels import decode
    from nanovllm.kernels.hopper import decode_tma
    from nanovllm.layers.attention.torch_ref import TorchAttention
    from nanovllm.layers.attention.triton_backend import TritonAttention
    from nanovllm.layers.context import Context
    from tests.triton_kernel_checks import assert_close, block_tables_for, random_cache
    heads, kv_heads, head_dim, width = 16, 8, 128, 1280 // block_size
    tma_launches, tma = [], decode_tma.decode_attention_tma
    monkeypatch.setattr(decode_tma, "decode_attention_tma", lambda *a, **k: tma_launches.append(1) or tma(*a, **k))
    k_cache, v_cache = random_cache(batch * width, block_size, kv_heads, head_dim, torch.bfloat16, "cuda")
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    tables = torch.full((batch, width), -1, dtype=torch.int32, device="cuda")
    context = Context(False, context_lens=lens, block_tables=tables)
    backend, scale = TritonAttention(), head_dim ** -0.5
    backend.decode(q, k_cache, v_cache, context, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(q, k_cache, v_cache, context, scale)
    tma_expected = batch == 16 and decode_tma.stages_for(batch * kv_heads, width * block_size,
                                                         decode.sm_count(q.device)) > 0 and decode_tma.usable(
        q, k_cache, v_cache)
    assert bool(tma_launches) == tma_expected
    for new_lens in ([1, 1024, 0, 37, 700, 256, 1, 999], [5, 0, 0, 1200, 3, 17, 512, 100]):
        new_lens = (new_lens * 2)[:batch]
        table = block_tables_for(new_lens, block_size, batch * width, "cuda")
        tables.fill_(-1)
        tables[:, :table.size(1)] = table
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = TorchAttention().decode(q.float(), k_cache.float(), v_cache.float(), context, scale)
        assert_close(out, ref, torch.bfloat16, f"graph replay context_lens={new_lens}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 4, 64), (16, 1, 128)])
@pytest.mark.parametrize("stages", [3, 4])
def test_gpu_decode_tma(stages, heads, kv_heads, head_dim, block_size, dtype):
    from nanovllm.kernels.hopper import decode_tma
    from tests.triton_kernel_checks import check_decode_tma
    if not decode_tma.usable(torch.zeros(1, heads, head_dim, dtype=dtype, device="cuda"),
                             *(torch.zeros(1, block_size, kv_heads, head_dim, dtype=dtype, device="cuda"),) * 2):
        pytest.skip("the TMA decode kernel needs Hopper and Gluon (Triton 3.6 or newer)")
    # contexts ending inside a tile, on a tile's last row, on a block's, the longest the engine's rule allows, 0
    check_decode_tma([640, 1, 63, 64, 65, 0, 4096, 129, 255, 256, 257, 3000, 511, 2, 1000, 192], block_size, heads,
                     kv_heads, head_dim, dtype, stages)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype,block_size", [(torch.bfloat16, 256), (torch.float16, 128)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (32, 4, 64)])
@pytest.mark.parametrize("stages,chunk_tiles", [(3, None), (4, None), (3, 3)])
def test_gpu_decode_tma_fp8(stages, chunk_tiles, heads, kv_heads, head_dim, block_size, dtype, kv_dtype):
    from nanovllm.kernels.hopper import decode_tma
    from nanovllm.layers.attention.fp8 import token_major
    from tests.triton_kernel_checks import check_decode_tma
    cache = torch.zeros(1, block_size, kv_heads, head_dim, dtype=kv_dtype, device="cuda")
    scales = torch.zeros(1, kv_heads, block_size, device="cuda")
    if not decode_tma.usable(torch.zeros(1, heads, head_dim, dtype=dtype, device="cuda"), cache, token_major(cache),
                             scales, scales):
        pytest.skip("the TMA decode kernel needs Hopper and Gluon (Triton 3.6 or newer)")
    check_decode_tma([640, 1, 63, 64, 65, 0, 4096, 129, 255, 256, 257, 3000, 511, 2, 1000, 192], block_size, heads,
                     kv_heads, head_dim, dtype, stages, kv_dtype, chunk_tiles)


@pytest.mark.gpu
def test_gpu_decode_picks_the_tma_kernel_by_shape(monkeypatch):
    # the engine's path (decode_attention): the TMA ring at 12-33 sequences with 8 KV heads and a bound up to 4,096
    # tokens, the split-K kernel otherwise (and with NANOVLLM_DECODE_TMA=0), for a 16-bit and an fp8 cache; both
    # give the same attention
    from nanovllm.kernels import decode
    from nanovllm.kernels.hopper import decode_tma
    from nanovllm.layers.attention.fp8 import token_major
    from tests.triton_kernel_checks import block_tables_for, random_cache, random_fp8_cache
    if not decode_tma.stages_for(128, 4096, decode.sm_count(torch.device("cuda"))):
        pytest.skip("no Gluon here")
    picked, tma = [], decode_tma.decode_attention_tma
    monkeypatch.setattr(decode_tma, "decode_attention_tma", lambda *a, **k: picked.append(a[6]) or tma(*a, **k))
    sms = decode.sm_count(torch.device("cuda"))

    def attend(batch, width, kv_dtype=None):
        picked.clear()
        lens = [700 - 3 * i for i in range(batch)]
        scales = {}
        if kv_dtype is None:
            k, v = random_cache(batch * width, 256, 8, 128, torch.bfloat16, "cuda")
        else:  # (V token-major, as the engine stores an fp8 cache)
            k, v, k_scale, v_scale = random_fp8_cache(batch * width, 256, 8, 128, kv_dtype, "cuda")
            v, scales = token_major(v), dict(k_scale=k_scale, v_scale=v_scale)
        tables = torch.full((batch, width), -1, dtype=torch.int32, device="cuda")
        t = block_tables_for(lens, 256, batch * width, "cuda")
        tables[:, :t.size(1)] = t
        q = torch.randn(batch, 16, 128, dtype=torch.bfloat16, device="cuda")
        ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out = decode.decode_attention(q, k, v, ctx, tables, 128 ** -0.5, **scales)
        split_k = decode.decode_attention(q, k, v, ctx, tables, 128 ** -0.5, max_split_tokens=128, **scales)
        torch.testing.assert_close(out.float(), split_k.float(), atol=2e-2, rtol=2e-2)
        return list(picked)
    for kv_dtype in (None, torch.float8_e4m3fn):
        assert attend(16, 16, kv_dtype) == [4 if 128 <= sms and kv_dtype is None else 3]
        assert attend(32, 16, kv_dtype) == ([3] if 256 <= 2 * sms else [])
        assert attend(8, 16, kv_dtype) == []  # 64 programs
        assert attend(16, 17, kv_dtype) == []  # a bound of 4,352 tokens
    monkeypatch.setenv("NANOVLLM_DECODE_TMA", "0")
    assert attend(16, 16) == [] and attend(16, 16, torch.float8_e4m3fn) == []


@pytest.mark.gpu
def test_gpu_decode_tma_context_past_its_bound_is_still_whole():
    # a caller's bound shorter than a context (the engine never passes one): the grid's chunks grow to cover it, so
    # the answer is the same as under a true bound; the split counters the split-K and linear kernels share go
    # back to zero, and nothing is written past out
    from nanovllm.kernels import decode
    from nanovllm.kernels.hopper import decode_tma
    from tests.triton_kernel_checks import block_tables_for, random_cache
    if not decode_tma.usable(torch.zeros(1, 16, 128, dtype=torch.bfloat16, device="cuda"),
                             *(torch.zeros(1, 256, 8, 128, dtype=torch.bfloat16, device="cuda"),) * 2):
        pytest.skip("the TMA decode kernel needs Hopper and Gluon (Triton 3.6 or newer)")
    lens = [2500] * 15 + [700]
    k, v = random_cache(16 * 10, 256, 8, 128, torch.bfloat16, "cuda")
    tables = block_tables_for(lens, 256, 16 * 10, "cuda")
    q = torch.randn(16, 16, 128, dtype=torch.bfloat16, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    whole = decode_tma.decode_attention_tma(q, k, v, ctx, tables, 128 ** -0.5, 4, None, 2560)  # 3 chunks
    guard = torch.zeros(2, 16, 16, 128, dtype=torch.bfloat16, device="cuda")  # out, then what lies past it
    for bound in (2048, 1024):
        guard.zero_()
        decode_tma.decode_attention_tma(q, k, v, ctx, tables, 128 ** -0.5, 4, guard[0], bound)
        torch.cuda.synchronize()
        assert not decode.split_counters(q.device, 16 * 8)[:16 * 8].any(), bound
        assert not guard[1].any(), bound
        torch.testing.assert_close(guard[0].float(), whole.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 300, 16384])
def test_gpu_rope_and_silu(tokens, norm):
    from tests.triton_kernel_checks import check_qk_norm_rope, check_race, check_rms_norm, check_silu_and_mul
    check_qk_norm_rope(tokens, 16, 8, 128, torch.bfloat16, norm, device="cuda")
    for heads in (1, 2, 4):
        check_qk_norm_rope(min(tokens, 256), 16, 8, 128, torch.bfloat16, norm, device="cuda", heads_per_program=heads)
    check_silu_and_mul(tokens, 3072, torch.bfloat16, device="cuda")
    check_rms_norm(tokens, 1024, torch.bfloat16, device="cuda")
    check_race(min(tokens, 600), 151936, torch.bfloat16, device="cuda")  # 600 rows: one program a row (unsplit)
    check_race(3, 151936, torch.bfloat16, device="cuda")  # split rows
    from tests.triton_kernel_checks import check_qk_norm_rope_store
    check_qk_norm_rope_store(min(tokens, 128), torch.bfloat16, device="cuda", block_size=256)
    check_qk_norm_rope_store(min(tokens, 128), torch.bfloat16, device="cuda", block_size=256,
                             kv_dtype=torch.float8_e4m3fn)
    for heads in (1, 2):
        check_qk_norm_rope_store(min(tokens, 128), torch.bfloat16, device="cuda", block_size=256,
                                 heads_per_program=heads)
        check_qk_norm_rope_store(min(tokens, 128), torch.bfloat16, device="cuda", block_size=256,
                                 kv_dtype=torch.float8_e4m3fn, heads_per_program=heads)
    if tokens == 1:
        from tests.triton_kernel_checks import check_race_draws
        check_race_draws(torch.bfloat16, device="cuda", rows=20000, vocab=151936)


@pytest.mark.gpu
def test_gpu_sampler_kernels():
    """Seeded rows keyed in the race and in exp_draws, the sampler's seeded rows, the penalties kernel, the logprobs
    kernel and the sampler's logprobs with it: Qwen3's vocabulary, bf16 logits (and float32 for logprobs)."""
    from tests.triton_kernel_checks import (
        check_logprob_stats,
        check_penalties,
        check_race_keys,
        check_race_keys_follow_softmax,
        check_sampler_logprobs,
        check_sampler_seeded_rows,
    )
    check_race_keys(torch.bfloat16, device="cuda", vocab=151936)
    check_race_keys_follow_softmax(device="cuda", rows=20000)
    check_sampler_seeded_rows(device="cuda", vocab=151936)
    for batch in (1, 256):
        check_penalties(batch, 151936, device="cuda", exact=False)
    for batch, k in ((1, 5), (16, 20), (256, 5), (256, 0), (7, 32)):
        for dtype in (torch.bfloat16, torch.float32):
            check_logprob_stats(batch, 151936, k, dtype, device="cuda")
    check_logprob_stats(16, 151936, 8, torch.bfloat16, device="cuda", ties=True, masked=0.3)
    check_sampler_logprobs(device="cuda", vocab=151936)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_gpu_gemv(rows):
    # the Qwen3-0.6B shapes (qkv, o, gate_up, down, LM head), and a ragged one with a bias
    from tests.triton_kernel_checks import check_gemv
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)):
        check_gemv(rows, n, k, torch.bfloat16, False, device="cuda")
    check_gemv(rows, 1000, 1000, torch.bfloat16, True, device="cuda")


@pytest.mark.gpu
def test_gpu_gemv_add_norm():
    # the norm folded between the Qwen3-0.6B projections at 16 and 9 rows: o_proj -> gate_up, down -> qkv, in
    # bf16 against float32; and the fused step against the plain model in float16 (three layers of bfloat16
    # roundings, in another order, would not meet a tolerance that catches a misplaced weight)
    from tests.triton_kernel_checks import check_fused_step, check_gemv_add_norm
    torch.manual_seed(0)
    for rows in (16, 9):
        check_gemv_add_norm(rows, 1024, 2048, 6144, torch.bfloat16, device="cuda")
        check_gemv_add_norm(rows, 1024, 3072, 4096, torch.bfloat16, device="cuda")
        check_fused_step(rows, torch.float16, device="cuda", tolerance=dict(atol=1e-2, rtol=1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_gpu_gemv_row_chain(pdl, monkeypatch):
    # the one-row kernel with and without programmatic dependent launch, with the norm / residual add / SiLU folded
    # in: each call reads what the one before wrote, eager and replayed as a CUDA graph: the same bits
    from nanovllm.kernels import gemv, norm
    from tests.triton_kernel_checks import check_fused_step, check_gemv, check_gemv_fused
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


@pytest.mark.gpu
@pytest.mark.parametrize("rows,kv_dtype,fold", [(1, None, False), (16, None, False), (16, torch.float8_e4m3fn, False),
                                               (16, None, True), (12, torch.float8_e4m3fn, True)])
def test_gpu_layer_chain_under_pdl(rows, kv_dtype, fold, monkeypatch):
    """Two decoder layers' kernels at decode shapes (Qwen3-0.6B), each reading what the one before wrote: launched
    under PDL (the norms, SiLU, rotary + K/V store, the 2-16-row linear kernel, decode attention with its early
    L2 prefetch at 1 row, and at 16 rows the TMA ring, which copies the tiles before the new token before its wait,
    from a 16-bit or an fp8 cache), replayed as a CUDA graph with new inputs, they give the bits of plain launches.
    A kernel that read before the one before it had finished would not. fold: the norms between the projections
    folded into them as the fused step does (gemv_add_norm, then gemv_normed)."""
    from nanovllm.kernels import activation, decode, gemv, norm, rope
    from nanovllm.kernels.hopper import pdl
    from nanovllm.layers.attention.fp8 import raw, token_major
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    from tests.triton_kernel_checks import block_tables_for, random_cache, random_fp8_cache
    if not pdl.pdl_enabled(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch here (before Hopper)")
    torch.manual_seed(rows)
    hidden, heads, kv_heads, head_dim, inter, block_size, width, eps = 1024, 16, 8, 128, 3072, 256, 16, 1e-6
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def weight(n, k):
        return torch.randn(n, k, **bf16) * k ** -0.5
    layers = [(weight((heads + 2 * kv_heads) * head_dim, hidden), weight(hidden, heads * head_dim),
               weight(2 * inter, hidden), weight(hidden, inter)) for _ in range(2)]
    nw, q_w, k_w = torch.rand(hidden, **bf16) + 0.5, torch.rand(head_dim, **bf16) + 0.5, torch.rand(head_dim, **bf16)
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).to("cuda").cos_sin_cache
    if kv_dtype is None:
        start = [random_cache(rows * width, block_size, kv_heads, head_dim, torch.bfloat16, "cuda") for _ in layers]
    else:  # (K, V token-major, K scales, V scales), as the engine stores an fp8 cache
        start = [random_fp8_cache(rows * width, block_size, kv_heads, head_dim, kv_dtype, "cuda") for _ in layers]
        start = [(k, token_major(v), ks, vs) for k, v, ks, vs in start]
    caches = [tuple(t.clone() for t in c) for c in start]
    x, res = torch.empty(rows, hidden, **bf16), torch.empty(rows, hidden, **bf16)
    lens = torch.empty(rows, dtype=torch.int32, device="cuda")
    tables = torch.full((rows, width), -1, dtype=torch.int32, device="cuda")
    positions = torch.empty(rows, dtype=torch.int64, device="cuda")
    slots = torch.empty(rows, dtype=torch.int32, device="cuda")
    early = []
    launched_early = decode.launched_early
    monkeypatch.setattr(decode, "launched_early", lambda *a: early.append(launched_early(*a)) or early[-1])
    from nanovllm.kernels.hopper import decode_tma
    tma_launches, tma = [], decode_tma.decode_attention_tma
    monkeypatch.setattr(decode_tma, "decode_attention_tma", lambda *a, **k: tma_launches.append(1) or tma(*a, **k))

    def step():
        h, r = norm.add_rms_norm(x, res, nw, eps)
        normed = None
        for (w_qkv, w_o, w_gate_up, w_down), (k_cache, v_cache, *scales) in zip(layers, caches):
            qkv = gemv.gemv(h, w_qkv) if normed is None else gemv.gemv_normed(normed, w_qkv)
            q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
            k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
            rope.qk_norm_rope_(q, k, positions, cos_sin, q_w, k_w, eps, store=(v, k_cache, v_cache, slots, *scales))
            o = decode.decode_attention(q, k_cache, v_cache, lens, tables, head_dim ** -0.5,
                                        **dict(zip(("k_scale", "v_scale"), scales)))
            if fold:
                r, normed = gemv.gemv_add_norm(o.view(rows, -1), w_o, None, r, nw, eps)
                act = activation.silu_and_mul(gemv.gemv_normed(normed, w_gate_up))
                r, normed = gemv.gemv_add_norm(act, w_down, None, r, nw, eps)
                h = normed.x
            else:
                h, r = norm.add_rms_norm(gemv.gemv(o.view(rows, -1), w_o), r, nw, eps)
                h = gemv.gemv(activation.silu_and_mul(gemv.gemv(h, w_gate_up)), w_down)
                h, r = norm.add_rms_norm(h, r, nw, eps)
        return h, r

    def inputs(i):  # new contexts (the new token last), tables, slots and hidden states; the caches as at start
        gen = torch.manual_seed(100 * rows + i)  # (block_tables_for draws from the global generator)
        new_lens = torch.randint(1, 900, (rows,), generator=gen)
        table = block_tables_for(new_lens.tolist(), block_size, rows * width, "cuda")
        tables.fill_(-1)
        tables[:, :table.size(1)] = table
        lens.copy_(new_lens)
        positions.copy_(new_lens - 1)
        last = (new_lens - 1).to("cuda")
        slots.copy_(table.gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size)
        x.copy_(torch.randn(rows, hidden, generator=gen).to(x))
        res.copy_(torch.randn(rows, hidden, generator=gen).to(res))
        for cache, cache0 in zip(caches, start):
            for t, t0 in zip(cache, cache0):
                t.copy_(t0)

    inputs(0)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    # decode attention launched early at 1 row; at 16 (128 programs) the TMA ring, which requests the tiles before
    # the new token before its wait, where the kernel runs here (Hopper with Gluon)
    if rows >= 12 and decode_tma.stages_for(rows * kv_heads, width * block_size, decode.sm_count(x.device)):
        assert tma_launches and not early
    else:
        assert early and all(early) and not tma_launches
    got = []
    for i in range(3):
        inputs(i)
        graph.replay()
        torch.cuda.synchronize()
        got.append([raw(t).clone() for t in (*out, *caches[0], *caches[1])])
    for module in (activation, decode, decode_tma, gemv, norm, rope):
        monkeypatch.setattr(module, "pdl_enabled", lambda device: False)
    for i in range(3):
        inputs(i)
        want = [raw(t) for t in (*step(), *caches[0], *caches[1])]  # (fp8 compared as bytes)
        assert all(torch.equal(a, b) for a, b in zip(got[i], want)), f"replay {i}"


def test_decode_launched_early_and_its_prefetch(monkeypatch):
    # under PDL with the L2 prefetch: a 16-bit cache in fixed splits of 1-2 tiles inside a block: the engine's
    # batches 1-16 (8 KV heads) at a max_model_len of 4,096, not 17 (4-tile splits); past 8,192 tokens their splits
    # hold 3 tiles. Each program asks for all its tiles where the grid is resident at once (an H200's 132 SMs off-GPU:
    # batches 1 and 2, 256 and 512 programs), else for its first (batch 3, 768; batch 16, 4,096)
    from nanovllm.kernels import decode
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert not decode.launched_early(2, 256, 64, 128, bf16, cpu)  # no PDL on CPU
    monkeypatch.setattr(decode, "pdl_enabled", lambda device: True)
    splits = {b: decode.decode_splits(b, 8, 4096, 64, cpu) for b in (1, 2, 3, 16, 17)}
    assert splits == {1: (32, 2), 2: (32, 2), 3: (32, 2), 16: (32, 2), 17: (16, 4)}
    for batch in (1, 16):
        assert decode.decode_splits(batch, 8, 8192, 64, cpu) == (64, 2)
        assert decode.decode_splits(batch, 8, 8448, 64, cpu)[1] == 3
    assert decode.launched_early(2, 256, 64, 128, bf16, cpu) and decode.launched_early(1, 256, 64, 128, bf16, cpu)
    assert not decode.launched_early(4, 256, 64, 128, bf16, cpu)  # batch 17; more tiles than the prefetch covers
    assert not decode.launched_early(3, 256, 64, 128, bf16, cpu)
    assert not decode.launched_early(2, 256, 64, 128, torch.float8_e4m3fn, cpu)  # fp8
    assert not decode.launched_early(2, 256, 64, 128, torch.float32, cpu)  # (128-byte lines of 64 values)
    assert not decode.launched_early(0, 256, 64, 128, bf16, cpu)  # equal runs (tests' num_splits)
    assert not decode.launched_early(2, 64, 64, 128, bf16, cpu)  # a split across blocks
    assert not decode.launched_early(2, 256, 64, 96, bf16, cpu)  # rows not whole 128-byte lines
    assert [decode.prefetch_tiles(b * 8 * 32, 2, cpu) for b in (1, 2, 3, 16)] == [2, 2, 1, 1]
    assert decode.prefetch_tiles(528, 2, cpu) == 2 and decode.prefetch_tiles(529, 2, cpu) == 1
    assert decode.prefetch_tiles(4096, 1, cpu) == 1


def test_decode_tma_rule():
    # the TMA ring serves 96 to two SMs' worth of (sequence, KV head) programs under a bound of at most 4,096 tokens
    # (on an H200's 132 SMs: batches 12-33 with 8 KV heads), 4 slots where each program has an SM, 3 past that
    from nanovllm.kernels.hopper import decode_tma
    if decode_tma.gluon is None:
        pytest.skip("this Triton has no Gluon")
    rule = decode_tma.stages_for
    assert [rule(p, 4096, 132) for p in (95, 96, 132, 133, 264, 265)] == [0, 4, 4, 3, 3, 0]
    assert rule(128, 4097, 132) == 0 and rule(128, 512, 132) == 4
    # an fp8 cache: three slots throughout, its contexts in chunks of at least 3 128-token tiles while every
    # (sequence, KV head) has an SM (two programs an SM), else of 1,024 tokens as a 16-bit cache's
    assert [rule(p, 4096, 132, fp8=True) for p in (95, 96, 132, 133, 264, 265)] == [0, 3, 3, 3, 3, 0]
    chunks = decode_tma.chunk_tiles_for
    assert [chunks(p, 132, fp8=True) for p in (96, 132, 133, 264)] == [3, 3, 8, 8]
    assert [chunks(p, 132) for p in (96, 132, 133, 264)] == [16] * 4


def test_decode_tma_compiles_for_hopper(monkeypatch):
    # the Gluon kernel through this Triton's Gluon API (experimental, renamed between releases), for sm_90 with a
    # stand-in driver: both ring depths the rule picks, bf16 and fp16, head_dim 128 and 64, a 16-bit and an fp8
    # cache, and within Hopper's shared memory
    from nanovllm.kernels.hopper import decode_tma
    if decode_tma.gluon is None:
        pytest.skip("this Triton has no Gluon")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class NoGpu:  # what a launch with warmup=True asks of the driver
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")
    monkeypatch.setattr(driver, "_active", NoGpu())
    kernel = decode_tma._decode_tma_kernel  # (its sm_90 builds stay out of the kernel's cache for real launches)
    monkeypatch.setattr(kernel, "device_caches", type(kernel.device_caches)(kernel.create_binder))
    from nanovllm.layers.attention.fp8 import token_major
    for stages, dtype, heads, kv_heads, head_dim, block_size, kv_dtype in [
            (4, torch.bfloat16, 16, 8, 128, 256, None), (3, torch.float16, 32, 4, 64, 64, None),
            (4, torch.bfloat16, 16, 8, 128, 256, torch.float8_e4m3fn), (3, torch.float16, 32, 4, 64, 128,
                                                                            torch.float8_e5m2)]:
        q = torch.zeros(16, heads, head_dim, dtype=dtype)
        k, v = (torch.zeros(8, block_size, kv_heads, head_dim, dtype=kv_dtype or dtype) for _ in range(2))
        scales = [torch.zeros(8, kv_heads, block_size) for _ in range(2)] if kv_dtype else []
        descs = decode_tma._descriptors(k, token_major(v) if kv_dtype else v, *scales)
        tables = torch.zeros(16, 4, dtype=torch.int32)
        part = torch.zeros(16, 4, dtype=torch.float32)
        kernel = decode_tma._decode_tma_kernel.warmup(
            q, q, *descs, part, part, part, tables, tables[:, 0], tables, q.stride(0), q.stride(1),
            q.stride(0), q.stride(1), tables.stride(0), 0.1, GROUP=heads // kv_heads, BLOCK_G=16,
            BLOCK_SIZE=block_size, BLOCK_N=decode_tma.block_n_for(k.dtype), HEAD_DIM=head_dim, STAGES=stages,
            CHUNK_TILES=decode_tma.CHUNK_TOKENS // decode_tma.block_n_for(k.dtype), PDL=True,
            QUANT=kv_dtype is not None, num_warps=4, grid=(1,))
        assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, (stages, kernel.metadata.shared)
        assert kernel.asm["ptx"].count("cp.async.bulk.tensor") > 0


def test_early_decode_launch_wiring(monkeypatch):
    # what decode_attention and qk_norm_rope_ pass their kernels where PDL is on (forced here; the kernels are stood
    # in for, nothing runs): early launches at batches 1 and 16 of a 4,096-token bound, with SPLIT_IN_BLOCK (the
    # prefetch needs the split's block) and both tiles asked for at batch 1, the first at 16; not early for an fp8
    # or float32 cache or past 16 (4-tile splits); the rotary kernel triggers first past one token only
    from nanovllm.kernels import decode, rope
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, kw))
    for module in (decode, rope):
        monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(decode, "_decode_kernel", Kernel())
    monkeypatch.setattr(rope, "_qk_norm_rope_kernel", Kernel())
    block_size, kv_heads, head_dim = 256, 8, 128

    def decode_launch(batch, dtype=torch.bfloat16, kv_dtype=None):
        launches.clear()
        k, v = (torch.zeros(4, block_size, kv_heads, head_dim, dtype=kv_dtype or dtype) for _ in range(2))
        scales = {}
        if kv_dtype is not None:
            scales = dict(k_scale=torch.ones(4, kv_heads, block_size), v_scale=torch.ones(4, kv_heads, block_size))
        decode.decode_attention(torch.zeros(batch, 2 * kv_heads, head_dim, dtype=dtype), k, v,
                                torch.ones(batch, dtype=torch.int32), torch.zeros(batch, 16, dtype=torch.int32),
                                head_dim ** -0.5, **scales)
        (grid, _, kw), = launches
        return grid, kw
    for batch, tiles in ((1, 2), (16, 1)):
        grid, kw = decode_launch(batch)
        assert grid == (batch, kv_heads, 32) and kw["EARLY"] and kw["launch_pdl"] and kw["SPLIT_IN_BLOCK"]
        assert kw["PREFETCH_TILES"] == tiles, (batch, kw["PREFETCH_TILES"])
    for grid, kw in (decode_launch(17), decode_launch(16, kv_dtype=torch.float8_e4m3fn),
                     decode_launch(16, dtype=torch.float32)):
        assert not kw["EARLY"] and "launch_pdl" not in kw and kw["PREFETCH_TILES"] == 0 and kw["PDL"], grid
    for tokens in (1, 2, 16, 300):
        launches.clear()
        q, k = torch.zeros(tokens, 16, head_dim), torch.zeros(tokens, kv_heads, head_dim)
        rope.qk_norm_rope_(q, k, torch.zeros(tokens, dtype=torch.int64), torch.zeros(64, head_dim))
        (_, args, kw), = launches
        assert args[-1] == int(tokens > 1) and kw["PDL"] and kw["launch_pdl"], (tokens, args[-1])


def test_decode_split_lengths():
    # The heuristic's choices (H200 shape, 132 SMs; tables 4,096 tokens wide): short splits at small batch, longer
    # ones as the batch grows; a 16-bit cache at batch 256 is not split, an fp8 one in splits of 1,024 tokens
    from nanovllm.kernels.decode import decode_splits
    cpu = torch.device("cpu")

    def split_tokens(batch, quant):
        num_splits, split_tiles = decode_splits(batch, 8, 4096, 128 if quant else 64, cpu, quant=quant)
        return split_tiles * (128 if quant else 64), num_splits

    assert split_tokens(16, False) == (128, 32) and split_tokens(64, False) == (512, 8)
    assert split_tokens(256, False) == (4096, 1)
    assert split_tokens(128, True) == (512, 8) and split_tokens(256, True) == (1024, 4)
    # fp8 with a long bound at large batch: no dozens of mostly empty splits, one per sequence as for 16-bit
    assert decode_splits(512, 8, 131072, 128, cpu, quant=True) == (1, 1024)


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


def test_rotary_store_refuses_a_v_unlike_k():
    # the kernel reads every token's V rows (slot -1 too) before it stores: a V with fewer tokens or heads than k
    # must fail before any launch, not read past its end
    from nanovllm.kernels.rope import qk_norm_rope_
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    caches = [torch.zeros(2, 8, 2, 16) for _ in "kv"]
    slots = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    cos_sin = torch.randn(64, 16)
    with pytest.raises(ValueError, match="shaped like k"):
        qk_norm_rope_(q, k, torch.arange(4), cos_sin, store=(torch.randn(2, 2, 16), *caches, slots))
