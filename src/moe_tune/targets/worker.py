"""A compile worker process: `python -m moe_tune.targets.worker`, started by `pool.py` with
`wheels.worker_env()`. Reads one job per line on stdin (base64 of a pickled `CompileJob`), compiles it,
writes one result per line on its protocol stream (the original stdout; fd 1 itself is pointed at stderr
so that what C++ libraries print cannot interleave with results)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
import time
import traceback

RESULT_PREFIX = "@@moe-tune-compile "


def _protocol_stream():
    """The original stdout for results; fd 1 (and Python's stdout) goes to stderr from now on."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def run_job(job) -> dict:
    """Compile one job; a result dict (`CompileResult.to_dict()`)."""
    from moe_tune.targets.calls import abstract_inputs, kernel_call
    from moe_tune.core.chips import get_target
    from moe_tune.targets.compile import ERROR, CompileResult, compile_call, first_line

    target = get_target(job.target)
    start = time.perf_counter()
    try:
        fn = kernel_call(job.op, job.backend, job.problem, job.config)
        result = compile_call(target, fn, lambda device: abstract_inputs(job.op, job.problem, device))
    except Exception as e:  # noqa: BLE001 - reported as the job's result, the worker goes on
        traceback.print_exc()
        result = CompileResult(target.name, ERROR, first_line(f"{type(e).__name__}: {e}"), "trace",
                               time.perf_counter() - start)
    return result.to_dict()


def main() -> None:
    out = _protocol_stream()
    import jax  # noqa: F401 - imported before the first job so that its start-up is not a job's time

    out.write(RESULT_PREFIX + json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        job_id, job = pickle.loads(base64.b64decode(line))
        out.write(RESULT_PREFIX + json.dumps({"id": job_id, **run_job(job)}) + "\n")


if __name__ == "__main__":
    main()
