"""`tiled` backend: pure-JAX grouped matmuls, the CPU backend.

gmm (fwd, dlhs) loops over groups; each group's rows go through full `tm`-row tiles (unmasked, big dots)
and then `tail`-row tiles for the rest (masked, small), so a group wastes fewer than `tail` rows; the
k x n plane is split into `tk` x `tn` blocks (one dot each). tgmm (drhs) cuts each group's rows into windows
of `tm` rows and writes each group's [k, n] result once, either from one batched dot over every group's
first window or from a loop over groups with a 2-D dot per window (`batched`); it ignores `tail`, `tk` and
`tn`. What was measured to choose this design: benchmarks/FINDINGS.md, "CPU ragged_dot".

bfloat16 operands and outputs are carried through the loops as their uint16 bits (an operand viewed so per
block, by `pallas_util.per_iteration`, never copied whole) and quantized operands (see `quantized.py`) as
their 1-byte values; both are converted block by block inside the loop by the same `pallas_util.load` (why:
`pallas_util`). Scales apply where the direction's plan says (`quant_plan.py`; one product function per
direction): fwd per row / channel once per result block after its k loop, sub-channel per k chunk (`tk` a
multiple or a divisor of the block) or, with `dequantize`, on each group's weights before full-k dots; dlhs
sub-channel on each weight block. A gmm whose tail tiles hold at most 4 rows runs bf16 dots in f32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import KernelConfig, positive_int_error
from moe_tune.kernels.pallas_util import as_bits, from_bits, load, packed_bytes, per_iteration, update_slice
from moe_tune.kernels.pallas_util import round_up, vary_like
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.metadata import group_bounds
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.quant_plan import Apply, LhsQuant, gmm_plan, problem_plan, tgmm_plan
from moe_tune.kernels.ragged_dot.quantized import prepare_gmm, prepare_tgmm
from moe_tune.kernels.ragged_dot.tiled_dots import cpu_dot_dtypes as _dot_dtypes, dlhs_product, fwd_product, tile_dots

# Cap on column blocks x contraction chunks per visit: each one is an unrolled dot in the loop body, and
# compile time grows with them.
MAX_BLOCKS_PER_VISIT = 32


@dataclasses.dataclass(frozen=True)
class TiledConfig(KernelConfig):
    """tm: rows per tile (drhs: rows per window, see `drhs_window`); tail: rows per tile for what is left of
    a group after its full `tm`-row tiles; tk, tn: blocks of the k x n plane (for dlhs: of n x k, the matmul
    it runs). Clamped to the dimensions they tile. batched: drhs's schedule (one batched dot over every
    group's first window, or a loop over groups; see `tiled_transposed_ragged_dot`). dequantize: fwd with
    sub-channel weight scales and float activations dequantizes each group's weights before its dots, instead
    of a dot per scale block (see `tiled_ragged_dot`). fwd and dlhs use tm, tail, tk and tn (fwd also
    dequantize); drhs uses tm and batched."""

    tm: int = 256
    tk: int = 1024
    tn: int = 1024
    tail: int = 32
    batched: bool = True
    dequantize: bool = False


def tiled_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tm: int,
    tk: int,
    tn: int,
    tail: int,
    out_dtype: jnp.dtype,
    group_offset: jax.Array | None = None,
    transpose_rhs: bool = False,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    dequantize: bool = False,
    lhs_quant: LhsQuant | None = None,
) -> jax.Array:
    """gmm. lhs [m, k], rhs [groups, k, n] ([groups, n, k] if transpose_rhs), group_sizes int [total_groups]
    -> [m, n] in out_dtype. Quantized lhs / rhs values (1-byte, 4-bit) come with the scales of
    `quantized.GmmOperands`; lhs_quant: a float lhs each row tile quantizes (dynamic w8a8).
    dequantize: with a float lhs and sub-channel rhs scales (fwd), dequantize each group's weights to the
    dot's dtype (once per group: the blocks depend on the group only, and XLA hoists them out of the tile
    loops) and run full tk chunks, rather than a dot per scale block with its scales applied to the result.

    Each group's rows are cut into tiles that start at the group's first row: as many full `tm`-row tiles
    as fit, which need no mask, then the rest in `tail`-row tiles, masked to the group. A group of s rows
    thus costs floor(s / tm) big dots and at most ceil(tm / tail) small ones, and wastes fewer than `tail`
    rows, where one tile size has to choose between big tiles (efficient dots, up to tm - 1 rows wasted per
    group) and small ones (no waste, slow dots).
    """
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tail, tk, tn = min(tm, m), min(tail, tm, m), min(tk, k), min(tn, n)
    starts, ends = group_bounds(group_sizes, m=m, groups=groups,
                                group_offset=0 if group_offset is None else group_offset)
    # `dequantize` applies where the plan says (`QuantPlan.dequantizable`), as the config check asks it
    plan = gmm_plan(lhs, lhs_scale, rhs, rhs_scale, lhs_quant, transpose_rhs=transpose_rhs).kernel_plan()
    plan = plan.with_dequantize(dequantize)
    dots = tile_dots(plan, k=k, n=n, tk=tk, tn=tn, min_rows=tail, out_dtype=out_dtype, transpose_rhs=transpose_rhs)
    rhs = packed_bytes(rhs) if dots.packed else rhs  # once, outside the loops: one pass (pallas_util)
    product = functools.partial(dlhs_product if transpose_rhs else fwd_product, dots=dots)
    row_scales = lambda row0, rows: (None if lhs_scale is None
                                     else jax.lax.dynamic_slice_in_dim(lhs_scale, row0, rows, axis=0))
    row_in_tail = jax.lax.broadcasted_iota(jnp.int32, (tail, 1), 0)

    def group_rows(g, out):
        start, end = starts[g], ends[g]
        full = jnp.maximum(end - start, 0) // tm
        w = as_bits(per_iteration(rhs, g))[g]  # sliced once per group, not once per tile
        ws = None if rhs_scale is None else rhs_scale[g]

        def full_tile(t, out):
            row0 = start + t * tm
            x = jax.lax.dynamic_slice_in_dim(as_bits(per_iteration(lhs, t)), row0, tm, axis=0)
            for n0, block in product(x, w, row_scales(row0, tm), ws):
                out = jax.lax.dynamic_update_slice(out, as_bits(block), (row0, n0))
            return out

        def tail_tile(t, out):
            first = start + full * tm + t * tail
            # Shifted back to end at row m when it would run past it; rows before `first` were written by
            # earlier tiles and keep their values.
            row0 = jnp.minimum(first, m - tail)
            rows = row0 + row_in_tail
            keep = (rows >= first) & (rows < end)
            x = jax.lax.dynamic_slice_in_dim(as_bits(per_iteration(lhs, t)), row0, tail, axis=0)
            for n0, block in product(x, w, row_scales(row0, tail), ws):
                current = jax.lax.dynamic_slice(out, (row0, n0), block.shape)
                out = jax.lax.dynamic_update_slice(out, jnp.where(keep, as_bits(block), current), (row0, n0))
            return out

        out = jax.lax.fori_loop(0, full, full_tile, out)
        tails = (end - (start + full * tm) + tail - 1) // tail
        return jax.lax.fori_loop(0, jnp.maximum(tails, 0), tail_tile, out)

    # a 2-byte output is carried as its bits too, so that every tile's update is in place; inside shard_map it
    # varies over the axes its operands vary over (`vary_like`: the carry's type must be the body's)
    zeros = vary_like(jnp.zeros((m, n), out_dtype), lhs, rhs, group_sizes, group_offset, lhs_scale, rhs_scale)
    out = jax.lax.fori_loop(0, groups, group_rows, as_bits(zeros))
    return from_bits(out, out_dtype)


def drhs_window(tm: int, *, m: int, groups: int) -> int:
    """The rows per window tgmm uses for a `tm` config: at most twice an average group (its gathered
    windows then take at most about twice the memory of lhs, whatever config a table lookup brought) and
    at most m."""
    return max(1, min(tm, m, round_up(2 * -(-m // max(groups, 1)), 16)))


def tiled_transposed_ragged_dot(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    tm: int,
    batched: bool,
    out_dtype: jnp.dtype,
    num_groups: int,
    group_offset: jax.Array | None = None,
    lhs_scale: jax.Array | None = None,
) -> jax.Array:
    """tgmm. lhs [m, k], dout [m, n] -> [num_groups, k, n]: group g's result is lhs[rows of g]^T @
    dout[rows of g] (zeros for an empty group), accumulated in f32 for low-precision outputs. 1-byte lhs
    values are converted per window (times their sub-channel scale f32 [m, k/bs], if given) to float32.

    Each group's rows are cut into windows of `tm` rows (see `drhs_window`) that start at the group's first
    row, rows past the group masked to zero; a `tm` at about the largest group size makes one dot per
    group, written once: the [k, n] results are what costs when groups are small (g x k x n output for
    2 x m x k x n FLOPs), and a schedule that adds every tile into its group's result reads and writes
    them per tile. Two schedules (FINDINGS.md: bf16 ragged_dot on CPU):
    - batched: every group's first window gathered into [num_groups, tm, k] and [num_groups, tm, n], one
      batched dot for all of them, then a loop adds the further windows of longer groups. No loop over
      groups: the faster schedule for many small groups in float32.
    - per group (not batched): a loop over groups, a 2-D dot per window, each result written once. XLA
      CPU's batched dot runs bfloat16 well below its 2-D dot's rate, so this is the faster one for bf16.
    """
    m, k = lhs.shape
    n = dout.shape[1]
    window = drhs_window(tm, m=m, groups=num_groups)
    starts, ends = group_bounds(group_sizes, m=m, groups=num_groups,
                                group_offset=0 if group_offset is None else group_offset)
    in_window = jnp.arange(window, dtype=jnp.int32)
    plan = tgmm_plan(lhs, lhs_scale, dout).kernel_plan()
    # quantized lhs values: dequantized one window at a time, in f32 (times their sub-channel scale)
    operand, acc_dtype = (jnp.dtype(jnp.float32),) * 2 if plan.float32_dots else _dot_dtypes(lhs.dtype, dout.dtype)
    x_dtype, d_dtype = lhs.dtype, dout.dtype
    # bf16 windows in the per-group schedule read lhs transposed, [k, m], made once (one pass over lhs): the
    # window's dot is then x^T [k, window] @ dout [window, n], a form XLA CPU runs in its bf16 dot library
    # (a `__ynn_fusion`); the contraction over the rows of both operands (the form of the f32 path) it runs
    # in float32 instead, 1.6-1.7x slower at deepseek-v2-lite's prefill drhs (FINDINGS.md: bf16 drhs transposed lhs).
    # A transpose made per window is folded back into the dot by XLA, so the whole of lhs is transposed, and
    # only for more than 2 groups: with 2 the group loop runs once, XLA inlines it, folds the transpose into
    # the dot as well and then fails to run the bf16 dot it made ("Unsupported element type for
    # DotThunk::Execute: BF16 x BF16 = F32"; `windows`' in_loop is the same case for group 0).
    lhs_t = (as_bits(lhs).T if not batched and num_groups > 2 and operand == jnp.bfloat16
             and x_dtype == jnp.bfloat16 and plan.a.scale is not Apply.DEQUANTIZE else None)

    def windows(step, first, end, in_loop: bool = True):
        """[b, k, n] in acc_dtype: for each of b groups (first, end: int [b]), the product of its rows in
        [first, end) of the window that starts at `first`; `step`: the loop iteration it runs in; `in_loop`
        False: a dot outside every loop, which reads lhs untransposed (see lhs_t)."""
        # per_iteration: the bf16 -> bits view fuses into this window's slice or gather (pallas_util); a view
        # made once outside a loop is a pass over the whole operand.
        x_bits, d_bits = as_bits(per_iteration(lhs, step)), as_bits(per_iteration(dout, step))
        row0 = jnp.minimum(first, m - window)  # shifted back to end at row m
        rows = row0[:, None] + in_window[None, :]  # [b, window]
        keep = (rows >= first[:, None]) & (rows < jnp.minimum(end, first + window)[:, None])
        if len(first) == 1 and lhs_t is not None and in_loop:  # x^T [k, window] @ dout window [window, n] (see lhs_t)
            x = load(jax.lax.dynamic_slice_in_dim(lhs_t, row0[0], window, axis=1), x_dtype, operand)
            x = jnp.where(keep[0][None, :], x, jnp.zeros((), operand))
            d = load(jax.lax.dynamic_slice_in_dim(d_bits, row0[0], window, axis=0), d_dtype, operand)
            product = jax.lax.dot_general(x, d, (((1,), (0,)), ((), ())), preferred_element_type=acc_dtype)
            return product.reshape(1, k, n)
        if len(first) == 1:  # a slice and a 2-D dot: XLA CPU's gather and batched dot are slower
            take = lambda a: jax.lax.dynamic_slice_in_dim(a, row0[0], window, axis=0)
            keep, dims = keep[0], (((0,), (0,)), ((), ()))
        else:
            take, dims = (lambda a: a[rows]), (((1,), (1,)), ((0,), (0,)))
        scale = jnp.repeat(take(lhs_scale), plan.a.block, axis=-1) if plan.a.scale is Apply.DEQUANTIZE else None
        x = jnp.where(keep[..., None], load(take(x_bits), x_dtype, operand, scale), 0.0)
        product = jax.lax.dot_general(x, load(take(d_bits), d_dtype, operand), dims, preferred_element_type=acc_dtype)
        return product.reshape(len(first), k, n)

    def later_windows(g):
        """(count, product): how many windows group g has after its first, and window w's [1, k, n] product
        (w = 0 for the second window)."""
        start, end = starts[g], ends[g]
        count = (jnp.maximum(end - start - window, 0) + window - 1) // window
        return count, lambda w: windows(w, (start + (w + 1) * window)[None], end[None])

    if batched:
        def add_later(g, out):
            count, product = later_windows(g)
            add = lambda w, out: jax.lax.dynamic_update_slice_in_dim(
                out, jax.lax.dynamic_slice_in_dim(out, g, 1) + product(w), g, axis=0)
            return jax.lax.fori_loop(0, count, add, out)

        first = vary_like(windows(0, starts, ends), lhs, dout, group_sizes, group_offset, lhs_scale)
        return jax.lax.fori_loop(0, num_groups, add_later, first).astype(out_dtype)

    def result(g, in_loop: bool = True):
        """[1, k, n] in out_dtype: group g's result."""
        count, product = later_windows(g)
        first = vary_like(windows(g, starts[g][None], ends[g][None], in_loop), lhs, dout, group_sizes, group_offset,
                          lhs_scale)
        acc = jax.lax.fori_loop(0, count, lambda w, acc: acc + product(w), first)
        return acc.astype(out_dtype)

    # The output is carried in its own dtype and each group's block written in place (`update_slice`: a
    # bfloat16 one through its bits), so the loop runs in the output's buffer. It starts as group 0's
    # result repeated, not as zeros: every group's block is written (an empty group's with zeros), and a
    # constant init is one XLA CSEs between two drhs of one shape (gate and up), after which neither loop
    # runs in its own buffer (a weight-sized copy each; FINDINGS.md: drhs carry in its output).
    init = jnp.broadcast_to(result(jnp.int32(0), False), (num_groups, k, n))
    return jax.lax.fori_loop(1, num_groups, lambda g, out: update_slice(out, result(g), (g, 0, 0)),
                             vary_like(init, lhs, dout, group_sizes, group_offset, lhs_scale))


def _pow2_up_to(limit: int, low: int) -> list[int]:
    values, v = [], low
    while v < limit:
        values.append(v)
        v *= 2
    return values + [limit]


# Tail tile sizes the sweep tries (fwd, dlhs): small enough to waste little of a group's last tile, big
# enough that its dot is not dominated by overhead.
TAIL_SIZES = (16, 32, 64)

# Also tried when an average group holds no more rows than the smallest of TAIL_SIZES (decode: m=256 over
# 64 groups is 4 rows a group): a 16-row tail computes up to 4x a group's rows, and those wasted dot FLOPs,
# not the weight bytes, were most of the time, for 1-byte and float weights alike (FINDINGS.md: small
# tails at decode: f32 74.6 -> 43.6 ms at 64 groups of 4 rows). No shipped table has groups that small.
SMALL_GROUP_TAIL_SIZES = (4, 8)


# drhs windows the sweep tries, in eighths of an average group: balanced routing's largest group is about
# an eighth to a quarter above the average at the sizes of MoE layers.
DRHS_WINDOW_EIGHTHS = (4, 8, 9, 10, 12, 16)


def _is_gmm(problem: RaggedDotProblem) -> bool:
    """fwd and dlhs run gmm (tiles, tail tiles, tk x tn blocks); drhs runs tgmm (windows of tm rows)."""
    return problem.direction != "drhs"


class TiledRaggedDot(RaggedDotBackend):
    name = "tiled"
    # bump on changes that can change the fastest or a valid config (Backend.revision); 7: a bf16 drhs per
    # group reads lhs transposed into XLA CPU's bf16 dot (1.6x at prefill), so its fastest window can change
    revision = 7
    config_cls = TiledConfig
    platforms = ("cpu", "gpu", "tpu")
    description = ("pure-JAX loop over each group's row tiles (full tiles, then small tail tiles); drhs: a dot "
                   "over each group's window, batched or in a loop over groups; the CPU backend")

    def config_error(self, config: TiledConfig, problem: RaggedDotProblem) -> str | None:
        for field in ("tm", "tk", "tn", "tail"):
            if error := positive_int_error(field, getattr(config, field)):
                return error
        for field in ("batched", "dequantize"):
            if not isinstance(getattr(config, field), bool):
                return f"{field} must be true or false, got {getattr(config, field)!r}"
        plan = problem_plan(problem)
        if config.dequantize and not plan.dequantizable:
            return "dequantize applies only to fwd with sub-channel weight scales and float activations"
        if not _is_gmm(problem):
            return None
        if config.tail > config.tm:
            return f"tail ({config.tail}) must not exceed tm ({config.tm})"
        _, k, n = problem.matmul_dims()
        chunk = min(config.tk, k)
        for block in plan.with_dequantize(config.dequantize).step_blocks:  # k chunks the plan scales per step
            if chunk % block and block % chunk:
                return f"tk={config.tk} must be a multiple of the scale block {block} or divide it"
        # Counted in tk chunks: sub-channel scales cut them further (k / block dots), whatever the config,
        # so counting those would leave no valid config for long k (k=7168 in blocks of 128: 56).
        blocks = -(-k // chunk) * -(-n // min(config.tn, n))
        if blocks > MAX_BLOCKS_PER_VISIT:
            return f"{blocks} dots per visit (k/tk * n/tn) exceeds {MAX_BLOCKS_PER_VISIT}"
        return None

    def default_config(self, problem: RaggedDotProblem) -> TiledConfig:
        m, k, n = problem.matmul_dims()
        rows_per_group = max(m // problem.groups, 1)
        if _is_gmm(problem):
            # Full tiles as big as an average group (up to 512 rows), so that most rows go through big dots;
            # tails of 1/8 of that keep the waste per group small, and groups of a few rows (decode) get a
            # tail about their size: wasted tail rows were most of the time there (FINDINGS.md: small tails at decode).
            tm = min(max(32, 1 << rows_per_group.bit_length() - 1), 512, m)
            small = [t for t in SMALL_GROUP_TAIL_SIZES if t >= rows_per_group]
            tail = small[0] if small else max(16, tm // 8)
            # dequantized sub-channel weights won at every shape measured (FINDINGS.md: sub-channel dequantize)
            dequantize = problem_plan(problem).dequantizable
            return TiledConfig(tm=tm, tk=k, tn=n, tail=min(tail, tm), dequantize=dequantize)
        # drhs: a window 2.5 standard deviations above an average group holds the groups of balanced
        # routing (multinomial) whole and pads little: a longer default window, kept by sweeps whose faster
        # candidates lay within noise of it, cost up to 20%. A bf16 dot runs per group (XLA CPU's batched
        # bf16 dot is slow: FINDINGS.md: bf16 ragged_dot on CPU), any other batched.
        p = 1 / max(problem.groups, 1)
        window = round_up(math.ceil(m * p + 2.5 * math.sqrt(m * p * (1 - p))), 16)
        bf16_dot = _dot_dtypes(problem.lhs_dtype, problem.out_dtype)[0] == jnp.bfloat16
        return TiledConfig(tm=min(window, m), tk=k, tn=n, batched=not bf16_dot)

    def candidate_values(self, problem: RaggedDotProblem) -> dict[str, list[int]]:
        m, k, n = problem.matmul_dims()
        if not _is_gmm(problem):
            # windows around the average group size: shorter ones split groups, longer ones pad them
            rows_per_group = max(m // problem.groups, 1)
            windows = {min(round_up(max(rows_per_group * f // 8, 1), 16), m) for f in DRHS_WINDOW_EIGHTHS}
            return {"tm": sorted(windows), "tk": [k], "tn": [n], "tail": [TiledConfig.tail], "batched": [True, False]}
        plan = problem_plan(problem)
        small_groups = m // problem.groups <= min(TAIL_SIZES)
        return {
            "tm": _pow2_up_to(min(m, 1024), 32),
            "tk": sorted({k, *(v for v in (512, *plan.step_blocks) if v < k)}),
            "tn": sorted({n, *(v for v in (512,) if v < n)}),
            "tail": [*(SMALL_GROUP_TAIL_SIZES if small_groups else ()), *TAIL_SIZES],
            **({"dequantize": [True, False]} if plan.dequantizable else {}),
        }

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        ops = prepare_gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs)
        return tiled_ragged_dot(ops.lhs, ops.rhs, group_sizes, tm=config.tm, tk=config.tk, tn=config.tn,
                                tail=config.tail, out_dtype=out_dtype, group_offset=group_offset,
                                transpose_rhs=transpose_rhs, lhs_scale=ops.lhs_scale, rhs_scale=ops.rhs_scale,
                                dequantize=config.dequantize, lhs_quant=ops.lhs_quant)

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        lhs, lhs_scale, dout = prepare_tgmm(lhs, dout)
        return tiled_transposed_ragged_dot(lhs, dout, group_sizes, tm=config.tm, batched=config.batched,
                                           out_dtype=out_dtype,
                                           num_groups=num_groups, group_offset=group_offset, lhs_scale=lhs_scale)
