"""`tiled` backend: dispatch and combine as loops over row chunks whose trip count is the valid work; the
CPU backend.

- Dispatch: zero the output, then a `fori_loop` over the `rows_per_chunk`-row chunks that overlap
  [start, end) gathers each chunk and writes it in place. Work is proportional to end - start (plus the
  zero fill every output needs). On CPU a fresh output costs about as much to zero as to fill, so when
  most rows are valid the second write dominates: `single_pass` (one masked pass that writes every row
  once and reads only the valid ones from memory) is also in the search space, and the sweep picks.
- Combine: the valid entries are compacted (a prefix sum, keeping their order, so their tokens stay
  sorted) and a loop over chunks of them gathers and scatter-adds into a float32 output. Invalid entries
  are never read, so work is proportional to the valid fraction. A bf16 / f16 output is not converted
  from a float32 one: each token's first valid entry is read by the pass that writes the output, and the
  loop sums only the later ones, in a float32 accumulator with one row per token that has any. Without a
  mask (dense) the loop runs over whole tokens and reduces each token's rows in registers instead.

`rows_per_chunk` trades the loop's per-iteration overhead (small chunks) against a working set that no
longer fits in cache (large chunks): the tuner picks it per shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.kernels.base import KernelConfig, positive_int_error
from moe_tune.kernels.gather.base import GatherBackend, GatherReduceBackend
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.pallas_util import as_bits, from_bits, load, per_iteration, update_slice
from moe_tune.kernels.pallas_util import vary_like

CHUNKS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# The default chunk holds about this many bytes of rows: a few chunks fit in a core's L2 cache.
DEFAULT_CHUNK_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class TiledGatherConfig(KernelConfig):
    """rows_per_chunk: output rows gathered per loop iteration. single_pass: instead of the loop, one pass
    over all rows that writes each output row once (out-of-range rows read row 0 of x, which stays in
    cache, and store zeros): no zero fill first, so it wins when most rows are valid, while the loop wins
    when few are (its zero fill is cheaper than gathering)."""

    rows_per_chunk: int = 128
    single_pass: bool = False


@dataclasses.dataclass(frozen=True)
class TiledGatherReduceConfig(KernelConfig):
    """rows_per_chunk: input rows (valid entries) gathered and reduced per loop iteration."""

    rows_per_chunk: int = 128


def default_chunk(problem: GatherProblem) -> int:
    """The largest power of two with about DEFAULT_CHUNK_BYTES of rows, within [8, 1024] and <= rows."""
    chunk = 8
    while chunk * 2 <= 1024 and chunk * 2 * problem.row_bytes() <= DEFAULT_CHUNK_BYTES:
        chunk *= 2
    return max(1, min(chunk, problem.rows))


def chunk_error(rows_per_chunk: int, problem: GatherProblem) -> str | None:
    if error := positive_int_error("rows_per_chunk", rows_per_chunk):
        return error
    if rows_per_chunk > problem.rows:
        return f"rows_per_chunk {rows_per_chunk} > rows {problem.rows}"
    return None


class _ChunkedBackend:
    """Validity rules, default and search space shared by the two tiled kernels (`rows_per_chunk`)."""

    name = "tiled"
    # bump on changes that can change the fastest or a valid config (Backend.revision); a kernel that
    # changes alone overrides it (the combine). 2: bf16 rows read through `per_iteration` (no whole-input
    # copy before the loop), so the fastest bf16 chunk can change. 3: the loop carries bf16 output in its
    # own dtype (no output-sized copy after the loop), so chunked bf16 gathers got faster against single_pass.
    revision = 3
    platforms = ("cpu", "gpu", "tpu")

    def config_error(self, config, problem: GatherProblem) -> str | None:
        return chunk_error(config.rows_per_chunk, problem)

    def default_config(self, problem: GatherProblem):
        return self.config_cls(rows_per_chunk=default_chunk(problem))

    def candidate_values(self, problem: GatherProblem):
        return {"rows_per_chunk": [c for c in CHUNKS if c <= problem.rows]}


def tiled_gather(x, indices, start, end, weights, *, rows_per_chunk: int) -> jax.Array:
    """x [tokens, hidden], indices int32 [rows], start / end int32 scalars, weights [rows] | None
    -> [rows, hidden] in x.dtype; rows outside [start, end) are zero and never read."""
    rows, hidden = indices.shape[0], x.shape[1]
    chunk = min(rows_per_chunk, rows)
    start = jnp.clip(jnp.asarray(start, jnp.int32), 0, rows)
    end = jnp.clip(jnp.asarray(end, jnp.int32), start, rows)
    row_in_chunk = jnp.arange(chunk, dtype=jnp.int32)
    dtype = x.dtype

    def body(c, out):
        # The last chunk is shifted back to end at `rows`; rows it shares with the previous chunk are
        # rewritten with the same values.
        row0 = jnp.minimum(c * chunk, rows - chunk)
        ids = jax.lax.dynamic_slice_in_dim(indices, row0, chunk)
        keep = (row0 + row_in_chunk >= start) & (row0 + row_in_chunk < end)
        x_bits = as_bits(per_iteration(x, c))  # see pallas_util: 2-byte rows gathered as their bits
        block = jnp.take(x_bits, jnp.where(keep, ids, 0), axis=0, mode="clip")
        if weights is not None:
            w = jax.lax.dynamic_slice_in_dim(weights, row0, chunk)[:, None]
            block = as_bits(load(block, dtype, jnp.float32, w.astype(jnp.float32)).astype(dtype))
        block = jnp.where(keep[:, None], block, jnp.zeros((), block.dtype))  # bits 0: +0.0
        return update_slice(out, from_bits(block, dtype), (row0, 0))

    # The output is carried in its own dtype (a bf16 one updated through its bits, in place): a uint16 carry
    # needed a bitcast after the loop, an output-sized copy (52 ms of deepseek-v2-lite's bf16 prefill
    # training step; FINDINGS.md: gather loop carry).
    # (inside shard_map it varies as the operands do: `vary_like`)
    out = vary_like(jnp.zeros((rows, hidden), dtype), x, indices, start, end, weights)
    return jax.lax.fori_loop(start // chunk, (end + chunk - 1) // chunk, body, out)


def single_pass_gather(x, indices, start, end, weights) -> jax.Array:
    """The same result as `tiled_gather` in one pass over all rows: each output row is written once;
    out-of-range rows read row 0 of x (cached, so memory traffic still follows the valid rows) and are
    stored as zeros."""
    rows = indices.shape[0]
    i = jnp.arange(rows, dtype=jnp.int32)
    keep = (i >= start) & (i < end)
    block = jnp.take(x, jnp.where(keep, indices, 0), axis=0, mode="clip")
    if weights is not None:
        block = block.astype(jnp.float32) * weights.astype(jnp.float32)[:, None]
    return jnp.where(keep[:, None], block, 0).astype(x.dtype)


def tiled_gather_reduce(x, indices, weights, valid, reduce_group_size: int, *, rows_per_chunk: int) -> jax.Array:
    """x [rows, hidden], indices int32 [rows], weights [rows], valid bool [rows] | None, r = reduce_group_size
    -> [rows // r, hidden] in x.dtype (float32 accumulation)."""
    if valid is None:
        return _dense_gather_reduce(x, indices, weights, reduce_group_size, rows_per_chunk)
    rows, hidden = indices.shape[0], x.shape[1]
    tokens, chunk = rows // reduce_group_size, min(rows_per_chunk, rows)
    valid = valid.astype(bool)
    if x.dtype == jnp.float32:  # the output is its own accumulator
        return _add_entries(x, indices, weights, valid, reduce_group_size, chunk,
                            jnp.zeros((tokens, hidden), jnp.float32))
    return _first_entries_in_output(x, indices, weights, valid, reduce_group_size, chunk)


def _add_entries(x: jax.Array, indices: jax.Array, weights: jax.Array, entries: jax.Array, r: int, chunk: int,
                 acc: jax.Array, acc_row: jax.Array | None = None) -> jax.Array:
    """acc [n, hidden] float32 plus, for every entry e with entries[e] (bool [rows]), w[e] * x[indices[e]]
    added into row acc_row[e // r] (int32 [rows // r], non-decreasing; None: row e // r) -> [n, hidden].

    A loop over chunks of the selected entries only, compacted by a prefix sum that keeps their order (so
    the rows they add into are sorted): other entries are never read."""
    rows = indices.shape[0]
    count = jnp.sum(entries, dtype=jnp.int32)
    # order[p] = the p-th selected entry, in entry order.
    slot = jnp.where(entries, jnp.cumsum(entries, dtype=jnp.int32) - 1, rows)
    order = jnp.zeros(rows, jnp.int32).at[slot].set(jnp.arange(rows, dtype=jnp.int32), mode="drop")
    pos_in_chunk = jnp.arange(chunk, dtype=jnp.int32)
    dtype = x.dtype

    def body(c, acc):
        pos = c * chunk + pos_in_chunk
        ok = pos < count
        entry = jnp.take(order, pos, mode="clip")
        x_bits = as_bits(per_iteration(x, c))  # see pallas_util: only the gathered rows are converted
        block = load(jnp.take(x_bits, jnp.take(indices, entry), axis=0, mode="clip"), dtype, jnp.float32)
        w = jnp.take(weights, entry).astype(jnp.float32)
        contribution = jnp.where(ok[:, None], block * w[:, None], 0.0)  # select: x[0] may be NaN
        row = entry // r if acc_row is None else jnp.take(acc_row, entry // r)
        row = jnp.where(ok, row, acc.shape[0])
        return acc.at[row].add(contribution, mode="drop", indices_are_sorted=True)

    acc = vary_like(acc, x, indices, weights, entries, acc_row)  # the loop's carry type (`vary_like`)
    return jax.lax.fori_loop(0, (count + chunk - 1) // chunk, body, acc)


def accumulator_sizes(tokens: int) -> tuple[int, ...]:
    """The row counts `_first_entries_in_output` compiles an accumulator for, smallest first: tokens / 16,
    tokens / 4 and tokens (those of at least 8 rows). Each is its own loop in the program (compile time),
    and a call uses the smallest that holds its tokens, so its zero fill is at most 4x the rows it needs."""
    sizes = [tokens]
    while len(sizes) < 3 and sizes[-1] // 4 >= 8:
        sizes.append(sizes[-1] // 4)
    return tuple(reversed(sizes))


def _first_entries_in_output(x: jax.Array, indices: jax.Array, weights: jax.Array, valid: jax.Array, r: int,
                             chunk: int) -> jax.Array:
    """The masked combine for a 2-byte x (bf16, f16) without a float32 [tokens, hidden] pass at the end.

    A float32 accumulator of the whole output would have to be converted to x.dtype after the loop: a pass over all
    tokens (4 bytes read, 2 written per element) that the float32 kernel does not make, and that dominated at low
    valid fractions (FINDINGS.md: bf16 gathers on CPU). Instead, each token's first valid entry is read by the one
    pass that writes the output (each row once, in x.dtype; a token with no valid entry reads row 0 of x, cached,
    and stores zeros), and only its later valid entries are summed in float32 by the loop, into an accumulator
    with one row per token that has any (at valid fraction 1/16, one token in 20). Its row count is dynamic, so
    `lax.switch` picks the smallest of `accumulator_sizes` that holds it."""
    rows, hidden = indices.shape[0], x.shape[1]
    tokens = rows // r
    by_token = valid.reshape(tokens, r)
    has_any = by_token.any(axis=1)
    first = jnp.argmax(by_token, axis=1).astype(jnp.int32)  # 0 where none is valid
    later = by_token & (jnp.arange(r, dtype=jnp.int32)[None, :] > first[:, None])
    has_later = later.any(axis=1)
    acc_row = jnp.cumsum(has_later, dtype=jnp.int32) - 1  # non-decreasing; a token's own row where has_later
    first_entry = jnp.arange(tokens, dtype=jnp.int32) * r + first
    first_row = jnp.where(has_any, jnp.take(indices, first_entry), 0)
    first_weight = jnp.take(weights, first_entry).astype(jnp.float32)[:, None]
    sizes = accumulator_sizes(tokens)

    def output_with(size: int):
        def output(_):
            acc = _add_entries(x, indices, weights, later.reshape(rows), r, chunk,
                               jnp.zeros((size, hidden), jnp.float32), acc_row)
            rest = jnp.where(has_later[:, None], jnp.take(acc, jnp.clip(acc_row, 0, size - 1), axis=0), 0.0)
            total = jnp.take(x, first_row, axis=0, mode="clip").astype(jnp.float32) * first_weight + rest
            return jnp.where(has_any[:, None], total, 0.0).astype(x.dtype)  # select: x[0] may be NaN
        return output

    needed = jnp.sum(has_later, dtype=jnp.int32)
    branch = sum((needed > size).astype(jnp.int32) for size in sizes[:-1])
    return jax.lax.switch(branch, [output_with(size) for size in sizes], None)


def _dense_gather_reduce(x, indices, weights, r: int, rows_per_chunk: int) -> jax.Array:
    """Every entry valid: a static loop over blocks of whole tokens, each reduced over its r rows."""
    rows, hidden = indices.shape[0], x.shape[1]
    tokens = rows // r
    per_chunk = max(1, min(rows_per_chunk // r, tokens))
    dtype = x.dtype  # see pallas_util: rows gathered and the output updated as bits

    def body(c, out):
        token0 = jnp.minimum(c * per_chunk, tokens - per_chunk)  # last block shifted back, rewritten equal
        ids = jax.lax.dynamic_slice_in_dim(indices, token0 * r, per_chunk * r)
        w = jax.lax.dynamic_slice_in_dim(weights, token0 * r, per_chunk * r).astype(jnp.float32)
        x_bits = as_bits(per_iteration(x, c))
        block = load(jnp.take(x_bits, ids, axis=0, mode="clip"), dtype, jnp.float32, w[:, None])
        block = as_bits(block.reshape(per_chunk, r, hidden).sum(axis=1).astype(dtype))
        return jax.lax.dynamic_update_slice_in_dim(out, block, token0, axis=0)

    out = as_bits(vary_like(jnp.zeros((tokens, hidden), dtype), x, indices, weights))
    return from_bits(jax.lax.fori_loop(0, -(-tokens // per_chunk), body, out), dtype)


class TiledGather(_ChunkedBackend, GatherBackend):
    config_cls = TiledGatherConfig
    description = "pure-JAX loop over the row chunks in [start, end), or one masked pass (CPU)"

    def config_error(self, config, problem: GatherProblem) -> str | None:
        if not isinstance(config.single_pass, bool):
            return f"single_pass must be a bool, got {config.single_pass!r}"
        return super().config_error(config, problem)

    def search_space(self, problem: GatherProblem) -> list[TiledGatherConfig]:
        """The loop at every chunk size, then the single pass (its chunk size is unused: one config)."""
        loops = super().search_space(problem)
        return [*loops, dataclasses.replace(loops[0], single_pass=True)]

    def gather(self, x, indices, start, end, weights, *, config):
        if config.single_pass:
            return single_pass_gather(x, indices, start, end, weights)
        return tiled_gather(x, indices, start, end, weights, rows_per_chunk=config.rows_per_chunk)


class TiledGatherReduce(_ChunkedBackend, GatherReduceBackend):
    # 3: a bf16 / f16 masked combine writes its output in one pass, without a float32 [tokens, hidden]
    # accumulator converted at the end (`_first_entries_in_output`), so its fastest chunk can change.
    revision = 3
    config_cls = TiledGatherReduceConfig
    description = "pure-JAX loop over chunks of the valid entries, scatter-add in f32 (CPU)"

    def gather_reduce(self, x, indices, weights, valid, reduce_group_size, *, config):
        return tiled_gather_reduce(x, indices, weights, valid, reduce_group_size,
                                   rows_per_chunk=config.rows_per_chunk)
