"""Compile candidates in parallel, ahead of time, once each; then gate them on correctness.

A candidate is one config of one backend for one problem. Its jitted function is named
`moe_tune_cand_<index>` so its program can be found in the profiler trace. The executable compiled here is
the one that is checked and timed: nothing is compiled twice.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
import numpy as np

from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.spec import OpSpec, relative_error
from moe_tune.tuner.timing import CANDIDATE_PREFIX, Timing

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
    def fn(inputs):
        return spec.run(backend, config, problem, inputs)

    fn.__name__ = fn.__qualname__ = f"{CANDIDATE_PREFIX}{index}"
    return jax.jit(fn)


def compile_all(
    spec: OpSpec,
    backend: Backend,
    problem: Any,
    candidates: list[Candidate],
    inputs: Mapping[str, jax.Array],
    *,
    workers: int,
    on_done: Callable[[Candidate], None] | None = None,
) -> None:
    """Lower and compile every candidate on a thread pool (XLA compiles outside the GIL)."""
    import time

    def build(cand: Candidate) -> Candidate:
        start = time.perf_counter()
        try:
            cand.executable = candidate_function(spec, backend, cand.config, problem, cand.index).lower(inputs).compile()
        except Exception as e:  # noqa: BLE001 - any failure is recorded as the candidate's reason
            cand.status, cand.stage, cand.reason = FAILED, "compile", _short(e)
            cand.debug = traceback.format_exc()  # type: ignore[attr-defined]
        cand.compile_s = time.perf_counter() - start
        return cand

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for fut in as_completed([pool.submit(build, c) for c in candidates]):
            if on_done is not None:
                on_done(fut.result())


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
