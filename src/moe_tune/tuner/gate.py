"""The correctness gate: a candidate whose output is off the reference is wrong, and a wrong candidate never
wins (its time does not count)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from moe_tune.kernels.kernel_op import error_scale, relative_error
from moe_tune.tuner.candidate import OK, Candidate, failure_reason


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
