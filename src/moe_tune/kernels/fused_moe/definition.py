"""Tuner-facing description of the fused MoE kernels (`fused_moe`): problems from options, seeded routed
inputs, the float64 references."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core import distributions
from moe_tune.core.errors import UsageError
from moe_tune.kernels import kernel_op as opt
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.fused_moe.activations import ACTIVATIONS
from moe_tune.kernels.fused_moe.base import weight_parts
from moe_tune.kernels.fused_moe.problem import DIRECTIONS, STAGES, FusedMoeProblem
from moe_tune.kernels.fused_moe.reference import gather_gmm_reference, gmm_combine_reference, local_row_range
from moe_tune.kernels.fused_moe.registry import BACKENDS, FALLBACK
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.kernels.layer_shape import LayerShape
from moe_tune.kernels.ragged_dot.definition import requested_format
from moe_tune.kernels.kernel_op import ShapeOption
from moe_tune.core.quant import QArray, dequantize_host, quantize

STAGE = ShapeOption("stage", STAGES, "fused_moe: the fused dispatch (gather + gate/up matmul) or combine (down "
                    "matmul + weighted sum).")
NO_GLU = "none"
GLU = ShapeOption("glu", (*ACTIVATIONS, NO_GLU), "fused_moe: the gated activation of the dispatch's epilogue "
                  "(default: silu; none: no activation, n is then gate and up concatenated, as a training "
                  "layer's forward dispatch keeps them for its backward).")

# The activation of the layer's gated experts (`moe_mlp`'s default, the presets' models'): its dispatch's epilogue.
LAYER_GLU = "silu"


def forward_glu(glu: str | None, *, differentiated: bool) -> str | None:
    """The glu a dispatch's forward kernel runs and is looked up with: a differentiated one runs none and keeps
    the pre-activation product, on which its backward differentiates the activation (`op.gather_gmm`)."""
    return None if differentiated else glu


# The default sweep: the gate/up dispatch of one Qwen3-30B-A3B MoE layer (hidden 2048, expert width 768, 128
# experts, top-8) for 512 tokens: 4096 rows, [2048, 1536] concatenated weights, SiLU.
DEFAULT_OPTIONS = {"tokens": 512, "top_k": 8, "k": 2048, "n": 1536, "groups": 128, "stage": "dispatch",
                   "glu": "silu", "dtype": "float32"}


def routed_tokens(group_sizes: np.ndarray, m: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """int32 [m]: the token of each expert-ordered row as a router lays them out: each group's rows hold
    distinct tokens (a token picks distinct experts) in increasing order; rows past the groups read token 0."""
    rows = np.zeros(m, np.int32)
    start = 0
    for size in np.asarray(group_sizes, np.int64):
        rows[start:start + size] = np.sort(rng.choice(tokens, size, replace=bool(size > tokens)))
        start += size
    return rows


class FusedMoeOp(KernelOp):
    name = "fused_moe"
    backends = BACKENDS
    fallback = FALLBACK
    description = "fused dispatch x[rows] @ w (gate/up, activation) and combine (down, weighted sum into tokens)"
    directions = DIRECTIONS
    problem_class = FusedMoeProblem
    options = (opt.TOKENS, opt.TOP_K, opt.K, opt.N, opt.GROUPS, opt.EP, STAGE, GLU, opt.RHS_QUANT, opt.QUANT_BLOCK,
               opt.DTYPE)

    def problem(self, *, tokens: int, top_k: int, k: int, n: int, groups: int, stage: str = "dispatch",
                glu: str | None = None, dtype: str = "float32", ep: int = 1, rhs_quant: str | None = None,
                quant_block: int | None = None, direction: str = "fwd") -> FusedMoeProblem:
        """`groups`: experts on this shard; with `ep` > 1 the router has groups x ep experts and the shard's
        rows are about 1/ep of the tokens x top_k. `rhs_quant` / `quant_block`: quantized weights, as
        ragged_dot's (`QuantFormat`: mxfp4 in its blocks of 32, None: one scale per channel)."""
        if quant_block is not None and rhs_quant is None:
            raise UsageError("quant_block (--quant-block) needs rhs_quant (--rhs-quant)")
        if isinstance(top_k, int) and isinstance(groups, int) and isinstance(ep, int) and top_k > groups * ep:
            raise UsageError(f"top_k ({top_k}) must not exceed experts ({groups * ep}: groups x ep): each token is "
                             "routed to top_k distinct experts")
        rhs = requested_format(rhs_quant, quant_block, k, "rhs_quant")
        return FusedMoeProblem(tokens=tokens, m=tokens * top_k, k=k, n=n, groups=groups, dtype=dtype, stage=stage,
                               direction=direction, glu=glu if stage == "dispatch" and glu != NO_GLU else None,
                               rhs_qdtype=rhs and rhs.dtype, rhs_qblock=rhs and rhs.block,
                               total_groups=groups * ep if ep > 1 else None, ep=ep)

    def default_problem_options(self) -> dict[str, Any]:
        return dict(DEFAULT_OPTIONS)

    def make_inputs(self, problem: FusedMoeProblem, distribution: str, seed: int) -> dict[str, Any]:
        """Routed rows over `total_groups` experts (the shard: the first `groups`), the direction's operand `a`
        (dispatch: x [tokens, k] / dh [m, n]; combine: h [m, k] with NaN rows outside the shard / dout
        [tokens, n]), weights [groups, k, n] (a QArray when quantized; the dispatch's as its gate and up
        halves, the two arrays `moe_mlp` passes: `base.FusedMoeBackend.takes`), row weights; rows outside the
        shard index past the tokens (they must never be read)."""
        rng = np.random.default_rng(seed)
        p, dtype = problem, jnp.dtype(problem.dtype)
        sizes = distributions.group_sizes(distribution, p.m, p.num_group_sizes, seed)
        rows = routed_tokens(sizes, p.m, p.tokens, rng)
        _, start, end = local_row_range(sizes, p.m, p.groups)
        rows[end:] = p.tokens + 7
        normal = lambda *shape: rng.standard_normal(shape, np.float32)
        rhs = normal(p.groups, p.k, p.n) / np.sqrt(p.k)
        rhs = jax.tree.map(np.asarray, quantize(rhs, p.rhs_qdtype, axis=1, block_size=p.rhs_qblock)) \
            if p.rhs_qdtype else rhs.astype(dtype)
        if p.rhs_parts == 2:
            rhs = gate_and_up(rhs)
        if p.stage == "dispatch":
            a = normal(p.tokens, p.k) if p.direction == "fwd" else normal(p.m, p.n)
            weights = np.ones(p.m, np.float32)
        else:
            a = normal(p.m, p.k) if p.direction == "fwd" else normal(p.tokens, p.n)
            weights = rng.random(p.m, np.float32)
            if p.direction == "fwd":
                a[end:] = np.nan
        inputs = {"a": a.astype(dtype), "rows": rows, "rhs": rhs, "group_sizes": sizes, "weights": weights}
        if p.total_groups:
            inputs["group_offset"] = np.int32(0)
        return inputs

    def reference(self, problem: FusedMoeProblem, inputs: Mapping[str, Any]) -> np.ndarray:
        rhs = np.concatenate([dequantize_host(part) if isinstance(part, QArray) else np.asarray(part)
                              for part in weight_parts(inputs["rhs"])], axis=2)
        common = dict(transpose_rhs=problem.transpose_rhs)
        if problem.kernel == "gather_gmm":
            return gather_gmm_reference(inputs["a"], inputs["rows"], rhs, inputs["group_sizes"],
                                        glu=None if problem.transpose_rhs else problem.glu, **common)
        return gmm_combine_reference(inputs["a"], rhs, inputs["group_sizes"], inputs["rows"], inputs["weights"],
                                     tokens=problem.tokens, **common)

    def run(self, backend: Backend, config: KernelConfig, problem: FusedMoeProblem,
            inputs: Mapping[str, jax.Array]) -> jax.Array:
        return backend.run(problem, config, dict(inputs))

    def memory_estimate(self, problem: FusedMoeProblem) -> int:
        """Host and device copies of the inputs, the float64 reference and one output (pure arithmetic)."""
        p, size = problem, problem.itemsize()
        a = (p.tokens if (p.stage == "dispatch") == (p.direction == "fwd") else p.m) * \
            (p.k if p.direction == "fwd" else p.n) * size
        # the weights' two copies: float, or quantized values and their float32 scales (4-bit values take a
        # byte each in NumPy, two a byte on the device)
        weights, form = p.groups * p.k * p.n, p.rhs_format
        rhs = 2 * weights * size if form is None else form.stored_bytes(weights, host=True) + form.stored_bytes(weights)
        out_rows = p.m if p.kernel == "gather_gmm" else p.tokens
        out_cols = p.k if p.direction == "bwd" else (p.out_n if p.stage == "dispatch" else p.n)
        return 2 * (a + 12 * p.m) + rhs + out_rows * out_cols * (8 + size)

    def input_shapes(self, problem: FusedMoeProblem, place) -> dict[str, Any]:
        """`make_inputs`' arrays (`a`, rows, rhs, group sizes, weights) as `place` gives them."""
        p = problem
        token_side = (p.stage == "dispatch") == (p.direction == "fwd")  # x of dispatch, dout of combine's bwd
        a_cols = p.k if p.direction == "fwd" else p.n

        def weights(n: int):
            if p.rhs_qdtype is None:
                return place((p.groups, p.k, n), p.dtype)
            return QArray(place((p.groups, p.k, n), p.rhs_qdtype),  # scaled along k: [g, k / qblock, n] float32
                          place((p.groups, p.k // p.rhs_qblock, n), jnp.float32))

        rhs = (weights(p.n // 2), weights(p.n // 2)) if p.rhs_parts == 2 else weights(p.n)  # gate and up parts
        inputs = {"a": place((p.tokens if token_side else p.m, a_cols), p.dtype), "rows": place((p.m,), jnp.int32),
                  "rhs": rhs, "group_sizes": place((p.num_group_sizes,), jnp.int32),
                  "weights": place((p.m,), jnp.float32)}
        if p.total_groups:
            inputs["group_offset"] = place((), jnp.int32)
        return inputs

    def looked_up(self, problem: FusedMoeProblem, *, differentiated: bool) -> list[FusedMoeProblem]:
        """The problems one call of a stage (its forward `problem`) looks up: the forward (a dispatch's with
        `forward_glu`) and, where the call is differentiated, the backward (keyed on the stage's glu)."""
        forward = dataclasses.replace(problem, direction="fwd",
                                      glu=forward_glu(problem.glu, differentiated=differentiated))
        return [forward, problem.with_direction("bwd")] if differentiated else [forward]

    def layer_calls(self, layer: LayerShape, runs: str | None) -> list[tuple[str, FusedMoeProblem]]:
        """The fused path's calls (SiLU-gated experts, quantized weights too; none with quantized activations,
        which run unfused, nor for None, the unfused layer): the gated dispatch (`fused gate/up`, gate and up
        one grouped matmul) and the combine (`fused down`), as `looked_up` says: serving evaluates them,
        training differentiates them (and evaluates between steps)."""
        if runs is None or layer.quantized_activations:
            return []
        common = dict(tokens=layer.tokens, top_k=layer.top_k, groups=layer.groups, ep=layer.ep, dtype=layer.dtype,
                      **layer.weight_quant())
        stages = (("fused gate/up", dict(stage="dispatch", k=layer.hidden, n=2 * layer.intermediate, glu=LAYER_GLU)),
                  ("fused down", dict(stage="combine", k=layer.intermediate, n=layer.hidden)))
        calls: dict[tuple, tuple[str, FusedMoeProblem]] = {}
        for role, stage in stages:
            problem = self.problem(**common, **stage)
            for differentiated in ((False,) if runs == "fwd" else (False, True)):
                for looked in self.looked_up(problem, differentiated=differentiated):
                    calls.setdefault(tuple(looked.key_fields().items()), (role, looked))
        return list(calls.values())

    def describe(self, problem: FusedMoeProblem) -> str:
        p = problem
        glu = f" glu={p.glu}" if p.glu else ""
        quant = f" rhs {p.rhs_format.label(p.k)}" if p.rhs_format else ""
        ep = f" ep={p.ep}" if p.ep > 1 else ""
        return (f"fused_moe {p.stage} {p.direction} tokens={p.tokens} m={p.m} k={p.k} n={p.n} g={p.groups}{glu} "
                f"{p.dtype}{quant}{ep}")


def gate_and_up(rhs: np.ndarray | QArray) -> tuple:
    """[groups, k, 2f] weights (a QArray's values and scales alike) -> their two halves along n, contiguous:
    the dispatch's gate and up as `moe_mlp` passes them."""
    f = rhs.shape[2] // 2
    halves = lambda a: (np.ascontiguousarray(a[..., :f]), np.ascontiguousarray(a[..., f:]))
    if isinstance(rhs, QArray):
        return tuple(QArray(q, s) for q, s in zip(halves(rhs.qvalue), halves(rhs.scale)))
    return halves(rhs)


FUSED_MOE = FusedMoeOp()
