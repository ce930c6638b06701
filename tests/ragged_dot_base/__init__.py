"""The tests every ragged_dot backend inherits: `RaggedDotBackendTests`.

A backend's test class subclasses the base once and names the backend; everything below then runs for it:

    class TestMine(RaggedDotBackendTests):
        backend = "mine"                  # its registered name
        backend_instance = MyRaggedDot()  # only for a backend not in the registry (registered per test)

What it gets, each checked against a float64 reference at small shapes (Pallas backends run in interpret
mode off their chip):
- float modes: float32 and bfloat16 inputs (plus `extra_dtypes`), mixed input / output dtypes, fixed cases
  (empty groups, rows past sum(group_sizes), sum(group_sizes) > m, expert-parallel shards via
  group_offset), dimension edge cases, random problems (hypothesis), jit, vmap, bad inputs and configs;
- the gradients through the public op's custom VJP (dlhs, drhs), per-direction configs;
- quantized operands (`moe_tune.QArray`) in every direction, at the kernel (`Backend.run`): int8 per
  channel, int8 / float8_e4m3fn in sub-channel blocks, lhs and rhs quantized (w8a8), group_offset shards
  with sliced weights; and through the public op with its gradients. A mode whose problem the backend
  cannot run (its default config's `config_error`) is skipped with that reason, as the op falls back;
- lowering for its native chips (`platforms`; cpu only when it has no other), through `jax.export` with
  `moe_tune.devices.platform` patched: float, mixed-dtype, group_offset and quantized problems in every
  direction; where `kernel_calls` names the chip's custom call, exactly one such call, holding the 1-byte
  operand for quantized problems.

A subclass tunes the cost (`k`, `n`, `max_*`, `max_examples`, `sampled_configs`, `quant_shard_directions`)
and the configs tried (`extra_configs`, `quantized_configs`), and lists the configs its backend must reject
(`invalid_configs`). Backend-specific tests stay in the subclass's own file.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_tune
from moe_tune.errors import InvalidConfigError, UsageError
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem, ragged_dot_reference
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.reference import ragged_dot_dlhs_reference, ragged_dot_drhs_reference
from moe_tune.quant import QArray, dequantize_host, quantize

DIRECTIONS = ("fwd", "dlhs", "drhs")  # gmm, gmm(transpose_rhs=True), tgmm

# Error allowed relative to max|reference|, by the output dtype (inputs are exact in the reference, and
# low-precision inputs are promised float32 accumulation, so only the output's rounding is forgiven).
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}
# Gradients (dlhs, drhs; returned in the input dtype): with float32 accumulation only the output's rounding
# is left (2**-9 of a value for bfloat16), ~0.002-0.003 of max|ref| at the fixed cases' sizes, so 5e-3 leaves
# a margin and still fails a kernel that sums its partial products in bfloat16
# (`TestTiled.test_bfloat16_gradients_accumulate_in_float32` shows the two errors it separates).
GRAD_TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 5e-3}
# Quantized operands: the integer (or float8) products are exact and accumulation is float32.
QUANT_TOLERANCE = 2e-6


# --------------------------------------------------------------------------------------------------------
# Float operands


def make_operands(m: int, k: int, n: int, groups: int, dtype: str, seed: int) -> tuple[jax.Array, jax.Array]:
    """lhs [m, k] and rhs [groups, k, n] in `dtype`, normal, rhs scaled so that outputs are O(1)."""
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((m, k), np.float32)
    rhs = rng.standard_normal((groups, k, n), np.float32) / np.sqrt(k)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)


def local_rows(sizes: Any, m: int, groups: int, offset: int) -> np.ndarray:
    """bool [m]: rows that belong to local groups [offset, offset + groups) (plain Python, ends clipped)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), m)
    starts = np.concatenate([[0], ends[:-1]])
    mask = np.zeros(m, bool)
    for g in range(offset, offset + groups):
        mask[starts[g]:ends[g]] = True
    return mask


def assert_matches_reference(out: jax.Array, lhs: jax.Array, rhs: jax.Array, sizes: Any, *, offset: int | None,
                             out_dtype: str, what: str = "") -> None:
    """`out` has the forward's shape and dtype, is zero on rows of no local group, and is within
    TOLERANCE[out_dtype] x max|reference| of the float64 reference elsewhere."""
    m, n = lhs.shape[0], rhs.shape[2]
    groups = rhs.shape[0]
    assert out.shape == (m, n), what
    assert out.dtype == jnp.dtype(out_dtype), what
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), f"non-finite output {what}"
    ref = ragged_dot_reference(
        np.asarray(lhs.astype(jnp.float32)), np.asarray(rhs.astype(jnp.float32)), np.asarray(sizes),
        group_offset=offset or 0,
    )
    mine = local_rows(sizes, m, groups, offset or 0)
    # Rows outside the local groups (other shards' rows, rows past sum(group_sizes)) are exactly zero.
    outside = got[~mine]
    assert np.all(outside == 0), f"{np.count_nonzero(outside)} non-zero values in rows of no local group {what}"
    scale = np.abs(ref).max()
    if scale == 0:
        assert np.all(got == 0), what
        return
    err = np.abs(got - ref).max() / scale
    assert err <= TOLERANCE[out_dtype], f"max error {err:.3g} x max|ref| > {TOLERANCE[out_dtype]} {what}"


def sizes_from_cuts(used: int, cuts: list[int]) -> list[int]:
    """Group sizes of `used` rows cut at `cuts` (one more group than cuts; empty groups where cuts repeat)."""
    bounds = [0, *sorted(cuts), used]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


# Fixed cases: (m, group_sizes, shard) where shard is None or (group_offset, local groups).
CASES = {
    "uneven": (37, [3, 20, 1, 13], None),
    "empty_first_and_last": (40, [0, 15, 25, 0], None),
    "empty_middle": (40, [10, 0, 0, 30], None),
    "one_group_holds_all_rows": (40, [0, 40, 0], None),
    "single_group": (29, [29], None),
    "sum_below_m": (48, [5, 7, 3], None),
    "all_groups_empty": (24, [0, 0, 0], None),
    "m_not_tile_multiple": (45, [11, 17, 17], None),
    "shard_middle": (40, [6, 9, 0, 12, 13], (1, 3)),
    "shard_first": (40, [6, 9, 0, 12, 13], (0, 2)),
    "shard_last_sum_below_m": (40, [6, 9, 0, 12, 10], (3, 2)),
    "shard_of_empty_groups": (40, [20, 0, 0, 20], (1, 2)),
    # sum(group_sizes) > m: a UsageError when the sizes are known; traced (under jit), group ends are clipped at
    # m, as in the reference
    "sum_above_m_is_clipped": (40, [30, 30, 5], None),
}
GRAD_CASES = ("uneven", "empty_first_and_last", "sum_below_m", "shard_middle", "one_group_holds_all_rows")
# (m, k, n, group_sizes, shard, dtype, preferred_element_type): what the few hypothesis examples of the slow
# backends would have to find
EDGE_CASES = {
    "all_dims_1": (1, 1, 1, [1], None, "float32", None),
    "k_is_1": (6, 1, 5, [2, 0, 4], None, "float32", None),
    "n_is_1": (9, 7, 1, [0, 9], None, "bfloat16", "float32"),
    "m_is_1_of_a_shard": (1, 3, 2, [0, 1, 0], (1, 2), "float32", "bfloat16"),
    "odd_dims_shard_with_rows_past_the_sum": (33, 131, 129, [4, 10, 0, 11], (1, 2), "bfloat16", None),
}


# --------------------------------------------------------------------------------------------------------
# Quantized operands: each direction takes its quantized operand as the op passes it: fwd = gmm(lhs, rhs_q)
# (weight-only, or lhs_q x rhs_q), dlhs = gmm(dout, rhs_q, transpose_rhs=True), drhs = tgmm(lhs_q, dout).


QM, QK, QN = 40, 32, 24
QSIZES = [9, 0, 23, 3]  # an empty group; rows 35..39 are past sum(group_sizes)
Q_SHARD_SIZES, Q_SHARD = [6, 9, 0, 14, 8], (1, 3)  # groups [1, 4) of 5 (group_offset, local groups)


@dataclasses.dataclass(frozen=True)
class QuantMode:
    """A direction and how its operands are quantized: a block is None (float operand), "k" (one scale per
    row / channel) or the sub-channel block along k; `qdtype` is the stored dtype of both."""

    direction: str
    lhs_block: int | str | None
    rhs_block: int | str | None
    qdtype: str = "int8"


# float8_e4m3fn for weight-only sub-channel (a float lhs meets fp8 weights) and for per-row x sub-channel
# (fp8 x fp8, which meets in bfloat16); int8 elsewhere (int8 x int8 accumulates in int32). The conversions
# are the same code for every mode, so each dtype path runs once per backend.
QUANT_MODES = {
    "fwd_weight_per_channel": QuantMode("fwd", None, "k"),
    "fwd_weight_sub_channel_fp8": QuantMode("fwd", None, 8, "float8_e4m3fn"),
    "fwd_w8a8_rows_x_sub_channel_fp8": QuantMode("fwd", "k", 8, "float8_e4m3fn"),
    "fwd_w8a8_sub_channel": QuantMode("fwd", 8, 16),
    "dlhs_weight_per_channel": QuantMode("dlhs", None, "k"),
    "dlhs_weight_sub_channel": QuantMode("dlhs", None, 8),
    "drhs_lhs_per_row": QuantMode("drhs", "k", None),
    "drhs_lhs_sub_channel": QuantMode("drhs", 8, None),
}


def quantized(x: Any, block: int | str | None, qdtype: str) -> jax.Array | QArray:
    """`x` as a float array (block None) or quantized along k (axis 1) in `block`s ("k": the whole axis)."""
    if block is None:
        return jnp.asarray(x)
    return quantize(jnp.asarray(x), qdtype, axis=1, block_size=None if block == "k" else block)


def as_f64(x: Any) -> np.ndarray:
    """float64 values of an array or (exactly dequantized) QArray."""
    return dequantize_host(x) if isinstance(x, QArray) else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def make_quant_case(mode: QuantMode, *, sizes: list[int] = QSIZES, groups: int | None = None, seed: int = 0
                    ) -> tuple[RaggedDotProblem, Any, Any]:
    """(problem, a, b): the direction's two operands, quantized as `mode` says, and its problem."""
    groups = len(sizes) if groups is None else groups
    rng = np.random.default_rng(seed)
    lhs = quantized(rng.standard_normal((QM, QK), np.float32), mode.lhs_block, mode.qdtype)
    rhs = quantized(rng.standard_normal((groups, QK, QN), np.float32) / np.sqrt(QK), mode.rhs_block, mode.qdtype)
    dout = jnp.asarray(rng.standard_normal((QM, QN), np.float32))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    offset = None if groups == len(sizes) else jnp.int32(0)
    problem = RaggedDotProblem.from_arrays(lhs, rhs, group_sizes, group_offset=offset, direction=mode.direction)
    a, b = {"fwd": (lhs, rhs), "dlhs": (dout, rhs), "drhs": (lhs, dout)}[mode.direction]
    return problem, a, b


def direction_reference(problem: RaggedDotProblem, a: Any, b: Any, sizes: Any, offset: int = 0) -> np.ndarray:
    """float64 result of `problem.direction` on its two operands (QArrays dequantized exactly)."""
    a, b, sizes = as_f64(a), as_f64(b), np.asarray(sizes)
    if problem.direction == "dlhs":
        return ragged_dot_dlhs_reference(a, b, sizes, group_offset=offset)
    if problem.direction == "drhs":
        return ragged_dot_drhs_reference(a, b, sizes, groups=problem.groups, group_offset=offset)
    return ragged_dot_reference(a, b, sizes, group_offset=offset)


def assert_quant_close(got: Any, ref: np.ndarray, what: str = "") -> None:
    """Within QUANT_TOLERANCE x max|ref| (float32 accumulation of exact products)."""
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, what
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(got - ref).max() / scale
    assert err <= QUANT_TOLERANCE, f"max error {err:.3g} x max|ref| {what}"


# --------------------------------------------------------------------------------------------------------
# Lowering for a chip this machine does not have: `jax.export` runs the real Pallas -> Mosaic / Triton
# lowering with no device and executes nothing (all arguments are `jax.ShapeDtypeStruct`). Interpret mode
# skips the chip's lowering rules (Mosaic's 8 x 128 block tiling, Triton's power-of-two arrays and one
# operand type per `tl.dot`, ...), so a kernel can pass every interpret-mode test and still not compile.


S = jax.ShapeDtypeStruct
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "tpu_custom_call"
KERNEL_CALLS = (MOSAIC_CALL, TRITON_CALL)
# devices.platform() name -> (jax.export platform, checks to disable). The Triton call is not on
# jax.export's list of custom calls with stable compatibility guarantees.
CHIPS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tpu": ("tpu", ()),
    "gpu": ("cuda", (jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL),)),
    "cpu": ("cpu", ()),
}
# float shapes: m not a multiple of any tile (row padding), n = 3 * 128 (a ragged last column tile).
LOWER_M, LOWER_K, LOWER_N, LOWER_GROUPS = 500, 256, 384, 4


def export_for(platform: str, fn: Callable, *args: Any) -> jax.export.Exported:
    """Lower `fn` for `platform` (a devices.platform() name). `fn` must be a fresh function: jit's trace
    cache is keyed on it, not on the patched platform."""
    target, disabled = CHIPS[platform]
    return jax.export.export(jax.jit(fn), platforms=[target], disabled_checks=disabled)(*args)


def kernel_call_lines(exported: jax.export.Exported, platform: str, call: str | None, what: str) -> list[str]:
    """The module targets the chip and holds exactly one call of `call` (the compiled kernel, not the kernel
    inlined as plain HLO, which is what interpret mode lowers to) and no other kernel's call; with `call`
    None, no kernel call at all. Returns the lines of that call."""
    assert exported.platforms == (CHIPS[platform][0],), what
    text = exported.mlir_module()
    for other in KERNEL_CALLS:
        if other != call:
            assert other not in text, f"{what}: a call of {other}"
    if call is None:
        return []
    calls = [line for line in text.splitlines() if f"stablehlo.custom_call @{call}(" in line]
    assert len(calls) == 1, f"{what}: {len(calls)} calls of {call}, want 1 (inlined as plain HLO?)"
    return calls


def assert_one_kernel_call(exported: jax.export.Exported, platform: str, what: str) -> str:
    """The module holds one call of the chip's kernel (Mosaic on tpu, Triton on gpu); returns its line."""
    return kernel_call_lines(exported, platform, {"tpu": MOSAIC_CALL, "gpu": TRITON_CALL}[platform], what)[0]


def assert_triton_params(call: str, config: KernelConfig, name: str, what: str) -> None:
    """The config's launch parameters reached the Triton call."""
    assert f'name = "{name}"' in call, what
    assert f"num_warps = {config.num_warps} : i32" in call, what
    if hasattr(config, "num_stages"):
        assert f"num_stages = {config.num_stages} : i32" in call, what


def configs_to_lower(backend: Any, problem: Any) -> list[KernelConfig]:
    """The default config, then the smallest and the largest of the search space (by product of fields)."""
    space = backend.search_space(problem)
    rest = sorted(space[1:], key=lambda c: (math.prod(dataclasses.astuple(c)), dataclasses.astuple(c)))
    picked = list(dict.fromkeys([space[0], *rest[:1], *rest[-1:]]))
    for config in picked:
        assert backend.config_error(config, problem) is None, config
    return picked


def direction_call(backend: RaggedDotBackend, problem: RaggedDotProblem, config: KernelConfig, with_offset: bool
                   ) -> tuple[Callable, list[Any]]:
    """A fresh function running `problem.direction` through the backend's gmm / tgmm, and its (abstract)
    float arguments."""
    a_dtype, b_dtype, _ = (jnp.dtype(d) for d in problem.operand_dtypes())
    m, k, n, g = problem.m, problem.k, problem.n, problem.groups
    a_shape, b_shape = {"fwd": ((m, k), (g, k, n)), "dlhs": ((m, n), (g, k, n)), "drhs": ((m, k), (m, n))}[
        problem.direction]
    args = [S(a_shape, a_dtype), S(b_shape, b_dtype), S((problem.num_group_sizes,), jnp.int32)]

    def fn(a, b, group_sizes, group_offset=None):
        return backend.run(problem, config, a, b, group_sizes, group_offset)

    return fn, args + ([S((), jnp.int32)] if with_offset else [])


def output_shape(problem: RaggedDotProblem) -> tuple[int, ...]:
    """The shape of `problem.direction`'s result."""
    m, k, n, g = problem.m, problem.k, problem.n, problem.groups
    return {"fwd": (m, n), "dlhs": (m, k), "drhs": (g, k, n)}[problem.direction]


def quantized_lowering_cases() -> Iterator[tuple[str, RaggedDotProblem, Any, Any, jax.Array]]:
    """(name, problem, a, b, group_sizes) of quantized problems at shapes a chip's kernels tile: weight-only
    and w8a8 (int8 and fp8) forwards, the weights' dlhs and the activations' drhs."""
    m, k, n, g = 256, 512, 256, 4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    d = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    sizes = jnp.asarray([64, 0, 100, 92], jnp.int32)
    w_sub, w_chan = quantize(w, "int8", axis=1, block_size=128), quantize(w, "float8_e4m3fn", axis=1)
    x_row, x_sub = quantize(x, "int8", axis=1), quantize(x, "int8", axis=1, block_size=128)
    x_fp8 = quantize(x, "float8_e4m3fn", axis=1, block_size=128)
    w_fp8 = quantize(w, "float8_e4m3fn", axis=1, block_size=256)
    cases = {"fwd_weight_sub_channel": ("fwd", x, w_sub), "fwd_w8a8": ("fwd", x_row, w_sub),
             "fwd_w8a8_fp8_sub_channel": ("fwd", x_fp8, w_fp8),
             "dlhs_weight_per_channel_fp8": ("dlhs", d, w_chan), "dlhs_weight_sub_channel": ("dlhs", d, w_sub),
             "drhs_lhs_sub_channel": ("drhs", x_sub, d)}
    for name, (direction, a, b) in cases.items():
        lhs, rhs = (a, b) if direction == "fwd" else (x, b) if direction == "dlhs" else (a, w)
        yield name, RaggedDotProblem.from_arrays(lhs, rhs, sizes, direction=direction), a, b, sizes


# --------------------------------------------------------------------------------------------------------
# The shared suite


class RaggedDotBackendTests:
    """Tests every ragged_dot backend passes. Subclasses set `backend` (and `backend_instance` for a backend
    not in the registry) and may override the class attributes and hooks below."""

    backend: ClassVar[str]
    backend_instance: ClassVar[RaggedDotBackend | None] = None  # registered for each test when given
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")  # input dtypes of the parametrized tests
    extra_dtypes: ClassVar[tuple[str, ...]] = ()  # further input dtypes: the random, mixed and lowering tests
    out_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")  # preferred_element_type values it takes
    k: ClassVar[int] = 24  # dims of the fixed cases
    n: ClassVar[int] = 40
    max_m: ClassVar[int] = 200  # hypothesis shapes
    max_k: ClassVar[int] = 96
    max_n: ClassVar[int] = 96
    max_groups: ClassVar[int] = 8
    max_examples: ClassVar[int] = 20
    # Draws the random test leaves out (fixed to these values): the slow backends' few examples go to shapes,
    # group patterns, dtypes and configs, not to the seed or jit.
    fixed_draws: ClassVar[dict[str, Any]] = {}
    sampled_configs: ClassVar[int] = 2  # non-default configs from the search space per fixed case
    fixed_case_extras: ClassVar[int] = 2  # how many `extra_configs` the fixed cases run (the random test: all)
    # Directions of the quantized expert-parallel shard test (the interpret-mode backends drop fwd, whose
    # shard code the float shard cases run).
    quant_shard_directions: ClassVar[tuple[str, ...]] = DIRECTIONS
    # devices.platform() name -> the custom call the backend's compiled kernel lowers to there (Pallas
    # backends: MOSAIC_CALL on tpu, TRITON_CALL on gpu); a chip not named here lowers to plain HLO.
    kernel_calls: ClassVar[Mapping[str, str]] = {}

    @pytest.fixture(autouse=True)
    def _registered(self) -> Iterator[None]:
        """A `backend_instance` is in the op's registry for the duration of each test."""
        if self.backend_instance is None:
            yield
            return
        BACKENDS.register(self.backend_instance)
        try:
            yield
        finally:
            BACKENDS.unregister(self.backend_instance.name)

    # ---- hooks

    @property
    def impl(self) -> RaggedDotBackend:
        """The backend under test, from the op's registry."""
        return BACKENDS.get(self.backend)

    def problem(self, m: int, k: int, n: int, groups: int, dtype: str, out_dtype: str | None = None,
                total_groups: int | None = None) -> RaggedDotProblem:
        """The forward problem of float operands in `dtype` (both), out_dtype defaulting to it."""
        return RaggedDotProblem(
            m=m, k=k, n=n, groups=groups, lhs_dtype=dtype, rhs_dtype=dtype, out_dtype=out_dtype or dtype,
            total_groups=total_groups if total_groups != groups else None,
        )

    def extra_configs(self, problem: RaggedDotProblem) -> list[KernelConfig]:
        """Hand-picked configs outside the search space (still valid) worth running."""
        return []

    def configs(self, problem: RaggedDotProblem) -> list[KernelConfig]:
        """The default plus a deterministic sample of other search-space configs, plus `extra_configs`."""
        space = self.impl.search_space(problem)
        others = space[1:]
        rng = random.Random(str(problem.key_fields()))
        picked = rng.sample(others, min(self.sampled_configs, len(others)))
        return [space[0], *picked, *self.extra_configs(problem)[: self.fixed_case_extras]]

    def invalid_configs(self, problem: RaggedDotProblem) -> list[dict[str, Any]]:
        """Configs (as dicts) this backend must reject for `problem` with InvalidConfigError."""
        return []

    def quantized_configs(self, problem: RaggedDotProblem) -> list[KernelConfig]:
        """Configs the quantized kernel tests run (default: the default config)."""
        return [self.impl.default_config(problem)]

    def unsupported(self, problem: RaggedDotProblem) -> str | None:
        """Why the backend cannot run `problem` (its default config's `config_error`: the op then falls back
        to its plain-JAX backend), else None."""
        return self.impl.config_error(self.impl.default_config(problem), problem)

    def lowering_chips(self) -> list[str]:
        """The chips the backend compiles for natively (devices.platform() names); cpu only when it has no
        other (every other test runs it on this CPU)."""
        return [p for p in self.impl.platforms if p != "cpu"] or ["cpu"]

    # ---- calling

    def call(self, lhs: jax.Array, rhs: jax.Array, sizes: list[int], *, config: Any,
             shard: tuple[int, int] | None = None, out_dtype: str | None = None, jit: bool = False) -> jax.Array:
        """The public op's forward with this backend and `config`; `shard` = (group_offset, local groups)."""
        offset = None if shard is None else jnp.int32(shard[0])
        group_sizes = jnp.asarray(sizes, jnp.int32)

        def f(lhs, rhs, group_sizes, offset):
            return moe_tune.ragged_dot(
                lhs, rhs, group_sizes, preferred_element_type=out_dtype, group_offset=offset,
                backend=self.backend, config=config,
            )

        if jit:
            f = jax.jit(f)
        return f(lhs, rhs, group_sizes, offset)

    def run_case(self, m: int, sizes: list[int], shard: tuple[int, int] | None, dtype: str, *,
                 out_dtype: str | None = None, configs: list[Any] | None = None, jit: bool = False, seed: int = 0,
                 k: int | None = None, n: int | None = None) -> None:
        """Forward of one case through the public op with each config, against the reference."""
        k, n = k or self.k, n or self.n
        groups = len(sizes) if shard is None else shard[1]
        offset = None if shard is None else shard[0]
        lhs, rhs = make_operands(m, k, n, groups, dtype, seed)
        result_dtype = out_dtype or dtype
        problem = self.problem(m, k, n, groups, dtype, result_dtype, total_groups=len(sizes))
        for config in configs if configs is not None else self.configs(problem):
            out = self.call(lhs, rhs, sizes, config=config, shard=shard, out_dtype=out_dtype, jit=jit)
            assert_matches_reference(
                out, lhs, rhs, sizes, offset=offset, out_dtype=result_dtype,
                what=f"[{self.backend} {config} m={m} sizes={sizes} shard={shard} {dtype}->{result_dtype}]",
            )

    def run_quantized(self, problem: RaggedDotProblem, config: KernelConfig, a: Any, b: Any, sizes: Any,
                      offset: jax.Array | None = None) -> jax.Array:
        """One direction of a (quantized) problem through the backend's kernel (`Backend.run`), jitted."""
        assert self.impl.config_error(config, problem) is None, config
        f = jax.jit(lambda a, b, s, o: self.impl.run(problem, config, a, b, s, o))
        return f(a, b, jnp.asarray(sizes, jnp.int32), offset)

    # ---- fixed cases

    @pytest.mark.parametrize("case", list(CASES), ids=str)
    def test_fixed_case(self, case, dtype):
        """Each fixed case (empty groups, rows past the sum, shards) with the sampled configs; sizes summing
        past m only under jit (traced), as known ones are a UsageError."""
        m, sizes, shard = CASES[case]
        self.run_case(m, sizes, shard, dtype, jit=sum(sizes) > m)

    def test_low_precision_in_float32_out(self):
        """Low-precision inputs with preferred_element_type=float32."""
        low = [d for d in (*self.dtypes, *self.extra_dtypes) if d != "float32"]
        assert low, "every backend takes some low-precision input"
        for dtype in low:
            self.run_case(37, [3, 20, 1, 13], None, dtype, out_dtype="float32")

    def test_float32_in_bfloat16_out(self):
        """float32 inputs with a bfloat16 output, whole and as a shard."""
        if "bfloat16" not in self.out_dtypes:
            pytest.skip(f"{self.backend} has no bfloat16 output")
        self.run_case(37, [3, 20, 1, 13], None, "float32", out_dtype="bfloat16")
        self.run_case(40, [6, 9, 0, 12, 13], (1, 3), "float32", out_dtype="bfloat16")

    def test_default_output_dtype_is_the_promoted_input_dtype(self, dtype):
        """Without preferred_element_type the output has the inputs' dtype."""
        lhs, rhs = make_operands(16, self.k, self.n, 2, dtype, 0)
        out = moe_tune.ragged_dot(lhs, rhs, jnp.asarray([9, 7], jnp.int32), backend=self.backend)
        assert out.dtype == jnp.dtype(dtype)

    def test_default_config_via_lookup(self, dtype):
        """config=None resolves a config (table or heuristic default) and still computes the right thing."""
        sizes = [3, 20, 1, 13]
        lhs, rhs = make_operands(37, self.k, self.n, 4, dtype, 3)
        out = moe_tune.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), backend=self.backend)
        assert_matches_reference(out, lhs, rhs, sizes, offset=None, out_dtype=dtype)

    def test_config_as_dict(self):
        """A config given as a dict of its fields."""
        problem = self.problem(37, self.k, self.n, 4, "float32")
        config = self.configs(problem)[-1]
        self.run_case(37, [3, 20, 1, 13], None, "float32", configs=[config.to_dict()])

    def test_search_space_configs(self, dtype):
        """The search space is valid, default first, no duplicates; a sample of it gives the right answer."""
        m, sizes = 45, [11, 0, 17, 9]
        problem = self.problem(m, self.k, self.n, len(sizes), dtype)
        space = self.impl.search_space(problem)
        assert space[0] == self.impl.default_config(problem)
        assert len(set(space)) == len(space)
        for config in space:
            assert self.impl.config_error(config, problem) is None, config
        sample = [space[0], *random.Random(1).sample(space[1:], min(3, len(space) - 1))]
        self.run_case(m, sizes, None, dtype, configs=sample)

    # ---- jit

    def test_under_jit(self, dtype):
        """A shard and a case with empty first and last groups under jit."""
        m, sizes, shard = CASES["shard_middle"]
        self.run_case(m, sizes, shard, dtype, jit=True)
        m, sizes, shard = CASES["empty_first_and_last"]
        self.run_case(m, sizes, shard, dtype, jit=True)

    def test_jit_traces_once_for_new_sizes_and_offsets(self):
        """group_sizes and group_offset are traced: new values reuse the compiled function and stay right."""
        m, k, n, groups = 40, self.k, self.n, 2
        lhs, rhs = make_operands(m, k, n, groups, "float32", 7)
        config = self.configs(self.problem(m, k, n, groups, "float32", total_groups=5))[0]
        traces = []

        @jax.jit
        def f(lhs, rhs, group_sizes, offset):
            traces.append(1)
            return moe_tune.ragged_dot(
                lhs, rhs, group_sizes, group_offset=offset, backend=self.backend, config=config
            )

        shards = [([6, 9, 0, 12, 13], 1), ([0, 0, 20, 20, 0], 2), ([40, 0, 0, 0, 0], 3), ([1, 2, 3, 4, 5], 0)]
        for sizes, offset in shards:
            out = f(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.int32(offset))
            assert_matches_reference(
                out, lhs, rhs, sizes, offset=offset, out_dtype="float32", what=f"{sizes} @ {offset}"
            )
        assert len(traces) == 1

    # ---- gradients (the custom VJP: dlhs and drhs directions)

    def direction_configs(self, problem: RaggedDotProblem) -> list[dict[str, KernelConfig] | None]:
        """Config mappings to differentiate with: all looked up (None), and one sampled per direction."""
        rng = random.Random(str(problem.key_fields()))
        sampled = {d: rng.choice(self.impl.search_space(problem.with_direction(d))) for d in DIRECTIONS}
        return [None, sampled]

    def check_grads(self, m: int, sizes: list[int], shard: tuple[int, int] | None, dtype: str, *, seed: int = 0,
                    jit: bool = True, k: int | None = None, n: int | None = None,
                    configs: list[Any] | None = None) -> None:
        """Both gradients through the public op (its custom VJP) with each config mapping, against the
        float64 dlhs / drhs references; rows outside the local groups get no gradient."""
        k, n = k or self.k, n or self.n
        groups = len(sizes) if shard is None else shard[1]
        offset = None if shard is None else shard[0]
        lhs, rhs = make_operands(m, k, n, groups, dtype, seed)
        cot = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((m, n)) / np.sqrt(n), dtype)
        problem = self.problem(m, k, n, groups, dtype, total_groups=len(sizes))
        a32 = lambda x: np.asarray(x.astype(jnp.float32))
        ref_dlhs = ragged_dot_dlhs_reference(a32(cot), a32(rhs), np.asarray(sizes), group_offset=offset or 0)
        ref_drhs = ragged_dot_drhs_reference(a32(lhs), a32(cot), np.asarray(sizes), groups=groups,
                                             group_offset=offset or 0)
        for config in self.direction_configs(problem) if configs is None else configs:
            def loss(x, w):
                out = moe_tune.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), backend=self.backend, config=config,
                                          group_offset=None if offset is None else jnp.int32(offset))
                return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

            grad = jax.grad(loss, argnums=(0, 1))
            dlhs, drhs = (jax.jit(grad) if jit else grad)(lhs, rhs)
            what = f"[{self.backend} {config} m={m} sizes={sizes} shard={shard} {dtype}]"
            assert dlhs.shape == lhs.shape and dlhs.dtype == lhs.dtype, what
            assert drhs.shape == rhs.shape and drhs.dtype == rhs.dtype, what
            for name, got, ref in (("dlhs", dlhs, ref_dlhs), ("drhs", drhs, ref_drhs)):
                got = np.asarray(got.astype(jnp.float32), np.float64)
                scale = max(np.abs(ref).max(), 1e-30)
                err = np.abs(got - ref).max() / scale if np.abs(ref).max() > 0 else np.abs(got).max()
                assert err <= GRAD_TOLERANCE[dtype], f"{name} error {err:.3g} > {GRAD_TOLERANCE[dtype]} {what}"
            # rows outside the local groups get no gradient
            assert np.all(np.asarray(dlhs)[~local_rows(sizes, m, groups, offset or 0)] == 0), what

    @pytest.mark.parametrize("case", GRAD_CASES, ids=str)
    def test_grad_matches_reference(self, case, dtype):
        """dlhs and drhs through the op's custom VJP, looked up and sampled per direction."""
        m, sizes, shard = CASES[case]
        self.check_grads(m, sizes, shard, dtype)

    def test_per_direction_configs_are_the_ones_that_run(self, caplog):
        """config={"fwd", "dlhs", "drhs"}: each direction's trace logs its own entry, given by the caller (not
        the lookup's), and an invalid dlhs or drhs entry is an InvalidConfigError once the backward is traced
        (the forward alone does not read it). Traced only (make_jaxpr): nothing runs."""
        m, sizes = 37, [3, 20, 1, 13]
        lhs, rhs = make_operands(m, self.k, self.n, len(sizes), "float32", 0)
        group_sizes = jnp.asarray(sizes, jnp.int32)
        problem = self.problem(m, self.k, self.n, len(sizes), "float32")

        def trace(config, grad=True):
            loss = lambda x, w: moe_tune.ragged_dot(x, w, group_sizes, backend=self.backend, config=config).sum()
            jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)) if grad else loss)(lhs, rhs)

        # the last config of each direction's space: not the default, where the space has another one
        given = {d: self.impl.search_space(problem.with_direction(d))[-1] for d in DIRECTIONS}
        caplog.set_level(logging.INFO, logger="moe_tune")
        trace(given)
        logged = {}
        for record in caplog.records:
            message = record.getMessage()
            if message.startswith("ragged_dot {'direction': "):
                logged[message.split("'")[3]] = message
        assert set(logged) == set(DIRECTIONS), logged
        for direction, config in given.items():
            assert f"backend {self.backend}, config {config.label()} (given by the caller)" in logged[direction], (
                direction, logged[direction])

        for direction in ("dlhs", "drhs"):
            bad = self.invalid_configs(problem.with_direction(direction))
            if self.impl.tunables():
                assert bad, "a backend with tunables lists invalid configs"
            for fields in bad[:2]:
                trace({direction: fields}, grad=False)  # the forward does not use it
                with pytest.raises(InvalidConfigError):
                    trace({direction: fields})

    def test_grad_without_jit(self):
        """The gradients outside jit (eager custom VJP)."""
        m, sizes, shard = CASES["uneven"]
        self.check_grads(m, sizes, shard, "float32", jit=False)

    def test_vmap_forward_and_grad(self):
        """A batch of independent ragged dots (e.g. per microbatch), each with its own group sizes."""
        m, k, n, groups = 32, self.k, self.n, 3
        batch_sizes = [[10, 0, 22], [32, 0, 0], [5, 5, 5]]
        lhs, rhs = make_operands(m, k, n, groups, "float32", 11)
        lhs_b = jnp.stack([lhs, 2 * lhs, -lhs])
        sizes_b = jnp.asarray(batch_sizes, jnp.int32)
        f = lambda x, s: moe_tune.ragged_dot(x, rhs, s, backend=self.backend)
        out = jax.jit(jax.vmap(f))(lhs_b, sizes_b)
        for i, sizes in enumerate(batch_sizes):
            assert_matches_reference(out[i], lhs_b[i], rhs, sizes, offset=None, out_dtype="float32", what=f"vmap {i}")
        grads = jax.jit(jax.vmap(jax.grad(lambda x, s: f(x, s).sum())))(lhs_b, sizes_b)
        for i, sizes in enumerate(batch_sizes):
            ref = ragged_dot_dlhs_reference(np.ones((m, n)), np.asarray(rhs), np.asarray(sizes))
            assert np.abs(np.asarray(grads[i]) - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1.0), f"vmap grad {i}"

    # ---- dimension edge cases

    @pytest.mark.parametrize("case", list(EDGE_CASES), ids=str)
    def test_dimension_edge_cases(self, case):
        """Dims of 1, odd dims, a one-row shard, with the default config under jit."""
        m, k, n, sizes, shard, dtype, out_dtype = EDGE_CASES[case]
        groups = len(sizes) if shard is None else shard[1]
        problem = self.problem(m, k, n, groups, dtype, out_dtype, total_groups=len(sizes))
        self.run_case(m, sizes, shard, dtype, out_dtype=out_dtype, configs=[self.impl.default_config(problem)],
                      jit=True, k=k, n=n)

    # ---- random problems

    def test_random_problems(self):
        """Hypothesis: shapes, group patterns, shards, dtypes, output dtypes and configs at random."""
        @settings(
            max_examples=self.max_examples, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.data())
        def check(data):
            m = data.draw(st.integers(1, self.max_m), label="m")
            k = data.draw(st.integers(1, self.max_k), label="k")
            n = data.draw(st.integers(1, self.max_n), label="n")
            groups = data.draw(st.integers(1, self.max_groups), label="groups")
            extra = data.draw(st.sampled_from([0, 0, 1, 3]), label="groups of other shards")
            total = groups + extra
            pattern = data.draw(st.sampled_from(["cuts", "cuts", "cuts", "one_group", "all_empty"]), label="pattern")
            if pattern == "all_empty":
                sizes = [0] * total
            elif pattern == "one_group":
                sizes = [0] * total
                sizes[data.draw(st.integers(0, total - 1))] = data.draw(st.integers(1, m))
            else:
                used = data.draw(st.integers(0, m), label="rows used")
                cuts = data.draw(st.lists(st.integers(0, used), min_size=total - 1, max_size=total - 1), label="cuts")
                sizes = sizes_from_cuts(used, cuts)
            sharded = extra > 0 or data.draw(st.booleans(), label="pass group_offset=0")
            shard = (data.draw(st.integers(0, extra), label="offset"), groups) if sharded else None
            dtype = data.draw(st.sampled_from((*self.dtypes, *self.extra_dtypes)), label="dtype")
            out_dtype = data.draw(st.sampled_from([None, *self.out_dtypes]), label="preferred_element_type")
            problem = self.problem(m, k, n, groups, dtype, out_dtype, total_groups=total)
            space = self.impl.search_space(problem) + self.extra_configs(problem)
            config = data.draw(st.sampled_from(space), label="config")
            jit = self.fixed_draws.get("jit", None)
            jit = data.draw(st.booleans(), label="jit") if jit is None else jit
            seed = self.fixed_draws.get("seed", None)
            seed = data.draw(st.integers(0, 2**31 - 1), label="seed") if seed is None else seed
            self.run_case(m, sizes, shard, dtype, out_dtype=out_dtype, configs=[config], jit=jit, seed=seed, k=k, n=n)

        check()

    # ---- quantized operands (QArray): every direction at the kernel, then through the public op

    @pytest.mark.parametrize("mode", list(QUANT_MODES), ids=str)
    def test_quantized_kernel_matches_the_dequantized_reference(self, mode):
        """`Backend.run` of one direction with quantized operands (as the op passes them) against the float64
        reference of the dequantized operands: float32 out, the empty group's drhs and the rows past
        sum(group_sizes) exactly zero."""
        problem, a, b = make_quant_case(QUANT_MODES[mode])
        if (reason := self.unsupported(problem)) is not None:
            pytest.skip(f"{self.backend} cannot run {mode}: {reason}")
        ref = direction_reference(problem, a, b, QSIZES)
        for config in self.quantized_configs(problem):
            out = self.run_quantized(problem, config, a, b, QSIZES)
            what = f"[{self.backend} {mode} {config}]"
            assert out.dtype == jnp.float32, what
            assert_quant_close(out, ref, what)
            if problem.direction == "drhs":
                assert not np.any(np.asarray(out[1])), f"the empty group's result is not zero {what}"
            else:
                assert not np.any(np.asarray(out[sum(QSIZES):])), f"rows past sum(group_sizes) are not zero {what}"

    def test_quantized_expert_parallel_shard_with_weights_sliced_by_group(self):
        """group_offset: the shard's groups [1, 4) of 5; the QArray weights are the full ones sliced by group.
        dlhs folds the per-channel scale into dout by each row's (local) group, so the offset must reach it."""
        offset, groups = Q_SHARD
        rng = np.random.default_rng(3)
        lhs = jnp.asarray(rng.standard_normal((QM, QK), np.float32))
        dout = jnp.asarray(rng.standard_normal((QM, QN), np.float32))
        full = quantize(jnp.asarray(rng.standard_normal((len(Q_SHARD_SIZES), QK, QN), np.float32)), "int8", axis=1)
        shard = full[offset:offset + groups]
        lhs_q = quantize(lhs, "int8", axis=1, block_size=8)
        operands = {"fwd": (lhs, shard), "dlhs": (dout, shard), "drhs": (lhs_q, dout)}
        for direction in self.quant_shard_directions:
            a, b = operands[direction]
            problem = RaggedDotProblem.from_arrays(lhs_q if direction == "drhs" else lhs, shard,
                                                   jnp.asarray(Q_SHARD_SIZES, jnp.int32),
                                                   group_offset=jnp.int32(offset), direction=direction)
            if (reason := self.unsupported(problem)) is not None:
                pytest.skip(f"{self.backend} cannot run the quantized {direction} shard: {reason}")
            out = self.run_quantized(problem, self.impl.default_config(problem), a, b, Q_SHARD_SIZES,
                                     offset=jnp.int32(offset))
            what = f"[{self.backend} {direction}]"
            assert_quant_close(out, direction_reference(problem, a, b, Q_SHARD_SIZES, offset=offset), what)
            if direction != "drhs":  # rows of other shards' groups are zero
                mine = local_rows(Q_SHARD_SIZES, QM, groups, offset)
                assert not np.any(np.asarray(out)[~mine]), what

    def test_quantized_operands_through_the_op_and_its_vjp(self):
        """The public op with QArray weights (int8 per channel: fwd, and dlhs for the float activations) and
        with QArray activations (int8 in sub-channel blocks: fwd, and drhs for the float weights), each
        direction with the backend's default config; a QArray is an autodiff constant (zero cotangent)."""
        rng = np.random.default_rng(4)
        lhs = jnp.asarray(rng.standard_normal((QM, QK), np.float32))
        rhs = jnp.asarray(rng.standard_normal((len(QSIZES), QK, QN), np.float32) / np.sqrt(QK))
        dout = jnp.asarray(rng.standard_normal((QM, QN), np.float32))
        sizes = jnp.asarray(QSIZES, jnp.int32)
        ran = 0
        for a, b in ((lhs, quantize(rhs, "int8", axis=1)), (quantize(lhs, "int8", axis=1, block_size=8), rhs)):
            problem = RaggedDotProblem.from_arrays(a, b, sizes)
            if self.unsupported(problem) is not None:
                continue
            config = {d: self.impl.default_config(problem.with_direction(d)) for d in DIRECTIONS}
            f = jax.jit(lambda a, b: moe_tune.ragged_dot(a, b, sizes, backend=self.backend, config=config))
            out, vjp = jax.vjp(f, a, b)
            da, db = vjp(dout)
            what = f"[{self.backend} lhs {type(a).__name__}, rhs {type(b).__name__}]"
            assert out.dtype == jnp.float32, what
            assert_quant_close(out, ragged_dot_reference(as_f64(a), as_f64(b), QSIZES), what)
            refs = (lambda: ragged_dot_dlhs_reference(as_f64(dout), as_f64(b), QSIZES),
                    lambda: ragged_dot_drhs_reference(as_f64(a), as_f64(dout), QSIZES, groups=len(QSIZES)))
            for x, grad, ref in ((a, da, refs[0]), (b, db, refs[1])):
                if isinstance(x, QArray):  # a constant: a zero cotangent (float0 for integer values)
                    for leaf in jax.tree.leaves(grad):
                        assert leaf.dtype == jax.dtypes.float0 or not np.any(np.asarray(leaf, np.float32)), what
                else:
                    assert grad.dtype == x.dtype, what
                    assert_quant_close(grad, ref(), what)
            ran += 1
        if not ran:
            pytest.skip(f"{self.backend} runs no quantized operands")

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_default_config_is_valid_for_model_sized_quantized_problems(self, direction):
        """DeepSeek-sized experts (k = 7168) with int8 weights in sub-channel blocks of 128, weight-only and
        w8a8 (fp8 per-row activations): the default config is valid. Nothing runs."""
        base = dict(m=4096, k=7168, n=2048, groups=32, lhs_dtype="bfloat16", out_dtype="bfloat16",
                    rhs_qdtype="int8", rhs_qblock=128, direction=direction)
        for problem in (RaggedDotProblem(**base), RaggedDotProblem(**{**base, "lhs_qdtype": "float8_e4m3fn"})):
            assert self.unsupported(problem) is None, problem

    # ---- lowering for its native chips (jax.export; nothing runs)

    def export_direction(self, on_chip: Callable[[str], None], problem: RaggedDotProblem, *,
                         with_offset: bool = False, configs: list[KernelConfig] | None = None) -> None:
        """Export `problem.direction` for each native chip with each config (default: `configs_to_lower` where
        the chip has a kernel call, whose lowering rules depend on the blocks; else the default config): the
        module targets the chip, holds the chip's kernel call (`kernel_calls`) and has the right output."""
        for chip in self.lowering_chips():
            on_chip(chip)
            call = self.kernel_calls.get(chip)
            default = configs_to_lower(self.impl, problem) if call else [self.impl.default_config(problem)]
            for config in configs or default:
                what = f"{self.backend} on {chip} {problem.key_fields()} {config.label()}"
                fn, args = direction_call(self.impl, problem, config, with_offset)
                exported = export_for(chip, fn, *args)
                lines = kernel_call_lines(exported, chip, call, what)
                assert [(a.shape, a.dtype) for a in exported.out_avals] == [
                    (output_shape(problem), jnp.dtype(problem.operand_dtypes()[2]))], what
                if call == TRITON_CALL:
                    name = "moe_tune_tgmm" if problem.direction == "drhs" else "moe_tune_gmm"
                    assert_triton_params(lines[0], config, name, what)

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_lowers_for_its_chip(self, on_chip, direction):
        """Every input dtype; a kernel with a call on the chip with the default, smallest and largest configs of
        its search space."""
        for dtype in (*self.dtypes, *self.extra_dtypes):
            problem = RaggedDotProblem(LOWER_M, LOWER_K, LOWER_N, LOWER_GROUPS, dtype, dtype, dtype,
                                       direction=direction)
            self.export_direction(on_chip, problem)

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_lowers_for_its_chip_with_group_offset(self, on_chip, direction):
        """An expert-parallel shard: group_sizes covers 2 * GROUPS groups, the call computes GROUPS of them."""
        for dtype in self.dtypes[:2]:
            problem = RaggedDotProblem(LOWER_M, LOWER_K, LOWER_N, LOWER_GROUPS, dtype, dtype, dtype,
                                       direction=direction, total_groups=2 * LOWER_GROUPS)
            self.export_direction(on_chip, problem, with_offset=True, configs=[self.impl.default_config(problem)])

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_lowers_for_its_chip_with_mixed_dtypes(self, on_chip, direction):
        """Low-precision inputs with a float32 output (the usual training setup) and the reverse: the gradients'
        matmuls then multiply operands of two dtypes (e.g. dlhs = float32 dout @ bfloat16 rhs), which Triton's
        `tl.dot` (one operand type) once failed to lower while interpret mode promoted like `jnp.dot`."""
        for low in (d for d in (*self.dtypes, *self.extra_dtypes) if d != "float32"):
            for lhs_rhs, out in ((low, "float32"), ("float32", low)):
                problem = RaggedDotProblem(LOWER_M, LOWER_K, LOWER_N, LOWER_GROUPS, lhs_rhs, lhs_rhs, out,
                                           direction=direction)
                self.export_direction(on_chip, problem, configs=[self.impl.default_config(problem)])

    def test_quantized_lowers_for_its_chip(self, on_chip):
        """Quantized problems of every direction lower with the default config; where the chip has a kernel
        call, the 1-byte values are an operand of it (not dequantized to a float array before the kernel)."""
        for chip in self.lowering_chips():
            on_chip(chip)
            call = self.kernel_calls.get(chip)
            for name, problem, a, b, sizes in quantized_lowering_cases():
                if self.unsupported(problem) is not None:
                    continue
                config = self.impl.default_config(problem)
                what = f"{self.backend} on {chip} {name}"
                exported = export_for(chip, lambda a, b, s, c=config, p=problem: self.impl.run(p, c, a, b, s),
                                      a, b, sizes)
                assert [(x.shape, x.dtype) for x in exported.out_avals] == [
                    (output_shape(problem), jnp.dtype(problem.operand_dtypes()[2]))], what
                lines = kernel_call_lines(exported, chip, call, what)
                if not lines:
                    continue
                q = a if isinstance(a, QArray) else b
                byte_type = "xi8>" if q.dtype == jnp.int8 else "xf8E4M3FN>"
                # a kernel may read lhs transposed, [k, m] (megablox's tgmm, as JAX's Megablox does), still 1-byte
                shapes = {"x".join(map(str, q.shape)), "x".join(map(str, q.shape[::-1]))}
                assert any(f"{shape}{byte_type}" in lines[0].split(" : (")[-1] for shape in shapes), \
                    f"{what}: the {q.shape} 1-byte operand is not an operand of the kernel"

    # ---- bad input

    def operands(self, dtype: str = "float32") -> tuple[jax.Array, jax.Array]:
        """Small operands for the bad-input tests: lhs [16, k], rhs [2, k, n]."""
        return make_operands(16, self.k, self.n, 2, dtype, 0)

    def test_lhs_must_be_2d(self):
        """A lhs that is not [m, k] is a UsageError."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="lhs"):
            moe_tune.ragged_dot(lhs[None], rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend)
        with pytest.raises(UsageError, match="lhs"):
            moe_tune.ragged_dot(lhs[0], rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend)

    def test_rhs_must_be_3d(self):
        """A rhs that is not [groups, k, n] is a UsageError."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="rhs"):
            moe_tune.ragged_dot(lhs, rhs[0], jnp.asarray([8, 8], jnp.int32), backend=self.backend)

    def test_contracting_dims_must_match(self):
        """lhs and rhs of different k are a UsageError."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="contracting"):
            moe_tune.ragged_dot(lhs[:, :-1], rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend)

    def test_group_sizes_length_must_match_without_offset(self):
        """Without group_offset, group_sizes has one entry per group."""
        lhs, rhs = self.operands()
        for sizes in ([16], [8, 4, 4]):
            with pytest.raises(UsageError, match="group_sizes"):
                moe_tune.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), backend=self.backend)

    def test_group_sizes_must_cover_the_shard(self):
        """With group_offset, group_sizes has at least the local groups."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="fewer"):
            moe_tune.ragged_dot(
                lhs, rhs, jnp.asarray([16], jnp.int32), group_offset=jnp.int32(0), backend=self.backend
            )

    def test_group_sizes_must_be_1d_integers(self):
        """Float or 2-D group_sizes are a UsageError."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="group_sizes"):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8.0, 8.0]), backend=self.backend)
        with pytest.raises(UsageError, match="group_sizes"):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([[8, 8]], jnp.int32), backend=self.backend)

    def test_unsupported_dtypes(self):
        """Integer operands and an integer output dtype are UsageErrors."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError):
            moe_tune.ragged_dot(
                lhs.astype(jnp.int32), rhs.astype(jnp.int32), jnp.asarray([8, 8], jnp.int32), backend=self.backend
            )
        with pytest.raises(UsageError):
            moe_tune.ragged_dot(
                lhs, rhs, jnp.asarray([8, 8], jnp.int32), preferred_element_type=jnp.int8, backend=self.backend
            )

    def test_unknown_backend(self):
        """An unknown backend name is a UsageError naming the choices."""
        lhs, rhs = self.operands()
        with pytest.raises(UsageError, match="unknown backend"):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend + "_nope")

    def test_config_with_unknown_field(self):
        """A config dict with a field the backend's config lacks is an InvalidConfigError."""
        lhs, rhs = self.operands()
        with pytest.raises(InvalidConfigError, match="no field"):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend, config={"bogus": 1})

    def test_config_of_another_backend(self):
        """Another backend's config is an InvalidConfigError naming the expected class."""
        lhs, rhs = self.operands()
        problem = self.problem(16, self.k, self.n, 2, "float32")
        others = [BACKENDS.get(name) for name in BACKENDS.names()]
        other = next(b for b in others if b.config_cls is not self.impl.config_cls)
        foreign = other.default_config(problem)
        with pytest.raises(InvalidConfigError, match=self.impl.config_cls.__name__):
            moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend, config=foreign)

    def test_invalid_configs_rejected(self, dtype):
        """`invalid_configs` are rejected by config_error, by the op and under jit (at trace time)."""
        lhs, rhs = self.operands(dtype)
        problem = self.problem(16, self.k, self.n, 2, dtype)
        bad = self.invalid_configs(problem)
        if not bad:  # only a backend without tunables has no config to get wrong
            assert self.impl.tunables() == [] and self.impl.config_cls() == self.impl.default_config(problem)
        for config in bad:
            assert self.impl.config_error(self.impl.config_cls(**config), problem) is not None, config
            with pytest.raises(InvalidConfigError):
                moe_tune.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32), backend=self.backend, config=config)
            with pytest.raises(InvalidConfigError):  # raised at trace time under jit too
                traced = jax.jit(
                    lambda a, b, c, config=config: moe_tune.ragged_dot(a, b, c, backend=self.backend, config=config)
                )
                traced(lhs, rhs, jnp.asarray([8, 8], jnp.int32))
