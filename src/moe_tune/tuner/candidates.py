"""Compile candidates in parallel, ahead of time, once each; then gate them on correctness.

A candidate is one config of one backend for one problem. Its jitted function is named
`moe_tune_cand_<index>` so its program can be found in the profiler trace. The executable compiled here is
the one that is checked and timed: nothing is compiled twice.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

from moe_tune import devices
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.spec import OpSpec, relative_error
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
    compile_s: float | None = None
    compiles: int = 0  # XLA compilations spent on this candidate, wherever they ran
    timing: Timing | None = None

    def record(self) -> dict[str, Any]:
        """JSON-ready summary (what tables and logs keep)."""
        out: dict[str, Any] = {"config": self.config.to_dict(), "status": self.status}
        if self.is_default:
            out["is_default"] = True
        if self.reason:
            out["stage"], out["reason"] = self.stage, self.reason
        if self.error is not None:
            out["error"] = self.error
        if self.timing is not None:
            out["median_s"], out["spread"] = self.timing.median_s, self.timing.spread
        return out


def _short(exc: BaseException) -> str:
    """One line: the exception type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def candidate_function(spec: OpSpec, backend: Backend, config: KernelConfig, problem: Any, index: int) -> Callable:
    return traceable(lambda inputs: spec.run(backend, config, problem, inputs), index)


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_backend_compiles = 0


def _count_compiles(event: str, seconds: float, **_: Any) -> None:
    global _backend_compiles
    if event == _COMPILE_EVENT:
        _backend_compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def backend_compiles() -> int:
    """XLA compilations this process has run so far (JAX's own monitoring event)."""
    return _backend_compiles


def _compile(spec: OpSpec, backend: Backend, problem: Any, config: KernelConfig, index: int, args: Any):
    """(executable, how many XLA compilations building it took: one, or zero on a cache hit)."""
    before = _backend_compiles
    compiled = candidate_function(spec, backend, config, problem, index).lower(args).compile()
    return compiled, _backend_compiles - before


def _compile_serialized(op_name: str, backend: Backend, problem: Any, config: KernelConfig, index: int,
                        shapes: Any) -> tuple[str, Any, float]:
    """Worker side: compile one candidate; ("ok", serialized executable, seconds, compiles), ("failed",
    reason, ...), or ("local", reason, ...) when it compiled but cannot travel (a Python host callback)."""
    from moe_tune.kernels import get_op

    start = time.perf_counter()
    try:
        compiled, compiles = _compile(get_op(op_name), backend, problem, config, index, shapes)
    except Exception as e:  # noqa: BLE001 - any failure is recorded as the candidate's reason
        return "failed", _short(e), time.perf_counter() - start, 0
    try:
        payload = serialize_executable.serialize(compiled)
        pickle.dumps(payload)
    except Exception as e:  # noqa: BLE001
        return "local", _short(e), time.perf_counter() - start, compiles
    return "ok", payload, time.perf_counter() - start, compiles


def _compile_in_workers(spec, backend, problem, candidates, inputs, workers, on_done, timeout) -> None:
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs)

    local: list[Candidate] = []

    def finish(cand: Candidate, status: str, value: Any) -> None:
        if status == "ok":
            status, value, cand.compile_s, cand.compiles = value
        if status == "local":
            local.append(cand)  # compiled fine but cannot be serialized: compile it here instead
            return
        if status == "ok":
            cand.executable = serialize_executable.deserialize_and_load(*value)
        else:
            cand.status, cand.stage, cand.reason = FAILED, "compile", value
        if on_done is not None:
            on_done(cand)

    requests = [(c, (spec.name, backend, problem, c.config, c.index, shapes)) for c in candidates]
    workers_module.pool(workers).map(f"{__name__}:_compile_serialized", requests, finish, timeout=timeout)
    _compile_here(spec, backend, problem, local, inputs, on_done)


def compile_all(
    spec: OpSpec,
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

    With `workers > 1` on CPU and GPU, candidates compile in worker processes (JAX's compile does not run
    two at once in one process) and come back serialized; a compile that takes longer than `timeout`
    seconds there is killed and recorded as failed. TPU allows one process per chip, so there, and with
    one worker, they compile here, one at a time (and without a timeout).
    """
    if workers > 1 and devices.platform() in ("cpu", "gpu"):
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
            cand.status, cand.stage, cand.reason = FAILED, "compile", _short(e)
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
    """Run each compiled candidate once (also its warm-up) and mark those off the reference as wrong."""
    for cand in candidates:
        if cand.status != OK:
            continue
        try:
            out = np.asarray(jax.block_until_ready(cand.executable(inputs)))
        except Exception as e:  # noqa: BLE001
            cand.status, cand.stage, cand.reason = FAILED, "run", _short(e)
        else:
            cand.error = relative_error(out, expected)
            if not cand.error <= tolerance:
                cand.status, cand.stage = WRONG, "check"
                cand.reason = f"relative error {cand.error:.3g} > tolerance {tolerance:.3g}"
        if on_done is not None:
            on_done(cand)
