"""`pallas_tpu` backend: dispatch and combine as Pallas Mosaic kernels on the TPU TensorCore, built from one
DMA per gathered row. Off TPU they run in Pallas TPU interpret mode (DMAs and semaphores simulated on the
CPU), which is slow and only meant for tests at small shapes.

- Dispatch (`ragged_gather`): the grid walks blocks of `block_rows` output rows. `indices` and the clipped
  [start, end) sit in SMEM (scalar prefetch); x stays in HBM. A step whose block overlaps the range issues
  one HBM -> VMEM DMA per row in the overlap, straight into the output block, then (weighted) scales the
  block in float32 and zeroes the rows outside the range. A step wholly outside the range only stores
  zeros. Rows outside the range are never read, whatever their indices hold.
- Combine (`ragged_gather_reduce` / `dense_gather_reduce`): the grid walks blocks of `block_tokens` output
  tokens. Each step DMAs the x rows of its valid entries into a VMEM scratch laid out [r, block_tokens,
  hidden] (entry j of every token in one slab), then sums the r slabs in float32 with their weights;
  invalid entries get no DMA and are selected away, so their NaN rows never reach the sum.

A bfloat16 x travels as 32-bit rows (`pallas_tpu_rows.py`: Mosaic copies single rows of 32-bit arrays
only), landing in a 32-bit VMEM scratch, written out in bfloat16 after the float32 weighting / reduce.

At most `dmas_in_flight` row DMAs are outstanding at once: a ring of that many DMA semaphores, where
issuing the n-th copy first waits for copy n - dmas_in_flight (same semaphore). More in flight hides HBM
latency for small rows; fewer keeps the DMA queues from being flooded. Validity rules (tile alignment,
VMEM and SMEM budgets) live in `config_error` of each backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_tune.core import devices
from moe_tune.kernels.base import KernelConfig, positive_int_error
from moe_tune.kernels.gather.base import GatherBackend, GatherReduceBackend
from moe_tune.kernels.gather.pallas_tpu_rows import LANES, stage_rows, staged_row_bytes, staging, unstage_rows
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.pallas_util import interpreted, out_struct, pallas_run, round_up, sublanes

# Each in-flight DMA owns one semaphore of the ring; keep the ring modest.
MAX_DMAS_IN_FLIGHT = 64
# Scalar prefetch copies `indices` (int32 [rows]) into SMEM, whose scoped budget is 1 MiB up to v6e. Half of
# it is left to Mosaic's own scalars (the margin vLLM's TPU backend also keeps for its page tables).
SMEM_PREFETCH_BYTES = 512 * 1024
# The default block is the largest whose blocks take at most this much VMEM: a step then moves a few MiB,
# which amortizes the ~0.35 us per-step overhead, and the rest of the budget is slack for Mosaic's own
# temporaries (the estimates below are approximate).
DEFAULT_VMEM_BYTES = devices.TPU_SCOPED_VMEM_BYTES // 2
DEFAULT_DMAS_IN_FLIGHT = 16
BLOCKS = (8, 16, 32, 64, 128, 256, 512, 1024)
DMAS = (4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class PallasTpuGatherConfig(KernelConfig):
    """block_rows: output rows per grid step; dmas_in_flight: row DMAs outstanding at once."""

    block_rows: int = 128
    dmas_in_flight: int = 16


@dataclasses.dataclass(frozen=True)
class PallasTpuGatherReduceConfig(KernelConfig):
    """block_tokens: output tokens per grid step (each gathers r rows); dmas_in_flight: row DMAs outstanding
    at once."""

    block_tokens: int = 64
    dmas_in_flight: int = 16


def _interpret():
    """False on TPU; elsewhere the TPU interpreter, which simulates DMAs and semaphores (and fills fresh
    VMEM with NaN, so a row the kernel forgot to write shows up in the output)."""
    return pltpu.InterpretParams() if interpreted("tpu") else False


def _lane_padded_bytes(rows: int, cols: int, itemsize: int = 4) -> int:
    """VMEM a [rows, cols] block takes once padded to whole (8, 128) tiles: narrow weight columns cost 128
    lanes each."""
    return round_up(rows, 8) * round_up(cols, LANES) * itemsize


def gather_vmem_bytes(config: PallasTpuGatherConfig, problem: GatherProblem) -> int:
    """Double-buffered output block, the double-buffered [block_rows, 1] f32 weights block, the 32-bit
    landing scratch of a bfloat16 x, and the f32 temporaries (scaled rows, row ids) of the weighting /
    unstaging pass."""
    rows = min(config.block_rows, problem.rows)
    need = 2 * rows * problem.row_bytes()
    stage = staging(problem.dtype, problem.hidden)
    if stage is not None:
        need += rows * staged_row_bytes(problem)
    if problem.weighted:
        need += 2 * _lane_padded_bytes(rows, 1)
    if problem.weighted or stage is not None:
        need += 2 * rows * problem.hidden * 4
    return need


def gather_reduce_vmem_bytes(config: PallasTpuGatherReduceConfig, problem: GatherProblem) -> int:
    """The [r, block_tokens, hidden] landing scratch (32-bit rows for a bfloat16 x), the double-buffered output
    block, the f32 accumulator and one f32 slab temporary, and the double-buffered [block_tokens, r] weights
    and validity blocks."""
    tokens, r = min(config.block_tokens, problem.tokens), problem.top_k
    return (r * tokens * staged_row_bytes(problem) + 2 * tokens * problem.row_bytes()
            + 2 * tokens * problem.hidden * 4 + 2 * 2 * _lane_padded_bytes(tokens, r))


def _shape_error(problem: GatherProblem) -> str | None:
    """Why no config can serve `problem` at all (independent of the tunables)."""
    if jnp.dtype(problem.dtype) == jnp.float16:
        # The real compiler (libtpu 0.0.42, v5e and v6e) fails to legalize the kernels' float16 vector stores.
        return ("dtype float16: Mosaic cannot store float16 vectors ('failed to legalize operation tpu.store'); "
                "pallas_tpu serves float32 and bfloat16 (use the jax or tiled backend)")
    if problem.hidden % LANES:
        return (f"hidden={problem.hidden} is not a multiple of {LANES} lanes: pallas_tpu copies whole "
                f"lane-aligned rows and cannot serve it (use the jax or tiled backend)")
    if 4 * problem.rows > SMEM_PREFETCH_BYTES:
        return (f"rows={problem.rows}: the int32 indices ({4 * problem.rows / 1024:.0f} KiB) exceed the "
                f"{SMEM_PREFETCH_BYTES // 1024} KiB of SMEM pallas_tpu allows its scalar prefetch")
    return None


def _tunable_error(name: str, value, align: int, limit: int) -> str | None:
    if error := positive_int_error(name, value):
        return error
    if value % align:
        return f"{name}={value} is not a multiple of {align} (sublanes of the block's tile for this dtype)"
    if value > limit:
        return f"{name}={value} exceeds {limit} (the size rounded up to {align})"
    return None


def _dmas_error(dmas, per_block: int) -> str | None:
    if error := positive_int_error("dmas_in_flight", dmas):
        return error
    if dmas > MAX_DMAS_IN_FLIGHT:
        return f"dmas_in_flight={dmas} exceeds {MAX_DMAS_IN_FLIGHT} (one DMA semaphore each)"
    if dmas > per_block:
        return f"dmas_in_flight={dmas} exceeds the {per_block} row DMAs one grid step can issue"
    return None


def _vmem_error(need: int) -> str | None:
    if need > devices.TPU_SCOPED_VMEM_BYTES:
        return (f"blocks need {need / 2**20:.1f} MiB of VMEM, over "
                f"{devices.TPU_SCOPED_VMEM_BYTES / 2**20:.0f} MiB")
    return None


def _default_block(vmem_bytes, cap: int, size: int, align: int) -> int:
    """The largest power-of-two multiple of `align`, within [align, cap], with vmem_bytes(block) <=
    DEFAULT_VMEM_BYTES, and no larger than `size` rounded up to `align`."""
    block = align
    while block * 2 <= cap and vmem_bytes(block * 2) <= DEFAULT_VMEM_BYTES:
        block *= 2
    return min(block, round_up(size, align))


def _block_candidates(size: int, align: int) -> list[int]:
    return sorted({b for b in (align, 2 * align, *BLOCKS) if b % align == 0 and b <= round_up(size, align)})


class RowDmaRing:
    """Row copies x_hbm[src] -> a [1, hidden] VMEM ref with at most `size` of them outstanding.

    Copy number n (counted per grid step) uses semaphore n % size and, when n >= size, first waits for
    copy n - size, which used the same semaphore. A wait only needs a descriptor of the same byte count,
    so waits are built on row 0 / `landing` rather than the rows actually copied."""

    def __init__(self, x_hbm, landing, sems, size: int):
        self.x_hbm, self.landing, self.sems, self.size = x_hbm, landing, sems, size

    def _copy(self, src_row, dst, slot):
        return pltpu.make_async_copy(self.x_hbm.at[pl.ds(src_row, 1)], dst, self.sems.at[slot])

    def _wait(self, slot) -> None:
        self._copy(0, self.landing, slot).wait()

    def start(self, src_row, dst, count, slot) -> None:
        """Issue copy number `count` on semaphore `slot` (== count % size)."""
        @pl.when(count >= self.size)
        def _():
            self._wait(slot)

        self._copy(src_row, dst, slot).start()

    def next_slot(self, slot):
        return jnp.where(slot + 1 == self.size, 0, slot + 1)

    def drain(self, count) -> None:
        """Wait for the copies still outstanding after `count` were issued: one on each semaphore used."""
        def wait(slot, carry):
            self._wait(slot)
            return carry

        jax.lax.fori_loop(0, jnp.minimum(count, self.size), wait, 0)


def _gather_kernel(idx_ref, bounds_ref, *refs, block_rows: int, rows: int, dmas: int, weighted: bool,
                   stage: str | None):
    """One block of dispatch. idx_ref int32 [rows] and bounds_ref int32 [2] (clipped start, end) in SMEM;
    w_ref f32 [block_rows, 1] (weighted only); x_hbm [tokens, hidden] (staged: 32-bit [tokens, width]) in
    HBM; o_ref [block_rows, hidden]; buf [block_rows, width] 32-bit landing scratch (staged only)."""
    w_ref = refs[0] if weighted else None
    x_hbm, o_ref, *scratch, sems = refs[1:] if weighted else refs
    dst = scratch[0] if stage else o_ref  # where the row DMAs land
    row0 = pl.program_id(0) * block_rows
    lo = jnp.maximum(bounds_ref[0], row0)
    hi = jnp.minimum(bounds_ref[1], row0 + block_rows)

    @pl.when(lo >= hi)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(lo < hi)
    def _():
        if not weighted and stage is None:
            # Unweighted 32-bit rows are a pure copy: zero the block first (only when the range leaves part of it
            # uncovered) and let the DMAs overwrite the rows in range, so no vector pass touches them.
            @pl.when((lo > row0) | (hi < jnp.minimum(row0 + block_rows, rows)))
            def _():
                o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        ring = RowDmaRing(x_hbm, dst.at[pl.ds(0, 1)], sems, dmas)

        def issue(i, slot):
            ring.start(idx_ref[i], dst.at[pl.ds(i - row0, 1)], i - lo, slot)
            return ring.next_slot(slot)

        # The loop runs over the rows in range only: rows outside it are never read, so their indices may
        # be anything.
        jax.lax.fori_loop(lo, hi, issue, jnp.int32(0))
        ring.drain(hi - lo)

        if weighted or stage is not None:
            for col, piece in unstage_rows(dst[...], stage):
                row = row0 + jax.lax.broadcasted_iota(jnp.int32, piece.shape, 0)
                scaled = piece * w_ref[...] if weighted else piece
                # A select, not a multiply by a mask: rows out of range hold uninitialized VMEM (maybe NaN).
                o_ref[:, col:col + piece.shape[1]] = jnp.where((row >= lo) & (row < hi), scaled,
                                                               0.0).astype(o_ref.dtype)


def pallas_tpu_gather(x, indices, start, end, weights, *, block_rows: int, dmas_in_flight: int) -> jax.Array:
    """x [tokens, hidden] (f32/bf16, hidden a multiple of 128), indices int32 [rows], start / end int32
    scalars (traced), weights [rows] (any float) or None -> [rows, hidden] in x.dtype; out[i] =
    x[indices[i]] * weights[i] (in float32) for start <= i < end, zero elsewhere."""
    rows, hidden = indices.shape[0], x.shape[1]
    block = min(block_rows, rows)  # a block as tall as the whole array is always a legal TPU block
    start = jnp.clip(jnp.asarray(start, jnp.int32), 0, rows)
    end = jnp.clip(jnp.asarray(end, jnp.int32), start, rows)
    weighted = weights is not None
    stage = staging(x.dtype, hidden)
    xs = stage_rows(x, stage)
    in_specs = [pl.BlockSpec(memory_space=pl.ANY)]  # x: rows are fetched by hand, one DMA each
    operands = [xs]
    if weighted:
        in_specs.insert(0, pl.BlockSpec((block, 1), lambda b, idx, bounds: (b, 0)))
        operands.insert(0, weights.astype(jnp.float32).reshape(rows, 1))
    args = (indices.astype(jnp.int32), jnp.stack([start, end]), *operands)
    kernel = pl.pallas_call(
        lambda *refs: _gather_kernel(*refs, block_rows=block, rows=rows, dmas=dmas_in_flight,
                                     weighted=weighted, stage=stage),
        out_shape=out_struct((rows, hidden), x.dtype, *args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(pl.cdiv(rows, block),),  # a ragged last block is padded on read, clipped on write
            in_specs=in_specs,
            out_specs=pl.BlockSpec((block, hidden), lambda b, idx, bounds: (b, 0)),
            scratch_shapes=[*([] if stage is None else [pltpu.VMEM((block, xs.shape[1]), xs.dtype)]),
                            pltpu.SemaphoreType.DMA((dmas_in_flight,))],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=pl.CostEstimate(
            flops=2 * rows * hidden if weighted else 0, transcendentals=0,
            bytes_accessed=rows * (xs.shape[1] * xs.dtype.itemsize + hidden * x.dtype.itemsize) + 8 * rows),
        interpret=_interpret(),
        name="moe_tune_ragged_gather",
    )
    return pallas_run(kernel, *args, interpret=interpreted("tpu"))


def _gather_reduce_kernel(idx_ref, *refs, block_tokens: int, tokens: int, r: int, dmas: int, masked: bool,
                          stage: str | None):
    """One block of combine. idx_ref int32 [rows] in SMEM (-1 marks an invalid entry); w_ref f32
    [block_tokens, r]; keep_ref int32 [block_tokens, r] (masked only); x_hbm [rows, hidden] (staged: 32-bit
    [rows, width]) in HBM; o_ref [block_tokens, hidden]; buf [r, block_tokens, width] scratch in x_hbm's
    dtype."""
    if masked:
        w_ref, keep_ref, x_hbm, o_ref, buf, sems = refs
    else:
        w_ref, x_hbm, o_ref, buf, sems = refs
        keep_ref = None
    t0 = pl.program_id(0) * block_tokens
    ring = RowDmaRing(x_hbm, buf.at[0, pl.ds(0, 1)], sems, dmas)

    def issue(t, carry):
        count, slot = carry
        for j in range(r):  # entry j of token t lands in slab j, row t
            src, dst = idx_ref[(t0 + t) * r + j], buf.at[j, pl.ds(t, 1)]
            if not masked:
                ring.start(src, dst, count, slot)
                count, slot = count + 1, ring.next_slot(slot)
                continue
            ok = src >= 0

            @pl.when(ok)
            def _():
                ring.start(src, dst, count, slot)

            count, slot = count + ok.astype(jnp.int32), jnp.where(ok, ring.next_slot(slot), slot)
        return count, slot

    # Only tokens inside the array: the last block may hang past `tokens` (its output rows are dropped).
    count, _ = jax.lax.fori_loop(0, jnp.minimum(block_tokens, tokens - t0), issue, (jnp.int32(0), jnp.int32(0)))
    ring.drain(count)

    @pl.when(count == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(count > 0)
    def _():
        accs = {}  # first column -> float32 sum of its piece
        for j in range(r):
            for col, piece in unstage_rows(buf[j], stage):
                term = piece * w_ref[:, j:j + 1]
                if masked:  # a select: slabs of invalid entries were never written and may hold NaN
                    # Broadcast the int32 column before comparing: lane-broadcasting a 32-bit value is the
                    # common Mosaic path, broadcasting a boolean mask less so.
                    term = jnp.where(jnp.broadcast_to(keep_ref[:, j:j + 1], term.shape) != 0, term, 0.0)
                accs[col] = accs[col] + term if col in accs else term
        for col, acc in accs.items():
            o_ref[:, col:col + acc.shape[1]] = acc.astype(o_ref.dtype)


def pallas_tpu_gather_reduce(x, indices, weights, valid, reduce_group_size: int, *, block_tokens: int,
                             dmas_in_flight: int) -> jax.Array:
    """x [rows, hidden] (f32/bf16, hidden a multiple of 128), indices int32 [rows], weights [rows] (any
    float), valid bool [rows] or None (all valid), r = reduce_group_size -> [rows // r, hidden] in x.dtype;
    out[t] = sum_j valid[i] * weights[i] * x[indices[i]], i = t * r + j, accumulated in float32. Invalid
    entries are never read."""
    r = reduce_group_size
    rows, hidden = indices.shape[0], x.shape[1]
    tokens = rows // r
    block = min(block_tokens, tokens)
    idx = indices.astype(jnp.int32)
    masked = valid is not None
    operands = [weights.astype(jnp.float32).reshape(tokens, r)]
    if masked:
        valid = valid.astype(bool)
        idx = jnp.where(valid, idx, -1)  # validity rides along in SMEM: one int32 per entry, not two
        operands.append(valid.astype(jnp.int32).reshape(tokens, r))
    table_spec = pl.BlockSpec((block, r), lambda b, idx: (b, 0))
    stage = staging(x.dtype, hidden)
    xs = stage_rows(x, stage)
    args = (idx, *operands, xs)
    kernel = pl.pallas_call(
        lambda *refs: _gather_reduce_kernel(*refs, block_tokens=block, tokens=tokens, r=r, dmas=dmas_in_flight,
                                            masked=masked, stage=stage),
        out_shape=out_struct((tokens, hidden), x.dtype, *args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(tokens, block),),
            in_specs=[table_spec] * len(operands) + [pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((block, hidden), lambda b, idx: (b, 0)),
            scratch_shapes=[pltpu.VMEM((r, block, xs.shape[1]), xs.dtype), pltpu.SemaphoreType.DMA((dmas_in_flight,))],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=pl.CostEstimate(
            flops=2 * rows * hidden, transcendentals=0,
            bytes_accessed=rows * xs.shape[1] * xs.dtype.itemsize + tokens * hidden * x.dtype.itemsize + 12 * rows),
        interpret=_interpret(),
        name="moe_tune_gather_reduce",
    )
    return pallas_run(kernel, *args, interpret=interpreted("tpu"))


class _PallasTpuBackend:
    name = "pallas_tpu"
    revision = 3  # bump on changes that can change the fastest or a valid config (Backend.revision)
    platforms = ("tpu",)
    # Uses PrefetchScalarGridSpec, pl.ANY, make_async_copy, SemaphoreType.DMA and pltpu.InterpretParams
    # (simulated DMAs in interpret mode) as of jax 0.10; Pallas TPU APIs move between minor releases.
    jax_versions = ">=0.10,<0.12"

    def runs_on(self, platform: str) -> bool:
        return True  # natively on TPU, in interpret mode everywhere else


class PallasTpuGather(_PallasTpuBackend, GatherBackend):
    config_cls = PallasTpuGatherConfig
    description = "Pallas Mosaic TPU: one DMA per row in [start, end) into VMEM output blocks; interpret mode off TPU"

    def config_error(self, config: PallasTpuGatherConfig, problem: GatherProblem) -> str | None:
        sub = sublanes(problem.dtype)
        return (_shape_error(problem)
                or _tunable_error("block_rows", config.block_rows, sub, round_up(problem.rows, sub))
                or _dmas_error(config.dmas_in_flight, config.block_rows)
                or _vmem_error(gather_vmem_bytes(config, problem)))

    def default_config(self, problem: GatherProblem) -> PallasTpuGatherConfig:
        vmem = lambda block: gather_vmem_bytes(PallasTpuGatherConfig(block, 1), problem)
        block = _default_block(vmem, 512, problem.rows, sublanes(problem.dtype))
        return PallasTpuGatherConfig(block_rows=block, dmas_in_flight=min(DEFAULT_DMAS_IN_FLIGHT, block))

    def candidate_values(self, problem: GatherProblem) -> dict[str, list[int]]:
        return {"block_rows": _block_candidates(problem.rows, sublanes(problem.dtype)), "dmas_in_flight": list(DMAS)}

    def gather(self, x, indices, start, end, weights, *, config):
        return pallas_tpu_gather(x, indices, start, end, weights, block_rows=config.block_rows,
                                 dmas_in_flight=config.dmas_in_flight)


class PallasTpuGatherReduce(_PallasTpuBackend, GatherReduceBackend):
    config_cls = PallasTpuGatherReduceConfig
    description = "Pallas Mosaic TPU: DMA each valid row into VMEM, f32 weighted sum per token; interpret mode off TPU"

    def config_error(self, config: PallasTpuGatherReduceConfig, problem: GatherProblem) -> str | None:
        sub = sublanes(problem.dtype)
        return (_shape_error(problem)
                or _tunable_error("block_tokens", config.block_tokens, sub, round_up(problem.tokens, sub))
                or _dmas_error(config.dmas_in_flight, config.block_tokens * problem.top_k)
                or _vmem_error(gather_reduce_vmem_bytes(config, problem)))

    def default_config(self, problem: GatherProblem) -> PallasTpuGatherReduceConfig:
        vmem = lambda block: gather_reduce_vmem_bytes(PallasTpuGatherReduceConfig(block, 1), problem)
        block = _default_block(vmem, 256, problem.tokens, sublanes(problem.dtype))
        return PallasTpuGatherReduceConfig(
            block_tokens=block, dmas_in_flight=min(DEFAULT_DMAS_IN_FLIGHT, block * problem.top_k))

    def candidate_values(self, problem: GatherProblem) -> dict[str, list[int]]:
        return {"block_tokens": _block_candidates(problem.tokens, sublanes(problem.dtype)),
                "dmas_in_flight": list(DMAS)}

    def gather_reduce(self, x, indices, weights, valid, reduce_group_size, *, config):
        return pallas_tpu_gather_reduce(x, indices, weights, valid, reduce_group_size,
                                        block_tokens=config.block_tokens, dmas_in_flight=config.dmas_in_flight)
