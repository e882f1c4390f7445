"""bench.py runs end to end on CPU (a tiny model, a small workload)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_runs_on_cpu(qwen3_tied):
    args = ["--model", qwen3_tied, "--num-seqs", "5", "--min-input", "5", "--max-input", "40", "--min-output", "3",
            "--max-output", "12", "--max-token-id", "399", "--max-model-len", "256", "--no-tqdm"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = out.stdout.splitlines()[0].split(", ")[-1].split()[0]
    assert f"nanovllm: {expected} output tokens" in out.stdout


def test_bench_and_latency_run_with_lora_on_cpu(qwen3_tied):
    """--lora writes random PEFT adapters the engine accepts, and spreads the requests over them."""
    args = ["--model", qwen3_tied, "--num-seqs", "5", "--min-input", "5", "--max-input", "40", "--min-output", "3",
            "--max-output", "12", "--max-token-id", "399", "--max-model-len", "256", "--no-tqdm", "--lora", "2",
            "--lora-rank", "8"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 LoRA adapters of rank 8" in out.stdout and "nanovllm: " in out.stdout
    args = ["--model", qwen3_tied, "--batches", "2", "--new-tokens", "3", "--prompt-len", "8", "--prefill-seqs", "0",
            "--clocks-up", "0", "--lora-rank", "4", "--max-token-id", "399"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "latency.py"), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decode batch   2:" in out.stdout


def test_rl_eval_benchmark_runs_on_cpu(qwen3_tied):
    args = ["--model", qwen3_tied, "--num-prompts", "3", "--n", "4", "--min-input", "5", "--max-input", "40",
            "--min-output", "3", "--max-output", "12", "--num-scored", "6", "--score-len", "30", "--max-token-id",
            "399", "--max-model-len", "256"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rl_eval.py"), *args], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line.split("|")[1].strip() for line in lines] == [
        "12 prompts, n=1", "3 prompts, n=4", "3 prompts x 4 requests",
        "prompt_logprobs=0", "prompt_logprobs=5", "prompt_logprobs=0, flat", "prompt_logprobs=5, flat",
        "no logprobs (prefill only)"]
    computed = [int(line.rsplit(" ", 1)[1]) for line in lines]
    assert computed[1] < computed[2]  # n=4 prefills each prompt once; 4 separate requests more often
    assert computed[3:] == [6 * 30] * 5


def test_bench_runs_data_parallel_on_cpu(qwen3_tied):
    args = ["--model", qwen3_tied, "--dp", "2", "--num-seqs", "6", "--min-input", "5", "--max-input", "40",
            "--min-output", "3", "--max-output", "12", "--max-token-id", "399", "--max-model-len", "256", "--no-tqdm"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = int(out.stdout.splitlines()[0].split(", ")[-1].split()[0])
    replicas = [line for line in out.stdout.splitlines() if line.startswith("replica ")]
    assert len(replicas) == 2 and sum(int(line.split(", ")[1].split()[0]) for line in replicas) == expected
    assert f"nanovllm: {expected} output tokens" in out.stdout


def test_host_time_benchmark_runs_on_cpu(qwen3_tied):
    # benchmarks/host_time.py wraps the engine's methods by name: a rename must show up here, not on the GPU
    args = ["--model", qwen3_tied, "--batches", "2", "--new-tokens", "3", "--prompt-len", "8", "--max-token-id",
            "399"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_time.py"), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("batch 2: ") and "host busy" in lines[0]
    parts = {line.rsplit("  ", 1)[0].strip() for line in lines[1:]}
    assert {"engine step", "launch", "runner.prepare", "run_model", "compute_logits"} <= parts


def test_profile_step_charges_each_kernel_what_it_adds_to_the_finish_line(capsys):
    # overlapping kernels (programmatic dependent launch) are charged only past the latest end so far, idle time
    # before a kernel's start separately; linear kernels are named by the two kernels before them
    from types import SimpleNamespace

    import torch
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import profile_step
    finally:
        sys.path.pop(0)

    def kernel(name, start, end):
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end))
    timeline = [kernel("_rms_norm_kernel", 0, 5), kernel("_gemv_kernel", 3, 10), kernel("_silu_kernel", 8, 9),
                kernel("_gemv_kernel", 12, 20), kernel("_rms_norm_kernel", 100, 105)]
    profile_step.critical_path(SimpleNamespace(events=lambda: timeline), steps=1, top=10)
    rows = {line[:78].strip(): line[78:].split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["rms_norm_kernel"] == ["2.0", "10.0", "80.0"]  # 5 + 5 added, 80 idle before the second
    assert rows["gemv_kernel after rms_norm_kernel"] == ["1.0", "5.0", "0.0"]  # 10 - 5 (its start overlaps)
    assert rows["silu_kernel"] == ["1.0", "0.0", "0.0"]  # inside the gemv: adds nothing
    assert rows["gemv_kernel after silu_kernel after gemv_kernel"] == ["1.0", "8.0", "2.0"]
