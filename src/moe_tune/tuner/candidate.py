"""One candidate of a sweep and the correctness gate it passes before its time counts.

A `Candidate` is one config of the backend, its index (its jitted function is named `moe_tune_cand_<index>`
so that its program can be found in the profiler trace) and what happened to it: status (`OK`, `WRONG`,
`FAILED`), where and why it failed, its relative error, compiles and timings. `Reference` is the sweep's
float64 reference output with its scale; `check_all` judges candidates against it: a candidate whose output is
off the reference is wrong, and a wrong candidate never wins.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.kernel_op import error_scale, relative_error
from moe_tune.tuner.timing import Timing

OK, WRONG, FAILED = "ok", "wrong", "failed"


@dataclasses.dataclass
class Candidate:
    index: int
    config: KernelConfig
    is_default: bool = False
    status: str = OK
    stage: str = ""  # where it failed: "compile", "run", "check"
    reason: str = ""
    error: float | None = None  # relative error vs the reference
    executable: Any = dataclasses.field(default=None, repr=False)
    worker_error: float | None = None  # its run in a worker, compared with the reference there (`gate`)
    compile_s: float | None = None
    compiles: int = 0  # XLA compilations spent on this candidate, wherever they ran
    timing: Timing | None = None
    first_timing: Timing | None = None  # a finalist's sweep-round timing, before the final round replaced it
    # the timing batch whose rounds its samples are, one per round (numbered across the runs of one sweep, so
    # a candidate restored from the log keeps its): candidates of one batch with as many samples are paired
    # round by round (`same_rounds`); None: not timed in a batch
    batch: int | None = None

    def fail(self, stage: str, reason: str) -> None:
        """Record a failure (or a wrong output, stage "check")."""
        self.status = WRONG if stage == "check" else FAILED
        self.stage, self.reason = stage, reason

    def record(self) -> dict[str, Any]:
        """JSON-ready summary (what tables keep)."""
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


def same_rounds(cands: list[Candidate] | tuple[Candidate, ...]) -> bool:
    """Whether `cands` were timed in the same rounds, one sample each per round: all in one timing batch of
    this process with as many samples each (a batch stops timing a candidate for good, so k samples are its
    first k rounds), by the same clock."""
    timed = [c.timing for c in cands if c.batch is not None and c.timing is not None]
    return len(timed) == len(cands) > 0 and len({c.batch for c in cands}) == 1 and len(
        {(t.samples, len(t.samples_s), t.method) for t in timed}) == 1


def short(exc: BaseException) -> str:
    """One line: the exception type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def failure_reason(exc: BaseException) -> str:
    """The recorded reason for an exception, flagged as out of memory when it is one."""
    if isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in str(exc):
        return f"out of memory: {short(exc)}"
    return short(exc)


@dataclasses.dataclass(frozen=True, eq=False)
class Reference:
    """The reference output of a sweep (any shape; float64 on the host for the ops here) and its max |value|,
    computed once: every candidate's output is compared with it (`error`), in this process or in a compile
    worker, which gets it once per sweep with the inputs (`token` names it there)."""

    expected: np.ndarray
    scale: float
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def of(cls, expected: np.ndarray) -> Reference:
        return cls(expected, error_scale(expected))

    def error(self, out: np.ndarray) -> float:
        """`kernel_op.relative_error` of `out` against the reference (inf for NaN/inf or another shape)."""
        return relative_error(out, self.expected, self.scale)


def check_all(
    candidates: Sequence[Candidate],
    inputs: Mapping[str, jax.Array],
    reference: Reference,
    tolerance: float,
    on_done: Callable[[Candidate], None] | None = None,
) -> None:
    """Mark candidates off the reference as wrong. A candidate that ran in a compile worker (see
    `compiling.compile_all`) is judged by the relative error computed there; one compiled in this process is
    run once here (also its warm-up)."""
    for cand in candidates:
        if cand.status != OK:
            continue
        out, error = None, cand.worker_error
        try:
            if error is not None:
                cand.worker_error = None
            else:
                out = np.asarray(jax.block_until_ready(cand.executable(inputs)))
        except Exception as e:  # noqa: BLE001
            cand.fail("run", failure_reason(e))
        else:
            cand.error = error if out is None else reference.error(out)
            if not cand.error <= tolerance:
                cand.fail("check", f"relative error {cand.error:.3g} > tolerance {tolerance:.3g}")
        if on_done is not None:
            on_done(cand)
