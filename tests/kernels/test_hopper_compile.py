"""Kernels compiled for Hopper (sm_90) with no GPU present: the code-generation errors and shared-memory overflows
the interpreter never sees (the attention, elementwise, sampler, small-batch linear, Gluon TMA decode and MoE
kernels), and the start-up's compile tally and parallel compiles (engine/warmup.py).

These need real @triton.jit kernels, which a process does not have once TRITON_INTERPRET=1 was set before its
kernels were defined: tests/conftest.py sets it on a machine without CUDA. There, the first of these tests to run
starts ONE subprocess (pytest on this file's selected tests, without TRITON_INTERPRET and without the conftest)
and each test reports its own outcome from it (compiled_elsewhere, reported). Where nothing interprets (a CUDA
machine, or that subprocess) they run in the test process itself.
"""
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
HOPPER_SHARED_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90


def interpreting() -> bool:
    """Whether @triton.jit gives this process interpreter objects (TRITON_INTERPRET=1 when its kernels were
    defined), not kernels that compile."""
    try:
        from nanovllm.kernels import activation
    except ImportError:  # no triton: each test skips itself
        return False
    return type(activation._silu_and_mul_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(scope="module")
def compiled_in_a_subprocess(request, tmp_path_factory):
    """(outcomes, process): this module's selected tests run in one subprocess without the interpreter; outcomes
    maps each test's name to ("passed" | "failed" | "skipped", the failure's text or the skip's reason)."""
    path = Path(__file__).resolve().relative_to(ROOT).as_posix()
    names = [item.name for item in request.session.items if getattr(item, "module", None) is request.module]
    report = tmp_path_factory.mktemp("hopper_compile") / "report.xml"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", f"--junitxml={report}",
           *(f"{path}::{name}" for name in names)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    outcomes = {}
    if report.exists():
        for case in ElementTree.parse(report).iter("testcase"):
            failed = [e for e in case if e.tag in ("failure", "error")]
            skipped = [e for e in case if e.tag == "skipped"]
            if failed:
                outcomes[case.get("name")] = "failed", "\n".join(e.text or e.get("message", "") for e in failed)
            elif skipped:
                outcomes[case.get("name")] = "skipped", skipped[0].get("message", "")
            else:
                outcomes[case.get("name")] = "passed", ""
    return outcomes, proc


@pytest.fixture
def compiled_elsewhere(request) -> tuple[str, str] | None:
    """None where this process compiles: the test runs here. Else the test's (outcome, text) in the subprocess
    (compiled_in_a_subprocess), which reported() gives as the test's own."""
    if not interpreting():
        return None
    outcomes, proc = request.getfixturevalue("compiled_in_a_subprocess")
    where = f"`{' '.join(proc.args)}` (exit {proc.returncode})"
    if request.node.name not in outcomes:
        return "failed", f"{where}, where it did not run:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    outcome, text = outcomes[request.node.name]
    return outcome, text if outcome == "skipped" else f"{where}:\n{text}"


def reported(compiled_elsewhere: tuple[str, str] | None) -> bool:
    """False: compile here. Else report the subprocess's outcome as this test's: a failure there fails it, a skip
    skips it, a pass returns True (the test is done)."""
    if compiled_elsewhere is None:
        return False
    outcome, text = compiled_elsewhere
    if outcome == "failed":
        pytest.fail(f"failed in {text}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(text)
    return True


def _compile_for_hopper(fn, pointer_types: dict[str, str], constexprs: dict, **options):
    """Compile a @triton.jit kernel for sm_90 with no GPU present: catches code-generation errors (and shared-memory
    overflows) that the interpreter never sees. Pointers and strides are marked 16-divisible as a launch would."""
    import inspect

    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    defaults = {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty and "constexpr" in str(p.annotation)}
    constexprs = defaults | constexprs  # (a constexpr left out takes its default, as at a launch)
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


def test_compile_tally_counts_a_compile(monkeypatch, compiled_elsewhere):
    if reported(compiled_elsewhere):
        return
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


def test_compile_ahead_compiles_on_threads_and_launches_nothing(monkeypatch, tmp_path, compiled_elsewhere):
    if reported(compiled_elsewhere):
        return
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


def test_attention_kernels_compile_for_hopper(compiled_elsewhere):
    if reported(compiled_elsewhere):
        return
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
    # sliding windows and soft-capped scores (Gemma: head_dim 256; a 16-bit and an fp8 cache)
    for head_dim, kv in ((256, None), (128, "*fp8e4nv")):
        block_m, block_n, warps, stages = prefill._prefill_config(head_dim, torch.bfloat16, 4096)
        _compile_for_hopper(
            prefill._prefill_kernel, {n: "*bf16" for n in ("q_ptr", "o_ptr")}
            | {n: kv or "*bf16" for n in ("k_ptr", "v_ptr")} | {n: "*fp32" for n in ("k_scale_ptr", "v_scale_ptr")}
            | {n: "*i32" for n in ("cu_q_ptr", "cu_k_ptr", "table_ptr")} | {"softcap": "fp32"},
            dict(GROUP=4, PAGED=True, BLOCK_SIZE=256, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
                 PRECISION="tf32", QUANT=kv is not None, V_TOKEN_MAJOR=kv is not None, WINDOW=True, SOFTCAP=True),
            num_warps=warps, num_stages=stages)
        block_n, warps, stages = decode._decode_config(head_dim, torch.bfloat16, kv is not None, kv is not None, 256)
        _compile_for_hopper(
            decode._decode_kernel, {n: "*bf16" for n in ("q_ptr", "o_ptr")}
            | {n: kv or "*bf16" for n in ("k_cache_ptr", "v_cache_ptr")}
            | {n: "*fp32" for n in ("part_m_ptr", "part_l_ptr", "part_acc_ptr", "k_scale_ptr", "v_scale_ptr")}
            | {n: "*i32" for n in ("context_lens_ptr", "table_ptr", "count_ptr")} | {"softcap": "fp32"},
            dict(GROUP=4, BLOCK_G=16, BLOCK_SIZE=256, BLOCK_N=block_n, HEAD_DIM=head_dim, PRECISION="tf32",
                 QUANT=kv is not None, V_TOKEN_MAJOR=kv is not None, PDL=True, WINDOW=True, SOFTCAP=True,
                 **{**decode.split_constants(4, 256, block_n, 4), "SPLIT_IN_BLOCK": False}),
            num_warps=warps, num_stages=stages)
    for kv, fp8_max in ((None, 1.0), ("*fp8e4nv", 448.0), ("*fp8e5", 57344.0)):
        _compile_for_hopper(store_kvcache._store_kvcache_kernel,
                            {n: "*bf16" for n in ("k_ptr", "v_ptr")} | {n: kv or "*bf16" for n in ("k_cache_ptr",
                                                                                                  "v_cache_ptr")}
                            | {n: "*fp32" for n in ("k_scale_ptr", "v_scale_ptr")} | {"slot_ptr": "*i32"},
                            dict(BLOCK_SIZE=256, BLOCK_T=16, HEAD_DIM=128, QUANT=kv is not None, FP8_MAX=fp8_max,
                                 V_TOKEN_MAJOR=kv is not None),
                            num_warps=4)


def test_elementwise_kernels_compile_for_hopper(compiled_elsewhere):
    if reported(compiled_elsewhere):
        return
    triton = pytest.importorskip("triton")
    from nanovllm.kernels import activation, rope
    for norm, store, quant, heads, offset in ((True, True, False, 0, False), (True, False, False, 0, False),
                                              (False, True, False, 0, False), (True, True, True, 0, False),
                                              (True, True, False, 2, False), (True, True, True, 1, False),
                                              (True, True, False, 2, True)):
        cache = "*fp8e4nv" if quant else "*bf16"
        _compile_for_hopper(rope._qk_norm_rope_kernel,
                            {n: "*bf16" for n in ("q_ptr", "k_ptr", "q_w_ptr", "k_w_ptr", "v_ptr")}
                            | {"k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": "*fp32",
                               "v_scale_ptr": "*fp32", "positions_ptr": "*i64", "cache_ptr": "*fp32",
                               "slot_ptr": "*i32", "eps": "fp32"},
                            dict(NORM=norm, BLOCK_HQ=heads or 16, BLOCK_HK=heads or 8, HALF=64, STORE=store,
                                 BLOCK_SIZE=256, QUANT=quant, FP8_MAX=448.0, PDL=True, OFFSET=offset),
                            num_warps=max(1, heads // 2) if heads else 4, launch_pdl=True)
    for gelu in (False, True):
        _compile_for_hopper(activation._silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"},
                            dict(BLOCK=1024, PDL=True, GELU=gelu), num_warps=4, launch_pdl=True)
    from nanovllm.kernels import norm, race
    for add, offset in ((True, False), (False, False), (False, True)):
        _compile_for_hopper(norm._rms_norm_kernel, {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr",
                                                                          "res_out_ptr")} | {"eps": "fp32"},
                            dict(ADD=add, BLOCK=1024, PDL=True, OFFSET=offset), num_warps=4, launch_pdl=True)
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
    # fp8 weights, one row (Qwen3-8B's down, K past the one-row kernel's): scales per row, per row and 128 columns
    # (each product), and per 128 x 128 block (shared by the program's rows: x takes them)
    for scale, group, shared in ((1, 1, False), (2, 128, False), (2, 128, True)):
        block_n, block_k, warps, stages = gemv.gemv_config(1, 4096, 12288, itemsize=1)
        block_k = min(block_k, 128) if scale == 2 and not shared else block_k
        _compile_for_hopper(gemv._gemv_kernel, {n: "*bf16" for n in ("x_ptr", "b_ptr", "y_ptr", "res_ptr", "xn_ptr",
                                                                     "nw_ptr")}
                            | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32",
                               "sumsq_ptr": "*fp32", "eps": "fp32"},
                            dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False, EVEN=True, SPLIT=False,
                                 SWAP=False, PDL=True, PARTS=16, SCALE=scale, GROUP=group, SHARED=shared),
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
    for scale, group, shared in ((1, 1, False), (2, 128, False), (2, 128, True)):  # fp8, 8B's qkv after its norm
        block_n, block_k, warps = gemv.row_config(6144, 4096)  # and residual add
        _compile_for_hopper(gemv._gemv_row_kernel, row_ptrs | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "eps": "fp32"},
                            dict(BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False, GATED=False, NORM=True, ADD=True,
                                 PDL=True, SCALE=scale, GROUP=group, SHARED=shared), num_warps=warps,
                            launch_pdl=True)
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


def test_decode_tma_compiles_for_hopper(monkeypatch, compiled_elsewhere):
    if reported(compiled_elsewhere):
        return
    # the Gluon kernel through this Triton's Gluon API (experimental, renamed between releases), for sm_90 with a
    # stand-in driver: both ring depths the rule picks, bf16 and fp16, head_dim 128 and 64, a 16-bit and an fp8
    # cache, with and without a window and a soft-cap, and within Hopper's shared memory
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
    for stages, dtype, heads, kv_heads, head_dim, block_size, kv_dtype, windowed in [
            (4, torch.bfloat16, 16, 8, 128, 256, None, False), (3, torch.float16, 32, 4, 64, 64, None, False),
            (4, torch.bfloat16, 16, 8, 128, 256, torch.float8_e4m3fn, False),
            (3, torch.float16, 32, 4, 64, 128, torch.float8_e5m2, False),
            (4, torch.bfloat16, 16, 8, 128, 256, None, True), (3, torch.bfloat16, 16, 8, 128, 256,
                                                               torch.float8_e4m3fn, True)]:
        q = torch.zeros(16, heads, head_dim, dtype=dtype)
        k, v = (torch.zeros(8, block_size, kv_heads, head_dim, dtype=kv_dtype or dtype) for _ in range(2))
        scales = [torch.zeros(8, kv_heads, block_size) for _ in range(2)] if kv_dtype else []
        descs = decode_tma._descriptors(k, token_major(v) if kv_dtype else v, *scales)
        tables = torch.zeros(16, 4, dtype=torch.int32)
        part = torch.zeros(16, 4, dtype=torch.float32)
        kernel = decode_tma._decode_tma_kernel.warmup(
            q, q, *descs, part, part, part, tables, tables[:, 0], tables, q.stride(0), q.stride(1),
            q.stride(0), q.stride(1), tables.stride(0), 0.1, 16, 30.0, WINDOW=windowed, SOFTCAP=windowed,
            GROUP=heads // kv_heads, BLOCK_G=16,
            BLOCK_SIZE=block_size, BLOCK_N=decode_tma.block_n_for(k.dtype), HEAD_DIM=head_dim, STAGES=stages,
            CHUNK_TILES=decode_tma.CHUNK_TOKENS // decode_tma.block_n_for(k.dtype), PDL=True,
            QUANT=kv_dtype is not None, num_warps=4, grid=(1,))
        assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, (stages, kernel.metadata.shared)
        assert kernel.asm["ptx"].count("cp.async.bulk.tensor") > 0


def test_moe_kernels_compile_for_hopper(compiled_elsewhere):
    """Every tile configuration moe_tiles picks compiles for sm_90 and fits its shared memory."""
    if reported(compiled_elsewhere):
        return
    pytest.importorskip("triton")
    from nanovllm.kernels import fused_moe as k
    index_ptrs = {n: "*i32" for n in ("sorted_ptr", "block_expert_ptr", "block_rows_ptr")}
    # (dtype, pairs, whether K divides by block_k: the masked path runs for hidden sizes like the tiny models' 64)
    for dtype, num_pairs, even_k in [(torch.bfloat16, 8, True), (torch.bfloat16, 8, False),
                                     (torch.bfloat16, 2048, True), (torch.bfloat16, 4096, True),
                                     (torch.bfloat16, 131072, True), (torch.float32, 8, False),
                                     (torch.float32, 131072, True)]:
        tiles = k.moe_tiles(num_pairs, 128, dtype)
        t = "*bf16" if dtype == torch.bfloat16 else "*fp32"
        common = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
                      EVEN_K=even_k, PRECISION="ieee" if dtype == torch.float32 else "tf32")
        launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        _compile_for_hopper(k._gate_up_kernel, {n: t for n in ("x_ptr", "w_ptr", "act_ptr")} | index_ptrs,
                            dict(TOP_K=8, **common), **launch)
        _compile_for_hopper(k._down_kernel, {n: t for n in ("act_ptr", "w_ptr", "out_ptr")} | index_ptrs
                            | {"weights_ptr": "*fp32"}, common, **launch)
        if dtype == torch.bfloat16:  # fp8 experts: scales per row, and per row and 128 columns
            for scale, group in ((1, 1), (2, 128)):
                fp8 = common | dict(SCALE=scale, GROUP=group, BLOCK_K=min(tiles.block_k, 128))
                _compile_for_hopper(k._gate_up_kernel, {n: t for n in ("x_ptr", "act_ptr")} | index_ptrs
                                    | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, dict(TOP_K=8, **fp8), **launch)
                _compile_for_hopper(k._down_kernel, {n: t for n in ("act_ptr", "out_ptr")} | index_ptrs
                                    | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "weights_ptr": "*fp32"}, fp8, **launch)
    step, _, _ = k._chunking(131072, 128)
    _compile_for_hopper(k._count_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32"}, dict(STEP=step, BLOCK_E=128),
                        num_warps=4)
    _compile_for_hopper(k._scatter_kernel, {"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_ptr": "*i32"},
                        dict(STEP=step, BLOCK_E=128), num_warps=4)
    _compile_for_hopper(k._offsets_kernel, {n: "*i32" for n in ("counts_ptr", "block_expert_ptr", "block_rows_ptr")},
                        dict(BLOCK_M=128, BLOCK_C=k.MAX_CHUNKS, BLOCK_E=128, BLOCK_B=64), num_warps=8)
