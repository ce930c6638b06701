"""Kernels, one package per op; inside each, one module per backend."""

from __future__ import annotations

from moe_tune.errors import UsageError
from moe_tune.kernels.spec import OpSpec


def _specs() -> dict[str, OpSpec]:
    from moe_tune.kernels.gather.spec import DENSE_GATHER_REDUCE, RAGGED_GATHER, RAGGED_GATHER_REDUCE
    from moe_tune.kernels.ragged_dot.spec import SPEC as RAGGED_DOT

    return {spec.name: spec for spec in (RAGGED_DOT, RAGGED_GATHER, RAGGED_GATHER_REDUCE, DENSE_GATHER_REDUCE)}


def op_names() -> list[str]:
    return list(_specs())


def get_op(name: str) -> OpSpec:
    specs = _specs()
    if name not in specs:
        raise UsageError(f"unknown op {name!r}; choose from {', '.join(specs)}")
    return specs[name]
