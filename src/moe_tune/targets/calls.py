"""One kernel call as the compilers see it: the op's traced function and abstract arguments placed on a
compile-only device, at any size (nothing is allocated). The op object answers both (`KernelOp.abstract_inputs`,
`KernelOp.run`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_tune.kernels import get_op, op_names
from moe_tune.kernels.base import KernelConfig


def described_ops() -> tuple[str, ...]:
    """The ops whose inputs have shapes before they are made (`KernelOp.has_input_shapes`): the kernels a
    chip compiles, not a choice between layers of them."""
    return tuple(name for name in op_names() if get_op(name).has_input_shapes)


DESCRIBED_OPS = described_ops()  # the ops registered when the package is imported (the layer's included)


def abstract_inputs(op: str, problem: Any, device: Any = None) -> dict[str, Any]:
    """The inputs `get_op(op).run` takes, as `jax.ShapeDtypeStruct`s committed to `device` (None: uncommitted),
    for an op of `described_ops()` (ValueError for another)."""
    return get_op(op).abstract_inputs(problem, device)


def kernel_call(op: str, backend: str, problem: Any, config: KernelConfig) -> Callable[[dict[str, Any]], Any]:
    """A fresh function of the inputs running one kernel call (fresh: jit caches traces by function, and the
    platform a kernel lowers for is read at trace time)."""
    spec = get_op(op)
    impl = spec.backends.get(backend)

    def call(inputs: dict[str, Any]) -> Any:
        return spec.run(impl, config, problem, inputs)

    return call
