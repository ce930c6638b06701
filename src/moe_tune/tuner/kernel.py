"""The kernel a sweep tunes: one op, one of its backends, one problem, bound once as one value.

Everything that compiles or runs a candidate takes a `Kernel` and a config, instead of threading the op,
the backend and the problem through each call. A `Kernel` travels to compile workers by the op's name (the
op object is found again there with `kernels.get_op`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from moe_tune.kernels import get_op
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.tuner import compile_count
from moe_tune.tuner.timing import traceable


@dataclasses.dataclass(frozen=True)
class Kernel:
    op: KernelOp
    backend: Backend
    problem: Any  # the op's problem object (RaggedDotProblem, GatherProblem)

    def __reduce__(self) -> tuple[Callable, tuple[str, Backend, Any]]:
        return _by_name, (self.op.name, self.backend, self.problem)

    def function(self, config: KernelConfig, index: int) -> Callable:
        """The jitted candidate `index`: inputs -> output, named for the profiler trace (`timing.traceable`)."""
        return traceable(lambda inputs: self.op.run(self.backend, config, self.problem, inputs), index)

    def compile(self, config: KernelConfig, index: int, args: Any) -> tuple[Any, int]:
        """(executable for `args` (arrays or ShapeDtypeStructs), how many XLA compilations building it took:
        one, or zero on a persistent-cache hit)."""
        before = compile_count.backend_compiles()
        compiled = self.function(config, index).lower(args).compile()
        return compiled, compile_count.backend_compiles() - before


def _by_name(op: str, backend: Backend, problem: Any) -> Kernel:
    return Kernel(get_op(op), backend, problem)
