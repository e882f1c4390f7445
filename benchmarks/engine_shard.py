"""Run one shard of the CPU suite's non-GPU tests (on a GPU machine they take CUDA, device "auto"):

    python3 benchmarks/engine_shard.py K/N tests/engine/test_engine.py ...

collects the files' tests (marker "not gpu"), keeps every N-th from the K-th (1-based, collection order) and runs
them in one pytest. benchmarks/gpu_suite.sh's engine_cuda step uses it (1/1, all of them, took 103 s on an H200;
shards keep a call short).
"""
import subprocess
import sys


def main():
    if len(sys.argv) < 3 or "/" not in sys.argv[1]:
        sys.exit(__doc__)
    k, n = (int(x) for x in sys.argv[1].split("/"))
    if not 1 <= k <= n:
        sys.exit(f"shard {k}/{n}: K must be in 1..N")
    files = sys.argv[2:]
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "not gpu", *files],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    ids = [line for line in listed if "::" in line]
    mine = ids[k - 1::n]
    print(f"shard {k}/{n}: {len(mine)} of {len(ids)} tests", flush=True)
    sys.exit(subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *mine]).returncode)


if __name__ == "__main__":
    main()
