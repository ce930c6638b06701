"""Tuner-facing description of ragged_dot (`RAGGED_DOT`): problems from options, seeded inputs, and the float64
NumPy references of the three directions that every backend and every tuning candidate is checked against.

Each group's operand rows are converted to float64 as that group is multiplied (`_f64`), not whole operands
first: the same values and products, without a float64 copy of the whole rhs (200 MB at the default sweep
shape, and groups with no rows are never converted; FINDINGS.md: sweep memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core import devices, distributions
from moe_tune.core.errors import UsageError
from moe_tune.kernels import kernel_op as opt
from moe_tune.kernels.base import Backend, KernelConfig, positive_int_error
from moe_tune.kernels.ragged_dot.problem import DEQUANTIZED_DTYPE, DIRECTIONS, OPERANDS, RaggedDotProblem
from moe_tune.kernels.ragged_dot.registry import BACKENDS
from moe_tune.kernels.kernel_op import BenchPlan, KernelOp, relative_error
from moe_tune.kernels.layer_shape import LayerShape
from moe_tune.core.quant import DynamicQuant, QArray, as_float, dequantize_host, quantize
from moe_tune.core.quant_format import QuantFormat


def _local_row_ranges(group_sizes: np.ndarray, m: int, groups: int, group_offset: int) -> list[tuple[int, int]]:
    sizes = np.maximum(np.asarray(group_sizes, np.int64), 0)
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    return [(int(starts[group_offset + i]), int(ends[group_offset + i])) for i in range(groups)]


def ragged_dot_reference(
    lhs: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray, *, group_offset: int = 0
) -> np.ndarray:
    """fwd: out[rows of local group i] = lhs[rows] @ rhs[i]; every other row is zero. float64 [m, n].

    lhs [m, k], rhs [groups, k, n], group_sizes [total_groups] (concrete values), local groups are
    `group_offset .. group_offset + groups - 1`.
    """
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, lhs.shape[0], rhs.shape[0], group_offset)):
        if e > s:
            out[s:e] = _f64(lhs[s:e]) @ _f64(rhs[i])
    return out


def ragged_dot_dlhs_reference(
    dout: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray, *, group_offset: int = 0
) -> np.ndarray:
    """dlhs: dlhs[rows of local group i] = dout[rows] @ rhs[i]^T; other rows zero. float64 [m, k]."""
    dout, rhs = np.asarray(dout), np.asarray(rhs)
    out = np.zeros((dout.shape[0], rhs.shape[1]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, dout.shape[0], rhs.shape[0], group_offset)):
        if e > s:
            out[s:e] = _f64(dout[s:e]) @ _f64(rhs[i]).T
    return out


def ragged_dot_drhs_reference(
    lhs: np.ndarray, dout: np.ndarray, group_sizes: np.ndarray, *, groups: int, group_offset: int = 0
) -> np.ndarray:
    """drhs (tgmm): drhs[i] = lhs[rows of local group i]^T @ dout[same rows]. float64 [groups, k, n]."""
    lhs, dout = np.asarray(lhs), np.asarray(dout)
    out = np.zeros((groups, lhs.shape[1], dout.shape[1]), np.float64)
    for i, (s, e) in enumerate(_local_row_ranges(group_sizes, lhs.shape[0], groups, group_offset)):
        if e > s:
            out[i] = _f64(lhs[s:e]).T @ _f64(dout[s:e])
    return out


def _f64(x: np.ndarray) -> np.ndarray:
    """A float64 copy of `x` (exact for every float and integer dtype the operands have)."""
    return np.asarray(x, np.float64)


# Above this many FLOPs an accelerator's reference runs on the device (float32, highest precision) instead
# of in float64 NumPy on the host, which would take minutes at real model sizes.
HOST_REFERENCE_MAX_FLOPS = 2 * 10**10

# The default sweep: the up projection of one Qwen3-30B-A3B MoE layer (hidden 2048 -> expert width 768,
# 128 experts, top-8) for 2048 tokens on an expert-parallel shard of 16 experts: m = 2048 * 8 * 16/128 = 2048
# rows. It is a real expert shape that a 2-core CPU sweeps in about a minute.
DEFAULT_OPTIONS = {"m": 2048, "k": 2048, "n": 768, "groups": 16, "dtype": "float32"}
# A dense matmul with the FLOPs of each direction, of its `a` and `b` (`OPERANDS`): [m,k]x[k,n], [m,n]x[n,k],
# [k,m]x[m,n] (bench's compute roofline).
DENSE = {
    "fwd": lambda a, b: a @ b[0],
    "dlhs": lambda a, b: a @ b[0].T,
    "drhs": lambda a, b: a.T @ b,
}
# The layer's two matmul roles: (role, k, n) of a layer's (hidden, expert width).
MATMULS = (("gate/up", "hidden", "intermediate"), ("down", "intermediate", "hidden"))


class RaggedDotOp(KernelOp):
    name = "ragged_dot"
    backends = BACKENDS
    fallback = "xla"  # jax.lax.ragged_dot_general
    description = "grouped matmul lhs[m,k] x rhs[g,k,n] -> [m,n] (Megablox gmm)"
    directions = DIRECTIONS
    problem_class = RaggedDotProblem
    options = (opt.M, opt.K, opt.N, opt.GROUPS, *opt.QUANT, opt.RHS_QLAYOUT, opt.DTYPE, opt.OUT_DTYPE)

    def problem(
        self, *, m: int, k: int, n: int, groups: int, dtype: str = "float32", out_dtype: str | None = None,
        direction: str = "fwd", rhs_quant: str | None = None, lhs_quant: str | None = None,
        quant_block: int | None = None, lhs_dynamic: bool | None = None, rhs_qlayout: str | None = None,
    ) -> RaggedDotProblem:
        """`dtype`: of the float operands (a quantized one counts as float32, what it dequantizes to, as
        `RaggedDotProblem.from_arrays` says) and of the output unless `out_dtype`. `rhs_quant` / `lhs_quant`:
        quantize that operand (int8, float8_e4m3fn; rhs also int4, mxfp4) with `quant_block` elements along k
        per scale (None: one scale per channel / row; mxfp4: 32), `QuantFormat`'s rule. `lhs_dynamic`: the
        kernel quantizes the float activations tile by tile (`moe_tune.ragged_dot(..., lhs_quant=...)`), in
        `quant_block`s, else the weights' own blocks, as the op does. `rhs_qlayout`: the quantized weights'
        memory layout (kn, nk: `moe_tune.QArray.layout`)."""
        if quant_block is not None and rhs_quant is None and lhs_quant is None:
            raise UsageError("quant_block (--quant-block) needs rhs_quant or lhs_quant (--rhs-quant / --lhs-quant)")
        if rhs_qlayout is not None and rhs_quant is None:
            raise UsageError("rhs_qlayout (--rhs-qlayout) needs rhs_quant (--rhs-quant)")
        if lhs_dynamic and lhs_quant is None:
            raise UsageError("lhs_dynamic (--lhs-dynamic) needs lhs_quant (--lhs-quant int8)")
        rhs = requested_format(rhs_quant, quant_block, k, "rhs_quant")
        # activations quantized in the kernel take the weights' blocks unless --quant-block says
        lhs_block = rhs.block if lhs_dynamic and quant_block is None and rhs is not None else quant_block
        lhs = requested_format(lhs_quant, lhs_block, k, "lhs_quant")
        floats = dict(lhs_dtype=dtype if lhs is None or lhs_dynamic else DEQUANTIZED_DTYPE,
                      rhs_dtype=dtype if rhs is None else DEQUANTIZED_DTYPE)
        return RaggedDotProblem(
            m=m, k=k, n=n, groups=groups, **floats, out_dtype=out_dtype or dtype, direction=direction,
            lhs_qdtype=lhs and lhs.dtype, lhs_qblock=lhs and lhs.block, rhs_qdtype=rhs and rhs.dtype,
            rhs_qblock=rhs and rhs.block, lhs_qdynamic=bool(lhs_dynamic), rhs_qlayout=rhs_qlayout,
        )

    def default_problem_options(self) -> dict[str, Any]:
        return dict(DEFAULT_OPTIONS)

    def float_inputs(self, problem: RaggedDotProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
        """The two float operands of the direction, `a` and `b` (`OPERANDS`), and `group_sizes`; values scaled
        so that results are O(1) whatever the sizes. A quantized operand is float32 here."""
        rng = np.random.default_rng(seed)
        m, k, n, g = problem.m, problem.k, problem.n, problem.groups
        make = {
            "lhs": lambda: rng.standard_normal((m, k), np.float32).astype(jnp.dtype(problem.lhs_dtype), copy=False),
            "rhs": lambda: _scaled(rng.standard_normal((g, k, n), np.float32), np.sqrt(k), problem.rhs_dtype),
            "dout": lambda: _scaled(rng.standard_normal((m, n), np.float32), np.sqrt(n), problem.out_dtype),
        }
        a, b = OPERANDS[problem.direction]
        a, b = make[a](), make[b]()
        sizes = distributions.group_sizes(distribution, m, problem.num_group_sizes, seed)
        return {"a": a, "b": b, "group_sizes": sizes}

    def make_inputs(self, problem: RaggedDotProblem, distribution: str, seed: int) -> dict[str, Any]:
        """`float_inputs`, with the direction's quantized operands (lhs, rhs) quantized along k: QArrays of
        NumPy arrays (quantized values, float32 scales; rhs in `rhs_qlayout`); activations the fwd kernel
        quantizes (`lhs_qdynamic`) a `DynamicQuant` of the float ones."""
        inputs = self.float_inputs(problem, distribution, seed)
        for name, operand in zip(("a", "b"), OPERANDS[problem.direction]):
            qdtype = getattr(problem, f"{operand}_qdtype", None)
            if operand == "lhs" and problem.lhs_qdynamic:
                if problem.direction == "fwd":  # elsewhere the float activations are read as they are
                    inputs[name] = DynamicQuant(inputs[name], qdtype, problem.lhs_qblock)
            elif qdtype is not None:
                q = quantize(inputs[name], qdtype, axis=1, block_size=getattr(problem, f"{operand}_qblock"),
                             layout=_layout(problem, operand))
                inputs[name] = jax.tree.map(np.asarray, q)
        return inputs

    def reference(self, problem: RaggedDotProblem, inputs: Mapping[str, Any]) -> np.ndarray:
        """Of the dequantized operands (exactly, in float64). Float64 on the host; for problems too big for
        that on an accelerator's host, XLA's ragged dot on the device in float32 at the highest matmul
        precision. Never on CPU: there XLA's ragged dot is the slower of the two and holds several times its
        output in temporaries (m=4096 k=2048 n=1408 g=128 drhs: 16 s and 12 GB, where the NumPy reference
        took 1.9 s and 2.9 GB, its result)."""
        inputs = {**inputs, **{name: dequantize_host(inputs[name].quantize() if isinstance(inputs[name], DynamicQuant)
                                                     else inputs[name])
                               for name in ("a", "b") if isinstance(inputs[name], (QArray, DynamicQuant))}}
        if problem.flops > HOST_REFERENCE_MAX_FLOPS and devices.platform() != "cpu":
            return self._device_reference(problem, inputs)
        a, b, sizes = inputs["a"], inputs["b"], inputs["group_sizes"]
        if problem.direction == "dlhs":
            return ragged_dot_dlhs_reference(a, b, sizes)
        if problem.direction == "drhs":
            return ragged_dot_drhs_reference(a, b, sizes, groups=problem.groups)
        return ragged_dot_reference(a, b, sizes)

    def distribution_record(self, problem: RaggedDotProblem, distribution: str, seed: int,
                            inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The group sizes; for a quantized problem also `quantization_error`: max |reference of the dequantized
        operands - reference of the unquantized ones| / max |the latter|. Recorded, never gated on: every
        correct candidate is within the tolerance of the former (the integer products are exact)."""
        record = super().distribution_record(problem, distribution, seed, inputs)
        if problem.quantized:
            unquantized = self.reference(problem, self.float_inputs(problem, distribution, seed))
            record["quantization_error"] = relative_error(self.reference(problem, inputs), unquantized)
        return record

    def _device_reference(self, problem: RaggedDotProblem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        f32 = dataclasses.replace(problem, lhs_dtype="float32", rhs_dtype="float32", out_dtype="float32",
                                  lhs_qdtype=None, lhs_qblock=None, rhs_qdtype=None, rhs_qblock=None,
                                  rhs_qlayout=None)
        xla = BACKENDS.get("xla")
        with jax.default_matmul_precision("highest"):
            out = jax.jit(lambda a, b, s: xla.run(f32, xla.default_config(f32), a, b, s))(
                jnp.asarray(inputs["a"], jnp.float32), jnp.asarray(inputs["b"], jnp.float32),
                jnp.asarray(inputs["group_sizes"]))
        return np.asarray(out, np.float64)

    def run(self, backend: Backend, config: KernelConfig, problem: RaggedDotProblem,
            inputs: Mapping[str, jax.Array]) -> jax.Array:
        return backend.run(problem, config, inputs["a"], inputs["b"], inputs["group_sizes"])

    def memory_estimate(self, problem: RaggedDotProblem) -> int:
        """Bytes a sweep of `problem` holds before any candidate runs (pure arithmetic, nothing allocated): the
        direction's two operands on the host and on the device, group_sizes, the float64 reference and one
        candidate output (fwd [m,n], dlhs [m,k], drhs [g,k,n])."""
        m, k, n, g = problem.m, problem.k, problem.n, problem.groups
        size = lambda dtype: np.dtype(jnp.dtype(dtype)).itemsize
        lhs, rhs = m * k * size(problem.lhs_dtype), g * k * n * size(problem.rhs_dtype)
        dout = m * n * size(problem.out_dtype)
        a, b = (dict(lhs=lhs, rhs=rhs, dout=dout)[operand] for operand in OPERANDS[problem.direction])
        out_elements = {"fwd": m * n, "dlhs": m * k, "drhs": g * k * n}[problem.direction]
        out_dtype = problem.operand_dtypes()[2]
        return 2 * (a + b + 4 * problem.num_group_sizes) + out_elements * (8 + size(out_dtype))

    def input_shapes(self, problem: RaggedDotProblem, place) -> dict[str, Any]:
        """`make_inputs`' arrays as `place` gives them: the direction's `a` and `b` (`OPERANDS`; a quantized
        one a QArray scaled along k, scale [.., k / qblock, ..] float32; activations the fwd kernel quantizes
        a DynamicQuant; rhs stored in `rhs_qlayout`) and `group_sizes`."""
        m, k, n, g = problem.m, problem.k, problem.n, problem.groups
        shapes = {"lhs": ((m, k), problem.lhs_dtype), "rhs": ((g, k, n), problem.rhs_dtype),
                  "dout": ((m, n), problem.out_dtype)}
        inputs: dict[str, Any] = {"group_sizes": place((problem.num_group_sizes,), jnp.int32)}
        for name, operand in zip(("a", "b"), OPERANDS[problem.direction]):
            shape, dtype = shapes[operand]
            qdtype = getattr(problem, f"{operand}_qdtype", None)
            if qdtype is None:
                inputs[name] = place(shape, dtype)
            elif operand == "lhs" and problem.lhs_qdynamic:  # float activations the fwd kernel quantizes
                value = place(shape, dtype)
                inputs[name] = DynamicQuant(value, qdtype, problem.lhs_qblock) if problem.direction == "fwd" else value
            else:
                block = getattr(problem, f"{operand}_qblock")
                scale = tuple(d // block if i == 1 else d for i, d in enumerate(shape))
                layout = _layout(problem, operand)
                stored = (lambda s: s) if layout == "kn" else (lambda s: (*s[:-2], s[-1], s[-2]))
                inputs[name] = QArray(place(stored(shape), qdtype), place(stored(scale), jnp.float32), layout)
        return inputs

    def bench_plan(self, problem: RaggedDotProblem, backend: Backend, tuned: KernelConfig, inputs: Mapping[str, Any],
                   *, distribution: str, seed: int) -> BenchPlan:
        """Beside the tuned and default configs: XLA's ragged dot (`xla`, the baseline), a dense matmul of the
        same FLOPs (`dense`, of the dequantized operands: the compute roofline), the tuned config on skewed
        group sizes (`skewed`), and a copy of the largest operand's size in float32 (the copy bandwidth; with
        the least bytes moved, `min_bytes`, the memory roofline)."""
        xla = BACKENDS.get("xla")
        run = lambda b, config, sizes="group_sizes": lambda x: b.run(problem, config, x["a"], x["b"], x[sizes])
        largest = max(problem.m * problem.k, problem.m * problem.n, problem.groups * problem.k * problem.n)
        return BenchPlan(
            baseline="xla", advice="pass backend='xla' for this shape",
            variants={"xla": run(xla, xla.default_config(problem)),
                      "dense": lambda x: DENSE[problem.direction](*map(as_float, (x["a"], x["b"]))),
                      "skewed": run(backend, tuned, "skewed_sizes")},
            inputs={"skewed_sizes": distributions.group_sizes("skewed", problem.m, problem.num_group_sizes, seed)},
            copy_bytes=4 * largest, least_bytes=problem.min_bytes, compute_bound="dense",
            ratios={"tuned_vs_dense": ("tuned", "dense"), "default_vs_dense": ("default", "dense"),
                    "xla_vs_dense": ("xla", "dense"), "skewed_vs_balanced": ("skewed", "tuned")},
            shown=("dense",))

    def layer_calls(self, layer: LayerShape, runs: str | None) -> list[tuple[str, RaggedDotProblem]]:
        """gate/up (lhs [m, hidden] x rhs [groups, hidden, intermediate]; gate and up have one shape: one call)
        and down (lhs [m, intermediate] x [groups, intermediate, hidden]), quantized as `layer.quant` says.
        Serving runs the forward; training also the gradients of the float operands (a QArray is a constant:
        quantized weights have no drhs, stored quantized activations no dlhs; activations quantized in the
        kernel are float); None: every direction."""
        constant = {d for d, side in (("drhs", "rhs_quant"), ("dlhs", "lhs_quant")) if layer.quant.get(side) is not None}
        constant -= {"dlhs"} if layer.quant.get("lhs_dynamic") else set()
        wanted = {None: self.directions, "fwd": ("fwd",)}.get(runs) or tuple(d for d in self.directions
                                                                              if d not in constant)
        sizes = {"hidden": layer.hidden, "intermediate": layer.intermediate}
        return [(role, self.problem(m=layer.m, k=sizes[k], n=sizes[n], groups=layer.groups, dtype=layer.dtype,
                                    **layer.given_quant(), direction=direction))
                for role, k, n in MATMULS for direction in wanted]

    def describe(self, problem: RaggedDotProblem) -> str:
        dt = problem.lhs_dtype if problem.lhs_dtype == problem.out_dtype else f"{problem.lhs_dtype}->{problem.out_dtype}"
        quant = "".join(f" {side} {problem.quant_format(side).label(problem.k)}"
                        + (" dynamic" if side == "lhs" and problem.lhs_qdynamic else "")
                        + (f" {problem.rhs_qlayout}" if side == "rhs" and problem.rhs_qlayout else "")
                        for side in ("lhs", "rhs") if problem.quant_format(side) is not None)
        return f"ragged_dot {problem.direction} m={problem.m} k={problem.k} n={problem.n} g={problem.groups} {dt}{quant}"


def _layout(problem: RaggedDotProblem, operand: str) -> str:
    """The memory layout of a quantized `operand` (lhs, rhs) of `problem`: rhs's `rhs_qlayout`, else "kn"."""
    return (problem.rhs_qlayout if operand == "rhs" else None) or "kn"


def requested_format(quant: str | None, block: int | None, k: int, arg: str) -> QuantFormat | None:
    """The format `--rhs-quant` / `--lhs-quant` (`arg`) and `--quant-block` ask for on an axis of `k`
    (None: not quantized): `QuantFormat.parse`, then its rule along k when k is a valid size (else the
    problem refuses k first). UsageError naming the argument."""
    if quant is None:
        return None
    form = QuantFormat.parse(quant, block, dtype_arg=arg, block_arg="quant_block")
    return form if positive_int_error("k", k) is not None else form.along(k, axis="k", block_arg="quant_block")


def _scaled(x: np.ndarray, divisor: np.float64, dtype: str) -> np.ndarray:
    """`(x / divisor).astype(dtype)` for float32 `x`: the float64 quotient rounded once to `dtype`. For float32
    it is computed in place, in blocks (the same values without a float64 copy of `x`: 0.4 s of a sweep's
    start at the default shape's [16, 2048, 768] rhs; FINDINGS.md: sweep memory)."""
    if jnp.dtype(dtype) == np.float32:
        return np.divide(x, divisor, out=x, casting="same_kind")
    return (x / divisor).astype(jnp.dtype(dtype))  # bf16/f16: rounded from float64 directly, as always


RAGGED_DOT = RaggedDotOp()
