"""The correctness gate: a candidate whose output is off the reference is wrong, and a wrong candidate never
wins (its time does not count)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from moe_tune.kernels.kernel_op import relative_error
from moe_tune.tuner.candidate import OK, Candidate, failure_reason


def check_all(
    candidates: Sequence[Candidate],
    inputs: Mapping[str, jax.Array],
    expected: np.ndarray,
    tolerance: float,
    on_done: Callable[[Candidate], None] | None = None,
) -> None:
    """Mark candidates off the reference as wrong. A candidate's output from its worker run (see
    `compiling.compile_all`) is checked as it is and dropped; a candidate without one (compiled in this
    process) is run once here (also its warm-up)."""
    for cand in candidates:
        if cand.status != OK:
            continue
        try:
            if cand.output is not None:
                out, cand.output = cand.output, None
            else:
                out = np.asarray(jax.block_until_ready(cand.executable(inputs)))
        except Exception as e:  # noqa: BLE001
            cand.fail("run", failure_reason(e))
        else:
            cand.error = relative_error(out, expected)
            if not cand.error <= tolerance:
                cand.fail("check", f"relative error {cand.error:.3g} > tolerance {tolerance:.3g}")
        if on_done is not None:
            on_done(cand)
