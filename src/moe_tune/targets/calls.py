"""One kernel call as the compilers see it: the op's traced function and abstract arguments placed on a
compile-only device, at any size (nothing is allocated)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune.kernels import get_op
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.gather.problem import GATHER_OPS, GatherProblem
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.core.quant import DynamicQuant, QArray

# direction -> (the two operands of its matmul), as the ragged_dot op passes them (`a`, `b`)
_OPERANDS = {"fwd": ("lhs", "rhs"), "dlhs": ("dout", "rhs"), "drhs": ("lhs", "dout")}


def _ragged_dot_inputs(problem: RaggedDotProblem, place: Callable) -> dict[str, Any]:
    m, k, n, g = problem.m, problem.k, problem.n, problem.groups
    shapes = {"lhs": ((m, k), problem.lhs_dtype), "rhs": ((g, k, n), problem.rhs_dtype),
              "dout": ((m, n), problem.out_dtype)}
    inputs: dict[str, Any] = {"group_sizes": place((problem.num_group_sizes,), jnp.int32)}
    for name, operand in zip(("a", "b"), _OPERANDS[problem.direction]):
        shape, dtype = shapes[operand]
        qdtype = getattr(problem, f"{operand}_qdtype", None)
        if qdtype is None:
            inputs[name] = place(shape, dtype)
        elif getattr(problem, f"{operand}_qdynamic", False):  # float activations the kernel quantizes (fwd)
            value = place(shape, dtype)
            inputs[name] = DynamicQuant(value, qdtype, problem.lhs_qblock) if problem.direction == "fwd" else value
        else:  # scaled along k (axis 1): scale [.., k / qblock, ..] in float32
            block = getattr(problem, f"{operand}_qblock")
            scale = tuple(d // block if i == 1 else d for i, d in enumerate(shape))
            inputs[name] = QArray(place(shape, qdtype), place(scale, jnp.float32))
    return inputs


def _gather_inputs(op: str, problem: GatherProblem, place: Callable) -> dict[str, Any]:
    tokens, rows, hidden = problem.tokens, problem.rows, problem.hidden
    if op == "ragged_gather":
        inputs = {"x": place((tokens, hidden), problem.dtype), "indices": place((rows,), jnp.int32),
                  "start": place((), jnp.int32), "end": place((), jnp.int32)}
        if problem.weighted:
            inputs["weights"] = place((rows,), jnp.float32)
        return inputs
    inputs = {"x": place((rows, hidden), problem.dtype), "indices": place((rows,), jnp.int32),
              "weights": place((rows,), jnp.float32)}
    if op == "ragged_gather_reduce":
        inputs["valid"] = place((rows,), jnp.bool_)
    return inputs


def _fused_moe_inputs(problem: FusedMoeProblem, place: Callable) -> dict[str, Any]:
    """The inputs `FusedMoeOp.make_inputs` builds (`a`, rows, rhs, group sizes, weights), as shapes."""
    p = problem
    token_side = (p.stage == "dispatch") == (p.direction == "fwd")  # x of dispatch, dout of combine's bwd
    a_cols = p.k if p.direction == "fwd" else p.n
    def weights(n: int):
        if p.rhs_qdtype is None:
            return place((p.groups, p.k, n), p.dtype)
        return QArray(place((p.groups, p.k, n), p.rhs_qdtype),  # scaled along k: [g, k / qblock, n] float32
                      place((p.groups, p.k // p.rhs_qblock, n), jnp.float32))

    rhs = (weights(p.n // 2), weights(p.n // 2)) if p.rhs_parts == 2 else weights(p.n)  # make_inputs' gate, up
    inputs = {"a": place((p.tokens if token_side else p.m, a_cols), p.dtype), "rows": place((p.m,), jnp.int32),
              "rhs": rhs, "group_sizes": place((p.num_group_sizes,), jnp.int32), "weights": place((p.m,), jnp.float32)}
    if p.total_groups:
        inputs["group_offset"] = place((), jnp.int32)
    return inputs


DESCRIBED_OPS = ("ragged_dot", "fused_moe", *GATHER_OPS)  # the ops whose inputs `abstract_inputs` describes


def abstract_inputs(op: str, problem: Any, device: Any = None) -> dict[str, Any]:
    """The inputs `get_op(op).run` takes, as `jax.ShapeDtypeStruct`s committed to `device` (None: uncommitted),
    for an op of `DESCRIBED_OPS` (ValueError for another)."""
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    place = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    if op == "ragged_dot":
        return _ragged_dot_inputs(problem, place)
    if op == "fused_moe":
        return _fused_moe_inputs(problem, place)
    if op in GATHER_OPS:
        return _gather_inputs(op, problem, place)
    raise ValueError(f"no abstract inputs for op {op!r} (described: {', '.join(DESCRIBED_OPS)})")


def kernel_call(op: str, backend: str, problem: Any, config: KernelConfig) -> Callable[[dict[str, Any]], Any]:
    """A fresh function of the inputs running one kernel call (fresh: jit caches traces by function, and the
    platform a kernel lowers for is read at trace time)."""
    spec = get_op(op)
    impl = spec.backends.get(backend)

    def call(inputs: dict[str, Any]) -> Any:
        return spec.run(impl, config, problem, inputs)

    return call
