"""Kernels, one package per op; inside each, one module per backend. Each op is one `KernelOp` object
(`get_op(name)`): its problem class, backends, shape options, config resolution and tuner hooks. How to add a
backend: `kernels/README.md`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from moe_tune.core.errors import UsageError
from moe_tune.core import contexts
from moe_tune.kernels.gather.definition import DENSE_GATHER_REDUCE, RAGGED_GATHER, RAGGED_GATHER_REDUCE
from moe_tune.kernels.kernel_op import KernelOp, Resolved
from moe_tune.kernels.kernel_op import ShapeOption
from moe_tune.kernels.ragged_dot.definition import RAGGED_DOT
from moe_tune.kernels.fused_moe.definition import FUSED_MOE

_OPS: dict[str, KernelOp] = {op.name: op for op in (RAGGED_DOT, RAGGED_GATHER, RAGGED_GATHER_REDUCE, DENSE_GATHER_REDUCE,
                                                    FUSED_MOE)}


def register_op(op: KernelOp) -> None:
    """Add an op built above the kernels (the layer's `moe_fusion`) to the registry; the package's import
    does it, so every `get_op` sees it. Registering the same op again is a no-op; another op of a taken name is
    an error."""
    if _OPS.setdefault(op.name, op) is not op:
        raise ValueError(f"op {op.name!r} is registered already")


def op_names() -> list[str]:
    """Every op's name, in the order the CLI lists them."""
    return list(_OPS)


def get_op(name: str) -> KernelOp:
    """The op object called `name`; UsageError naming the choices when there is none."""
    if name not in _OPS:
        raise UsageError(f"unknown op {name!r}; choose from {', '.join(_OPS)}")
    return _OPS[name]


@contextlib.contextmanager
def use_backend(op: str, name: str) -> Iterator[str]:
    """Calls of `op` traced inside the block that pass no backend run on backend `name` (`moe_mlp`'s kernels,
    say). Blocks nest; a UsageError (one line) for an unknown op or backend. Read at trace time, as the tables
    are: a function jitted outside the block keeps the backend it was traced with."""
    get_op(op).backends.get(name)
    with contexts.choose_backend(op, name):
        yield name


__all__ = ["KernelOp", "Resolved", "ShapeOption", "get_op", "op_names", "register_op", "use_backend"]
