"""`pallas_tpu` backend of the fused MoE op: the Pallas Mosaic TPU kernels of `pallas_tpu_kernels.py` (a
gathered-row dispatch fused into the grouped matmul, and a combine that adds into a VMEM-resident output
slab), their config, validity rules and search space. Off TPU the kernels run in Pallas TPU interpret mode
(DMAs simulated on the CPU), slow and only meant for tests at small shapes.

One config serves the four directions (each tuned separately); `tm` tiles the expert-ordered rows, `tk`
the contraction, `tn` the output columns (of the gated output with glu), `dmas_in_flight` bounds the row
DMAs outstanding in gather_gmm (unused by gmm_combine, whose h comes in blocks).

Validity (`config_error`): float32 / bfloat16 activations, float or int8 / float8_e4m3fn weights; TPU
block alignment ((8 or 16) x 128, or the whole dimension), `tk` dividing the contraction, `tn` dividing the
gated width with glu and the combine's output, a block never straddling gate and up (`tn` dividing f
without glu, `tk` dividing f in the dispatch's backward: the kernels read them as two operands,
`pallas_tpu_weights.py`), the tile along the forward k a multiple or a divisor of the
scale block; the SMEM the scalar-prefetch tables take and the VMEM the blocks, scratches and the compiler's
own temporaries take against the chip's scoped budget (`devices.tpu_scoped_vmem_bytes`). The budget rules
were held to the v5e compiler (benchmarks/fused_moe_compile_probe.py: no false accepts, some false rejects
near the limit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.core import devices
from moe_tune.kernels.base import KernelConfig, positive_int_error
from moe_tune.kernels.fused_moe.base import FusedMoeBackend, weights_shape
from moe_tune.kernels.fused_moe.pallas_tpu_kernels import packs_halves, pallas_gather_gmm, pallas_gmm_combine
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.kernels.pallas_util import round_up, sublanes
from moe_tune.kernels.ragged_dot.base import rows_in_local_groups
from moe_tune.kernels.ragged_dot.metadata import max_visits

LANES = 128
SUPPORTED = ("float32", "bfloat16")
# Rows of a 1-byte block's native tile ((32, 128)): a dequantized sub-block starts and ends on one.
BYTE_SUBLANES = 32
# The scalar-prefetch tables (rows, weights, the visit schedule) sit in SMEM, whose scoped budget is 1 MiB
# up to v6e; half is left to Mosaic's own scalars, as the pallas_tpu gathers do.
SMEM_PREFETCH_BYTES = 512 * 1024
MAX_DMAS_IN_FLIGHT = 64
TILES = (128, 256, 512, 1024, 2048)


@dataclasses.dataclass(frozen=True)
class FusedPallasTpuConfig(KernelConfig):
    """tm: rows per tile; tk: contraction per k step; tn: output columns per tile; dmas_in_flight: row DMAs
    outstanding at once while gather_gmm gathers a tile (gmm_combine ignores it)."""

    tm: int = 128
    tk: int = 512
    tn: int = 512
    dmas_in_flight: int = 16


@dataclasses.dataclass(frozen=True)
class Dims:
    """The matmul a direction runs: `kc` contraction, `n_w` weight columns, `n_out` output columns (n_w / 2
    with glu), `glu`, whether it gathers (gather_gmm) or scatters (gmm_combine)."""

    kc: int
    n_w: int
    n_out: int
    glu: str | None
    gathers: bool


def dims(problem: FusedMoeProblem) -> Dims:
    glu = None if problem.transpose_rhs else problem.glu
    kc, n_w = (problem.n, problem.k) if problem.transpose_rhs else (problem.k, problem.n)
    return Dims(kc, n_w, n_w // 2 if glu else n_w, glu, problem.kernel == "gather_gmm")


def part_split(problem: FusedMoeProblem) -> tuple[str, int] | None:
    """(the tile, f) along the dispatch's gate | up parts of f = n / 2 columns each
    (`FusedMoeProblem.parts_split`): tk along the backward's contraction, tn along the forward's output columns
    without glu; None elsewhere."""
    split = problem.parts_split
    return None if split is None else ({"k": "tk", "n": "tn"}[split], problem.n // 2)


def tiled_sizes(problem: FusedMoeProblem) -> tuple[int, int]:
    """(contraction, output columns) that tk and tn tile: `dims`', except that along gate | up a tile tiles f,
    where f is lane-aligned (else no lane-aligned block fits a part: the tiles tile 2f and the backend
    concatenates the parts, as before)."""
    d, split = dims(problem), part_split(problem)
    if split is None or split[1] % LANES:
        return d.kc, d.n_out
    return (split[1], d.n_out) if split[0] == "tk" else (d.kc, split[1])


def smem_bytes(config: FusedPallasTpuConfig, problem: FusedMoeProblem) -> int:
    """The int32/float32 scalar-prefetch tables: rows (and the combine's weights) [m padded to tm], group and
    tile ids per visit, group starts and ends, and three scalars."""
    m_p = round_up(problem.m, config.tm)
    per_row = 1 if dims(problem).gathers else 2
    return 4 * (per_row * m_p + 2 * max_visits(m_p, config.tm, problem.groups) + 2 * problem.groups + 3)


def vmem_bytes(config: FusedPallasTpuConfig, problem: FusedMoeProblem) -> int:
    """VMEM the kernel needs: double-buffered weight (and h) blocks, the output block or slab, the float32
    accumulators and the gathered-row scratch, what the compiler keeps beside them (the dot's converted
    operand tile, the epilogue's float32 temporaries) and the chip's reserve (`devices.tpu_vmem_model`)."""
    d, tm, tk, tn = dims(problem), config.tm, config.tk, config.tn
    item = jnp.dtype(problem.dtype).itemsize
    # weight operands, each double-buffered: gate and up (glu, or the dispatch's parts; an idle part's
    # blocks stay resident); accumulators: 2 with glu
    weights, accs = (2 if d.glu or part_split(problem) else 1), (2 if d.glu else 1)
    reserve, _ = devices.tpu_vmem_model()
    w_item = 1 if problem.rhs_qdtype else item
    need = reserve + 2 * weights * tk * tn * w_item + accs * tm * tn * 4 + tm * tk * 4
    if problem.rhs_qdtype:  # per operand the scale blocks, whole along k, and the dequantized float32 block
        cols = tk if problem.transpose_rhs else tn
        need += weights * (2 * round_up(problem.k // problem.rhs_qblock, 8) * cols * 4 + tk * tn * 4)
    if d.gathers:  # row scratch (32-bit rows: bfloat16 pairs or float32), output block, glu's temporaries
        row_bytes = d.kc * (2 if packs_halves(problem.dtype, d.kc, tk) else 4)
        need += tm * row_bytes + 2 * tm * tn * item + (2 * tm * tn * 4 if d.glu else 0)
    else:  # h blocks, the float32 slab
        need += 2 * tm * tk * item + problem.tokens * tn * 4
    return need


def _tile_error(name: str, tile, size: int, align: int, *, divides: bool) -> str | None:
    if error := positive_int_error(name, tile):
        return error
    if tile % align and tile != size:
        return f"{name}={tile} must be a multiple of {align} or equal {size}"
    if tile > size:
        return f"{name}={tile} exceeds {size}"
    if divides and size % tile:
        return f"{name}={tile} must divide {size}"
    return None


def shape_error(problem: FusedMoeProblem) -> str | None:
    """Why no config can serve `problem` (independent of the tunables), or None."""
    if problem.dtype not in SUPPORTED:
        return f"pallas_tpu supports {'/'.join(SUPPORTED)}, not dtype={problem.dtype}"
    if problem.rhs_format is not None and problem.rhs_format.four_bit:  # 1-byte weights only
        return f"pallas_tpu dequantizes 1-byte weights, not {problem.rhs_format.name} (it runs the jax backend)"
    d = dims(problem)
    if d.gathers and d.kc % LANES:
        return (f"the gathered rows ({d.kc} wide) are not a multiple of {LANES} lanes: Mosaic copies whole "
                f"lane-aligned rows")
    if d.glu and d.n_out % LANES:
        return f"with glu the gated width ({d.n_out}) must be a multiple of {LANES} (gate and up blocks)"
    return None


class PallasTpuFusedMoe(FusedMoeBackend):
    name = "pallas_tpu"
    # 2: gate and up read as two operands (`split_weights`), the rule that a block does not straddle them, and
    # the VMEM their blocks take
    revision = 2  # bump on changes that can change the fastest or a valid config (Backend.revision)
    split_weights = True  # reads (gate, up) as two operands: no concatenated copy of the weights per call
    config_cls = FusedPallasTpuConfig
    platforms = ("tpu",)
    # PrefetchScalarGridSpec, pl.ANY, make_async_copy, DMA semaphores and InterpretParams as of jax 0.10.
    jax_versions = ">=0.10,<0.12"
    description = ("Pallas Mosaic TPU: x rows DMAed by index into the grouped matmul; gate and up read as two "
                   "operands; combine adds into a VMEM-resident output slab; interpret mode off TPU")

    def runs_on(self, platform: str) -> bool:
        return True  # natively on TPU, in interpret mode everywhere else

    def config_error(self, config: FusedPallasTpuConfig, problem: FusedMoeProblem) -> str | None:
        if reason := shape_error(problem):
            return reason
        d, sub = dims(problem), sublanes(problem.dtype)
        n_tiled = d.n_out
        reason = (_tile_error("tm", config.tm, round_up(problem.m, sub), sub, divides=False)
                  or _tile_error("tk", config.tk, d.kc, LANES, divides=True)
                  # glu: gate and up blocks are whole column blocks of [.., 2f]; combine: whole slab blocks
                  or _tile_error("tn", config.tn, n_tiled, LANES, divides=bool(d.glu) or not d.gathers))
        if reason:
            return reason
        if d.glu and config.tn % LANES:
            return f"tn={config.tn} must be a multiple of {LANES} with glu (a block of the concatenated weights)"
        split = part_split(problem)
        if split and not split[1] % LANES and split[1] % getattr(config, split[0]):
            name, f = split
            return (f"{name}={getattr(config, name)} must divide the {f} columns of each of gate and up (a block "
                    f"never straddles the two)")
        if problem.rhs_qdtype:
            # The weight block's rows run along the forward k (tk; transposed, tn): dequantized in sub-blocks
            # that each lie in one scale block and start on a whole 1-byte tile.
            name, tile = ("tn", config.tn) if problem.transpose_rhs else ("tk", config.tk)
            block = problem.rhs_qblock
            if tile % block and block % tile:
                return f"{name}={tile} must be a multiple of the scale block {block} or divide it"
            if min(tile, block) % BYTE_SUBLANES:
                return (f"{name}={tile} and the scale block {block}: sub-blocks must be multiples of "
                        f"{BYTE_SUBLANES} rows")
        dmas = config.dmas_in_flight
        if not isinstance(dmas, int) or isinstance(dmas, bool) or not 0 < dmas <= MAX_DMAS_IN_FLIGHT:
            return f"dmas_in_flight must be an integer in 1..{MAX_DMAS_IN_FLIGHT}, got {dmas!r}"
        if dmas > config.tm:
            return f"dmas_in_flight={dmas} exceeds the {config.tm} row DMAs of a tile"
        if (smem := smem_bytes(config, problem)) > SMEM_PREFETCH_BYTES:
            return (f"the scalar-prefetch tables take {smem / 1024:.0f} KiB of SMEM, over "
                    f"{SMEM_PREFETCH_BYTES // 1024} KiB")
        need, budget = vmem_bytes(config, problem), devices.tpu_scoped_vmem_bytes()
        if need > budget:
            return f"needs {need / 2**20:.1f} MiB of VMEM, over the chip's {budget / 2**20:.0f} MiB of scoped VMEM"
        return None

    def default_config(self, problem: FusedMoeProblem) -> FusedPallasTpuConfig:
        """tm 128 (or the rows rounded up), the largest tk <= 512 and tn <= 512 that divide their
        dimensions (`tiled_sizes`: f along gate | up), halved (tn first, then tk, then tm) until the VMEM and
        SMEM rules hold."""
        sub = sublanes(problem.dtype)
        kc, n_out = tiled_sizes(problem)

        def fit(want: int, size: int) -> int:
            for tile in range(min(want, size) // LANES * LANES, 0, -LANES):
                if size % tile == 0:
                    return tile
            return size

        config = FusedPallasTpuConfig(tm=min(128, round_up(problem.m, sub)), tk=fit(512, kc),
                                      tn=fit(512, n_out), dmas_in_flight=16)
        config = dataclasses.replace(config, dmas_in_flight=min(16, config.tm))
        for field, floor in (("tn", LANES), ("tk", LANES), ("tm", sub)):
            while self.config_error(config, problem) and getattr(config, field) // 2 >= floor:
                smaller = getattr(config, field) // 2
                size = n_out if field == "tn" else kc
                if field != "tm" and (smaller % LANES or size % smaller):
                    break
                config = dataclasses.replace(config, **{field: smaller},
                                             dmas_in_flight=min(config.dmas_in_flight, smaller if field == "tm"
                                                                else config.tm))
        return config

    def candidate_values(self, problem: FusedMoeProblem) -> dict[str, list[int]]:
        d, sub = dims(problem), sublanes(problem.dtype)
        kc, n_out = tiled_sizes(problem)
        tiles = lambda size: sorted({size, *(t for t in TILES if t < size)})
        dmas = [8, 16, 32] if d.gathers else [16]
        return {"tm": [2 * sub, 64, 128, 256, 512], "tk": tiles(kc), "tn": tiles(n_out), "dmas_in_flight": dmas}

    def gather_gmm(self, x, rows, rhs, group_sizes, *, config, out_dtype, group_offset=None, glu=None,
                   transpose_rhs=False):
        out = pallas_gather_gmm(x, rows, rhs, group_sizes, tm=config.tm, tk=config.tk, tn=config.tn,
                                dmas_in_flight=config.dmas_in_flight, out_dtype=jnp.dtype(out_dtype),
                                group_offset=group_offset, glu=glu, transpose_rhs=transpose_rhs)
        # Rows no local group owns are never written.
        keep = rows_in_local_groups(group_sizes, rows.shape[0], weights_shape(rhs)[0], group_offset)
        return jnp.where(keep, out, jnp.zeros((), out.dtype))

    def gmm_combine(self, h, rhs, group_sizes, rows, row_weights, *, tokens, config, out_dtype, group_offset=None,
                    skip_zero_weights=False, transpose_rhs=False) -> jax.Array:
        return pallas_gmm_combine(h, rhs, group_sizes, rows, row_weights, tokens=tokens, tm=config.tm,
                                  tk=config.tk, tn=config.tn, out_dtype=jnp.dtype(out_dtype),
                                  group_offset=group_offset, skip_zero_weights=skip_zero_weights,
                                  transpose_rhs=transpose_rhs)
