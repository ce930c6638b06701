"""The sweep's float64 reference on OpenBLAS's threads against one thread (`threadpoolctl`, as `tuner/candidate.py` runs it), at the
`strategies_cpu.py` shape (k=2048 n=768 groups=16 float32) and the counts of its ladder; alone, then with one
busy-looping process beside it (what a compile worker is to the reference while a sweep compiles).

    .venv/bin/python benchmarks/reference_threads_cpu.py [--ms 256,1024,2048]
        [--repeat 6]

The two variants run interleaved (threads, one, threads, one ...), in this process; printed: per count the
median and the worst of each. Nothing is asserted (a shared machine).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time

from moe_tune.kernels import get_op
from threadpoolctl import threadpool_info, threadpool_limits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="256,1024,2048")
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    load = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    threads = next((p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"), None)
    if threads is None:
        print("no BLAS threadpoolctl can see in this process: nothing to compare")
        return 0
    print(f"BLAS threads {threads}; load: {load()}", flush=True)
    op = get_op("ragged_dot")
    for busy in (False, True):
        loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            time.sleep(0.2)
            for m in (int(v) for v in args.ms.split(",")):
                problem = op.problem(m=m, k=2048, n=768, groups=16)
                inputs = op.make_inputs(problem, "balanced", 0)
                times: dict[str, list[float]] = {f"{threads} threads": [], "1 thread": []}
                for _ in range(args.repeat):
                    for name in times:
                        context = (threadpool_limits(limits=1, user_api="blas") if name == "1 thread"
                                   else contextlib.nullcontext())
                        with context:
                            start = time.perf_counter()
                            op.reference(problem, inputs)
                            times[name].append(time.perf_counter() - start)
                shown = "; ".join(f"{name} median {statistics.median(v):.3f} s, worst {max(v):.3f} s"
                                  for name, v in times.items())
                print(f"{'beside a busy loop' if busy else 'alone':<18} m={m:<5} {shown}", flush=True)
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
    print(f"load at the end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
