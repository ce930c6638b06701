"""Compile candidates ahead of time, once each, run each once, and gate them on correctness.

A candidate is one config of one backend for one problem. Its jitted function is named
`moe_tune_cand_<index>` so its program can be found in the profiler trace.

What runs where:

* With workers (`workers > 1` on CPU and GPU), each candidate is compiled AND run once, on the sweep's
  real inputs, in a worker subprocess (`workers.py`), under one per-candidate timeout for both. The worker
  sends back the serialized executable and the output as a NumPy array. The inputs go to each worker once
  per sweep (cached there under a token), not with every request. `check_all` then compares that output
  with the reference here, without running the candidate in this process. The reason is isolation: a
  candidate that segfaults, aborts, hangs or runs out of memory when run takes down (or stalls) only its
  worker; it is recorded as failed at stage "run" with the reason -- "worker died (SIGABRT, signal 6)
  running the candidate", "worker hung: timed out after N s running the candidate", "out of memory: ..."
  (XLA's RESOURCE_EXHAUSTED, a MemoryError, or the worker SIGKILLed, which on Linux usually means the OOM
  killer) -- the worker is restarted and the sweep goes on. The same failures during the compile are
  recorded at stage "compile". The executable compiled in the worker is the one that is timed: nothing is
  compiled twice, with one exception: a candidate whose executable cannot be serialized (a Python host
  callback) is still compiled and checked in the worker, and only if it ran there correctly is it
  compiled a second time here, for timing (its `compiles` counts both). A candidate that crashed or hung
  in a worker is never run in this process.
* With one worker, and on TPU (one process per chip), candidates compile here, one at a time, without a
  timeout, and `check_all` runs each once here: a crashing candidate then takes the sweep down with it.

Timing (`timing.py`) always runs in this process, on the executables compiled as above.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

from moe_tune import devices
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import KernelOp, relative_error
from moe_tune.tuner import workers as workers_module
from moe_tune.tuner.timing import Timing, traceable

OK, WRONG, FAILED = "ok", "wrong", "failed"


@dataclasses.dataclass
class Candidate:
    index: int
    config: KernelConfig
    is_default: bool = False
    status: str = OK
    stage: str = ""  # where it failed: "compile", "run"
    reason: str = ""
    error: float | None = None  # relative error vs the reference
    executable: Any = dataclasses.field(default=None, repr=False)
    output: np.ndarray | None = dataclasses.field(default=None, repr=False)  # its run in a worker, to check
    compile_s: float | None = None
    compiles: int = 0  # XLA compilations spent on this candidate, wherever they ran
    timing: Timing | None = None
    first_timing: Timing | None = None  # a finalist's sweep-round timing, before the final round replaced it

    def record(self) -> dict[str, Any]:
        """JSON-ready summary (what tables and logs keep)."""
        out: dict[str, Any] = {"config": self.config.to_dict(), "status": self.status}
        if self.is_default:
            out["is_default"] = True
        if self.reason:
            out["stage"], out["reason"] = self.stage, self.reason
        if self.error is not None:
            out["error"] = self.error
        sweep_round = self.sweep_round_timing  # every candidate's from one kind of round: comparable
        if sweep_round is not None:
            out.update(median_s=sweep_round.median_s, spread=sweep_round.spread, min_s=sweep_round.min_s,
                       max_s=sweep_round.max_s)
        return out

    @property
    def sweep_round_timing(self) -> Timing | None:
        """The timing of the round every candidate ran (a finalist's before the final round replaced it)."""
        return self.first_timing or self.timing

    def finalist_record(self) -> dict[str, Any]:
        """A finalist as the entry's verdict records it: its final-round and sweep-round timing."""
        first, final = self.sweep_round_timing, self.timing
        return {"config": self.config.to_dict(), "is_default": self.is_default, "median_s": final.median_s,
                "spread": final.spread, "min_s": final.min_s, "max_s": final.max_s, "samples": final.samples,
                "first_median_s": first.median_s, "first_spread": first.spread}


def _short(exc: BaseException) -> str:
    """One line: the exception type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def candidate_function(spec: KernelOp, backend: Backend, config: KernelConfig, problem: Any, index: int) -> Callable:
    return traceable(lambda inputs: spec.run(backend, config, problem, inputs), index)


# JAX records the compile-duration event around "compile, or load from the persistent cache", and a cache
# hit event when it loads: real XLA compilations are the difference.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_backend_compiles = 0


def _count_compiles(event: str, seconds: float, **_: Any) -> None:
    global _backend_compiles
    if event == _COMPILE_EVENT:
        _backend_compiles += 1


def _count_cache_hits(event: str, **_: Any) -> None:
    global _backend_compiles
    if event == _CACHE_HIT_EVENT:
        _backend_compiles -= 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)
jax.monitoring.register_event_listener(_count_cache_hits)


def backend_compiles() -> int:
    """XLA compilations this process has run so far (JAX's monitoring events; persistent-cache hits are
    loads, not compilations, and do not count)."""
    return _backend_compiles


def _compile(spec: KernelOp, backend: Backend, problem: Any, config: KernelConfig, index: int, args: Any):
    """(executable, how many XLA compilations building it took: one, or zero on a cache hit)."""
    before = _backend_compiles
    compiled = candidate_function(spec, backend, config, problem, index).lower(args).compile()
    return compiled, _backend_compiles - before


def failure_reason(exc: BaseException) -> str:
    """The recorded reason for an exception, flagged as out of memory when it is one."""
    short = _short(exc)
    if isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in str(exc):
        return f"out of memory: {short}"
    return short


_worker_inputs: dict[str, Any] = {}


def _inputs_in_worker(token: str) -> Any:
    """Worker side: the sweep's inputs on this worker's device, put there once per sweep (token)."""
    if token not in _worker_inputs:
        _worker_inputs.clear()
        _worker_inputs[token] = jax.device_put(workers_module.shared(token))
    return _worker_inputs[token]


def _compile_and_run(op_name: str, backend: Backend, problem: Any, config: KernelConfig, index: int,
                     shapes: Any, token: str) -> dict[str, Any]:
    """Worker side: compile one candidate, then run it once on the sweep's inputs.

    Returns {"status", "stage", "reason", "compile_s", "compiles", "executable", "output"}: status OK with
    the serialized executable (None when it cannot travel, e.g. a Python host callback; "local_reason" says
    why) and the output as a NumPy array, or FAILED at stage "compile" or "run" with the reason. Once
    compiled it reports progress ("compiled"), so that if running it kills or hangs this worker the caller
    knows the compile went through and the run did not.
    """
    from moe_tune.kernels import get_op

    start = time.perf_counter()
    try:
        compiled, compiles = _compile(get_op(op_name), backend, problem, config, index, shapes)
    except Exception as e:  # noqa: BLE001 - any failure is recorded as the candidate's reason
        return {"status": FAILED, "stage": "compile", "reason": failure_reason(e),
                "compile_s": time.perf_counter() - start, "compiles": 0}
    compile_s = time.perf_counter() - start
    result: dict[str, Any] = {"status": OK, "stage": "", "reason": "", "compile_s": compile_s,
                              "compiles": compiles, "executable": None, "output": None}
    try:
        payload = serialize_executable.serialize(compiled)
        pickle.dumps(payload)
        result["executable"] = payload
    except Exception as e:  # noqa: BLE001
        result["local_reason"] = _short(e)
    workers_module.progress({"compiled": True, "compile_s": compile_s, "compiles": compiles})
    try:
        result["output"] = np.asarray(jax.block_until_ready(compiled(_inputs_in_worker(token))))
    except Exception as e:  # noqa: BLE001 - MemoryError included
        result.update(status=FAILED, stage="run", reason=failure_reason(e), executable=None)
    return result


def _record_worker_failure(cand: Candidate, failure: workers_module.WorkerFailure) -> None:
    """Record a request whose worker died, hung or raised; the stage is the one it had reached."""
    compiled = next((p for p in failure.progress if isinstance(p, dict) and p.get("compiled")), None)
    if compiled is not None:
        cand.compile_s, cand.compiles = compiled["compile_s"], compiled["compiles"]
    stage = "run" if compiled is not None else "compile"
    doing = "running the candidate" if compiled is not None else "compiling the candidate"
    if failure.kind == "died" and failure.returncode == -signal.SIGKILL:
        # The pool kills a worker only on timeout, which is recorded as such: SIGKILL from elsewhere on
        # Linux is nearly always the kernel's OOM killer.
        reason = (f"out of memory: {failure.describe()} {doing} (killed from outside the sweep; on Linux "
                  f"usually the kernel's OOM killer)")
    elif failure.kind == "error":
        reason = f"{failure.message} (in the worker, {doing})"
    else:
        reason = f"{failure.describe()} {doing}"
    cand.status, cand.stage, cand.reason = FAILED, stage, reason


_sent_inputs: tuple[Any, list[weakref.ref], str, Any] | None = None  # (treedef, leaves, token, host inputs)


def _shared_inputs(inputs: Any) -> tuple[str, Any]:
    """(token, host copy) for the inputs: the same for every call with the same arrays, so that each worker
    gets a sweep's inputs once, with its first request, even when the sweep compiles in several chunks.
    Forgotten when those arrays are freed."""
    global _sent_inputs
    leaves, treedef = jax.tree.flatten(inputs)
    if (_sent_inputs is not None and _sent_inputs[0] == treedef and len(_sent_inputs[1]) == len(leaves)
            and all(ref() is leaf for ref, leaf in zip(_sent_inputs[1], leaves))):
        return _sent_inputs[2], _sent_inputs[3]
    token, host = uuid.uuid4().hex, jax.tree.map(np.asarray, inputs)
    try:
        refs = [weakref.ref(leaf) for leaf in leaves]
    except TypeError:  # a leaf that cannot be referenced weakly (a Python scalar): no reuse across calls
        return token, host
    _sent_inputs = (treedef, refs, token, host)
    if leaves:
        weakref.finalize(leaves[0], _forget_inputs, token)
    return token, host


def _forget_inputs(token: str) -> None:
    global _sent_inputs
    if _sent_inputs is not None and _sent_inputs[2] == token:
        _sent_inputs = None


def _compile_in_workers(spec, backend, problem, candidates, inputs, workers, on_done, timeout) -> None:
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs)
    token, host_inputs = _shared_inputs(inputs)

    local: list[Candidate] = []

    def finish(cand: Candidate, status: str, value: Any) -> None:
        if status != "ok":
            _record_worker_failure(cand, value)
        else:
            cand.compile_s, cand.compiles = value["compile_s"], value["compiles"]
            if value["status"] != OK:
                cand.status, cand.stage, cand.reason = FAILED, value["stage"], value["reason"]
            else:
                cand.output = value["output"]
                if value["executable"] is None:
                    local.append(cand)  # ran fine in the worker but cannot travel: compiled here for timing
                    return
                try:
                    cand.executable = serialize_executable.deserialize_and_load(*value["executable"])
                except Exception as e:  # noqa: BLE001
                    cand.output = None
                    cand.status, cand.stage = FAILED, "compile"
                    cand.reason = f"could not load the executable compiled in the worker: {_short(e)}"
        if on_done is not None:
            on_done(cand)

    requests = [(c, (spec.name, backend, problem, c.config, c.index, shapes, token)) for c in candidates]
    workers_module.pool(workers).map(f"{__name__}:_compile_and_run", requests, finish, timeout=timeout,
                                     shared=(token, host_inputs))
    worker_s = {c.index: c.compile_s or 0.0 for c in local}
    _compile_here(spec, backend, problem, local, inputs, None)
    for cand in local:
        cand.compile_s = (cand.compile_s or 0.0) + worker_s[cand.index]
        if on_done is not None:
            on_done(cand)


def uses_workers(workers: int) -> bool:
    """Whether `compile_all` compiles in worker processes (see there)."""
    return workers > 1 and devices.platform() in ("cpu", "gpu")


def start_workers(workers: int) -> None:
    """Start the worker processes `compile_all` will use, if it will, so that their start-up (a JAX import
    each, about a second) overlaps whatever the caller does before compiling."""
    if uses_workers(workers):
        workers_module.pool(workers)


def compile_all(
    spec: KernelOp,
    backend: Backend,
    problem: Any,
    candidates: list[Candidate],
    inputs: Mapping[str, jax.Array],
    *,
    workers: int,
    on_done: Callable[[Candidate], None] | None = None,
    timeout: float | None = None,
) -> None:
    """Compile every candidate once, ahead of time.

    With `workers > 1` on CPU and GPU, each candidate is compiled and run once in a worker process (JAX's
    compile does not run two at once in one process, and a candidate that crashes, hangs or runs out of
    memory must not take the sweep with it); it comes back serialized, with its output for `check_all`.
    A candidate whose compile and first run take longer than `timeout` seconds has its worker killed and
    is recorded as failed, as is one whose worker dies. TPU allows one process per chip, so there, and
    with one worker, candidates compile here, one at a time (and without a timeout), and are run by
    `check_all`. See the module docstring.
    """
    if uses_workers(workers):
        _compile_in_workers(spec, backend, problem, candidates, inputs, workers, on_done, timeout)
    else:
        _compile_here(spec, backend, problem, candidates, inputs, on_done)


def _compile_here(spec, backend, problem, candidates, inputs, on_done) -> None:
    for cand in candidates:
        start = time.perf_counter()
        try:
            cand.executable, compiles = _compile(spec, backend, problem, cand.config, cand.index, inputs)
            cand.compiles += compiles
        except Exception as e:  # noqa: BLE001 - any failure is recorded as the candidate's reason
            cand.status, cand.stage, cand.reason = FAILED, "compile", failure_reason(e)
        cand.compile_s = time.perf_counter() - start
        if on_done is not None:
            on_done(cand)


def check_all(
    candidates: list[Candidate],
    inputs: Mapping[str, jax.Array],
    expected: np.ndarray,
    tolerance: float,
    on_done: Callable[[Candidate], None] | None = None,
) -> None:
    """Mark candidates off the reference as wrong. A candidate's output from its worker run (see
    `compile_all`) is checked as it is; a candidate without one (compiled in this process) is run once here
    (also its warm-up)."""
    for cand in candidates:
        if cand.status != OK:
            continue
        try:
            if cand.output is not None:
                out, cand.output = cand.output, None
            else:
                out = np.asarray(jax.block_until_ready(cand.executable(inputs)))
        except Exception as e:  # noqa: BLE001
            cand.status, cand.stage, cand.reason = FAILED, "run", failure_reason(e)
        else:
            cand.error = relative_error(out, expected)
            if not cand.error <= tolerance:
                cand.status, cand.stage = WRONG, "check"
                cand.reason = f"relative error {cand.error:.3g} > tolerance {tolerance:.3g}"
        if on_done is not None:
            on_done(cand)
