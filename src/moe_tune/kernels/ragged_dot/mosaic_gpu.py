"""`mosaic_gpu` backend: JAX's Pallas Mosaic GPU ragged dots (wgmma on Hopper, tcgen05 on Blackwell), with
the config rules and search space of each chip.

The kernel is chosen by the compute capability of the GPU being compiled for (`devices`, so that compiling
for a target chip picks that chip's kernel):
- sm_90 (H100, H200): fwd and dlhs on `ragged_dot_mgpu.ragged_dot` (`transpose_rhs` for dlhs), drhs on
  `transposed_ragged_dot_mgpu.transposed_ragged_dot`;
- sm_100 (B200): fwd and dlhs on `blackwell_ragged_dot_mgpu.ragged_dot_kernel` (dlhs with rhs transposed by
  XLA first: the kernel has no `transpose_rhs`), as 2-CTA pairs only (`collective`: JAX 0.10.2's kernel fails
  without them); drhs on this project's tcgen05 kernel, `mosaic_gpu_tgmm_sm100` (JAX 0.10 / 0.11 have no
  tcgen05 transposed ragged dot, and their Hopper one uses wgmma, which sm_100 does not have), one CTA per
  output tile (not 2-CTA);
- off a GPU the Hopper gmm runs in Mosaic GPU's interpreter, which the tests check against the float64
  references (dlhs with rhs transposed by XLA there: the interpreter's wgmma cannot read a transposed ref);
  the interpreter cannot run the tgmm kernel (see `chip_error`), so drhs off a GPU falls back, nor the
  Blackwell kernels ("Unsupported memory space: tmem").
`mosaic_gpu_kernels.py` wraps the calls (padding, shards, zero rows); `mosaic_gpu_smem.py` counts shared
memory the way Mosaic GPU does.

What no config can run (`chip_error`, so that the op falls back to its plain-JAX backend with one warning):
a GPU below sm_90; quantized operands (the kernels take one 16-bit dtype and apply no scales; JAX's one
mixed-type kernel, `hopper_mixed_type_matmul_mgpu`, is a dense int8 x 16-bit matmul with no scales and no
groups); float32 operands (tensor cores multiply float32 as tf32, short of a float32 result); operands of two
dtypes, or a result dtype other than theirs (the kernels write their input dtype: a float32 result would be
rounded to 16 bits first).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_tune.core import devices
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot import mosaic_gpu_kernels as kernels
from moe_tune.kernels.ragged_dot import mosaic_gpu_smem as smem
from moe_tune.kernels.ragged_dot import mosaic_gpu_tgmm_sm100 as tgmm_sm100
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.core.quant import QArray

HOPPER, BLACKWELL = "hopper", "blackwell"
LOW_PRECISION = ("bfloat16", "float16")
MMA_ROWS = 64  # rows of one warpgroup's wgmma: blocks of rows are multiples of it
MIN_BLOCK = 64  # 64 16-bit values: the 128-byte swizzle the kernels' TMA transfers use


@dataclasses.dataclass(frozen=True)
class MosaicGpuConfig(KernelConfig):
    """Tiles of the matmul being run, in the upstream kernels' names.

    gmm (fwd, dlhs): block_m rows, block_n output columns, block_k of the contraction (for dlhs: block_n tiles
    the forward's k and block_k its n). tgmm (drhs): block_m tiles k, block_n tiles n, block_k the rows.
    max_concurrent_steps: pipeline depth (shared-memory buffers of each operand). grid_block_n: width of the
    grid's snake (Hopper `grid_block_n`, Blackwell `grid_tile_width`). Blackwell only (at their defaults on
    Hopper): `collective` (2-CTA pairs computing 2 x block_m by 2 x block_n), `grid_minor_dim` (the grid's
    minor dimension as upstream's `MatmulDimension` numbers it: 1 = n, 0 = m; a number, as every tunable is),
    `epilogue_tile_n` (columns per store of the epilogue).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1
    collective: bool = False
    grid_minor_dim: int = 1
    epilogue_tile_n: int = 64


BLACKWELL_ONLY = {"collective": False, "grid_minor_dim": 1, "epilogue_tile_n": 64}


def chip() -> str | None:
    """The kernel family of the chip being compiled for: `hopper` (sm_90; also off a GPU, where the Hopper
    kernels run interpreted), `blackwell` (sm_100), None for any other GPU."""
    if devices.platform() != "gpu":
        return HOPPER
    capability = devices.gpu_compute_capability()
    if capability is None:
        return None
    return {9: HOPPER, 10: BLACKWELL}.get(capability[0])


def fit_block(want: int, size: int, least: int = MIN_BLOCK) -> int:
    """A block of `want`, or the smallest multiple of `least` covering `size` when that is smaller."""
    return max(least, min(want, -(-size // least) * least))


class MosaicGpuRaggedDot(RaggedDotBackend):
    name = "mosaic_gpu"
    revision = 1
    config_cls = MosaicGpuConfig
    platforms = ("gpu",)
    # The upstream kernels' names, arguments and Mosaic GPU's interpreter as read in jax 0.10.2 (the GPU
    # machines run 0.11: kernels/guard.py falls back outside this range).
    jax_versions = ">=0.10.2,<0.12"
    description = "JAX's Pallas Mosaic GPU ragged dots (wgmma on sm_90, tcgen05 on sm_100); interpreted elsewhere"

    def runs_on(self, platform: str) -> bool:
        return True  # compiled on GPU, in Mosaic GPU's interpreter elsewhere

    def chip_error(self, problem: RaggedDotProblem) -> str | None:
        family = chip()
        if family is None:
            capability = devices.gpu_compute_capability()
            have = "an unknown GPU" if capability is None else f"sm_{capability[0]}{capability[1]}"
            return f"the Mosaic GPU ragged kernels need sm_90 (wgmma) or sm_100 (tcgen05), this is {have}"
        if problem.quantized:
            return ("quantized operands are not supported: JAX's Mosaic GPU ragged kernels take one 16-bit dtype "
                    "and apply no scales (backend mosaic_gpu_quant runs quantized weights on sm_90)")
        a, b, out = problem.operand_dtypes()
        if a != b or a not in LOW_PRECISION:
            return (f"operands {a} x {b}: the Mosaic GPU ragged kernels take two operands of one 16-bit dtype "
                    f"({' or '.join(LOW_PRECISION)}; tensor cores multiply float32 as tf32)")
        if out != a:
            return f"a {out} result from {a} operands: the Mosaic GPU ragged kernels write their operands' dtype"
        if problem.direction == "drhs" and kernels.interpreting():
            return ("drhs in Mosaic GPU's interpreter: its tgmm kernel's plgpu.layout_cast has no CPU rule, and "
                    "with one XLA:CPU crashes (SIGFPE folding a remainder by zero)")
        return None

    def config_error(self, config: MosaicGpuConfig, problem: RaggedDotProblem) -> str | None:
        if (reason := self.chip_error(problem)) is not None:
            return reason
        family = chip()
        if family == HOPPER:
            for field, default in BLACKWELL_ONLY.items():
                if getattr(config, field) != default:
                    return f"{field}={getattr(config, field)!r} is Blackwell's; on Hopper it stays {default!r}"
        if config.grid_minor_dim not in (0, 1):
            return f"grid_minor_dim={config.grid_minor_dim!r} must be 1 (n) or 0 (m)"
        if config.block_m % MMA_ROWS or config.block_m <= 0:
            return f"block_m={config.block_m} must be a positive multiple of {MMA_ROWS} (one warpgroup's rows)"
        for field in ("block_n", "block_k", "epilogue_tile_n"):
            value = getattr(config, field)
            if value <= 0 or value % MIN_BLOCK or value > 256:
                return f"{field}={value} must be a multiple of {MIN_BLOCK} up to 256"
        if config.grid_block_n < 1:
            return f"grid_block_n={config.grid_block_n} must be >= 1"
        least = 1 if problem.direction == "drhs" else 2  # gmm's pipeline delays each release by one step
        if not least <= config.max_concurrent_steps <= 8:
            return f"max_concurrent_steps={config.max_concurrent_steps} must be in {least}..8"
        if family == BLACKWELL and (reason := self._blackwell_error(config, problem.direction)) is not None:
            return reason
        if (reason := self._fits_dims(config, problem)) is not None:
            return reason
        need, budget = self.shared_memory_bytes(config, problem), devices.gpu_shared_memory_bytes()
        if need > budget:
            return f"needs {need} bytes of shared memory, over the {budget} bytes of one block"
        return None

    @staticmethod
    def _blackwell_error(config: MosaicGpuConfig, direction: str) -> str | None:
        if direction == "drhs":
            return _blackwell_tgmm_error(config)
        if not config.collective:
            # jax 0.10.2's kernel reads the cluster axis `x` and unpacks three grid indices into two unless it is
            # collective ("Found an unbound axis name: x", then "too many values to unpack")
            return "collective=False: JAX's Blackwell ragged kernel runs only as 2-CTA pairs (collective=True)"
        if config.block_m != 128:
            return f"block_m={config.block_m}: Blackwell's kernel takes 128 rows per CTA (tcgen05's M)"
        pair = 2 if config.collective else 1
        if (config.block_n * pair) % config.epilogue_tile_n:
            return f"epilogue_tile_n={config.epilogue_tile_n} must divide the pair's {config.block_n * pair} columns"
        if smem.tmem_columns(2 * config.block_n * pair) > smem.TMEM_COLUMNS:
            return (f"block_n={config.block_n}: its double-buffered float32 accumulator needs over "
                    f"{smem.TMEM_COLUMNS} TMEM columns")
        return None

    @staticmethod
    def _fits_dims(config: MosaicGpuConfig, problem: RaggedDotProblem) -> str | None:
        """Blocks no larger than the (64-rounded) dims they tile: a larger one only computes padding."""
        rows, contract, cols = problem.matmul_dims()
        tiled = ({"block_m": contract, "block_n": cols, "block_k": rows} if problem.direction == "drhs"
                 else {"block_n": cols, "block_k": contract})
        if chip() == BLACKWELL:
            tiled.pop("block_m", None)  # 128 rows of tcgen05 (k padded up to them), whatever the dimension
        for field, size in tiled.items():
            if getattr(config, field) > fit_block(256, size):
                return f"{field}={getattr(config, field)} is larger than the dimension it tiles ({size})"
        return None

    def shared_memory_bytes(self, config: MosaicGpuConfig, problem: RaggedDotProblem) -> int:
        """Bytes of shared memory the kernel asks for (`mosaic_gpu_smem`, as Mosaic GPU counts them)."""
        a, _, out = (jnp.dtype(d).itemsize for d in problem.operand_dtypes())
        _, contract, _ = problem.matmul_dims()
        bm, bn, bk, steps = config.block_m, config.block_n, config.block_k, config.max_concurrent_steps
        if problem.direction == "drhs" and chip() == BLACKWELL:
            return smem.blackwell_tgmm_bytes(bm, bn, bk, steps, config.epilogue_tile_n, a)
        if problem.direction == "drhs":
            return smem.hopper_tgmm_bytes(bm, bn, bk, steps, a, out)
        if chip() == BLACKWELL:
            return smem.blackwell_gmm_bytes(bm, bn, bk, steps, config.epilogue_tile_n, a)
        return smem.hopper_gmm_bytes(bm, bn, bk, steps, -(-contract // bk) * bk, a, out)

    def default_config(self, problem: RaggedDotProblem) -> MosaicGpuConfig:
        rows, contract, cols = problem.matmul_dims()
        if problem.direction == "drhs" and chip() == BLACKWELL:
            return MosaicGpuConfig(block_m=128, block_n=fit_block(128, cols), block_k=64, max_concurrent_steps=4)
        if problem.direction == "drhs":
            return MosaicGpuConfig(block_m=fit_block(128, contract), block_n=fit_block(128, cols), block_k=64,
                                   max_concurrent_steps=2)
        return MosaicGpuConfig(block_m=128, block_n=fit_block(128, cols), block_k=64, max_concurrent_steps=4,
                               collective=chip() == BLACKWELL)

    def candidate_values(self, problem: RaggedDotProblem) -> dict[str, list]:
        values = {"block_m": [64, 128], "block_n": [64, 128, 256], "block_k": [64, 128],
                  "max_concurrent_steps": [2, 3, 4, 6], "grid_block_n": [1, 4]}
        if problem.direction == "drhs" and chip() == BLACKWELL:
            values.update(block_m=[128], max_concurrent_steps=[1, 2, 3, 4, 6], grid_block_n=[1],
                          epilogue_tile_n=[64, 128])
        elif problem.direction == "drhs":
            values["max_concurrent_steps"] = [1, 2, 3, 4]
        elif chip() == BLACKWELL:
            values.update(block_m=[128], collective=[True], grid_minor_dim=[1, 0])
        return values

    # ---- the kernels

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        lhs, rhs = (_float(x) for x in (lhs, rhs))
        m = lhs.shape[0]
        sizes, start = kernels.local_groups(group_sizes, m, rhs.shape[0], group_offset)
        shard = group_offset is not None
        x = kernels.to_row_zero(lhs, start, shard)
        if chip() == BLACKWELL:
            out = kernels.blackwell_gmm(
                x, rhs, sizes, tile_m=config.block_m, tile_n=config.block_n, tile_k=config.block_k,
                max_concurrent_steps=config.max_concurrent_steps, collective=config.collective,
                grid_tile_width=config.grid_block_n, grid_minor_dim=config.grid_minor_dim,
                epilogue_tile_n=config.epilogue_tile_n, transpose_rhs=transpose_rhs)
        else:
            out = kernels.hopper_gmm(
                x, rhs, sizes, block_m=config.block_m, block_n=config.block_n, block_k=config.block_k,
                max_concurrent_steps=config.max_concurrent_steps, grid_block_n=config.grid_block_n,
                transpose_rhs=transpose_rhs)
        return kernels.zero_past(out, sizes, start, shard).astype(out_dtype)

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        lhs = _float(lhs)
        sizes, start = kernels.local_groups(group_sizes, lhs.shape[0], num_groups, group_offset)
        if chip() == BLACKWELL:  # rows gathered group by group: the shard's start is read there, no roll
            return tgmm_sm100.blackwell_tgmm(
                lhs, dout, sizes, start, block_m=config.block_m, block_n=config.block_n, block_k=config.block_k,
                max_concurrent_steps=config.max_concurrent_steps,
                epilogue_tile_n=config.epilogue_tile_n).astype(out_dtype)
        shard = group_offset is not None
        out = kernels.hopper_tgmm(
            kernels.to_row_zero(lhs, start, shard), kernels.to_row_zero(dout, start, shard), sizes,
            block_m=config.block_m, block_n=config.block_n, block_k=config.block_k,
            max_concurrent_steps=config.max_concurrent_steps, grid_block_n=config.grid_block_n)
        return out.astype(out_dtype)


def _blackwell_tgmm_error(config: MosaicGpuConfig) -> str | None:
    """What `mosaic_gpu_tgmm_sm100` cannot run: one CTA per output tile of block_m (k) x block_n."""
    if config.collective:
        return "collective=True: the sm_100 drhs kernel runs one CTA per output tile (no 2-CTA pairs)"
    if config.block_m != tgmm_sm100.TCGEN05_ROWS:
        return f"block_m={config.block_m}: the sm_100 drhs kernel's tcgen05 M is {tgmm_sm100.TCGEN05_ROWS} (k tiles)"
    if config.grid_block_n != 1 or config.grid_minor_dim != 1:
        return "grid_block_n and grid_minor_dim stay 1: the sm_100 drhs kernel's grid is one CTA per output tile"
    if config.block_n % config.epilogue_tile_n:
        return f"epilogue_tile_n={config.epilogue_tile_n} must divide block_n={config.block_n}"
    if smem.tmem_columns(config.block_n) > smem.TMEM_COLUMNS:  # float32 accumulator: a column per output column
        return f"block_n={config.block_n}: its float32 accumulator needs over {smem.TMEM_COLUMNS} TMEM columns"
    return None


def _float(x: jax.Array | QArray) -> jax.Array:
    """The operand as an array: `chip_error` refuses quantized problems, so a QArray here is a caller's bug."""
    if isinstance(x, QArray):
        raise TypeError("the mosaic_gpu backend takes no quantized operands (its config_error says why)")
    return x
