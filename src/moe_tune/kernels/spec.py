"""`OpSpec`: what the tuner needs to know about an op beyond its backends.

How to build a problem from user-facing options, how to make real inputs for it, the float64 reference
the candidates are checked against, how to call a backend, and how close is close enough.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import numpy as np

from moe_tune.kernels.base import Backend, BackendRegistry, KernelConfig
from moe_tune.kernels.options import ShapeOption

# Largest error allowed, relative to max |reference|, by the lowest-precision dtype involved. Wrong
# configs produce errors of order one (missing or misplaced rows), far above these.
TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 2e-2}


class OpSpec(abc.ABC):
    name: ClassVar[str]
    backends: ClassVar[BackendRegistry]
    description: ClassVar[str] = ""
    problem_class: ClassVar[type]  # the op's problem (a frozen dataclass, `profiles.protocols.ProblemLike`)
    directions: ClassVar[tuple[str, ...]] = ("fwd",)  # separately tuned passes (e.g. fwd and gradients)
    options: ClassVar[tuple[ShapeOption, ...]] = ()  # the shape options `problem()` takes (CLI flags, model presets)

    @property
    def option_names(self) -> tuple[str, ...]:
        """The keywords of `problem()`, in declaration order."""
        return tuple(option.name for option in self.options)

    @abc.abstractmethod
    def problem(self, **options: Any) -> Any:
        """Build (and validate) a problem from CLI-style options; raise UsageError on bad input."""

    @abc.abstractmethod
    def default_problem_options(self) -> dict[str, Any]:
        """Options of the realistic default shape a bare `moe-tune sweep --op NAME` tunes."""

    @abc.abstractmethod
    def make_inputs(self, problem: Any, distribution: str, seed: int) -> dict[str, np.ndarray]:
        """Real (random, seeded) host inputs for `problem`, with group sizes drawn from `distribution`."""

    @abc.abstractmethod
    def reference(self, problem: Any, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Float64 expected output."""

    @abc.abstractmethod
    def run(self, backend: Backend, config: KernelConfig, problem: Any, inputs: Mapping[str, jax.Array]) -> jax.Array:
        """Trace one call of `backend` with `config` (inside jit)."""

    @abc.abstractmethod
    def describe(self, problem: Any) -> str:
        """One-line human description of a problem."""

    def memory_estimate(self, problem: Any) -> int:
        """Bytes of memory a sweep (or `moe-tune bench`) of `problem` needs at least before any candidate runs:
        the host inputs, their device copy, the float64 reference and one candidate output. Pure arithmetic
        on the problem, so that an absurd shape is refused before anything is allocated. 0: unknown."""
        return 0

    def distribution_record(self, problem: Any, distribution: str, seed: int,
                            inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """What an entry records of the inputs it was tuned on, beyond the distribution's name and seed."""
        return {"group_sizes": np.asarray(inputs["group_sizes"]).tolist()}

    def tolerance(self, problem: Any) -> float:
        dtypes = [v for k, v in problem.key_fields().items() if k.endswith("dtype")]
        return max(TOLERANCE.get(d, 2e-2) for d in dtypes)

    def flops(self, problem: Any) -> int:
        return getattr(problem, "flops", 0)


# Elements per block of `relative_error`: its float64 temporaries stay at tens of MB. Whole-array ones took
# several times the output's size, and a drhs output can be gigabytes ([128, 2048, 1408] f32 is 1.5 GB:
# checking it took the sweep past 18 GB and the OOM killer).
_ERROR_BLOCK = 1 << 22


def relative_error(out: np.ndarray, expected: np.ndarray) -> float:
    """max |out - expected| / max |expected|, in float64; NaN/inf in `out` counts as infinitely wrong."""
    out, expected = np.asarray(out), np.asarray(expected)
    if out.shape != expected.shape:
        return float("inf")
    out, expected = out.reshape(-1), expected.reshape(-1)
    worst = scale = 0.0
    for lo in range(0, out.size, _ERROR_BLOCK):
        block = out[lo:lo + _ERROR_BLOCK].astype(np.float64)
        if not np.all(np.isfinite(block)):
            return float("inf")
        want = expected[lo:lo + _ERROR_BLOCK].astype(np.float64)
        worst = max(worst, float(np.max(np.abs(block - want))))
        scale = max(scale, float(np.max(np.abs(want))))
    return worst / max(scale, 1e-30)
