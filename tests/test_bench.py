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
