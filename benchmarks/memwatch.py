"""Run a command and report the peak memory of its process tree: the sum of every process's PSS
(/proc/PID/smaps_rollup: shared pages split between their users), polled every 0.25 s, and the moe_tune
shared-memory payload files the tree wrote (/dev/shm/moe_tune_shared_<pid>_*). Linux only.

    .venv/bin/python benchmarks/memwatch.py COMMAND ARGS...     (its exit status is the command's)
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (those still running)."""
    found = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                for child in children.read().split():
                    found += process_tree(int(child))
    except OSError:  # the process ended while being read
        pass
    return found


def pss_bytes(pid: int) -> int:
    """The process's proportional set size, 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def shared_payload_bytes(pids: list[int]) -> int:
    """Bytes of the moe_tune payload files these processes wrote (not other sweeps')."""
    files = [f for pid in pids for f in glob.glob(f"/dev/shm/moe_tune_shared_{pid}_*")]
    return sum(os.path.getsize(f) for f in files if os.path.exists(f))


def main() -> int:
    proc = subprocess.Popen(sys.argv[1:])
    peak = peak_shm = peak_total = most_procs = 0
    while proc.poll() is None:
        pids = process_tree(proc.pid)
        total, shm = sum(pss_bytes(p) for p in pids), shared_payload_bytes(pids)
        peak, peak_shm, peak_total = max(peak, total), max(peak_shm, shm), max(peak_total, total + shm)
        most_procs = max(most_procs, len(pids))
        time.sleep(0.25)
    print(f"MEMWATCH rc={proc.returncode} peak_pss_GiB={peak / 2**30:.2f} peak_shm_GiB={peak_shm / 2**30:.2f} "
          f"peak_pss_plus_shm_GiB={peak_total / 2**30:.2f} max_procs={most_procs}", flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
