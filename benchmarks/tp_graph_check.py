"""Does a TP=2 engine start, generate and exit on 2 GPUs, with and without decode CUDA graphs? (diagnosis)

Each variant runs the engine in its own process group: it must print DONE within DEADLINE_S and exit within
EXIT_S after that. A process still alive gets a native backtrace of every thread of rank 0 (cuda-gdb, when
there is one), then SIGABRT so that PYTHONFAULTHANDLER prints every rank's Python stack; logs go to $OUT.
History: TP=2 with graphs once looked hung "in generation"; this script found that generation finished and
the shutdown hung (docs/benchmarks.md).

    python benchmarks/tp_graph_check.py [VARIANT...]     # default: every variant
"""
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S, EXIT_S = 120, 20

ENGINE_SCRIPT = r"""
import logging, os, sys, time
from nanovllm import LLM, SamplingParams
logging.basicConfig(format="%(asctime)s %(process)d %(message)s")
logging.getLogger("nanovllm").setLevel(logging.DEBUG)
if __name__ == "__main__":
    t = time.monotonic()
    llm = LLM(sys.argv[1], load_format="dummy", tensor_parallel_size=2, max_num_seqs=16, max_model_len=1024,
              enforce_eager=os.environ.get("ENFORCE_EAGER") == "1")
    print(f"STARTED {time.monotonic() - t:.1f}s", flush=True)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for n in (1, 4, 16, 16):
        t = time.monotonic()
        llm.generate([[1 + i] * (20 + 7 * i) for i in range(n)], sp, use_tqdm=False)
        print(f"GENERATED {n} in {time.monotonic() - t:.2f}s", flush=True)
    t = time.monotonic()
    llm.exit()
    print(f"EXITED {time.monotonic() - t:.2f}s", flush=True)
    print("DONE", flush=True)
"""

VARIANTS = {
    "graphs": {},
    "eager": {"ENFORCE_EAGER": "1"},
}


def run_variant(name: str, model: str, out_dir: str) -> str:
    env = dict(os.environ, PYTHONFAULTHANDLER="1", NCCL_DEBUG="WARN", PYTHONUNBUFFERED="1", **VARIANTS[name])
    log_path = os.path.join(out_dir, f"engine_{name}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, model], stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=env, start_new_session=True)

        def text() -> str:
            with open(log_path) as f:
                return f.read()
        while proc.poll() is None and "DONE" not in text() and time.monotonic() - start < DEADLINE_S:
            time.sleep(0.5)
        done_at = time.monotonic()
        try:
            proc.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            if shutil.which("cuda-gdb"):
                with open(os.path.join(out_dir, f"engine_{name}.gdb.txt"), "w") as f:
                    subprocess.call(["timeout", "60", "cuda-gdb", "-p", str(proc.pid), "-batch",
                                     "-ex", "thread apply all bt 30"], stdout=f, stderr=subprocess.STDOUT)
            os.killpg(proc.pid, signal.SIGABRT)
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    progress = [ln for ln in text().splitlines() if ln.startswith(("STARTED", "GENERATED", "EXITED", "DONE"))]
    exit_s = time.monotonic() - done_at
    return f"{name:17s} rc={proc.returncode} process exit {exit_s:.1f}s after DONE | {' | '.join(progress)}"


def main():
    out_dir = os.environ.get("OUT", "/tmp/tp_check")
    os.makedirs(out_dir, exist_ok=True)
    model = os.environ.get("MODEL") or os.path.join(ROOT, "benchmarks/configs/qwen3-0.6b")
    lines = []
    for name in sys.argv[1:] or VARIANTS:
        lines.append(run_variant(name, model, out_dir))
        print(lines[-1], flush=True)
    print("\n== summary ==\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
