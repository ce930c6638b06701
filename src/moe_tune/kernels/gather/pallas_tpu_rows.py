"""How the `pallas_tpu` gathers move rows of a bfloat16 x.

Mosaic copies single rows of 32-bit arrays only (a packed 16-bit tile holds row pairs: one-row DMAs fail
with "Slice sizes along tiled dimensions must be aligned to tiles"), so a bfloat16 x travels as 32-bit rows
(`staging`): with hidden a multiple of 256 as uint32 words of columns j and j + hidden/2 (one XLA pass packs
x; the DMAs move bfloat16 bytes; a kernel unpacks each half exactly, a bfloat16 being the top half of a
float32), else as float32 rows. They land in a 32-bit VMEM scratch and are written out in bfloat16 after the
float32 weighting / reduce. float16 is refused: Mosaic cannot store its vectors (`pallas_tpu._shape_error`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_tune.kernels.gather.problem import GatherProblem

LANES = 128


def staging(dtype, hidden: int) -> str | None:
    """How rows of an x of `dtype` travel: None (32-bit: as they are), "halves" (bfloat16, hidden a multiple
    of 256: uint32 words of columns j and j + hidden/2) or "wide" (bfloat16 otherwise: float32 rows)."""
    if jnp.dtype(dtype).itemsize == 4:
        return None
    return "halves" if jnp.dtype(dtype) == jnp.bfloat16 and hidden % (2 * LANES) == 0 else "wide"


def staged_row_bytes(problem: GatherProblem) -> int:
    """Bytes of one row as the DMAs move it."""
    stage = staging(problem.dtype, problem.hidden)
    return problem.row_bytes() if stage is None else 4 * problem.hidden // (2 if stage == "halves" else 1)


def stage_rows(x: jax.Array, stage: str | None) -> jax.Array:
    """x [rows, hidden] as the 32-bit array the row DMAs copy."""
    if stage == "halves":
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        half = x.shape[1] // 2
        return bits[:, :half] | (bits[:, half:] << 16)
    return x.astype(jnp.float32) if stage == "wide" else x


def unstage_rows(v: jax.Array, stage: str | None) -> list[tuple[int, jax.Array]]:
    """The float32 values of staged rows `v` as (first column, piece) pairs: two lane-aligned halves, or one."""
    if stage == "halves":  # a bfloat16 is a float32 whose low 16 bits are zero
        return [(0, jax.lax.bitcast_convert_type(v << 16, jnp.float32)),
                (v.shape[-1], jax.lax.bitcast_convert_type(v & jnp.uint32(0xFFFF0000), jnp.float32))]
    return [(0, v.astype(jnp.float32))]
