"""`megablox` backend: the Pallas TPU grouped matmul (`gmm`) from `jax.experimental.pallas.ops.tpu.megablox`.

The TPU backend. Elsewhere it runs in Pallas interpret mode, which is slow and only meant for tests at
small shapes. Tiling is (tm, tk, tn); block shapes follow the TPU rule that the last two dims of a block
are multiples of (8 x packing, 128) or span the whole array, and double-buffered blocks must fit in VMEM.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp

from moe_tune import devices
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend, rows_in_local_groups
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem

# The package re-exports a custom_vjp `gmm` under the same name as the module, so import the module itself.
_gmm_kernel = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

LANES = 128
SUPPORTED = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class MegabloxConfig(KernelConfig):
    """Block of lhs is [tm, tk], of rhs [tk, tn], of out [tm, tn]."""

    tm: int = 128
    tk: int = 128
    tn: int = 128


def _sublanes(dtype: str) -> int:
    """Rows per native TPU tile: 8 for 32-bit, 16 for bf16 (two values packed per 32-bit sublane)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _padded_m(problem: RaggedDotProblem, tm: int) -> int:
    return -(-problem.m // tm) * tm


def vmem_bytes(config: MegabloxConfig, problem: RaggedDotProblem) -> int:
    """VMEM the kernel's blocks take: double-buffered lhs/rhs/out blocks plus the f32 accumulator."""
    in_bytes = jnp.dtype(problem.lhs_dtype).itemsize
    out_bytes = jnp.dtype(problem.out_dtype).itemsize
    tm, tk, tn = config.tm, config.tk, config.tn
    return 2 * (tm * tk + tk * tn) * in_bytes + 2 * tm * tn * out_bytes + tm * tn * 4


class MegabloxRaggedDot(RaggedDotBackend):
    name = "megablox"
    config_cls = MegabloxConfig
    platforms = ("tpu",)
    description = "Pallas Mosaic TPU gmm (Megablox); interpret mode off TPU"

    def runs_on(self, platform: str) -> bool:
        return True  # natively on TPU, in interpret mode everywhere else

    def config_error(self, config: MegabloxConfig, problem: RaggedDotProblem) -> str | None:
        for name in ("lhs_dtype", "rhs_dtype", "out_dtype"):
            if getattr(problem, name) not in SUPPORTED:
                return f"megablox supports {'/'.join(SUPPORTED)}, not {name}={getattr(problem, name)}"
        tm, tk, tn = config.tm, config.tk, config.tn
        if min(tm, tk, tn) <= 0:
            return "tile sizes must be positive"
        sub = _sublanes(problem.lhs_dtype)
        if tm % sub:
            return f"tm={tm} is not a multiple of {sub} ({problem.lhs_dtype} sublanes)"
        if tm > _padded_m(problem, sub):
            return f"tm={tm} exceeds m={problem.m} rounded up to {sub}"
        if tk != problem.k and tk % LANES:
            return f"tk={tk} must be a multiple of {LANES} or equal k={problem.k}"
        if tk > problem.k:
            return f"tk={tk} exceeds k={problem.k}"
        if tn != problem.n and tn % LANES:
            return f"tn={tn} must be a multiple of {LANES} or equal n={problem.n}"
        if tn > problem.n:
            return f"tn={tn} exceeds n={problem.n}"
        need = vmem_bytes(config, problem)
        if need > devices.TPU_SCOPED_VMEM_BYTES:
            return f"blocks need {need / 2**20:.1f} MiB of VMEM, over {devices.TPU_SCOPED_VMEM_BYTES / 2**20:.0f} MiB"
        return None

    def _largest_valid(self, wanted: int, size: int, align: int) -> int:
        """The largest multiple of `align` <= min(wanted, size), or the full size when none exists."""
        best = min(wanted, size) // align * align
        return best if best > 0 else size

    def default_config(self, problem: RaggedDotProblem) -> MegabloxConfig:
        sub = _sublanes(problem.lhs_dtype)
        tm = self._largest_valid(256, -(-problem.m // sub) * sub, sub)
        tk = self._largest_valid(512, problem.k, LANES)
        tn = self._largest_valid(512, problem.n, LANES)
        config = MegabloxConfig(tm, tk, tn)
        while self.config_error(config, problem) and config.tk > LANES:  # shrink to fit VMEM
            config = MegabloxConfig(tm, max(config.tk // 2 // LANES * LANES, LANES), tn)
        return config

    def candidate_values(self, problem: RaggedDotProblem) -> dict[str, list[int]]:
        sub = _sublanes(problem.lhs_dtype)
        tms = [v for v in (sub, 2 * sub, 64, 128, 256, 512, 1024) if v % sub == 0]
        dims = lambda size: sorted({size, *(v for v in (128, 256, 512, 1024, 2048) if v < size)})
        return {"tm": tms, "tk": dims(problem.k), "tn": dims(problem.n)}

    def __call__(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None):
        m = lhs.shape[0]
        padded = -(-m // config.tm) * config.tm
        if padded != m:  # gmm needs tm | m; the padding rows are past sum(group_sizes) and never visited
            lhs = jnp.pad(lhs, ((0, padded - m), (0, 0)))
        offset = None if group_offset is None else jnp.asarray(group_offset, jnp.int32)
        out = _gmm_kernel.gmm(
            lhs, rhs, group_sizes.astype(jnp.int32), jnp.dtype(out_dtype),
            (config.tm, config.tk, config.tn), offset,
            interpret=devices.platform() != "tpu",
        )[:m]
        # gmm leaves rows that no group owns (past sum(group_sizes)) uninitialized on TPU.
        keep = rows_in_local_groups(group_sizes, m, rhs.shape[0], group_offset)
        return jnp.where(keep, out, jnp.zeros((), out.dtype))
