"""`sparsecore` backend: dispatch and combine on the TPU's SparseCores (v5p, v6e), beside the TensorCores that
run the grouped matmuls.

Both kernels are `pl.kernel`s over a `VectorSubcoreMesh` of all the chip's SparseCores and `subcores` vector
subcores of each; the W = cores x subcores workers take the output's blocks round-robin (worker w: blocks w,
w + W, ...). A block is `rows_per_step` output rows (dispatch) or `tokens_per_step` output tokens (combine); the
last block is shifted back to end at the array's end (the rows it shares with the one before are written twice,
with the same values). Per block, an XLA prologue lays out what the kernel reads with vector loads only (a
vector subcore cannot read a scalar from its VMEM, nor DMA into its SMEM): the source rows (-1 where nothing may
be read), the output rows, the weights repeated across a vector, and for dispatch the block's part of the range.

- Dispatch (`ragged_gather`): one indexed DMA (`x_hbm.at[Indices(idx, ignored_value=-1)]`) gathers the block's
  rows in [start, end) into VMEM: rows outside the range are never read. A block the range leaves partly
  uncovered is zeroed first (one wholly outside it is only zeroed); weighted, each row in the range is scaled
  in float32 and rounded once; an indexed DMA writes the block to its output rows.
- Combine (`ragged_gather_reduce` / `dense_gather_reduce`): one indexed DMA gathers a block's valid entries
  (invalid ones are -1: never read, their rows may be NaN); each token's weighted sum is a tree of float32
  vector adds per lane chunk (no sequential chain over top_k), invalid entries selected away, not multiplied.

Layouts (`tc_tiled`): a float32 x and output stay in the TensorCore's tiled HBM layout, as XLA holds them. The
indexed DMAs move 32-bit elements only in that layout, so a bfloat16 kernel takes the SparseCore layout and XLA
converts x before it and the output after it (a pass over each, measured in the compiled HLO of qwen3-30b-a3b's
combine for v6e: 17 MB of temporaries, a copy of x).

Off TPU the kernels run in Pallas TPU interpret mode, with two substitutions the interpreter needs (jax 0.10):
it runs one core (`lax.axis_index` of any mesh axis is 0), so the workers run one after the other in a loop,
each with its own index; and it cannot interpret indexed DMAs, so `_row_dmas` issues one row DMA per index that
is not -1. Everything else, the work split, the block and range arithmetic, the masks and the float32 sums, is
the same code. Validity rules (VMEM per subcore, lane and DMA granule alignment) read the chip's SparseCore
facts (`core/chips.py`) in `config_error`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import tpu_sc as plsc

from moe_tune.core import devices
from moe_tune.core.chips import TPU_TARGETS, SparseCoreFacts, for_device_kind
from moe_tune.kernels.base import KernelConfig, positive_int_error
from moe_tune.kernels.gather.base import GatherBackend, GatherReduceBackend
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.pallas_util import interpreted, out_struct, pallas_run, round_up

IGNORED = -1  # an index the gather DMA skips
DMA_GRANULE_BYTES = 32  # `pltpu.get_tpu_info().sparse_core.dma_granule_size_bytes` on v5p and v6e
ROW_STEPS = (8, 16, 32, 64, 128, 256)
TOKEN_STEPS = (1, 2, 4, 8, 16, 32)
SUBCORES = (4, 8, 16)
# The default block takes at most this share of a subcore's VMEM.
DEFAULT_VMEM_SHARE = 0.5
# Off a SparseCore chip (interpret mode) the work is split as on the first TPU target that has SparseCores.
INTERPRETED_FACTS = next(t.sparse_core for t in TPU_TARGETS if t.sparse_core is not None)


@dataclasses.dataclass(frozen=True)
class SparseCoreGatherConfig(KernelConfig):
    """rows_per_step: output rows one subcore gathers per step; subcores: vector subcores used per SparseCore."""

    rows_per_step: int = 32
    subcores: int = 16


@dataclasses.dataclass(frozen=True)
class SparseCoreGatherReduceConfig(KernelConfig):
    """tokens_per_step: output tokens one subcore reduces per step (each gathers top_k rows); subcores: vector
    subcores used per SparseCore."""

    tokens_per_step: int = 4
    subcores: int = 16


def chip_facts() -> SparseCoreFacts | None:
    """The judged chip's SparseCores (None on a TPU without them); off TPU those the interpreter splits over."""
    if devices.platform() != "tpu":
        return INTERPRETED_FACTS
    target = for_device_kind(devices.device_kind())
    return None if target is None else target.sparse_core


def vector_width(dtype, lanes: int) -> int:
    """Elements of one vector register: `lanes` 32-bit values, twice as many 16-bit ones."""
    return lanes * (4 // jnp.dtype(dtype).itemsize)


def _mesh(cores: int, subcores: int, interpret: bool):
    if not interpret:
        return plsc.VectorSubcoreMesh(core_axis_name="core", subcore_axis_name="subcore", num_cores=cores,
                                      num_subcores=subcores)
    # The interpreter runs one core whatever the mesh says (the workers loop inside it); the mesh's own check
    # asks the default device for its SparseCores, which a CPU has none of, so it is skipped.
    mesh = object.__new__(plsc.VectorSubcoreMesh)
    for name, value in {"core_axis_name": "core", "subcore_axis_name": "subcore", "num_cores": 1,
                        "num_subcores": 1}.items():
        object.__setattr__(mesh, name, value)
    return mesh


def tc_tiled(dtype) -> bool:
    """Whether the kernels take HBM operands in the TensorCore's tiled layout, as XLA keeps them: 32-bit rows.
    The indexed DMAs move 32-bit elements only in that layout, so a 16-bit x and output take the SparseCore's
    own layout, and XLA converts them before and after the kernel (a pass over each)."""
    return jnp.dtype(dtype).itemsize == 4


def _cost(operands: list, x, gathered: int, written: int, flops: int) -> pl.CostEstimate:
    """For XLA's scheduler (to overlap the kernel with the TensorCore's work): the rows gathered from x and
    written, hidden x itemsize bytes each, the per-block index and weight operands read whole, the flops."""
    small = sum(a.size * a.dtype.itemsize for a in operands if a is not x)
    row = x.shape[1] * x.dtype.itemsize
    return pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=(gathered + written) * row + small)


def _run(worker, *, workers: int, subcores: int, interpret: bool, tc_tiling: bool, out_type, scratch, name: str,
         cost: pl.CostEstimate):
    """`worker(w, *refs)` for every w in [0, workers): one per vector subcore, or in a loop when interpreted."""
    def body(*refs):
        if interpret:
            pl.loop(0, workers)(lambda w: worker(w, *refs))
        else:
            worker(lax.axis_index("core") * subcores + lax.axis_index("subcore"), *refs)

    return pl.kernel(body, out_type=out_type, mesh=_mesh(workers // subcores, subcores, interpret),
                     scratch_types=scratch, compiler_params=pltpu.CompilerParams(use_tc_tiling_on_sc=tc_tiling),
                     interpret=pltpu.InterpretParams() if interpret else False, cost_estimate=cost, name=name)


def _row_dmas(hbm, idx_vmem, buf, interpret: bool, *, gather: bool) -> None:
    """gather: buf[r] = hbm[idx[r]]; else (scatter) hbm[idx[r]] = buf[r]; for every r whose index (int32 [1, n]
    in VMEM) is not IGNORED (a gather leaves the others' rows as they are). One indexed DMA; interpreted, one
    row DMA per index."""
    if not interpret:
        rows = hbm.at[plsc.Indices(idx_vmem.at[0], ignored_value=IGNORED)]
        pltpu.sync_copy(rows, buf) if gather else pltpu.sync_copy(buf, rows)
        return

    @pl.loop(0, idx_vmem.shape[1])
    def _(r):
        row = idx_vmem[0, r]

        @pl.when(row != IGNORED)
        def _():
            src, dst = hbm.at[pl.ds(row, 1)], buf.at[pl.ds(r, 1)]
            pltpu.sync_copy(src, dst) if gather else pltpu.sync_copy(dst, src)


def _fill_zero(buf, width: int) -> None:
    """buf [n, hidden] = 0, one vector at a time."""
    zero = jnp.zeros((width,), buf.dtype)

    @pl.loop(0, buf.shape[0])
    def _(r):
        @pl.loop(0, buf.shape[1], step=width)
        def _(c):
            buf[r, pl.ds(c, width)] = zero


def _blocks(worker, workers: int, count: int, body) -> None:
    """body(b) for the blocks b = worker, worker + workers, ... below count."""
    @pl.loop(0, pl.cdiv(count, workers))
    def _(i):
        b = worker + i * workers

        @pl.when(b < count)
        def _():
            body(b)


def _block_rows(size: int, step: int) -> jax.Array:
    """int32 [blocks, step]: the rows of each block of `step`, the last shifted back to end at `size`."""
    starts = jnp.minimum(jnp.arange(pl.cdiv(size, step), dtype=jnp.int32) * step, size - step)
    return starts[:, None] + jnp.arange(step, dtype=jnp.int32)


def _per_lane(values: jax.Array, width: int) -> jax.Array:
    """float32 values [...] -> [..., width]: each repeated across one vector (a vector subcore has no scalar
    path from its VMEM, so a per-row factor arrives as a vector)."""
    return jnp.broadcast_to(values.astype(jnp.float32)[..., None], (*values.shape, width))


def sparsecore_gather(x, indices, start, end, weights, *, rows_per_step: int, subcores: int) -> jax.Array:
    """x [tokens, hidden] (f32/bf16), indices int32 [rows], start / end int32 scalars (traced), weights [rows]
    or None -> [rows, hidden] in x.dtype; out[i] = x[indices[i]] * weights[i] (in float32) for start <= i <
    end, zero elsewhere. rows_per_step <= rows."""
    interpret = interpreted("tpu")
    facts = chip_facts()
    rows, hidden = indices.shape[0], x.shape[1]
    step, workers = rows_per_step, facts.cores * subcores
    width = vector_width(x.dtype, facts.lanes)
    weighted = weights is not None
    start = jnp.clip(jnp.asarray(start, jnp.int32), 0, rows)
    end = jnp.clip(jnp.asarray(end, jnp.int32), start, rows)
    live = (jnp.arange(rows, dtype=jnp.int32) >= start) & (jnp.arange(rows, dtype=jnp.int32) < end)
    rows_of_block = _block_rows(rows, step)  # [blocks, step]
    row0 = rows_of_block[:, 0]
    # per block: the range as rows of the block, [lo, hi) (an empty block: lo = hi)
    span = jnp.stack([jnp.clip(start - row0, 0, step), jnp.clip(end - row0, 0, step)], axis=1)
    span = jnp.maximum(span, span[:, :1])
    span = jnp.zeros((row0.shape[0], 1, facts.lanes), jnp.int32).at[:, 0, :2].set(span)
    idx = jnp.where(live, indices.astype(jnp.int32), IGNORED)[rows_of_block][:, None, :]
    operands = [span, idx, rows_of_block[:, None, :], x]
    if weighted:  # zero outside the range: those rows are zero, and a garbage weight must not make them NaN
        operands.append(_per_lane(jnp.where(live, weights.astype(jnp.float32), 0.0)[rows_of_block], width))

    def worker(w, span_hbm, idx_hbm, dst_hbm, x_hbm, *refs):
        w_hbm = refs[0] if weighted else None
        o_hbm, span_vmem, idx_vmem, dst_vmem, w_vmem, buf = refs[1:] if weighted else refs

        def block(b):
            pltpu.sync_copy(span_hbm.at[b], span_vmem)
            bounds = span_vmem[0, :]
            lo, hi = bounds[0], bounds[1]

            @pl.when((lo > 0) | (hi < step))  # rows outside the range stay zero
            def _():
                _fill_zero(buf, width)

            @pl.when(lo < hi)
            def _():
                pltpu.sync_copy(idx_hbm.at[b], idx_vmem)
                _row_dmas(x_hbm, idx_vmem, buf, interpret, gather=True)
                if weighted:
                    pltpu.sync_copy(w_hbm.at[b], w_vmem)

                    @pl.loop(lo, hi)
                    def _(r):
                        scale = w_vmem[r, :]

                        @pl.loop(0, hidden, step=width)
                        def _(c):
                            buf[r, pl.ds(c, width)] = (buf[r, pl.ds(c, width)].astype(jnp.float32)
                                                       * scale).astype(buf.dtype)

            pltpu.sync_copy(dst_hbm.at[b], dst_vmem)
            _row_dmas(o_hbm, dst_vmem, buf, interpret, gather=False)

        _blocks(w, workers, row0.shape[0], block)

    scratch = [pltpu.VMEM((1, facts.lanes), jnp.int32), pltpu.VMEM((1, step), jnp.int32),
               pltpu.VMEM((1, step), jnp.int32), pltpu.VMEM((step, width), jnp.float32),
               pltpu.VMEM((step, hidden), x.dtype)]
    kernel = _run(worker, workers=workers, subcores=subcores, interpret=interpret, tc_tiling=tc_tiled(x.dtype),
                  out_type=out_struct((rows, hidden), x.dtype, *operands), scratch=scratch,
                  name="moe_tune_sparsecore_gather",  # at most rows read (those in the range), rows written
                  cost=_cost(operands, x, rows, rows, rows * hidden if weighted else 0))
    return pallas_run(kernel, *operands, interpret=interpret)  # inside shard_map: typed as its operands vary


def _tree_sum(terms: list) -> jax.Array:
    """The sum of `terms` as a balanced tree of adds (depth log2(len), no chain over them)."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def sparsecore_gather_reduce(x, indices, weights, valid, reduce_group_size: int, *, tokens_per_step: int,
                             subcores: int) -> jax.Array:
    """x [rows, hidden] (f32/bf16), indices int32 [rows], weights [rows], valid bool [rows] or None (all valid),
    r = reduce_group_size -> [rows // r, hidden] in x.dtype; out[t] = sum_j valid[i] * weights[i] *
    x[indices[i]], i = t * r + j, accumulated in float32. Invalid entries are never read. tokens_per_step <=
    rows // r."""
    interpret = interpreted("tpu")
    facts = chip_facts()
    r = reduce_group_size
    rows, hidden = indices.shape[0], x.shape[1]
    tokens = rows // r
    step, workers = tokens_per_step, facts.cores * subcores
    width = vector_width(x.dtype, facts.lanes)
    masked = valid is not None
    idx, w = indices.astype(jnp.int32), weights.astype(jnp.float32)
    if masked:
        idx = jnp.where(valid, idx, IGNORED)
    tokens_of_block = _block_rows(tokens, step)  # [blocks, step]
    # a block's entries in entry order (token t's entry j at t * r + j)
    by_block = lambda a: a.reshape(tokens, r)[tokens_of_block].reshape(tokens_of_block.shape[0], step * r)
    operands = [by_block(idx)[:, None, :], tokens_of_block[:, None, :], _per_lane(by_block(w), width), x]
    if masked:
        operands.append(_per_lane(by_block(valid.astype(jnp.float32)), width))

    def worker(wk, idx_hbm, dst_hbm, w_hbm, x_hbm, *refs):
        keep_hbm = refs[0] if masked else None
        o_hbm, idx_vmem, dst_vmem, w_vmem, keep_vmem, buf, out = refs[1:] if masked else refs

        def block(b):
            pltpu.sync_copy(idx_hbm.at[b], idx_vmem)
            pltpu.sync_copy(w_hbm.at[b], w_vmem)
            if masked:
                pltpu.sync_copy(keep_hbm.at[b], keep_vmem)
            _row_dmas(x_hbm, idx_vmem, buf, interpret, gather=True)

            @pl.loop(0, step)
            def _(t):
                scales = [w_vmem[t * r + j, :] for j in range(r)]
                keeps = [keep_vmem[t * r + j, :] != 0.0 for j in range(r)] if masked else None

                @pl.loop(0, hidden, step=width)
                def _(c):
                    terms = []
                    for j in range(r):
                        term = buf[t * r + j, pl.ds(c, width)].astype(jnp.float32) * scales[j]
                        # a select: rows of invalid entries were never gathered and hold anything
                        terms.append(jnp.where(keeps[j], term, 0.0) if masked else term)
                    out[t, pl.ds(c, width)] = _tree_sum(terms).astype(out.dtype)

            pltpu.sync_copy(dst_hbm.at[b], dst_vmem)
            _row_dmas(o_hbm, dst_vmem, out, interpret, gather=False)

        _blocks(wk, workers, tokens_of_block.shape[0], block)

    entries = step * r
    scratch = [pltpu.VMEM((1, entries), jnp.int32), pltpu.VMEM((1, step), jnp.int32),
               pltpu.VMEM((entries, width), jnp.float32),
               pltpu.VMEM((entries, width) if masked else (1, width), jnp.float32),
               pltpu.VMEM((entries, hidden), x.dtype), pltpu.VMEM((step, hidden), x.dtype)]
    kernel = _run(worker, workers=workers, subcores=subcores, interpret=interpret, tc_tiling=tc_tiled(x.dtype),
                  out_type=out_struct((tokens, hidden), x.dtype, *operands), scratch=scratch,
                  name="moe_tune_sparsecore_gather_reduce",  # r products and r - 1 adds an element
                  cost=_cost(operands, x, tokens * r, tokens, (2 * r - 1) * tokens * hidden))
    return pallas_run(kernel, *operands, interpret=interpret)  # inside shard_map: typed as its operands vary


def _vmem(shape: tuple[int, ...], dtype, tc_tiling: bool) -> int:
    """Bytes of a VMEM buffer: in the TensorCore layout padded to whole (8, 128) tiles of 32-bit words (so a
    [n, 8] weight block takes 128 lanes a row), else as it is."""
    itemsize = jnp.dtype(dtype).itemsize
    if not tc_tiling:
        return math.prod(shape) * itemsize
    *lead, rows, cols = (1, *shape) if len(shape) == 1 else shape
    return math.prod(lead) * round_up(rows, 8) * round_up(cols * itemsize // 4, 128) * 4


def gather_vmem_bytes(config: SparseCoreGatherConfig, problem: GatherProblem, lanes: int) -> int:
    """A subcore's VMEM: the [rows_per_step, hidden] row buffer, its source and destination rows, its range and
    its per-lane weights."""
    s, tc, width = config.rows_per_step, tc_tiled(problem.dtype), vector_width(problem.dtype, lanes)
    return (_vmem((s, problem.hidden), problem.dtype, tc) + 2 * _vmem((1, s), jnp.int32, tc)
            + _vmem((1, lanes), jnp.int32, tc) + _vmem((s, width), jnp.float32, tc))


def gather_reduce_vmem_bytes(config: SparseCoreGatherReduceConfig, problem: GatherProblem, lanes: int) -> int:
    """A subcore's VMEM: the [tokens_per_step * top_k, hidden] rows, the output block, their indices, and the
    per-lane weights and validity of the block's entries."""
    t, tc, width = config.tokens_per_step, tc_tiled(problem.dtype), vector_width(problem.dtype, lanes)
    entries = t * problem.top_k
    return (_vmem((entries, problem.hidden), problem.dtype, tc) + _vmem((t, problem.hidden), problem.dtype, tc)
            + _vmem((1, entries), jnp.int32, tc) + _vmem((1, t), jnp.int32, tc)
            + 2 * _vmem((entries, width), jnp.float32, tc))


class _SparseCoreBackend:
    name = "sparsecore"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    platforms = ("tpu",)
    # pl.kernel over plsc.VectorSubcoreMesh, plsc.Indices and pltpu.sync_copy as of jax 0.10; the SparseCore
    # Pallas API is young and moves between minor releases.
    jax_versions = ">=0.10,<0.12"
    # A TPU without SparseCores runs the TensorCore kernels instead (`guard.chip_guard`).
    chip_fallback = "pallas_tpu"
    step_field: str
    steps: tuple[int, ...]

    def runs_on(self, platform: str) -> bool:
        return True  # natively on a TPU with SparseCores, in interpret mode everywhere else

    def chip_error(self, problem: GatherProblem) -> str | None:
        if chip_facts() is None:
            return f"{devices.device_kind()} has no SparseCores"
        return None

    def _step_limit(self, problem: GatherProblem) -> int:
        return problem.rows if self.step_field == "rows_per_step" else problem.tokens

    def _vmem_bytes(self, config, problem: GatherProblem) -> int:
        raise NotImplementedError

    def config_error(self, config, problem: GatherProblem) -> str | None:
        if (reason := self.chip_error(problem)) is not None:
            return reason
        facts = chip_facts()
        dtype = jnp.dtype(problem.dtype)
        if dtype not in (jnp.float32, jnp.bfloat16):
            return f"dtype {problem.dtype}: sparsecore serves float32 and bfloat16 (use the jax or tiled backend)"
        width = vector_width(dtype, facts.lanes)
        if problem.hidden % width:
            return (f"hidden={problem.hidden} is not a multiple of {width} ({problem.dtype} elements of one "
                    f"{facts.lanes}-lane SparseCore vector)")
        if problem.row_bytes() % DMA_GRANULE_BYTES:
            return f"a row of {problem.row_bytes()} bytes is not a whole number of {DMA_GRANULE_BYTES}-byte DMA granules"
        step = getattr(config, self.step_field)
        if error := positive_int_error(self.step_field, step) or positive_int_error("subcores", config.subcores):
            return error
        if step > (limit := self._step_limit(problem)):
            return f"{self.step_field}={step} exceeds {limit} (the output's {self.step_field.split('_')[0]})"
        if config.subcores > facts.subcores:
            return f"subcores={config.subcores} exceeds the {facts.subcores} vector subcores of a SparseCore"
        need = self._vmem_bytes(config, problem)
        if need > facts.vmem_bytes:
            return (f"a step needs {need / 1024:.0f} KiB of VMEM, over the {facts.vmem_bytes // 1024} KiB of a "
                    f"vector subcore")
        return None

    def default_config(self, problem: GatherProblem):
        facts = chip_facts() or INTERPRETED_FACTS
        limit = self._step_limit(problem)
        fits = [s for s in self.steps if s <= limit and self._vmem_bytes(
            self.config_cls(s, facts.subcores), problem) <= DEFAULT_VMEM_SHARE * facts.vmem_bytes]
        step = max(fits) if fits else min(self.steps[0], limit)
        return self.config_cls(step, facts.subcores)

    def candidate_values(self, problem: GatherProblem) -> dict[str, list[int]]:
        facts = chip_facts() or INTERPRETED_FACTS
        limit = self._step_limit(problem)
        return {self.step_field: [s for s in self.steps if s <= limit] or [limit],
                "subcores": [s for s in SUBCORES if s <= facts.subcores]}


class SparseCoreGather(_SparseCoreBackend, GatherBackend):
    config_cls = SparseCoreGatherConfig
    step_field, steps = "rows_per_step", ROW_STEPS
    description = "Pallas SparseCore: indexed-DMA row gather on every vector subcore; interpret mode off TPU"

    def _vmem_bytes(self, config, problem):
        return gather_vmem_bytes(config, problem, (chip_facts() or INTERPRETED_FACTS).lanes)

    def gather(self, x, indices, start, end, weights, *, config):
        return sparsecore_gather(x, indices, start, end, weights, rows_per_step=config.rows_per_step,
                                 subcores=config.subcores)


class SparseCoreGatherReduce(_SparseCoreBackend, GatherReduceBackend):
    config_cls = SparseCoreGatherReduceConfig
    step_field, steps = "tokens_per_step", TOKEN_STEPS
    description = "Pallas SparseCore: indexed-DMA gather of each token's rows, f32 tree sum; interpret mode off TPU"

    def _vmem_bytes(self, config, problem):
        return gather_reduce_vmem_bytes(config, problem, (chip_facts() or INTERPRETED_FACTS).lanes)

    def gather_reduce(self, x, indices, weights, valid, reduce_group_size, *, config):
        return sparsecore_gather_reduce(x, indices, weights, valid, reduce_group_size,
                                        tokens_per_step=config.tokens_per_step, subcores=config.subcores)
