"""The VMEM and SMEM rules of the `in_kernel` strategy's two collective kernels (`in_kernel_gmm.dispatch_gate_up`,
`in_kernel_return.down_return`): what a tile choice (tm, tk, tn) takes of the chip's scoped VMEM, and what the
scalar-prefetch tables and SMEM scratch take of SMEM. `in_kernel_gmm.tiles` picks the largest tiles these rules
accept; the layer refuses the fused kernels where none fits (`in_kernel_gmm.refusal`).

VMEM model (bytes; tm rows, tk contraction, tn output columns per tile), both kernels:
- each weight operand double-buffered: 2 x tk x tn x its stored itemsize (gate and up: two operands);
  quantized (a QArray scaled along k), per operand also its float32 scale block double-buffered,
  2 x round_up(k / block, 8) x tn x 4;
- float32 accumulators tm x tn x 4 (gate/up: two);
- what the compiler keeps beside them (a constant of Mosaic's own, the dot's operand tiles);
- the chip's reserve (`devices.tpu_vmem_model`: VMEM the compiler took beyond the megablox model).
gate/up adds the gathered-row scratch [tm, w] (w: the row's 32-bit words, `in_kernel_gmm._words`) and its
double-buffered output block 2 x tm x tn x the activation's itemsize; the return adds its double-buffered h
blocks 2 x tm x tk x h's itemsize and its two staging slots 2 x tm x tw x 4 (tw: the words of tn columns).
The coefficients were fitted on v5e (libtpu 0.0.42) to the scoped allocations the compiler reports, each kernel
alone at qwen3-30b-a3b with bfloat16 and int8 weights (12 tiles each, a kernel's vmem_limit_bytes raised step
by step until it compiled), then rounded up; each term is at or above the fit. The budget is the chip's
default scoped VMEM (`devices.tpu_scoped_vmem_bytes`, the chip table's one fact). The rules were held to
libtpu's compile verdicts on v5e and v6e at four presets (benchmarks/in_kernel_rules_audit.py;
benchmarks/results/in_kernel_rules_audit_v5e_v6e_2026-12-02.json).

SMEM: the visit schedule's tables (`visit_schedule`: group and tile ids per visit, group starts and ends,
three scalars) plus each kernel's own metadata, against `in_kernel_tpu.SMEM_METADATA_BYTES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from moe_tune.core import devices
from moe_tune.core.quant import QArray
from moe_tune.kernels.fused_moe.base import weight_parts
from moe_tune.kernels.pallas_util import round_up
from moe_tune.kernels.ragged_dot.metadata import max_visits
from moe_tune.layer.in_kernel_tpu import SMEM_METADATA_BYTES

LANES = 128
ROW_ALIGN = 16  # a row tile is a multiple of 16 rows (bfloat16's sublane packing)
# The row tiles the kernels take (ShardingConfig.row_tile's values; 0 there: the rules' largest).
ROW_TILES = (16, 32, 64, 128, 256, 512)
SCALE_SUBLANES = 8  # a float32 scale block's rows pad to 8
# What Mosaic allocated beyond the kernels' buffers (the fit's constant: about 0.9 MiB for gate/up, none for
# the return), rounded up; kept free.
GATE_UP_INTERNAL_BYTES = 1 << 20
DOWN_INTERNAL_BYTES = 1 << 18


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one kernel's weights are stored: `item` bytes per stored element (float: its dtype's; int8 and
    float8_e4m3fn: 1) and `scale_rows` (a QArray's k / block float32 scale rows; None for float weights)."""

    item: int
    scale_rows: int | None = None


def weight_format(w) -> WeightFormat:
    """The format of weights [local, k, n] (an array, a QArray scaled along k, or a tuple of parts)."""
    part = weight_parts(w)[0]
    if isinstance(part, QArray):
        return WeightFormat(jnp.dtype(part.dtype).itemsize, part.scale_shape[1])
    return WeightFormat(jnp.dtype(part.dtype).itemsize)


def vmem_budget() -> int:
    """The scoped VMEM of the chip the kernels are lowered for (`devices.judging`'s, else this machine's)."""
    return devices.tpu_scoped_vmem_bytes()


def _weights(tk: int, tn: int, weights: WeightFormat) -> int:
    """One weight operand's VMEM: its blocks double-buffered, and when quantized its float32 scale blocks (the
    dequantized values stay in vector registers: no [tk, tn] float32 block was seen in the fit)."""
    need = 2 * tk * tn * weights.item
    if weights.scale_rows is not None:
        need += 2 * round_up(weights.scale_rows, SCALE_SUBLANES) * tn * 4
    return need


def _reserve() -> int:
    reserve, _ = devices.tpu_vmem_model()
    return reserve


def gate_up_vmem_bytes(tm: int, tk: int, tn: int, *, word_bytes: int, x_dtype, weights: WeightFormat) -> int:
    """VMEM of `dispatch_gate_up` at tiles (tm, tk, tn): `word_bytes` the bytes of one gathered row as it
    travels (hidden x 2 packed bfloat16, else hidden x 4), activations `x_dtype` (its output's), `weights`
    the gate and up operands' format. Terms: Mosaic's own `GATE_UP_INTERNAL_BYTES`, gate and up blocks,
    1 byte per weight element more (the fit's residual along the blocks), two float32 accumulators and the
    double-buffered output block, twice the row scratch (the scratch and its unpacked rows) and 2 bytes per
    element of the [tm, tk] step (the dot's operand)."""
    item = jnp.dtype(x_dtype).itemsize
    return (_reserve() + GATE_UP_INTERNAL_BYTES + 2 * _weights(tk, tn, weights) + tk * tn
            + tm * tn * (2 * 4 + 2 * item) + 2 * tm * word_bytes + 2 * tm * tk)


def down_vmem_bytes(tm: int, tk: int, tn: int, *, h_dtype, packed: bool, weights: WeightFormat) -> int:
    """VMEM of `down_return` at tiles (tm, tk, tn): h blocks of `h_dtype`, output rows as packed bfloat16
    words (`packed`: tn / 2 words per row) or float32, `weights` the down operand's format. Terms:
    `DOWN_INTERNAL_BYTES`, the weight blocks, the float32 accumulator, two staging slots of words, the
    double-buffered h blocks and 2 bytes per element of them more (the dot's operand)."""
    tw = tn // 2 if packed else tn
    item = jnp.dtype(h_dtype).itemsize
    return (_reserve() + DOWN_INTERNAL_BYTES + _weights(tk, tn, weights) + tm * tn * 4 + 2 * tm * tw * 4
            + tm * tk * (2 * item + 2))


def words_aligned(tn: int, width: int, *, packed: bool) -> bool:
    """Whether the return's output tile of `tn` of `width` columns moves as whole 128-lane rows of words: packed
    bfloat16 halves (tn / 2 words) need tn a multiple of 256, or all of the width (Mosaic refuses a row copy
    of 64 words: "Source and target leading tiles have different trailing dimensions", libtpu 0.0.42)."""
    return not packed or tn == width or (tn // 2) % LANES == 0


def fits_vmem(need: Callable[[int, int, int], int]) -> Callable[[int, int, int], bool]:
    """A tile predicate: `need(tm, tk, tn)` within the chip's scoped VMEM."""
    return lambda tm, tk, tn: need(tm, tk, tn) <= vmem_budget()


def schedule_bytes(rows: int, tm: int, groups: int) -> int:
    """SMEM of `visit_schedule`'s tables: group and tile ids per visit, starts and ends per group, info [3]."""
    return 4 * (2 * max_visits(round_up(rows, tm), tm, groups) + 2 * groups + 3)


def gate_up_smem_bytes(entries: int, rows_in: int, local: int, tm: int) -> int:
    """SMEM of `dispatch_gate_up`'s scalar prefetch: the schedule, three int32 per sent entry (src, dev,
    dest) and the counts int32 [3 local + 1]."""
    return schedule_bytes(rows_in, tm, local) + 4 * (3 * entries + 3 * local + 1)


def down_smem_bytes(rows: int, local: int, devices_: int, tm: int) -> int:
    """SMEM of `down_return`: the schedule, three int32 per (local expert, device) segment, `expected` [1] and
    the int32 [4] pending-DMA scratch."""
    return schedule_bytes(rows, tm, local) + 4 * (3 * local * devices_ + 1 + 4)


def smem_error(smem: int, what: str) -> str | None:
    """Why `smem` bytes of `what` cannot sit in SMEM (past `SMEM_METADATA_BYTES`), or None."""
    if smem > SMEM_METADATA_BYTES:
        return f"{what} ({smem / 1024:.0f} KiB) exceed {SMEM_METADATA_BYTES // 1024} KiB of SMEM"
    return None
