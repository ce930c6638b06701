"""Kernels, one package per op; inside each, one module per backend. Each op is one `OpSpec` object
(`get_op(name)`): its problem class, backends, shape options, config resolution and tuner hooks. How to add a
backend: `kernels/README.md`."""

from __future__ import annotations

from moe_tune.errors import UsageError
from moe_tune.kernels.gather.spec import DENSE_GATHER_REDUCE, RAGGED_GATHER, RAGGED_GATHER_REDUCE
from moe_tune.kernels.options import ShapeOption
from moe_tune.kernels.ragged_dot.spec import SPEC as RAGGED_DOT
from moe_tune.kernels.spec import OpSpec, Resolved

_SPECS: dict[str, OpSpec] = {spec.name: spec for spec in (RAGGED_DOT, RAGGED_GATHER, RAGGED_GATHER_REDUCE,
                                                          DENSE_GATHER_REDUCE)}


def op_names() -> list[str]:
    """Every op's name, in the order the CLI lists them."""
    return list(_SPECS)


def get_op(name: str) -> OpSpec:
    """The op object called `name`; UsageError naming the choices when there is none."""
    if name not in _SPECS:
        raise UsageError(f"unknown op {name!r}; choose from {', '.join(_SPECS)}")
    return _SPECS[name]


__all__ = ["OpSpec", "Resolved", "ShapeOption", "get_op", "op_names"]
