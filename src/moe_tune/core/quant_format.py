"""Quantization formats: what a valid quantized operand is, decided in this one place.

A `QuantFormat` is a stored dtype (int8, float8_e4m3fn, int4, float4_e2m1fn = "mxfp4") and `block`, how many
consecutive elements along the scaled axis share one scale (None: the whole axis, one scale per row or
channel). `QuantFormat.parse` builds one from what a person writes ("int8", "mxfp4", "int4", a NumPy / JAX
dtype, a table key's stored name; an optional block) and names the argument in its one-line UsageError. The
format then answers what follows from the two:

- `name`: what a person reads and types ("mxfp4" for float4_e2m1fn); `dtype`: what table keys store;
- `qmax`, `bits`, `bytes_per_element` (4-bit: 0.5, two values a byte), `four_bit`, `activations` (whether
  the kernels quantize activations to it: the 1-byte dtypes);
- the block: mxfp4 (OCP Microscaling) takes blocks of `MX_BLOCK` only, and has it when none is given;
  `along(size)` is the format on an axis of that length, its block concrete (the whole axis when None), or
  the UsageError of the rule (a block divides the axis);
- `scale_shape(shape, axis)`, `stored_bytes(elements)` (values and float32 scales) and `label(size)`.

The weight layouts (`QLAYOUTS`, `check_layout`) are decided here too: how a quantized [g, k, n] weight's
values and scales lie in memory. "kn" stores them as they read, [g, k, n] with scale [g, k/bs, n]. "nk"
stores both with their last two axes swapped: values [g, n, k], contiguous along the contraction k (a 4-bit
dtype's two values a byte then pair along k), block scales [g, n, k/bs], per-channel scales [g, n, 1] (the
same bytes as [g, 1, n]). The layout changes where values lie, never which values there are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from moe_tune.core.errors import UsageError

# Largest magnitude each quantized dtype stores, and its bits per value; the one place these numbers live.
QMAX: dict[str, float] = {"int8": 127.0, "float8_e4m3fn": 448.0, "int4": 7.0, "float4_e2m1fn": 6.0}
BITS: dict[str, int] = {"int8": 8, "float8_e4m3fn": 8, "int4": 4, "float4_e2m1fn": 4}
QDTYPES = tuple(QMAX)  # stored dtype names (what keys say)
FOUR_BIT = tuple(name for name in QDTYPES if BITS[name] == 4)
ACTIVATION_QDTYPES = tuple(name for name in QDTYPES if BITS[name] == 8)  # what a kernel quantizes activations to
# Names users may give for a stored dtype: "mxfp4" (OCP Microscaling FP4) is float4_e2m1fn values with the MX
# power-of-two scales, the only rule float4_e2m1fn is quantized with.
ALIASES = {"mxfp4": "float4_e2m1fn"}
DISPLAY = {stored: alias for alias, stored in ALIASES.items()}  # the name a person reads
QUANT_NAMES = (*QDTYPES, *ALIASES)  # what --rhs-quant accepts
MX_BLOCK = 32  # OCP MX: elements along the scaled axis per scale
FIXED_BLOCK = {"float4_e2m1fn": MX_BLOCK}  # dtypes that take one block only, and have it when none is given
SCALE_BYTES = 4  # float32 scales
# How a quantized array's values and scales lie in memory (see the module docstring): "kn" as they read,
# "nk" with the last two axes swapped (a weight's k contiguous: what swap-AB tensor-core kernels load).
QLAYOUTS = ("kn", "nk")
DEFAULT_QLAYOUT = "kn"


def qdtype_name(dtype: Any, arg: str = "dtype") -> str:
    """The stored dtype name of a quantized dtype or its alias ("mxfp4" -> "float4_e2m1fn"); a UsageError
    naming `arg` for any other dtype."""
    if isinstance(dtype, str) and dtype in ALIASES:
        return ALIASES[dtype]
    try:
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError):
        name = str(dtype)
    if name not in QMAX:
        raise UsageError(f"{arg}: cannot quantize to {name}; use one of {', '.join(QUANT_NAMES)}")
    return name


def check_layout(layout: Any, arg: str = "layout") -> str:
    """`layout` when it is one of `QLAYOUTS`; a one-line UsageError naming `arg` otherwise."""
    if not isinstance(layout, str) or layout not in QLAYOUTS:
        raise UsageError(f"{arg} must be one of {', '.join(QLAYOUTS)} (how the weights' values lie in memory: "
                         f"'kn' as [g, k, n], 'nk' as [g, n, k], k contiguous), got {layout!r}")
    return layout


def _checked_block(dtype: str, block: Any, arg: str) -> int | None:
    """`block` as a Python int (None: the dtype's fixed block, else None); a UsageError naming `arg` for a
    value that is not a positive integer (a float, a bool, a string), or a block mxfp4 does not take."""
    if block is None:
        return FIXED_BLOCK.get(dtype)
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise UsageError(f"{arg} must be a positive integer (elements per scale) or None, got {block!r} "
                         f"({type(block).__name__})")
    if block <= 0:
        raise UsageError(f"{arg} {int(block)} does not divide any length: it must be a positive integer")
    if dtype in FIXED_BLOCK and block != FIXED_BLOCK[dtype]:
        raise UsageError(f"{DISPLAY.get(dtype, dtype)} ({dtype}) takes blocks of {FIXED_BLOCK[dtype]} along k "
                         f"(OCP MX), got {arg} {int(block)}")
    return int(block)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A stored quantized dtype and its scale block along the scaled axis (see the module docstring). Always
    valid: the constructor canonicalizes `dtype` and checks `block` as `parse` does."""

    dtype: str
    block: int | None = None

    def __post_init__(self) -> None:
        dtype = qdtype_name(self.dtype)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "block", _checked_block(dtype, self.block, "block"))

    @classmethod
    def parse(cls, dtype: Any, block: Any = None, *, dtype_arg: str = "dtype",
              block_arg: str = "block_size") -> "QuantFormat":
        """The format a person asks for: `dtype` a name of `QUANT_NAMES` or a dtype, `block` the elements per
        scale (None: the whole axis; mxfp4: 32). One-line UsageError naming `dtype_arg` / `block_arg`."""
        name = qdtype_name(dtype, dtype_arg)
        return cls(name, _checked_block(name, block, block_arg))

    @property
    def name(self) -> str:
        """What a person reads and types: "mxfp4" for float4_e2m1fn, else the stored dtype name."""
        return DISPLAY.get(self.dtype, self.dtype)

    @property
    def qmax(self) -> float:
        return QMAX[self.dtype]

    @property
    def bits(self) -> int:
        return BITS[self.dtype]

    @property
    def bytes_per_element(self) -> float:
        """Bytes per value as stored on a device (4-bit: 0.5, two values a byte; NumPy's ml_dtypes hold a
        4-bit value in a byte of its own, `stored_bytes(host=True)`)."""
        return self.bits / 8

    @property
    def four_bit(self) -> bool:
        return self.bits == 4

    @property
    def activations(self) -> bool:
        """Whether the kernels quantize activations to this dtype (dynamic w8a8: the 1-byte ones)."""
        return self.dtype in ACTIVATION_QDTYPES

    def along(self, size: int, *, axis: str = "axis 1", block_arg: str = "block_size") -> "QuantFormat":
        """This format on an axis of `size` elements (`axis` names it in the message), its block concrete
        (`size` when None); a one-line UsageError naming the rule when the block does not divide it or the
        axis is empty."""
        if size == 0:
            raise UsageError(f"nothing to quantize along {axis}: its length is 0")
        block = self.block or size
        if size % block:
            raise UsageError(f"{self.name} quantizes blocks of {block} along {axis}: {block_arg} {block} does "
                             f"not divide its length {size}")
        return dataclasses.replace(self, block=int(block))

    def scale_shape(self, shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
        """The scale's shape for values of `shape` scaled along `axis`: that axis // block (1 when None)."""
        shape = tuple(shape)
        blocks = 1 if self.block is None else shape[axis] // self.block
        return (*shape[:axis], blocks, *shape[axis + 1:])

    def stored_bytes(self, elements: int, *, host: bool = False) -> int:
        """Bytes an operand of `elements` values takes as stored on a device (values at `bytes_per_element`,
        float32 scales: one per block), or with `host` in NumPy (ml_dtypes keep a 4-bit value in a byte);
        the block must be concrete (`along`)."""
        if self.block is None:
            raise ValueError("stored_bytes needs a concrete block: use QuantFormat.along(size) first")
        values = elements * np.dtype(jnp.dtype(self.dtype)).itemsize if host else elements * self.bits // 8
        return values + SCALE_BYTES * (elements // self.block)

    def label(self, size: int | None = None) -> str:
        """`int8`, `int4/128`, `mxfp4`: the name, and the block unless it is the whole axis (`size`) or the
        dtype's fixed block."""
        if self.block in (None, size, FIXED_BLOCK.get(self.dtype)):
            return self.name
        return f"{self.name}/{self.block}"
