"""The static description of one ragged_dot call: what a config is chosen for and what tables are keyed on."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from moe_tune.core.errors import UsageError
from moe_tune.kernels.base import positive_int_error
from moe_tune.core.quant import DynamicQuant, QArray, check_operand
from moe_tune.core.quant_format import ACTIVATION_QDTYPES, DEFAULT_QLAYOUT, QuantFormat, check_layout

DIRECTIONS = ("fwd", "dlhs", "drhs")
# The two operands each direction's kernel reads, `a` and `b` (`RaggedDotBackend.run`), by forward name.
OPERANDS = {"fwd": ("lhs", "rhs"), "dlhs": ("dout", "rhs"), "drhs": ("lhs", "dout")}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# The layouts a quantized operand must have (named in the error for any other).
LHS_LAYOUT = "[m, k] scaled along axis 1 (k) with scale [m, k/bs]"
RHS_LAYOUT = "[g, k, n] scaled along axis 1 (k) with scale [g, k/bs, n]"
# The dtype a quantized operand counts as in a problem (what `dequantize` returns).
DEQUANTIZED_DTYPE = "float32"


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name used in keys (`float32`, `bfloat16`); raises UsageError for unknown names."""
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        raise UsageError(f"unknown dtype {dtype!r}; use one of {', '.join(SUPPORTED_DTYPES)}") from None


def supported_dtype(dtype: Any, name: str = "dtype") -> str:
    """`dtype_name` of a float dtype the kernels take (`SUPPORTED_DTYPES`); UsageError naming `name` otherwise."""
    canonical = dtype_name(dtype)
    if canonical not in SUPPORTED_DTYPES:
        raise UsageError(f"{name} {canonical} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
    return canonical


def check_positive(problem: Any, names: tuple[str, ...]) -> None:
    """UsageError unless each named field of a problem is a positive integer: `base.positive_int_error`'s rule,
    a NumPy integer allowed too (shapes read off arrays)."""
    for name in names:
        value = getattr(problem, name)
        if (error := positive_int_error(name, int(value) if isinstance(value, np.integer) else value)) is not None:
            raise UsageError(error)


def int_scalar(value: Any, name: str) -> Any:
    """`value` as an int32 scalar array when it is a Python int or a 0-d integer NumPy / JAX array (traced
    or not); a UsageError naming `name` otherwise: a float, bool, string or vector would be cast (truncated,
    parsed) or fail deep inside a kernel. Checks the static dtype and shape only."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    plain_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not plain_int and not (shape == () and dtype is not None and jnp.issubdtype(dtype, jnp.integer)):
        got = f"a {dtype} array of shape {tuple(shape)}" if shape is not None else repr(value)
        raise UsageError(f"{name} must be an integer scalar (a Python int or a 0-d integer array), got {got}")
    return jnp.asarray(value, jnp.int32)


def checked_quant_fields(problem: Any, side: str) -> None:
    """Check and canonicalize a problem's `{side}_qdtype` / `{side}_qblock` (its key fields) by the one
    rule, `QuantFormat`'s, along the problem's `k`: the stored dtype name ("mxfp4" -> float4_e2m1fn), the
    block concrete (None: k; mxfp4: 32). UsageError naming the field."""
    qdtype, qblock = getattr(problem, f"{side}_qdtype"), getattr(problem, f"{side}_qblock")
    if qdtype is None:
        if qblock is not None:
            raise UsageError(f"{side}_qblock given without {side}_qdtype")
        return
    form = QuantFormat.parse(qdtype, qblock, dtype_arg=f"{side}_qdtype", block_arg=f"{side}_qblock")
    form = form.along(problem.k, axis="k", block_arg=f"{side}_qblock")
    object.__setattr__(problem, f"{side}_qdtype", form.dtype)
    object.__setattr__(problem, f"{side}_qblock", form.block)


@dataclasses.dataclass(frozen=True)
class RaggedDotProblem:
    """Shapes and dtypes of `ragged_dot(lhs [m,k], rhs [groups,k,n], group_sizes) -> out [m,n]`, and which
    of its three matmuls (`direction`: fwd, or the gradients dlhs / drhs) is being run.

    Shapes and dtypes are always those of the forward call, so the three directions of one layer share
    every key field but `direction`.

    `groups` is the number of groups this call computes (rhs.shape[0]); with `group_offset` (expert
    parallelism) `group_sizes` may hold more groups than that, but the work and the key only depend on
    the local count. `total_groups` is kept for input generation and is not part of the key.

    Quantized operands (`moe_tune.QArray`): `lhs_qdtype` / `rhs_qdtype` name the stored dtype (int8,
    float8_e4m3fn, int4, float4_e2m1fn = mxfp4; None for a float operand) and `lhs_qblock` / `rhs_qblock` how
    many elements along k share one scale (k: one scale per row / channel; mxfp4: 32). A quantized operand's
    `lhs_dtype` / `rhs_dtype` is float32, the dtype of its dequantized values. `lhs_qdynamic`: the lhs is
    float (`lhs_dtype` its dtype) and the kernel quantizes each tile it loads to `lhs_qdtype` in blocks of
    `lhs_qblock` (`moe_tune.DynamicQuant`, dynamic w8a8; only with quantized weights). The quantization fields
    enter `key_fields` only for a quantized operand (`lhs_qdynamic` only when true), so the keys of float
    problems are those they always were. `rhs_qlayout`: how quantized weights lie in memory
    (`moe_tune.QArray.layout`): None for "kn" (given as "kn" it is stored as None), so it enters the key only
    for "nk" weights and every key of "kn" weights is the one it always was.
    """

    SIZE_FIELDS: ClassVar[tuple[str, ...]] = ("m",)  # what `nearest` lookup may vary
    # key fields only a quantized problem has (after the others, in this order)
    OPTIONAL_KEY_FIELDS: ClassVar[tuple[str, ...]] = ("lhs_qdtype", "lhs_qblock", "rhs_qdtype", "rhs_qblock",
                                                      "lhs_qdynamic", "rhs_qlayout")
    # optional key fields a sweep's identity leaves out when None (added after identities were first hashed)
    UNSET_OMITTED: ClassVar[tuple[str, ...]] = ("rhs_qlayout",)

    m: int
    k: int
    n: int
    groups: int
    lhs_dtype: str = "float32"
    rhs_dtype: str = "float32"
    out_dtype: str = "float32"
    direction: str = "fwd"
    total_groups: int | None = None
    lhs_qdtype: str | None = None
    rhs_qdtype: str | None = None
    lhs_qblock: int | None = None
    rhs_qblock: int | None = None
    lhs_qdynamic: bool = False
    rhs_qlayout: str | None = None

    def __post_init__(self) -> None:
        check_positive(self, ("m", "k", "n", "groups"))
        if self.total_groups is not None and self.total_groups < self.groups:
            raise UsageError(f"total_groups ({self.total_groups}) < groups ({self.groups})")
        if self.direction not in DIRECTIONS:
            raise UsageError(f"unknown direction {self.direction!r}; choose from {', '.join(DIRECTIONS)}")
        for name in ("lhs_dtype", "rhs_dtype", "out_dtype"):
            object.__setattr__(self, name, supported_dtype(getattr(self, name), name))
        for side in ("lhs", "rhs"):
            checked_quant_fields(self, side)
        if self.lhs_qdynamic:
            if self.lhs_qdtype is None or not self.quant_format("lhs").activations:
                raise UsageError("lhs_qdynamic quantizes the activations in the kernel to lhs_qdtype "
                                 f"{' or '.join(ACTIVATION_QDTYPES)}, got {self.lhs_qdtype}")
            if self.rhs_qdtype is None:
                raise UsageError("activations quantized in the kernel (lhs_quant) need quantized weights (rhs)")
        if self.rhs_qlayout is not None:
            layout = check_layout(self.rhs_qlayout, "rhs_qlayout")
            if self.rhs_qdtype is None:
                raise UsageError(f"rhs_qlayout {layout!r} is the layout of quantized weights: it needs rhs_qdtype")
            object.__setattr__(self, "rhs_qlayout", None if layout == DEFAULT_QLAYOUT else layout)

    def quant_format(self, side: str) -> QuantFormat | None:
        """The quantization of operand `side` (lhs, rhs; its block concrete), None for a float operand."""
        qdtype = getattr(self, f"{side}_qdtype")
        return None if qdtype is None else QuantFormat(qdtype, getattr(self, f"{side}_qblock"))

    @property
    def quantized(self) -> bool:
        return self.lhs_qdtype is not None or self.rhs_qdtype is not None

    def matmul_dims(self) -> tuple[int, int, int]:
        """(rows, contracting, output columns) of the matmul this direction runs.

        fwd: out[m,n] = lhs[m,k] @ rhs[g,k,n]; dlhs: dlhs[m,k] = dout[m,n] @ rhs[g]^T (contracts n);
        drhs: drhs[g,k,n] = lhs[rows of g]^T @ dout[rows of g] (contracts the m rows; returns k x n).
        """
        return (self.m, self.n, self.k) if self.direction == "dlhs" else (self.m, self.k, self.n)

    def operand_dtypes(self) -> tuple[str, str, str]:
        """(first operand, second operand, result) dtypes of this direction's matmul."""
        if self.direction == "dlhs":
            return self.out_dtype, self.rhs_dtype, self.lhs_dtype
        if self.direction == "drhs":
            return self.lhs_dtype, self.out_dtype, self.rhs_dtype
        return self.lhs_dtype, self.rhs_dtype, self.out_dtype

    def with_direction(self, direction: str) -> "RaggedDotProblem":
        return dataclasses.replace(self, direction=direction)

    @property
    def num_group_sizes(self) -> int:
        return self.total_groups or self.groups

    @property
    def flops(self) -> int:
        """FLOPs of the useful work (each row multiplied by one group's [k,n] matrix)."""
        return 2 * self.m * self.k * self.n

    @property
    def min_bytes(self) -> int:
        """Bytes every direction must move at least: its two operands read once and its result written once
        (the rows [m, k] and [m, n], and the groups' [groups, k, n] matrices)."""
        size = lambda dtype: np.dtype(jnp.dtype(dtype)).itemsize
        lhs, rhs = self.m * self.k, self.groups * self.k * self.n

        def stored(elements: int, side: str) -> int:
            # a quantized operand: its values (4-bit: two a byte) and float32 scales (one per qblock along k);
            # activations quantized in the kernel are read as the floats they are
            form = None if side == "lhs" and self.lhs_qdynamic else self.quant_format(side)
            return elements * size(getattr(self, f"{side}_dtype")) if form is None else form.stored_bytes(elements)

        lhs, rhs = stored(lhs, "lhs"), stored(rhs, "rhs")
        return lhs + rhs + self.m * self.n * size(self.out_dtype)

    def key_fields(self) -> dict[str, Any]:
        """The fields a table entry is keyed on (order matters: it is the key's order)."""
        return {
            "direction": self.direction,
            "m": self.m,
            "k": self.k,
            "n": self.n,
            "groups": self.groups,
            "lhs_dtype": self.lhs_dtype,
            "rhs_dtype": self.rhs_dtype,
            "out_dtype": self.out_dtype,
            **{f"{side}_{field}": getattr(self, f"{side}_{field}") for side in ("lhs", "rhs")
               if getattr(self, f"{side}_qdtype") is not None for field in ("qdtype", "qblock")},
            **({"lhs_qdynamic": True} if self.lhs_qdynamic else {}),
            **({"rhs_qlayout": self.rhs_qlayout} if self.rhs_qlayout is not None else {}),
        }

    @classmethod
    def from_key_fields(cls, fields: dict[str, Any]) -> "RaggedDotProblem":
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})

    def with_m(self, m: int) -> "RaggedDotProblem":
        return dataclasses.replace(self, m=m)

    @classmethod
    def from_arrays(
        cls,
        lhs: Any,
        rhs: Any,
        group_sizes: Any,
        *,
        preferred_element_type: Any = None,
        group_offset: Any = None,
        direction: str = "fwd",
    ) -> "RaggedDotProblem":
        """Validate the operands of a forward ragged_dot and describe them (works on tracers). Either operand
        may be a `QArray` (lhs [m, k] scaled [m, k/bs], rhs [g, k, n] scaled [g, k/bs, n], as they read: in
        either memory layout, rhs's layout its `rhs_qlayout`); lhs may be a `DynamicQuant` (float activations
        quantized in the kernel)."""
        if getattr(lhs, "ndim", None) != 2:
            raise UsageError(f"lhs must be [m, k], got shape {getattr(lhs, 'shape', None)}")
        if getattr(rhs, "ndim", None) != 3:
            raise UsageError(f"rhs must be [groups, k, n], got shape {getattr(rhs, 'shape', None)}")
        if isinstance(rhs, DynamicQuant):
            raise UsageError("rhs cannot be a DynamicQuant: the kernels quantize the activations (lhs) only; "
                             "quantize weights with moe_tune.quantize")
        if getattr(group_sizes, "ndim", None) != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
            raise UsageError("group_sizes must be a 1-D integer array")
        m, k = lhs.shape
        groups, k_rhs, n = rhs.shape
        if k != k_rhs:
            raise UsageError(f"contracting dims differ: lhs {lhs.shape} vs rhs {rhs.shape}")
        total = group_sizes.shape[0]
        if group_offset is None and total != groups:
            raise UsageError(f"group_sizes has {total} groups but rhs has {groups} (pass group_offset to shard)")
        if total < groups:
            raise UsageError(f"group_sizes has {total} groups, fewer than rhs's {groups}")
        quant: dict[str, Any] = {}
        for side, x, layout in (("lhs", lhs, LHS_LAYOUT), ("rhs", rhs, RHS_LAYOUT)):
            if isinstance(x, QArray):
                quant[f"{side}_qblock"] = check_operand(x, name=side, layout=layout)
                quant[f"{side}_qdtype"] = x.dtype.name
        if isinstance(rhs, QArray):
            quant["rhs_qlayout"] = rhs.layout
        if isinstance(lhs, DynamicQuant):
            quant.update(lhs_qdtype=lhs.qdtype, lhs_qblock=lhs.block(), lhs_qdynamic=True)
        # a quantized operand counts as float32 (what it dequantizes to); the output follows the float ones
        lhs_dtype, rhs_dtype = (DEQUANTIZED_DTYPE if isinstance(x, QArray) else x.dtype for x in (lhs, rhs))
        floats = [x.dtype for x in (lhs, rhs) if not isinstance(x, QArray)] or [jnp.float32]
        out = preferred_element_type if preferred_element_type is not None else jnp.result_type(*floats)
        return cls(
            m=m, k=k, n=n, groups=groups,
            lhs_dtype=dtype_name(lhs_dtype), rhs_dtype=dtype_name(rhs_dtype), out_dtype=dtype_name(out),
            direction=direction, total_groups=total if total != groups else None, **quant,
        )
