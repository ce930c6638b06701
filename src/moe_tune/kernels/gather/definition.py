"""Tuner-facing description of dispatch and combine: problems from user-facing options (tokens, hidden size,
top_k, experts, expert-parallel size), seeded routed inputs, the float64 references."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core import distributions
from moe_tune.kernels import kernel_op as opt
from moe_tune.kernels.base import Backend, BackendRegistry, KernelConfig
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.reference import gather_reduce_reference, ragged_gather_reference
from moe_tune.kernels.gather.registry import (
    DENSE_GATHER_REDUCE_BACKENDS, FALLBACK, GATHER_BACKENDS, GATHER_REDUCE_BACKENDS,
)
from moe_tune.kernels.kernel_op import ShapeOption
from moe_tune.kernels.kernel_op import BenchPlan, KernelOp
from moe_tune.kernels.layer_shape import LayerShape

# The default sweep: dispatch / combine of one Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts, top-8) for
# 1024 tokens; a 64 MiB expert-ordered buffer that a 2-core CPU sweeps in well under a minute.
DEFAULT_OPTIONS = {"tokens": 1024, "hidden": 2048, "top_k": 8, "experts": 128, "ep": 1, "dtype": "float32"}


def routed_rows(problem: GatherProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
    """How a router would lay the `rows = tokens * top_k` (token, k) entries out in expert order.

    Expert loads come from the named distribution over `experts` experts. Returns `group_sizes` [experts],
    `token_of_row` [rows] (the token each expert-ordered row copies: dispatch's indices), `row_of_entry`
    [rows] (where entry t * top_k + j went: combine's indices) and `end`, the rows of the first
    `experts / ep` experts (the shard whose range [0, end) is valid).
    """
    experts = problem.experts or DEFAULT_OPTIONS["experts"]
    sizes = distributions.group_sizes(distribution, problem.rows, experts, seed)
    rng = np.random.default_rng(seed)
    entry_of_row = rng.permutation(problem.rows).astype(np.int32)  # which entry lands in each sorted row
    row_of_entry = np.empty(problem.rows, np.int32)
    row_of_entry[entry_of_row] = np.arange(problem.rows, dtype=np.int32)
    end = int(np.sum(sizes[: experts // problem.ep]))
    return {"group_sizes": sizes, "token_of_row": entry_of_row // problem.top_k, "row_of_entry": row_of_entry,
            "end": end}


class _GatherOp(KernelOp):
    options: ClassVar[tuple[ShapeOption, ...]] = (opt.TOKENS, opt.HIDDEN, opt.TOP_K, opt.EXPERTS, opt.EP, opt.DTYPE)
    default_weighted: ClassVar[bool] = True
    fallback = FALLBACK
    problem_class = GatherProblem

    def problem(self, *, tokens: int, hidden: int, top_k: int, dtype: str = "float32", experts: int | None = None,
                ep: int = 1, weighted: bool | None = None, direction: str = "fwd") -> GatherProblem:
        return GatherProblem(tokens=tokens, rows=tokens * top_k, hidden=hidden, dtype=dtype, experts=experts,
                             ep=ep, weighted=self.default_weighted if weighted is None else weighted,
                             direction=direction)

    def default_problem_options(self) -> dict[str, Any]:
        return {name: value for name, value in DEFAULT_OPTIONS.items() if name in self.option_names}

    def distribution_record(self, problem: GatherProblem, distribution: str, seed: int,
                            inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        routed = routed_rows(problem, distribution, seed)
        return {"group_sizes": routed["group_sizes"].tolist(), "experts": len(routed["group_sizes"]),
                "ep": problem.ep, "valid_fraction": routed["end"] / problem.rows}

    def output_rows(self, problem: GatherProblem) -> int:
        """Rows of the forward output: every routed row for dispatch, one per token for combine."""
        return problem.rows if self.name == "ragged_gather" else problem.tokens

    def bytes_moved(self, problem: GatherProblem, valid_fraction: float = 1.0) -> int:
        """Least bytes any kernel moves: each valid row read once, the whole output written once."""
        return round(valid_fraction * problem.rows + self.output_rows(problem)) * problem.row_bytes()

    def input_rows(self, problem: GatherProblem) -> int:
        """Rows of the forward input x: one per token for dispatch, every routed row for combine."""
        return problem.tokens if self.name == "ragged_gather" else problem.rows

    def memory_estimate(self, problem: GatherProblem) -> int:
        """Bytes a sweep of `problem` holds before any candidate runs (pure arithmetic, nothing allocated): x,
        indices, weights and the mask on the host and on the device, the float64 reference and one output."""
        small = problem.rows * (4 + 4 + 1)  # int32 indices, float32 weights, bool mask (an upper bound)
        out_rows = self.output_rows(problem)
        return (2 * (self.input_rows(problem) * problem.row_bytes() + small)
                + out_rows * problem.hidden * 8 + out_rows * problem.row_bytes())

    def bench_plan(self, problem: GatherProblem, backend: Backend, tuned: KernelConfig, inputs: Mapping[str, Any],
                   *, distribution: str, seed: int) -> BenchPlan:
        """Beside the tuned and default configs: the plain-JAX fallback (the baseline), a copy of the op's larger
        side ([rows, hidden]: dispatch's output, combine's input, so that it streams from memory as the op
        does: the copy bandwidth, and with the least bytes moved at the valid fraction, the roofline), and
        `output_write`, a fresh array of the output's shape filled with a constant: no kernel can return its
        output faster, whatever the valid fraction."""
        plain = self.backends.get(self.fallback)
        config = plain.default_config(problem)
        valid_fraction = self.distribution_record(problem, distribution, seed, inputs)["valid_fraction"]
        output_shape = (self.output_rows(problem), problem.hidden)
        least = self.bytes_moved(problem, valid_fraction)
        flag = self.fallback_flag
        return BenchPlan(
            baseline="fallback",
            advice=f"pass {flag}=True for this shape (or set MOE_TUNE_{flag.upper()}=1 for a whole run)",
            variants={"fallback": lambda x: self.run(plain, config, problem, x),
                      "output_write": lambda x: jnp.full(output_shape, x["fill"])},
            inputs={"fill": np.zeros((), jnp.dtype(problem.dtype))},  # an input: XLA cannot fold the fill
            copy_bytes=problem.rows * problem.row_bytes(), least_bytes=least,
            ratios={"tuned_vs_output_write": ("tuned", "output_write")}, shown=("output_write",),
            details={"valid_fraction": valid_fraction, "least_bytes": least})

    def _layer_call(self, role: str, layer: LayerShape, **extra: Any) -> tuple[str, GatherProblem]:
        """This op's call of `role` in `layer`, from the layer's gather options this op takes."""
        given = {**layer.gather_options(), **extra}
        return role, self.problem(**{k: v for k, v in given.items() if k in self.option_names})

    def describe(self, problem: GatherProblem) -> str:
        weights = "" if problem.weighted else " unweighted"
        ep = f" (ep={problem.ep})" if "ep" in self.option_names else ""
        return (f"{self.name} tokens={problem.tokens} top_k={problem.top_k} hidden={problem.hidden} "
                f"{problem.dtype}{weights}{ep}")


class RaggedGatherOp(_GatherOp):
    name = "ragged_gather"
    backends = GATHER_BACKENDS
    description = "dispatch: x[tokens,d] -> [tokens*top_k,d] in expert order, rows in [start,end) only"
    options = (*_GatherOp.options, opt.WEIGHTED)
    default_weighted = False  # MoE dispatch copies tokens; the top-k weights are applied at combine
    fallback_flag = "ragged_gather_fallback"

    def input_shapes(self, problem: GatherProblem, place) -> dict[str, Any]:
        inputs = {"x": place((problem.tokens, problem.hidden), problem.dtype), "indices": place((problem.rows,), jnp.int32),
                  "start": place((), jnp.int32), "end": place((), jnp.int32)}
        if problem.weighted:
            inputs["weights"] = place((problem.rows,), jnp.float32)
        return inputs

    def layer_calls(self, layer: LayerShape, runs: str | None) -> list[tuple[str, GatherProblem]]:
        """The dispatch (unweighted: the top-k weights are applied at combine); training also the combine's
        gradient, a weighted gather of d(out) rows (`combine bwd`)."""
        calls = [self._layer_call("dispatch", layer)]
        return calls + [self._layer_call("combine bwd", layer, weighted=True)] if runs == "all" else calls

    def make_inputs(self, problem: GatherProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
        routed = routed_rows(problem, distribution, seed)
        rng = np.random.default_rng(seed + 1)
        dtype = jax.numpy.dtype(problem.dtype)
        inputs = {"x": rng.standard_normal((problem.tokens, problem.hidden), np.float32).astype(dtype),
                  "indices": routed["token_of_row"], "start": np.int32(0), "end": np.int32(routed["end"])}
        if problem.weighted:
            inputs["weights"] = rng.random(problem.rows, np.float32)
        return inputs

    def reference(self, problem: GatherProblem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        return ragged_gather_reference(inputs["x"], inputs["indices"], inputs["start"], inputs["end"],
                                       inputs.get("weights"))

    def run(self, backend: Backend, config: KernelConfig, problem: GatherProblem,
            inputs: Mapping[str, jax.Array]) -> jax.Array:
        return backend.gather(inputs["x"], inputs["indices"], inputs["start"], inputs["end"], inputs.get("weights"),
                              config=config)


class _GatherReduceOp(_GatherOp):
    masked: ClassVar[bool]
    fallback_flag = "ragged_gather_reduce_fallback"

    def input_shapes(self, problem: GatherProblem, place) -> dict[str, Any]:
        rows = problem.rows
        inputs = {"x": place((rows, problem.hidden), problem.dtype), "indices": place((rows,), jnp.int32),
                  "weights": place((rows,), jnp.float32)}
        if self.masked:
            inputs["valid"] = place((rows,), jnp.bool_)
        return inputs

    def make_inputs(self, problem: GatherProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
        """Expert outputs x [rows, hidden] in expert order; with a mask, rows past the shard's range are
        NaN (another shard computed them) and must not be read."""
        routed = routed_rows(problem, distribution, seed)
        rng = np.random.default_rng(seed + 1)
        x = rng.standard_normal((problem.rows, problem.hidden), np.float32)
        weights = rng.random((problem.tokens, problem.top_k), np.float32)
        inputs = {"indices": routed["row_of_entry"],
                  "weights": (weights / weights.sum(axis=1, keepdims=True)).reshape(-1)}
        if self.masked:
            x[routed["end"]:] = np.nan
            inputs["valid"] = routed["row_of_entry"] < routed["end"]
        inputs["x"] = x.astype(jax.numpy.dtype(problem.dtype))
        return inputs

    def reference(self, problem: GatherProblem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        return gather_reduce_reference(inputs["x"], inputs["indices"], inputs["weights"], inputs.get("valid"),
                                       problem.top_k)

    def run(self, backend: Backend, config: KernelConfig, problem: GatherProblem,
            inputs: Mapping[str, jax.Array]) -> jax.Array:
        return backend.gather_reduce(inputs["x"], inputs["indices"], inputs["weights"], inputs.get("valid"),
                                     problem.top_k, config=config)


class RaggedGatherReduceOp(_GatherReduceOp):
    name = "ragged_gather_reduce"
    backends: ClassVar[BackendRegistry] = GATHER_REDUCE_BACKENDS
    description = "combine: [tokens*top_k,d] -> [tokens,d], weighted sum of each token's valid rows"
    masked = True

    def layer_calls(self, layer: LayerShape, runs: str | None) -> list[tuple[str, GatherProblem]]:
        """The combine of an expert-parallel shard (rows masked to its experts: ep > 1); training also the
        dispatch's gradient (`dispatch bwd`, at ep > 1 the combine's own key)."""
        calls = [self._layer_call("combine", layer)] if layer.ep > 1 else []
        return calls + [self._layer_call("dispatch bwd", layer)] if runs == "all" else calls


class DenseGatherReduceOp(_GatherReduceOp):
    name = "dense_gather_reduce"
    backends: ClassVar[BackendRegistry] = DENSE_GATHER_REDUCE_BACKENDS
    description = "combine without a mask (pure tensor parallelism): weighted sum of each token's rows"
    masked = False
    options = (opt.TOKENS, opt.HIDDEN, opt.TOP_K, opt.EXPERTS, opt.DTYPE)

    def layer_calls(self, layer: LayerShape, runs: str | None) -> list[tuple[str, GatherProblem]]:
        """The combine where every expert is local (ep 1: no mask)."""
        return [self._layer_call("combine", layer)] if layer.ep == 1 else []


RAGGED_GATHER = RaggedGatherOp()
RAGGED_GATHER_REDUCE = RaggedGatherReduceOp()
DENSE_GATHER_REDUCE = DenseGatherReduceOp()
OPS = {op.name: op for op in (RAGGED_GATHER, RAGGED_GATHER_REDUCE, DENSE_GATHER_REDUCE)}
