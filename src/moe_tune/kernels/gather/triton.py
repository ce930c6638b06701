"""`triton` backend: Pallas kernels for GPU (the Triton lowering) for dispatch and combine; interpret mode
elsewhere.

- Dispatch (`TritonGather`): the grid is (row blocks, column blocks). A program owns `block_rows` output
  rows and `block_cols` columns of hidden. When its rows lie wholly outside [start, end) it only stores
  zeros (no index or x loads); otherwise it loads the indices of its rows that are in range (masked),
  gathers those rows' column slice of x with one masked vector-index load, weights them in float32 and
  stores the block. Rows outside the range are never read: their indices may be garbage.
- Combine (`TritonGatherReduce`): the grid is (token blocks, column blocks). A program owns `block_tokens`
  output tokens and `block_cols` columns and loops over the reduce group (j = 0..r-1): each step gathers
  the rows of entries t * r + j of its tokens with a masked load and adds them, weighted, into a float32
  accumulator, which is stored once. Invalid entries are masked out of every load (x rows, weights).

The per-entry tables are rearranged outside the kernels, which costs a few bytes per row against the
`hidden * itemsize` bytes per row the kernels move: combine folds `valid` into the indices (-1 = invalid)
and transposes indices and weights to [r, tokens], so the indices a step needs are contiguous.

Padding: the small per-row tables (indices, weights) are padded to whole row / token blocks, and so is
the output (sliced back afterwards, a copy only when the row / token count is not a multiple of the
block). x is never padded or copied: `block_cols` must divide hidden (`config_error`), so every load of x
is in bounds by construction and the same code runs compiled and in interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_tune.core import devices
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.gather.base import GatherBackend, GatherReduceBackend
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.pallas_util import interpreted, out_struct, pad_to, pallas_run

# Uses pl.program_id / pl.ds / pl.when and triton.load / store (masked, vector-index) / CompilerParams, as
# in 0.10.2. JAX 0.11.0 deprecates the Pallas Triton backend (still shipped) and plans its removal, hence
# the upper bound.
JAX_VERSIONS = ">=0.10,<0.12"

NUM_WARPS = (1, 2, 4, 8, 16)
MAX_BLOCK = 4096
# float32 tile elements one thread may hold: past about this many, the tile plus its per-element
# addresses outgrow the 255 registers of a thread and the kernel spills to local memory.
MAX_TILE_ELEMENTS_PER_THREAD = 128
THREADS_PER_WARP = 32
# Default column slice: about 1 KiB of each gathered row per program, two warp-wide 16-byte-per-lane
# accesses: fully coalesced, while leaving several column blocks (programs) per row block to spread rows.
DEFAULT_COL_BYTES = 1024
COL_CANDIDATES = (64, 128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class TritonGatherConfig(KernelConfig):
    """block_rows: output rows per program; block_cols: columns of hidden per program (divides hidden);
    num_warps: warps per program."""

    block_rows: int = 32
    block_cols: int = 256
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class TritonGatherReduceConfig(KernelConfig):
    """block_tokens: output tokens per program; block_cols: columns of hidden per program (divides
    hidden); num_warps: warps per program."""

    block_tokens: int = 16
    block_cols: int = 256
    num_warps: int = 4


def _is_pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _default_block_cols(problem: GatherProblem) -> int:
    """The largest power of two that divides hidden, capped at DEFAULT_COL_BYTES of a row."""
    target = max(64, DEFAULT_COL_BYTES // jnp.dtype(problem.dtype).itemsize)
    return min(problem.hidden & -problem.hidden, target)


def _col_candidates(problem: GatherProblem) -> list[int]:
    fits = [c for c in COL_CANDIDATES if problem.hidden % c == 0]
    # A hidden with no power-of-two factor >= 64 leaves only its largest power-of-two factor.
    return fits or [problem.hidden & -problem.hidden]


class _TritonGatherCommon:
    """Validity rules, default and search space shared by the two kernels. They differ in the name and
    extent of the row-like block (`block_rows` over rows, `block_tokens` over tokens) and in the number of
    float32 tiles a program keeps live (dispatch: the gathered tile; combine: that and the accumulator)."""

    name = "triton"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    platforms = ("gpu",)
    jax_versions = JAX_VERSIONS
    block_field: str
    extent_name: str
    live_tiles: int
    default_block: int
    block_candidates: tuple[int, ...]

    def runs_on(self, platform: str) -> bool:
        return True  # compiled on GPU, in interpret mode elsewhere

    @property
    def interpret(self) -> bool:
        return interpreted("gpu")

    def blocked_extent(self, problem: GatherProblem) -> int:
        """The length of the axis the row-like block tiles."""
        raise NotImplementedError

    def shared_memory_bytes(self, config, problem: GatherProblem) -> int:
        """One float32 tile: there are no tl.dot operands to stage, so shared memory only ever holds a tile
        being converted between register layouts (the weighting / reduction broadcasts)."""
        return getattr(config, self.block_field) * config.block_cols * 4

    def config_error(self, config, problem: GatherProblem) -> str | None:
        block = getattr(config, self.block_field)
        for name, value in ((self.block_field, block), ("block_cols", config.block_cols)):
            if not _is_pow2(value) or value > MAX_BLOCK:
                # Triton tensors must have a power-of-two number of elements.
                return f"{name}={value!r} must be a power of two <= {MAX_BLOCK}"
        if config.num_warps not in NUM_WARPS or isinstance(config.num_warps, bool):
            return f"num_warps={config.num_warps!r} must be one of {NUM_WARPS}"
        extent = self.blocked_extent(problem)
        if block > _next_pow2(extent):
            return f"{self.block_field}={block} is larger than the {extent} {self.extent_name} it tiles"
        if problem.hidden % config.block_cols:
            # Padding x to whole column blocks would copy all of it: as much traffic as the kernel itself.
            return f"block_cols={config.block_cols} must divide hidden={problem.hidden} (x is not padded)"
        tile = block * config.block_cols
        threads = THREADS_PER_WARP * config.num_warps
        if self.live_tiles * tile > MAX_TILE_ELEMENTS_PER_THREAD * threads:
            return (f"{self.live_tiles} float32 tile(s) of {tile} elements over {threads} threads exceed "
                    f"{MAX_TILE_ELEMENTS_PER_THREAD} elements per thread (register spills)")
        need = self.shared_memory_bytes(config, problem)
        budget = devices.gpu_shared_memory_bytes()
        if need > budget:
            return f"needs {need // 1024} KiB of shared memory per block, over the {budget // 1024} KiB budget"
        return None

    def default_config(self, problem: GatherProblem):
        block = min(self.default_block, _next_pow2(self.blocked_extent(problem)))
        return self.config_cls(**{self.block_field: block}, block_cols=_default_block_cols(problem), num_warps=4)

    def candidate_values(self, problem: GatherProblem) -> dict[str, list[int]]:
        cap = _next_pow2(self.blocked_extent(problem))
        blocks = sorted({min(b, cap) for b in self.block_candidates})
        return {self.block_field: blocks, "block_cols": _col_candidates(problem), "num_warps": [2, 4, 8]}


def _gather_kernel(bounds_ref, idx_ref, x_ref, *refs, block_rows, block_cols, weighted):
    """bounds int32 [2] = (start, end) clipped to [0, rows]; idx int32 [rows_p]; x [tokens, hidden];
    weights [rows_p] (when weighted) -> out [rows_p, hidden] in x.dtype."""
    w_ref, out_ref = refs if weighted else (None, *refs)
    row0 = pl.program_id(0) * block_rows
    col0 = pl.program_id(1) * block_cols
    start, end = bounds_ref[0], bounds_ref[1]
    out_block = out_ref.at[pl.ds(row0, block_rows), pl.ds(col0, block_cols)]
    overlaps = (row0 < end) & (row0 + block_rows > start)

    @pl.when(overlaps)
    def _():
        rows = row0 + jnp.arange(block_rows, dtype=jnp.int32)
        keep = (rows >= start) & (rows < end)
        # other=0 turns the out-of-range (possibly garbage) indices into row 0, so even the addresses of
        # the masked lanes below stay inside x.
        ids = plgpu.load(idx_ref.at[pl.ds(row0, block_rows)], mask=keep, other=0)
        cols = col0 + jnp.arange(block_cols, dtype=jnp.int32)
        # Two broadcast index vectors rather than (ids, pl.ds): interpret mode only supports masked
        # vector-index loads when every index is an array.
        mask = jnp.broadcast_to(keep[:, None], (block_rows, block_cols))
        vals = plgpu.load(x_ref.at[ids[:, None], cols[None, :]], mask=mask, other=0)
        if weighted:
            w = plgpu.load(w_ref.at[pl.ds(row0, block_rows)], mask=keep, other=0).astype(jnp.float32)
            vals = (vals.astype(jnp.float32) * w[:, None]).astype(out_ref.dtype)
        plgpu.store(out_block, vals)  # masked rows hold 0 (other=0), so the store needs no mask

    @pl.when(jnp.logical_not(overlaps))
    def _():
        plgpu.store(out_block, jnp.zeros((block_rows, block_cols), out_ref.dtype))


def _gather_reduce_kernel(idx_ref, w_ref, x_ref, out_ref, *, block_tokens, block_cols, group):
    """idx int32 [r, tokens_p] (-1 = invalid or padding); weights float32 [r, tokens_p]; x [rows, hidden]
    -> out [tokens_p, hidden] in x.dtype."""
    tok0 = pl.program_id(0) * block_tokens
    cols = pl.program_id(1) * block_cols + jnp.arange(block_cols, dtype=jnp.int32)

    def step(j, acc):
        ids = idx_ref[j, pl.ds(tok0, block_tokens)]
        ok = ids >= 0
        # Weights are masked too: an invalid entry's weight may be anything, and 0 * NaN would leak in.
        w = plgpu.load(w_ref.at[j, pl.ds(tok0, block_tokens)], mask=ok, other=0)
        safe = jnp.where(ok, ids, 0)  # keeps the masked lanes' addresses inside x
        mask = jnp.broadcast_to(ok[:, None], (block_tokens, block_cols))
        vals = plgpu.load(x_ref.at[safe[:, None], cols[None, :]], mask=mask, other=0)
        return acc + vals.astype(jnp.float32) * w[:, None]

    acc = jax.lax.fori_loop(0, group, step, jnp.zeros((block_tokens, block_cols), jnp.float32))
    plgpu.store(out_ref.at[pl.ds(tok0, block_tokens), pl.ds(pl.program_id(1) * block_cols, block_cols)],
                acc.astype(out_ref.dtype))


class TritonGather(_TritonGatherCommon, GatherBackend):
    config_cls = TritonGatherConfig
    description = "Pallas Triton dispatch for GPUs (blocks outside [start, end) only zero-fill); interpret elsewhere"
    block_field = "block_rows"
    extent_name = "rows"
    live_tiles = 1
    default_block = 32
    block_candidates = (8, 16, 32, 64, 128)

    def blocked_extent(self, problem: GatherProblem) -> int:
        return problem.rows

    def gather(self, x, indices, start, end, weights, *, config):
        """x [tokens, hidden] (f32/bf16/f16), indices int32 [rows], start / end int32 scalars (traced),
        weights [rows] (any float) or None -> [rows, hidden] in x.dtype; see `GatherBackend.gather`."""
        rows, hidden = indices.shape[0], x.shape[1]
        if rows == 0:
            return jnp.zeros((0, hidden), x.dtype)
        br, bc = config.block_rows, config.block_cols
        start = jnp.clip(jnp.asarray(start, jnp.int32), 0, rows)
        end = jnp.clip(jnp.asarray(end, jnp.int32), start, rows)
        # Padded rows are >= rows >= end: never in range, so their index value is never used.
        idx = pad_to(indices.astype(jnp.int32), 0, br)
        rows_p = idx.shape[0]
        operands = [jnp.stack([start, end]), idx, x]
        if weights is not None:
            operands.append(pad_to(weights, 0, br))
        kernel = functools.partial(_gather_kernel, block_rows=br, block_cols=bc, weighted=weights is not None)
        out = pallas_run(pl.pallas_call(
            kernel,
            grid=(rows_p // br, hidden // bc),
            out_shape=out_struct((rows_p, hidden), x.dtype, *operands),
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
            interpret=self.interpret,
            name="moe_tune_gather",
        ), *operands, interpret=self.interpret)
        return out if rows_p == rows else out[:rows]


class TritonGatherReduce(_TritonGatherCommon, GatherReduceBackend):
    config_cls = TritonGatherReduceConfig
    description = "Pallas Triton combine for GPUs (masked gathers, f32 accumulation); interpret mode elsewhere"
    block_field = "block_tokens"
    extent_name = "tokens"
    live_tiles = 2
    default_block = 16
    block_candidates = (4, 8, 16, 32, 64)

    def blocked_extent(self, problem: GatherProblem) -> int:
        return problem.tokens

    def gather_reduce(self, x, indices, weights, valid, reduce_group_size, *, config):
        """x [rows, hidden] (f32/bf16/f16), indices int32 [rows], weights [rows] (any float), valid bool
        [rows] or None, r = reduce_group_size -> [rows // r, hidden] in x.dtype; see
        `GatherReduceBackend.gather_reduce`."""
        rows, hidden = indices.shape[0], x.shape[1]
        r = reduce_group_size
        tokens = rows // r
        if tokens == 0:
            return jnp.zeros((0, hidden), x.dtype)
        bt, bc = config.block_tokens, config.block_cols
        idx = indices.astype(jnp.int32)
        if valid is not None:
            idx = jnp.where(valid.astype(bool), idx, -1)
        # [r, tokens]: step j of a program reads block_tokens consecutive entries. Padded tokens are
        # invalid (-1) and weigh 0.
        idx_t = pad_to(idx.reshape(tokens, r).T, 1, bt, value=-1)
        w_t = pad_to(weights.astype(jnp.float32).reshape(tokens, r).T, 1, bt)
        tokens_p = idx_t.shape[1]
        kernel = functools.partial(_gather_reduce_kernel, block_tokens=bt, block_cols=bc, group=r)
        out = pallas_run(pl.pallas_call(
            kernel,
            grid=(tokens_p // bt, hidden // bc),
            out_shape=out_struct((tokens_p, hidden), x.dtype, idx_t, w_t, x),
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
            interpret=self.interpret,
            name="moe_tune_gather_reduce",
        ), idx_t, w_t, x, interpret=self.interpret)
        return out if tokens_p == tokens else out[:tokens]
