"""`megablox` backend: the Pallas TPU grouped matmul (`gmm`) from `jax.experimental.pallas.ops.tpu.megablox`.

The TPU backend. Elsewhere it runs in Pallas interpret mode, which is slow and only meant for tests at
small shapes. Tiling is (tm, tk, tn); block shapes follow the TPU rule that the last two dims of a block
are multiples of (8 x packing, 128) or span the whole array, and double-buffered blocks must fit in VMEM.
Quantized operands (QArray: int8, float8_e4m3fn, and int4 / mxfp4 weights, whose 4-bit blocks are read into
the kernel) and activations quantized in the kernel (dynamic w8a8) run this package's own kernels,
`megablox_quant.py`, with the same tiling.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp

from moe_tune.core import devices
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.pallas_util import interpreted, pad_to, sublanes, vma_unchecked
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend, rows_in_local_groups
from moe_tune.kernels.ragged_dot.megablox_quant import quantized_gmm, quantized_tgmm
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.quant_plan import OperandPlan, QuantPlan, problem_plan, tgmm_plan
from moe_tune.kernels.ragged_dot.quantized import prepare_gmm, prepare_tgmm

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


def _scale_bytes(config: MegabloxConfig, plan: QuantPlan) -> int:
    """VMEM of the quantized kernels' double-buffered float32 scale blocks (`QuantPlan.scale_blocks`: whole
    along k / bs), padded to the (8, 128) tile as VMEM holds them."""
    tile = lambda rows, cols: -(-rows // 8) * 8 * -(-cols // LANES) * LANES
    return 2 * 4 * sum(tile(*shape) for shape in plan.scale_blocks(config.tm, config.tk, config.tn))


def _stored_bytes(op: OperandPlan) -> float:
    """Bytes an element of the operand's blocks takes in VMEM: 4-bit values two a byte."""
    return 0.5 if op.four_bit else jnp.dtype(op.dtype).itemsize


def vmem_bytes(config: MegabloxConfig, problem: RaggedDotProblem) -> int:
    """VMEM the kernel needs: its blocks (`block_bytes`) and what the compiler keeps beside them
    (`compiler_bytes`)."""
    return block_bytes(config, problem) + compiler_bytes(config, problem)


def block_bytes(config: MegabloxConfig, problem: RaggedDotProblem) -> int:
    """VMEM the kernel's blocks take: double-buffered input/output blocks plus the f32 accumulator. The
    quantized kernels' blocks hold what the plan says they load (`QuantPlan.a` / `b` dtypes: 1-byte values,
    float32 for an operand a scale was folded into), beside their scale blocks."""
    plan = problem_plan(problem)
    tm, tk, tn = config.tm, config.tk, config.tn
    if plan.quantized:
        a, b = (_stored_bytes(op) for op in plan.operands)
        out = jnp.dtype(problem.operand_dtypes()[2]).itemsize
        blocks = (tk * tm * a + tm * tn * b + tk * tn * out) if problem.direction == "drhs" else (
            tm * tk * a + tk * tn * b + tm * tn * out)
        return int(2 * blocks) + _scale_bytes(config, plan) + (tk if problem.direction == "drhs" else tm) * tn * 4
    a, _, out = problem.operand_dtypes()
    in_bytes, out_bytes = jnp.dtype(a).itemsize, jnp.dtype(out).itemsize
    if problem.direction == "drhs":  # tgmm: lhs^T [tk, tm], dout [tm, tn] -> [tk, tn]
        return 2 * (tk * tm + tm * tn) * in_bytes + 2 * tk * tn * out_bytes + tk * tn * 4
    return 2 * (tm * tk + tk * tn) * in_bytes + 2 * tm * tn * out_bytes + tm * tn * 4


def compiler_bytes(config: MegabloxConfig, problem: RaggedDotProblem) -> int:
    """VMEM the compiler keeps beside the blocks, as the real compiler reports it (libtpu 0.0.42 through
    `moe_tune.targets`, benchmarks/compile_check.py): a config whose blocks alone fill the budget exactly
    fails with `CompileTimeScopedVmemOom`. One more copy of the first operand's block (the tile the dot
    reads, masked or converted); a 1-byte block that meets a float one in the dot, converted to that float
    dtype (int8 weights beside float32 activations: four times the block); for the quantized dlhs kernel,
    whose dots run in float32 at full precision on a transposed weight block, that block in float32 and two
    more float32 copies of the first operand's (its float32 value and the dot's split of it). Per chip
    (`devices.tpu_vmem_model`): a reserve, and temporaries in float32 where
    the chip computes so (v4)."""
    plan = problem_plan(problem)
    tm, tk, tn = config.tm, config.tk, config.tn
    a, b = (tk * tm, tm * tn) if problem.direction == "drhs" else (tm * tk, tk * tn)
    reserve, float32_temporaries = devices.tpu_vmem_model()
    size = lambda dtype: 4 if float32_temporaries else jnp.dtype(dtype).itemsize
    extra = reserve + a * size(plan.a.dtype if plan.quantized else problem.operand_dtypes()[0])
    if plan.quantized and problem.direction == "dlhs":
        extra += 4 * b + 8 * a
    elif plan.a.low_bit != plan.b.low_bit:  # one 1-byte operand, converted to its partner's dtype
        extra += a * size(plan.b.dtype) if plan.a.low_bit else b * size(plan.a.dtype)
    return extra


def quant_config_error(config: MegabloxConfig, problem: RaggedDotProblem) -> str | None:
    """The quantized kernels' own rules, where the plan runs them (`QuantPlan.quantized`): no ragged
    contraction tile (their k loop has no remainder mask), each sub-channel scale block the kernel
    applies (`QuantPlan.sub_channel_blocks`) a multiple or a divisor of the tile along the forward k (tk;
    for dlhs tn, which tiles its output, the forward k), and activations quantized in the kernel whole
    scale blocks of theirs in tk (their scales come from the tile; one per row: tk = k)."""
    plan = problem_plan(problem)
    if not plan.quantized:
        return None
    _, k, _ = problem.matmul_dims()
    if problem.direction != "drhs" and k % config.tk:
        return f"tk={config.tk} must divide the contraction ({k}) for quantized operands"
    tile, name = (config.tn, "tn") if problem.direction == "dlhs" else (config.tk, "tk")
    for block in plan.sub_channel_blocks:
        if tile % block and block % tile:
            return f"{name}={tile} must be a multiple of the scale block {block} or divide it"
    if plan.a.quantize_to and config.tk % plan.a.block:  # its scales come from the tile: whole blocks in it
        what = f"tk={k}: one scale per row" if plan.a.block == k else f"a multiple of {plan.a.block}"
        return f"tk={config.tk}: activations quantized in the kernel need the tile to hold their scale blocks ({what})"
    return None


class MegabloxRaggedDot(RaggedDotBackend):
    name = "megablox"
    # bump on changes that can change the fastest or a valid config (Backend.revision). 2: the quantized
    # kernels' tile rules apply only where the plan runs them (dlhs with only lhs quantized runs the float gmm).
    # 3: the VMEM rule counts what the compiler keeps beside the blocks, against the chip's own budget.
    # 4: 4-bit weights (int4, mxfp4) and activations quantized in the kernel (dynamic w8a8), their rules
    revision = 4
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
        m, k, n = problem.matmul_dims()
        if problem_plan(problem).a.four_bit:
            return "4-bit values are weights (rhs) only in megablox"
        if reason := quant_config_error(config, problem):
            return reason
        sub = sublanes(problem_plan(problem).a.dtype)
        # tgmm reads lhs transposed, [tk, tm] blocks: there rows tile the lanes and k the sublanes.
        m_align, k_align = (LANES, sub) if problem.direction == "drhs" else (sub, LANES)
        if tm % m_align:
            return f"tm={tm} is not a multiple of {m_align}"
        if tm > -(-m // m_align) * m_align:
            return f"tm={tm} exceeds m={m} rounded up to {m_align}"
        for name, tile, size, align in (("tk", tk, k, k_align), ("tn", tn, n, LANES)):
            if tile != size and tile % align:
                return f"{name}={tile} must be a multiple of {align} or equal {size}"
            if tile > size:
                return f"{name}={tile} exceeds {size}"
        need, budget = vmem_bytes(config, problem), devices.tpu_scoped_vmem_bytes()
        if need > budget:
            return f"needs {need / 2**20:.1f} MiB of VMEM, over the chip's {budget / 2**20:.0f} MiB of scoped VMEM"
        return None

    def _largest_valid(self, wanted: int, size: int, align: int) -> int:
        """The largest multiple of `align` <= min(wanted, size), or the full size when none exists."""
        best = min(wanted, size) // align * align
        return best if best > 0 else size

    def default_config(self, problem: RaggedDotProblem) -> MegabloxConfig:
        m, k, n = problem.matmul_dims()
        sub = sublanes(problem_plan(problem).a.dtype)
        m_align, k_align = (LANES, sub) if problem.direction == "drhs" else (sub, LANES)
        tm = self._largest_valid(256, -(-m // m_align) * m_align, m_align)
        tk = self._largest_valid(512, k, k_align)
        tn = self._largest_valid(512, n, LANES)
        divides = problem_plan(problem).quantized and problem.direction != "drhs"  # the quantized gmm: tk | k
        if divides and k % tk:  # k = 768: 384; gpt-oss's 2880, no multiple of 128: k itself
            tk = self._dividing(tk, k, k_align) or k
        config = MegabloxConfig(tm, tk, tn)
        while self.config_error(config, problem):  # shrink to fit VMEM: tk, else (quantized gmm) tn, then tm
            if not divides:
                if config.tk <= k_align:
                    break
                config = dataclasses.replace(config, tk=max(config.tk // 2 // k_align * k_align, k_align))
                continue
            smaller = dataclasses.replace(config, tk=self._dividing(config.tk // 2, k, k_align) or 0)
            if not smaller.tk:
                half_n = config.tn // 2 // LANES * LANES
                smaller = dataclasses.replace(config, tn=half_n) if half_n >= LANES else dataclasses.replace(
                    config, tm=config.tm // 2 // m_align * m_align)
            if not min(smaller.tm, smaller.tn):
                break
            config = smaller
        return config

    @staticmethod
    def _dividing(most: int, k: int, align: int) -> int | None:
        """The largest multiple of `align` <= most that divides k, else None."""
        return next((t for t in range(most // align * align, 0, -align) if k % t == 0), None)

    def candidate_values(self, problem: RaggedDotProblem) -> dict[str, list[int]]:
        _, k, n = problem.matmul_dims()
        sub = sublanes(problem_plan(problem).a.dtype)
        dims = lambda size: sorted({size, *(v for v in (128, 256, 512, 1024, 2048) if v < size)})
        return {"tm": [sub, 2 * sub, 64, 128, 256, 512, 1024], "tk": dims(k), "tn": dims(n)}

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        m = lhs.shape[0]
        offset = None if group_offset is None else jnp.asarray(group_offset, jnp.int32)
        ops = prepare_gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs)
        if ops.plan(transpose_rhs).quantized:
            out = quantized_gmm(*ops, group_sizes.astype(jnp.int32), tiling=(config.tm, config.tk, config.tn),
                                out_dtype=jnp.dtype(out_dtype), group_offset=offset, transpose_rhs=transpose_rhs,
                                interpret=interpreted("tpu"))
        else:
            # Megablox needs tm | m; the padded rows are past sum(group_sizes), so no group visits them. Its
            # out_shape carries no vma: `vma_unchecked` types its result inside shard_map.
            out = vma_unchecked(
                _gmm_kernel.gmm, pad_to(lhs, 0, config.tm), rhs, group_sizes.astype(jnp.int32),
                jnp.dtype(out_dtype), (config.tm, config.tk, config.tn), offset, transpose_rhs=transpose_rhs,
                interpret=interpreted("tpu"),
            )[:m]
        # gmm leaves rows that no group owns (past sum(group_sizes)) uninitialized on TPU.
        keep = rows_in_local_groups(group_sizes, m, rhs.shape[0], group_offset)
        return jnp.where(keep, out, jnp.zeros((), out.dtype))

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        offset = None if group_offset is None else jnp.asarray(group_offset, jnp.int32)
        lhs, lhs_scale, dout = prepare_tgmm(lhs, dout)
        if tgmm_plan(lhs, lhs_scale, dout).quantized:
            return quantized_tgmm(lhs, lhs_scale, dout, group_sizes.astype(jnp.int32),
                                  tiling=(config.tm, config.tk, config.tn), out_dtype=jnp.dtype(out_dtype),
                                  num_groups=num_groups, group_offset=offset, interpret=interpreted("tpu"))
        return vma_unchecked(
            _gmm_kernel.tgmm, pad_to(lhs, 0, config.tm).swapaxes(0, 1), pad_to(dout, 0, config.tm),
            group_sizes.astype(jnp.int32), jnp.dtype(out_dtype), (config.tm, config.tk, config.tn), offset,
            num_actual_groups=num_groups, interpret=interpreted("tpu"),
        )
