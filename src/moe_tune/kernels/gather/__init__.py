"""Dispatch and combine: `ragged_gather`, `ragged_gather_reduce`, `dense_gather_reduce`, their backends (`jax`
fallback, `tiled`, `triton`, `pallas_tpu`, `sparsecore`), problems and op definitions (definition.py)."""

from moe_tune.kernels.gather.op import dense_gather_reduce, ragged_gather, ragged_gather_reduce
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.registry import DENSE_GATHER_REDUCE_BACKENDS, GATHER_BACKENDS, GATHER_REDUCE_BACKENDS

__all__ = ["DENSE_GATHER_REDUCE_BACKENDS", "GATHER_BACKENDS", "GATHER_REDUCE_BACKENDS", "GatherProblem",
           "dense_gather_reduce", "ragged_gather", "ragged_gather_reduce"]
