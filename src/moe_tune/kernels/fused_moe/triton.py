"""`triton` backend of the fused MoE op: Pallas kernels for GPU (the Triton lowering); interpret mode elsewhere.

Both kernels walk the Megablox visit schedule (`ragged_dot/metadata.py`) with the grid (visits, column
blocks): a program multiplies one `block_m`-row tile by its group's weights, `block_k` at a time, keeping
only that group's rows (a tile shared by two groups is visited twice, each visit owning disjoint rows).

- gather_gmm: the lhs tile is an indexed load, `x[rows[i], k block]` for the group's rows (masked: other
  rows, including every row outside the shard, are never read and their `rows` entries may be anything), so
  no gathered [m, k] copy exists. With `glu` a program holds the gate and the up accumulators of the same
  columns and applies the activation in float32 before its one store.
- gmm_combine: after the k loop the float32 tile is multiplied by the rows' weights and added into
  `out[rows[i], columns]` with float32 atomic adds: the products of a token's k rows, which live in k
  different programs, are summed by the memory system in whatever order they arrive, never written as an
  [m, n] buffer. Invalid rows (outside the shard; weight 0 with skip_zero_weights) are masked out of the h,
  weight and row loads and their adds go to a trash row past the tokens (dropped), so their NaN never
  reaches a token. Interpret mode emulates the atomics with a scatter that keeps one of several adds to the
  same address within one program: exact for routing, where a token meets an expert once.

Gate and up come as two arrays (`split_weights`, `base.py`), read where they are (no concatenated copy of
the weights per call, which cost ~0.8 GB of temp at qwen3-30b-a3b on an H100): with glu the gate and the up
accumulators read their own refs; without glu (the training forward keeps [m, 2f]) a program's column
block lies in one part (block_n divides f) and two `pl.when` branches pick it, each a full k loop; where
the parts split the contraction (the dispatch's backward, dh @ [gate | up]^T) the k loop runs over gate's
f columns, then over up's, into the same accumulator (block_k divides f).

Quantized weights (int8, float8_e4m3fn, int4; mxfp4 as the same bits in int4, `_loadable`, decoded by
`tile_quant.decode_e2m1`) are loaded as they are stored and dequantized per block in float32.

Loads use index vectors clipped to the array (never a block hanging past it), so x, h and the weights are
never padded; `block_k` / `block_n` must divide the contraction / the output columns (`config_error`).
Only the gather output is padded to whole row tiles (a copy only when m is not a multiple of block_m).
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
from moe_tune.kernels.fused_moe.activations import ACTIVATIONS
from moe_tune.kernels.fused_moe.base import (FusedMoeBackend, kernel_operands, kernel_parts, weight_refs,
                                              weights_shape)
from moe_tune.kernels.fused_moe.pallas_tpu import dims
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.pallas_util import (exact_f32_precision, interpreted, out_struct, pallas_run, round_up,
                                         vary_like)
from moe_tune.kernels.ragged_dot.base import rows_in_local_groups
from moe_tune.kernels.ragged_dot.metadata import make_group_metadata
from moe_tune.kernels.ragged_dot.tile_quant import decode_e2m1

BLOCKS = (16, 32, 64, 128, 256)
SUPPORTED = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class FusedTritonConfig(KernelConfig):
    """Blocks of the matmul a direction runs (block_k tiles its contraction, block_n its output columns:
    of the gated output with glu), warps and software-pipeline stages per program."""

    block_m: int = 64
    block_k: int = 32
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _tile_rows(gid, tid, starts, ends, v, bm: int, m: int):
    """(group, clipped row indices int32 [bm], keep bool [bm]: the rows of the group in visit v's tile)."""
    group = gid[v]
    rows = tid[v] * bm + jnp.arange(bm, dtype=jnp.int32)
    keep = (rows >= starts[group]) & (rows < ends[group])
    return group, jnp.minimum(rows, m - 1), keep


def _weight_block(w_ref, s_ref, group, row0, rows: int, col0, cols: int, block, dtype, e2m1=False) -> jax.Array:
    """w[group][row0:row0 + rows, col0:col0 + cols] (rows along the forward k) in the dot's dtype; quantized
    (s_ref float32 [g, k / block, n]): dequantized in float32, by one row of scales when the block's rows lie
    in one scale block (per channel, or a tile no taller than the scale block), else by a gathered [rows,
    cols] load of them. `e2m1`: the values are mxfp4 codes held as int4 (`_loadable`), decoded here."""
    w = w_ref[group, pl.ds(row0, rows), pl.ds(col0, cols)]
    if s_ref is None:
        return w.astype(dtype)
    columns = pl.ds(col0, cols)
    if s_ref.shape[1] == 1 or block % rows == 0:  # row0 is a multiple of rows: one scale block
        scale = s_ref[group, jax.lax.div(row0, jnp.int32(block)), columns][None, :]
    else:
        scale_rows = (row0 + jnp.arange(rows, dtype=jnp.int32)) // block
        scale = s_ref[group, scale_rows[:, None], (col0 + jnp.arange(cols, dtype=jnp.int32))[None, :]]
    return ((decode_e2m1(w) if e2m1 else w.astype(jnp.float32)) * scale).astype(dtype)


def _product(a_ref, a_rows, keep, segments, group, col0, *, bk, bn, transpose_rhs, dtype, block, e2m1=False):
    """f32 [bm, bn] accumulators of a[a_rows] @ w[group][:, col0:col0 + bn]: a's rows masked by keep (never
    read where False). `segments` (`_blocks`) run one after the other into the same accumulators, each a k
    loop in steps of bk over a's columns [a_col0, a_col0 + steps * bk) with one (weight ref, scale ref or None,
    column offset) per accumulator: the weight parts that split the contraction (transpose_rhs) follow each
    other, k restarting at 0 in each part."""
    bm = keep.shape[0]
    mask = jnp.broadcast_to(keep[:, None], (bm, bk))
    accs = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in segments[0][2])
    for a_col0, k_steps, views in segments:
        def body(kk, accs, a_col0=a_col0, views=views):
            ks = a_col0 + kk * bk + jnp.arange(bk, dtype=jnp.int32)
            a = plgpu.load(a_ref.at[a_rows[:, None], ks[None, :]], mask=mask, other=0).astype(dtype)
            out = []
            for acc, (w_ref, s_ref, offset) in zip(accs, views):
                if transpose_rhs:  # rhs[g].T: the block [bn, bk] of [g, k, n], read transposed
                    w = _weight_block(w_ref, s_ref, group, col0 + offset, bn, kk * bk, bk, block, dtype, e2m1)
                else:
                    w = _weight_block(w_ref, s_ref, group, kk * bk, bk, col0 + offset, bn, block, dtype, e2m1)
                out.append(acc + plgpu.dot(a, w, trans_b=transpose_rhs, precision=exact_f32_precision(dtype)))
            return tuple(out)

        accs = jax.lax.fori_loop(0, k_steps, body, accs)
    return accs


def _blocks(weights, j, *, bn: int, bk: int, kc: int, glu: str | None, transpose_rhs: bool, n_out: int):
    """What program column block j multiplies: [(condition or None, local col0, segments)], each entry to run
    under its condition (`pl.when`; None: always), the segments as `_product` takes them. The weight parts
    stand for their concatenation along n (`base.py`):
    - transpose_rhs: they split the contraction: one segment per part, a's columns offset by the parts before;
    - glu: gate and up accumulators over the same columns, from the two parts (or from one array, up
      n_out columns further);
    - else the block lies in one part (block_n divides each part's width: the backend checks): one entry per
      part, taken where j falls in it (two pl.when branches for gate | up, each a full k loop)."""
    col0 = j * bn
    if transpose_rhs:
        segments, start = [], 0
        for w_ref, s_ref in weights:
            width = w_ref.shape[2]  # the contraction runs along the parts' n
            segments.append((start, width // bk, [(w_ref, s_ref, 0)]))
            start += width
        return [(None, col0, segments)]
    if glu:
        (gate, gate_scale), (up, up_scale) = weights if len(weights) == 2 else weights * 2
        views = [(gate, gate_scale, 0), (up, up_scale, 0 if len(weights) == 2 else n_out)]
        return [(None, col0, [(0, kc // bk, views)])]
    if len(weights) == 1:
        return [(None, col0, [(0, kc // bk, [(*weights[0], 0)])])]
    entries, start = [], 0
    for w_ref, s_ref in weights:
        width = w_ref.shape[2]
        inside = (j >= start // bn) & (j < (start + width) // bn)
        entries.append((inside, col0 - start, [(0, kc // bk, [(w_ref, s_ref, 0)])]))
        start += width
    return entries


def _each_block(blocks, run) -> None:
    """run(col0, segments) for each of `_blocks`' entries, under its condition."""
    for condition, col0, segments in blocks:
        if condition is None:
            run(col0, segments)
        else:
            pl.when(condition)(functools.partial(run, col0, segments))


def _gather_gmm_kernel(gid, tid, starts, ends, info, rows_ref, x_ref, *refs, m, bm, bk, bn, k_steps, glu,
                       transpose_rhs, dtype, block, parts, e2m1=False):
    """Schedule tables (gid, tid [visits], starts, ends [groups], info [1] = real visits); rows int32 [m];
    x [tokens, kc]; the weight parts (`parts` of them: gate, up), each [g, k, n_p] (read as rhs[g].T when
    transposed, kc = sum of n_p) followed by its scale [g, k / block, n_p] when quantized -> out [m_p, n_out]."""
    weights, (out_ref,) = weight_refs(refs, parts, block is not None)
    v, j = pl.program_id(0), pl.program_id(1)
    n_out = out_ref.shape[1]

    @pl.when(v < info[0])
    def _():
        group, rows, keep = _tile_rows(gid, tid, starts, ends, v, bm, m)
        tokens = plgpu.load(rows_ref.at[rows], mask=keep, other=0)  # outside the group: row 0, masked below

        def run(col0, segments):
            accs = _product(x_ref, tokens, keep, segments, group, col0, bk=bk, bn=bn, transpose_rhs=transpose_rhs,
                            dtype=dtype, block=block, e2m1=e2m1)
            out = ACTIVATIONS[glu][0](accs[0]) * accs[1] if glu else accs[0]
            plgpu.store(out_ref.at[pl.ds(tid[v] * bm, bm), pl.ds(j * bn, bn)], out.astype(out_ref.dtype),
                        mask=jnp.broadcast_to(keep[:, None], (bm, bn)))

        _each_block(_blocks(weights, j, bn=bn, bk=bk, kc=k_steps * bk, glu=glu, transpose_rhs=transpose_rhs,
                            n_out=n_out), run)


def _gmm_combine_kernel(gid, tid, starts, ends, info, rows_ref, weights_ref, h_ref, *refs, m, bm, bk, bn, k_steps,
                        skip_zero, transpose_rhs, dtype, trash, masked_atomics, block, parts, e2m1=False):
    """Schedule tables as in `_gather_gmm_kernel`; rows int32 [m]; weights float32 [m]; h [m, kc]; the weight
    parts (and their scales) as there; out float32 [tokens + 1, n] (aliased with the zero-filled input before
    it; row `trash` = tokens takes the invalid rows' adds)."""
    rhs, (_, out_ref) = weight_refs(refs, parts, block is not None)
    v, j = pl.program_id(0), pl.program_id(1)

    @pl.when(v < info[0])
    def _():
        group, rows, keep = _tile_rows(gid, tid, starts, ends, v, bm, m)
        weights = plgpu.load(weights_ref.at[rows], mask=keep, other=0)
        valid = keep & (weights != 0) if skip_zero else keep
        tokens = jnp.where(valid, plgpu.load(rows_ref.at[rows], mask=valid, other=trash), trash)

        def run(col0, segments):
            (acc,) = _product(h_ref, rows, valid, segments, group, col0, bk=bk, bn=bn, transpose_rhs=transpose_rhs,
                              dtype=dtype, block=block, e2m1=e2m1)
            # A select: an invalid row's product may be NaN (h rows are masked to 0, but weights are anything).
            y = jnp.where(valid[:, None], acc * weights[:, None], 0.0)
            cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
            mask = jnp.broadcast_to(valid[:, None], (bm, bn)) if masked_atomics else None
            plgpu.atomic_add(out_ref, (tokens[:, None], cols[None, :]), y, mask=mask)

        _each_block(_blocks(rhs, j, bn=bn, bk=bk, kc=k_steps * bk, glu=None, transpose_rhs=transpose_rhs,
                            n_out=out_ref.shape[1]), run)


def _weight_arrays(rhs, tile: int, glu: str | None) -> tuple[list[jax.Array], int | None]:
    """The arrays the kernels take for `rhs` (`base.kernel_parts`: the parts where no block of `tile` along n,
    block_n or block_k where n is the transposed contraction, straddles two), and the scale block along k
    (None: float)."""
    parts = kernel_parts(rhs, tile=tile, glu=glu)
    values, scale = parts[0]
    return kernel_operands(parts), None if scale is None else values.shape[1] // scale.shape[1]


def _loadable(weights: list[jax.Array]) -> tuple[list[jax.Array], bool]:
    """The weight arrays as Triton loads them, and whether they hold mxfp4 codes: Triton loads no float4, so
    float4_e2m1fn values travel as the same bits in int4 (an XLA bitcast, free), decoded in the kernel."""
    e2m1 = any(w.dtype == jnp.float4_e2m1fn for w in weights)
    return [jax.lax.bitcast_convert_type(w, jnp.int4) if w.dtype == jnp.float4_e2m1fn else w for w in weights], e2m1


def _dot_dtype(a, values, block: int | None) -> jnp.dtype:
    """tl.dot takes one operand type: the activations' when the weights are dequantized (a scale `block`),
    else the promoted."""
    return a.dtype if block is not None else jnp.promote_types(a.dtype, values.dtype)


def _schedule(group_sizes, group_offset, m: int, bm: int, groups: int):
    meta = make_group_metadata(group_sizes, m=m, tm=bm, groups=groups,
                               group_offset=0 if group_offset is None else group_offset)
    return meta.group_ids, meta.tile_ids, meta.group_starts, meta.group_ends, meta.num_visits[None]


def _blocked_sizes(problem: FusedMoeProblem) -> tuple[int, int, str]:
    """(contraction, output columns) that block_k and block_n must divide, and what splits them: the whole
    ones (`dims`), except along the dispatch's gate | up parts (`FusedMoeProblem.parts_split`), where a block
    must not straddle the two and divides f = n / 2."""
    d, f, why = dims(problem), problem.n // 2, " of each of gate and up"
    return {None: (d.kc, d.n_out, ""), "k": (f, d.n_out, why), "n": (d.kc, f, why)}[problem.parts_split]


class TritonFusedMoe(FusedMoeBackend):
    name = "triton"
    # 2: gate and up read as two parts (`split_weights`), and the rule that a block does not straddle them;
    # 3: 4-bit weights (int4, mxfp4 as its int4 bits) served
    revision = 3  # bump on changes that can change the fastest or a valid config (Backend.revision)
    split_weights = True  # reads (gate, up) as two parts: no concatenated copy of the weights per call
    config_cls = FusedTritonConfig
    platforms = ("gpu",)
    # pl.program_id / pl.when, triton load / store / atomic_add / dot / CompilerParams as of jax 0.10.2; JAX
    # 0.11 deprecates the Pallas Triton backend (still shipped).
    jax_versions = ">=0.10,<0.12"
    description = ("Pallas Triton: indexed row loads into the grouped matmul, gate and up read as two arrays; "
                   "combine by float32 atomic adds into the token rows; interpret mode elsewhere")

    def runs_on(self, platform: str) -> bool:
        return True  # compiled on GPU, in interpret mode elsewhere

    def config_error(self, config: FusedTritonConfig, problem: FusedMoeProblem) -> str | None:
        if problem.dtype not in SUPPORTED:
            return f"triton supports {'/'.join(SUPPORTED)}, not dtype={problem.dtype}"
        if (reason := self.chip_error(problem)) is not None:
            return reason
        for name in ("block_m", "block_k", "block_n"):
            value = getattr(config, name)
            if value not in BLOCKS:
                return f"{name}={value!r} must be one of {BLOCKS} (a power of two >= 16 for tl.dot)"
        if config.num_warps not in (1, 2, 4, 8, 16) or isinstance(config.num_warps, bool):
            return f"num_warps={config.num_warps!r} must be a power of two <= 16"
        if not isinstance(config.num_stages, int) or not 1 <= config.num_stages <= 6:
            return f"num_stages={config.num_stages!r} must be in 1..6"
        # Neither x / h nor the weights are padded (a copy of each per call): blocks divide what they tile.
        kc, n_out, parts = _blocked_sizes(problem)
        if kc % config.block_k:
            return f"block_k={config.block_k} must divide the contraction{parts} ({kc})"
        if n_out % config.block_n:
            return f"block_n={config.block_n} must divide the output columns{parts} ({n_out})"
        if config.block_m > max(16, 1 << (problem.m - 1).bit_length()):
            return f"block_m={config.block_m} is larger than the {problem.m} rows it tiles"
        need, budget = self.shared_memory_bytes(config, problem), devices.gpu_shared_memory_bytes()
        if need > budget:
            return f"needs {need // 1024} KiB of shared memory per block, over the {budget // 1024} KiB budget"
        return None

    def chip_error(self, problem: FusedMoeProblem) -> str | None:
        """Triton converts float8 with an instruction of compute capability 8.9 and later (an older GPU aborts
        the compiling process: `ragged_dot/triton.py`)."""
        capability = devices.gpu_compute_capability()
        if problem.rhs_qdtype == "float8_e4m3fn" and capability is not None and capability < (8, 9):
            return (f"float8 weights need compute capability >= 8.9 in Triton, this GPU has "
                    f"{capability[0]}.{capability[1]}")
        return None

    def shared_memory_bytes(self, config: FusedTritonConfig, problem: FusedMoeProblem) -> int:
        """Pipelined loads: num_stages copies of the lhs tile and of each weight tile (two with glu), as loaded
        (quantized weights at 1 byte, 4-bit too). Weight parts add none: one part's tile is loaded at a time
        (a `pl.when` branch or k loop per part), and the H100 compiler's verdicts near the budget are the
        same on parts as on one array (benchmarks/results/fused_triton_weights_h100_compile_*). Quantized
        weights add, as the H100 compiler requested them (benchmarks/results/fused_moe_compile_*): per stage and weight tile a row of float32 scales, or
        where the tile spans several scale blocks its gathered [rows, cols] float32 scales in num_stages - 1
        buffers; and but for the plain dispatch a conversion buffer of up to bm x max(bk, bn) 16-bit values."""
        views = 2 if dims(problem).glu else 1
        bm, bk, bn, stages = config.block_m, config.block_k, config.block_n, config.num_stages
        item = jnp.dtype(problem.dtype).itemsize
        if not problem.rhs_qdtype:
            return stages * (bm * bk + views * bk * bn) * item
        need = stages * (bm * bk * item + views * bk * bn)
        rows, cols = (bn, bk) if problem.transpose_rhs else (bk, bn)
        if problem.rhs_qblock == problem.k or problem.rhs_qblock % rows == 0:  # one scale row per tile
            need += stages * views * cols * 4
        else:
            need += (stages - 1) * views * bk * bn * 4
        if problem.kernel == "gmm_combine" or problem.transpose_rhs:
            need += bm * max(bk, bn) * 2
        return need

    def default_config(self, problem: FusedMoeProblem) -> FusedTritonConfig:
        kc, n_out, _ = _blocked_sizes(problem)
        pick = lambda want, size: max([b for b in BLOCKS if b <= want and size % b == 0], default=16)
        block_m = min(64, max(16, 1 << (problem.m - 1).bit_length()))  # no taller than the rows
        return FusedTritonConfig(block_m=block_m, block_k=pick(32, kc), block_n=pick(64, n_out), num_warps=4,
                                 num_stages=2)

    def candidate_values(self, problem: FusedMoeProblem) -> dict[str, list[int]]:
        return {"block_m": [32, 64, 128], "block_k": [32, 64, 128], "block_n": [64, 128, 256],
                "num_warps": [4, 8], "num_stages": [2, 3, 4]}

    def gather_gmm(self, x, rows, rhs, group_sizes, *, config, out_dtype, group_offset=None, glu=None,
                   transpose_rhs=False):
        m, kc = rows.shape[0], x.shape[1]
        bm, bk, bn = config.block_m, config.block_k, config.block_n
        weights, block = _weight_arrays(rhs, bk if transpose_rhs else bn, glu)
        weights, e2m1 = _loadable(weights)
        groups, k_w, n_w = weights_shape(rhs)
        n_out = k_w if transpose_rhs else n_w // 2 if glu else n_w
        m_p = round_up(m, bm)
        kernel = functools.partial(_gather_gmm_kernel, m=m, bm=bm, bk=bk, bn=bn, k_steps=kc // bk, glu=glu,
                                   transpose_rhs=transpose_rhs, dtype=_dot_dtype(x, weights[0], block), block=block,
                                   parts=len(weights) // (1 if block is None else 2), e2m1=e2m1)
        tables = _schedule(group_sizes, group_offset, m, bm, groups)
        args = (*tables, rows.astype(jnp.int32), x, *weights)
        out = pallas_run(pl.pallas_call(
            kernel,
            grid=(tables[0].shape[0], n_out // bn),
            out_shape=out_struct((m_p, n_out), out_dtype, *args),
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
            interpret=interpreted("gpu"),
            name="moe_tune_gather_gmm",
        ), *args, interpret=interpreted("gpu"))
        # Rows no local group owns were never stored.
        keep = rows_in_local_groups(group_sizes, m, groups, group_offset)
        return jnp.where(keep, out[:m], jnp.zeros((), out.dtype))

    def gmm_combine(self, h, rhs, group_sizes, rows, row_weights, *, tokens, config, out_dtype, group_offset=None,
                    skip_zero_weights=False, transpose_rhs=False) -> jax.Array:
        m, kc = h.shape
        bm, bk, bn = config.block_m, config.block_k, config.block_n
        weights, block = _weight_arrays(rhs, bk if transpose_rhs else bn, None)
        weights, e2m1 = _loadable(weights)
        groups, k_w, n_w = weights_shape(rhs)
        n = k_w if transpose_rhs else n_w
        interpret = interpreted("gpu")
        kernel = functools.partial(
            _gmm_combine_kernel, m=m, bm=bm, bk=bk, bn=bn, k_steps=kc // bk, skip_zero=skip_zero_weights,
            transpose_rhs=transpose_rhs, dtype=_dot_dtype(h, weights[0], block), trash=tokens,
            # Interpret mode's atomics take no mask; there the invalid rows' adds all land on the trash row.
            masked_atomics=not interpret, block=block, parts=len(weights) // (1 if block is None else 2), e2m1=e2m1)
        tables = _schedule(group_sizes, group_offset, m, bm, groups)
        args = (*tables, rows.astype(jnp.int32), row_weights.astype(jnp.float32), h, *weights)
        # the accumulator's type is the output's (aliased): varying as the operands do inside shard_map
        args = (*args, vary_like(jnp.zeros((tokens + 1, n), jnp.float32), *args))
        out = pallas_run(pl.pallas_call(
            kernel,
            grid=(tables[0].shape[0], n // bn),
            out_shape=out_struct((tokens + 1, n), jnp.float32, *args),
            # the zero-filled accumulator, after the 5 tables, rows, weights, h and the weight arrays
            input_output_aliases={8 + len(weights): 0},
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
            interpret=interpret,
            name="moe_tune_gmm_combine",
        ), *args, interpret=interpret)
        return out[:tokens].astype(out_dtype)
