"""What a tuner worker (`tuner/compiling.py`, a `moe_tune.workers` pool) runs: `prepare` once when it starts,
then for each candidate `compile_and_run`: compile it, run it once on the sweep's inputs, and send back the
serialized executable and the output's relative error against the sweep's reference. It runs in the worker
process, so a candidate that crashes, hangs or runs out of memory there takes down only the worker.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

from moe_tune.core import settings
from moe_tune.kernels.base import KernelConfig
from moe_tune.tuner import compiling as workers
from moe_tune.tuner.candidate import Reference, failure_reason, short
from moe_tune.tuner.compiling import FAILED, OK, Kernel
from moe_tune.workers import progress

_inputs: dict[str, Any] = {}


def prepare() -> None:
    """Run by each worker before it serves: the persistent compile cache shared with the sweep's process,
    when that turned it on (the sweep's process trimmed it)."""
    if settings.compile_cache_dir_set():
        from moe_tune.tuner import compiling

        compiling.enable_cache(trim_to_size=False)


def _inputs_here(token: str) -> Any:
    """The sweep's inputs on this worker's device, put there once per sweep (token)."""
    if token not in _inputs:
        _inputs.clear()
        _inputs[token] = jax.device_put(workers.shared(token)[0])
    return _inputs[token]


def _reference_here(token: str) -> Reference:
    """The sweep's reference (`gate.Reference`) shared with the inputs under `token`."""
    return workers.shared(token)[1]


def compile_and_run(kernel: Kernel, config: KernelConfig, index: int, shapes: Any, token: str) -> dict[str, Any]:
    """Compile candidate `index` for `shapes` (ShapeDtypeStructs of the inputs), then run it once on the
    inputs shared under `token` (with the reference: `(host inputs, gate.Reference)`).

    Returns {"status", "stage", "reason", "compile_s", "compiles", "executable", "error", "run_s"} (and the
    CPU seconds of the compile and the run, "compile_cpu_s", "run_cpu_s"):
    status OK with the serialized executable (None when it cannot travel, e.g. a Python host callback;
    "local_reason" says why) and the output's relative error against the reference, or FAILED at stage
    "compile" or "run" with the reason. Once compiled it reports progress ("compiled"), so that if running it
    kills or hangs this worker the caller knows the compile went through and the run did not.
    """
    start, cpu = time.perf_counter(), time.process_time()
    try:
        compiled, compiles = kernel.compile(config, index, shapes)
    except Exception as e:  # noqa: BLE001 - any failure is recorded as the candidate's reason
        return {"status": FAILED, "stage": "compile", "reason": failure_reason(e),
                "compile_s": time.perf_counter() - start, "compiles": 0}
    compile_s = time.perf_counter() - start
    # this process's CPU seconds (all its threads), beside the wall: their difference is time spent waiting
    # for a core (benchmarks/sweep_cpu.py)
    result: dict[str, Any] = {"status": OK, "stage": "", "reason": "", "compile_s": compile_s,
                              "compile_cpu_s": time.process_time() - cpu, "compiles": compiles, "executable": None}
    try:
        payload = serialize_executable.serialize(compiled)
        pickle.dumps(payload)
        result["executable"] = payload
    except Exception as e:  # noqa: BLE001
        result["local_reason"] = short(e)
    progress({"compiled": True, "compile_s": compile_s, "compiles": compiles})
    start, cpu = time.perf_counter(), time.process_time()
    try:
        inputs = _inputs_here(token)  # put on the device once per sweep, outside the run's clocks
        start, cpu = time.perf_counter(), time.process_time()
        output = np.asarray(jax.block_until_ready(compiled(inputs)))
    except Exception as e:  # noqa: BLE001 - MemoryError included
        result.update(status=FAILED, stage="run", reason=failure_reason(e), executable=None)
    result["run_s"] = time.perf_counter() - start  # the first run, for the check (benchmarks/sweep_cpu.py)
    result["run_cpu_s"] = time.process_time() - cpu
    if result["status"] == OK:
        start = time.perf_counter()
        # the comparison here: the output (the size of the reference) does not travel back
        result["error"] = _reference_here(token).error(output)
        result["check_s"] = time.perf_counter() - start
    return result
