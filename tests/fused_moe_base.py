"""The tests every fused_moe backend passes (`FusedMoeBackendTests`), each against the float64 references at
tiny shapes (interpret-mode Pallas backends run them too).

A backend's test class subclasses the base and names the backend (`backend = "tiled"`); optional hooks:
`dtypes`, `shapes`, `max_configs`, `invalid_configs(problem)` (configs it must reject), `quantized` (whether
it runs QArray weights; the op falls back otherwise). Semantics checked (`kernels/fused_moe/base.py`): both
kernels in both directions, with and without the gated epilogue, on a whole layer and on an expert-parallel
shard whose rows outside the shard hold NaN (h) and out-of-range tokens (rows) that must never be read, the
combine's zero-weight rule (0 x NaN = NaN unless skip_zero_weights), QArray weights, and weight parts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune.core.errors import InvalidConfigError
from moe_tune.kernels import get_op
from moe_tune.kernels.fused_moe.base import concatenated
from moe_tune.kernels.fused_moe.reference import gather_gmm_reference, gmm_combine_reference, local_row_range
from moe_tune.kernels.ragged_dot.metadata import select_shard

# Error allowed relative to max|reference|, by dtype.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
CASES = [  # (stage, direction, glu, ep)
    ("dispatch", "fwd", "silu", 1), ("dispatch", "fwd", None, 2), ("dispatch", "bwd", "silu", 2),
    ("combine", "fwd", None, 1), ("combine", "fwd", None, 2), ("combine", "bwd", None, 2),
]


def relative_error(out, expected) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    if out.shape != expected.shape:
        return float("inf")
    same_nan = np.array_equal(np.isnan(out), np.isnan(expected))
    if not same_nan:
        return float("inf")
    scale = max(float(np.nanmax(np.abs(expected), initial=0.0)), 1e-30)
    return float(np.nanmax(np.abs(out - expected), initial=0.0)) / scale


class FusedMoeBackendTests:
    backend: ClassVar[str]
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)  # beyond float32, which every case runs
    # (tokens, top_k, k, n, experts): k, n multiples of 128 suit the Pallas tiles
    shapes: ClassVar[tuple[tuple[int, ...], ...]] = ((16, 2, 128, 256, 4),)
    max_configs: ClassVar[int] = 2  # configs of the search space run (default first), in the float32 cases
    quantized: ClassVar[bool] = True

    @property
    def op(self):
        return get_op("fused_moe")

    @property
    def impl(self):
        return self.op.backends.get(self.backend)

    def invalid_configs(self, problem) -> list[Any]:
        return []

    def _problem(self, shape, stage, direction, glu, ep, dtype, **quant):
        tokens, top_k, k, n, experts = shape
        return self.op.problem(tokens=tokens, top_k=top_k, k=k, n=n, groups=experts // ep, ep=ep, stage=stage,
                               direction=direction, glu=glu, dtype=dtype, **quant)

    def _check(self, problem, configs=None, seed=0):
        inputs = self.op.make_inputs(problem, "balanced", seed)
        expected = self.op.reference(problem, inputs)
        device = jax.device_put(inputs)
        for config in (configs or self.impl.search_space(problem)[:self.max_configs]):
            out = jax.jit(lambda a, c=config: self.op.run(self.impl, c, problem, a))(device)
            error = relative_error(out, expected)
            assert error <= TOLERANCE[problem.dtype], (problem, config, error)

    @pytest.mark.parametrize("stage,direction,glu,ep", CASES)
    def test_matches_reference(self, stage, direction, glu, ep):
        for shape in self.shapes:
            self._check(self._problem(shape, stage, direction, glu, ep, "float32"))

    @pytest.mark.parametrize("stage,direction,glu,ep", [CASES[0], CASES[4]])
    def test_low_precision(self, stage, direction, glu, ep):
        """Each of `dtypes` with the default config: the gated dispatch and a shard's combine."""
        for dtype in self.dtypes:
            problem = self._problem(self.shapes[0], stage, direction, glu, ep, dtype)
            self._check(problem, [self.impl.default_config(problem)])

    def test_quantized_weights(self):
        shape = self.shapes[0]
        problem = self._problem(shape, "dispatch", "fwd", "silu", 1, "float32", rhs_quant="int8")
        if not self.quantized or self.impl.config_error(self.impl.default_config(problem), problem):
            pytest.skip(f"{self.backend} does not run QArray weights (the op falls back)")
        self._check(problem, [self.impl.default_config(problem)])

    @pytest.mark.parametrize("skip", [False, True])
    def test_zero_weight_rows_follow_the_gather_reduce_rules(self, skip):
        """A valid row of weight 0 whose h is NaN: NaN in its token unless skip_zero_weights drops it."""
        tokens, top_k, k, n, experts = self.shapes[0]
        rng = np.random.default_rng(3)
        m = tokens * top_k
        sizes = np.full(experts, m // experts, np.int32)
        rows = np.concatenate([np.sort(rng.choice(tokens, s, replace=False)) for s in sizes]).astype(np.int32)
        h = rng.standard_normal((m, k)).astype(np.float32)
        weights = rng.random(m).astype(np.float32)
        h[5], weights[5] = np.nan, 0.0
        rhs = (rng.standard_normal((experts, k, n)) / np.sqrt(k)).astype(np.float32)
        problem = self._problem(self.shapes[0], "combine", "fwd", None, 1, "float32")
        config = self.impl.default_config(problem)
        out = self.impl.gmm_combine(jnp.asarray(h), jnp.asarray(rhs), jnp.asarray(sizes), jnp.asarray(rows),
                                    jnp.asarray(weights), tokens=tokens, config=config, out_dtype=jnp.float32,
                                    skip_zero_weights=skip)
        expected = gmm_combine_reference(h, rhs, sizes, rows, weights, tokens=tokens, skip_zero_weights=skip)
        assert np.isnan(np.asarray(out)[rows[5]]).all() != skip
        assert relative_error(out, expected) <= TOLERANCE["float32"]

    def test_out_of_range_offset_selects_no_row(self):
        """A traced group_offset past the groups (normalized by select_shard): every output row zero."""
        tokens, top_k, k, n, experts = self.shapes[0]
        rng = np.random.default_rng(4)
        m, local = tokens * top_k, experts // 2
        sizes, offset = select_shard(jnp.full((experts,), m // experts, jnp.int32), jnp.int32(experts), m=m,
                                     groups=local)
        x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal((local, k, n)), jnp.float32)
        problem = self._problem(self.shapes[0], "dispatch", "fwd", None, 2, "float32")
        out = self.impl.gather_gmm(x, jnp.zeros((m,), jnp.int32), rhs, sizes, config=self.impl.default_config(problem),
                                   out_dtype=jnp.float32, group_offset=offset)
        assert not np.asarray(out).any()

    @pytest.mark.parametrize("direction,glu,ep,quant", [
        ("fwd", "silu", 1, {}), ("fwd", None, 2, {}), ("bwd", "silu", 2, {}),
        ("fwd", None, 1, {"rhs_quant": "int8"}), ("bwd", None, 1, {"rhs_quant": "float8_e4m3fn", "quant_block": 64})])
    def test_weight_parts_stand_for_their_concatenation(self, direction, glu, ep, quant):
        """The dispatch's inputs hold gate and up as two arrays, as `moe_mlp` passes them; run on them (read
        where they are with `split_weights`, else concatenated by `takes`) and on their concatenation, each
        gives the float64 reference: with and without glu, the backward (the parts split the contraction), on
        a shard, with int8 and float8 weights (values and scales split alike), each with the default config."""
        problem = self._problem(self.shapes[0], "dispatch", direction, glu, ep, "float32", **quant)
        if quant and (not self.quantized or self.impl.config_error(self.impl.default_config(problem), problem)):
            pytest.skip(f"{self.backend} does not run QArray weights (the op falls back)")
        inputs = jax.device_put(self.op.make_inputs(problem, "balanced", 5))  # the dispatch's: (gate, up)
        assert problem.rhs_parts == 2 and len(inputs["rhs"]) == 2
        expected = self.op.reference(problem, inputs)
        config = self.impl.default_config(problem)
        for rhs in (inputs["rhs"], concatenated(list(inputs["rhs"]))):
            out = jax.jit(lambda a: self.op.run(self.impl, config, problem, a))({**inputs, "rhs": rhs})
            assert relative_error(out, expected) <= TOLERANCE["float32"], (problem, config, type(rhs))

    def test_rejects_invalid_configs(self):
        problem = self._problem(self.shapes[0], "dispatch", "fwd", "silu", 1, "float32")
        for config in self.invalid_configs(problem):
            assert self.impl.config_error(config, problem) is not None
            with pytest.raises(InvalidConfigError):
                self.impl.coerce_config(config, problem)

    def test_search_space_is_valid_and_starts_with_the_default(self):
        problem = self._problem(self.shapes[0], "combine", "fwd", None, 1, "float32")
        space = self.impl.search_space(problem)
        assert space[0] == self.impl.default_config(problem)
        assert all(self.impl.config_error(c, problem) is None for c in space)


def assert_lowered_without_concatenated_weights(platform: str, backend: str, config, kernel_call: str, *, f: int,
                                                local: int, tokens: int, m: int, total: int, k: int) -> None:
    """The dispatch's forward and backward (glu silu, shard offset 1) on gate and up, bf16 [local, k, f] each,
    lowered for `platform` (the chip's kernels, not interpret mode): no [local, k, 2f] weights concatenate,
    and at least two calls of the chip's kernels (`kernel_call`, a text of the module)."""
    from ragged_dot_base.lowering import export_for

    from moe_tune.kernels.fused_moe.op import gather_gmm

    S = jax.ShapeDtypeStruct
    part = S((local, k, f), jnp.bfloat16)

    def step(x, rows, sizes, g, u):
        loss = lambda x, g, u: jnp.sum(gather_gmm(x, rows, (g, u), sizes, group_offset=1, glu="silu",
                                                  backend=backend, config={"fwd": config, "bwd": config})
                                       .astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(x, g, u)

    text = export_for(platform, step, S((tokens, k), jnp.bfloat16), S((m,), jnp.int32), S((total,), jnp.int32),
                      part, part).mlir_module()
    concatenates = [line for line in text.splitlines() if "stablehlo.concatenate" in line
                    and f"tensor<{local}x{k}x{2 * f}xbf16>" in line]
    assert not concatenates, concatenates
    assert text.count(kernel_call) >= 2


def assert_parts_vjp_matches_float64(backend: str, config, rows: np.ndarray, sizes: np.ndarray, x: np.ndarray,
                                     gate: np.ndarray, up: np.ndarray, cot: np.ndarray, *, local: int) -> None:
    """d/d(x, gate, up) of sum(cot * gather_gmm(x, rows, (gate, up), glu=silu)) on a shard (group_offset 1),
    through the op's custom VJP on `backend`, against the float64 chain rule: the forward runs the dispatch
    without glu on the parts, the backward's dx the combine over [gate | up]^T, each weight's gradient per part.
    x float32 [tokens, k]; gate, up float32 [local, k, f]; cot float32 [m, f]; rows int32 [m]."""
    from moe_tune.kernels.fused_moe.op import gather_gmm

    (tokens, _), f, m = x.shape, gate.shape[2], rows.shape[0]
    loss = lambda x, g, u: jnp.sum(cot * gather_gmm(x, jnp.asarray(rows), (g, u), jnp.asarray(sizes), group_offset=1,
                                                    glu="silu", backend=backend,
                                                    config={"fwd": config, "bwd": config}))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, gate, up)
    w = np.concatenate([gate, up], axis=2).astype(np.float64)
    clipped = np.clip(rows, 0, tokens - 1)
    h = gather_gmm_reference(x, clipped, w, sizes, group_offset=1)
    sigmoid = 1.0 / (1.0 + np.exp(-h[:, :f]))
    act, act_grad = h[:, :f] * sigmoid, sigmoid * (1.0 + h[:, :f] * (1.0 - sigmoid))
    c = cot.astype(np.float64)
    dh = np.concatenate([c * h[:, f:] * act_grad, c * act], axis=1)
    ranges, start, end = local_row_range(sizes, m, local, 1)
    dh[:start] = dh[end:] = 0.0
    dx = gmm_combine_reference(dh, w, sizes, rows, np.ones(m), tokens=tokens, group_offset=1, transpose_rhs=True)
    dw = np.zeros_like(w)
    for g, (s, e) in enumerate(ranges):
        dw[g] = x[clipped[s:e]].astype(np.float64).T @ dh[s:e]
    for out, ref in zip(got, (dx, dw[:, :, :f], dw[:, :, f:])):
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-5 * np.abs(ref).max(), rtol=2e-5)
