"""`LoweringTests`: the backend lowers for its native chips (`platforms`; cpu only when it has no other)
through `jax.export` with `moe_tune.core.devices.platform` patched, float, mixed-dtype, group_offset and quantized
problems in every direction; where `kernel_calls` names the chip's custom call, exactly one such call,
holding the 1-byte operand for quantized problems. Also the export helpers tests/test_lowering.py uses."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune.core.quant import QArray, quantize
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend

from .helpers import DIRECTIONS
from .hooks import BackendHooks

# Lowering for a chip this machine does not have: `jax.export` runs the real Pallas -> Mosaic / Triton
# lowering with no device and executes nothing (all arguments are `jax.ShapeDtypeStruct`). Interpret mode
# skips the chip's lowering rules (Mosaic's 8 x 128 block tiling, Triton's power-of-two arrays and one
# operand type per `tl.dot`, ...), so a kernel can pass every interpret-mode test and still not compile.


S = jax.ShapeDtypeStruct
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "tpu_custom_call"
KERNEL_CALLS = (MOSAIC_CALL, TRITON_CALL)
# devices.platform() name -> (jax.export platform, checks to disable). The Triton call is not on
# jax.export's list of custom calls with stable compatibility guarantees.
CHIPS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tpu": ("tpu", ()),
    "gpu": ("cuda", (jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL),)),
    "cpu": ("cpu", ()),
}
# float shapes: m not a multiple of any tile (row padding), n = 3 * 128 (a ragged last column tile).
LOWER_M, LOWER_K, LOWER_N, LOWER_GROUPS = 500, 256, 384, 4


def export_for(platform: str, fn: Callable, *args: Any) -> jax.export.Exported:
    """Lower `fn` for `platform` (a devices.platform() name). `fn` must be a fresh function: jit's trace
    cache is keyed on it, not on the patched platform."""
    target, disabled = CHIPS[platform]
    return jax.export.export(jax.jit(fn), platforms=[target], disabled_checks=disabled)(*args)


def kernel_call_lines(exported: jax.export.Exported, platform: str, call: str | None, what: str) -> list[str]:
    """The module targets the chip and holds exactly one call of `call` (the compiled kernel, not the kernel
    inlined as plain HLO, which is what interpret mode lowers to) and no other kernel's call; with `call`
    None, no kernel call at all. Returns the lines of that call."""
    assert exported.platforms == (CHIPS[platform][0],), what
    text = exported.mlir_module()
    for other in KERNEL_CALLS:
        if other != call:
            assert other not in text, f"{what}: a call of {other}"
    if call is None:
        return []
    calls = [line for line in text.splitlines() if f"stablehlo.custom_call @{call}(" in line]
    assert len(calls) == 1, f"{what}: {len(calls)} calls of {call}, want 1 (inlined as plain HLO?)"
    return calls


def assert_one_kernel_call(exported: jax.export.Exported, platform: str, what: str) -> str:
    """The module holds one call of the chip's kernel (Mosaic on tpu, Triton on gpu); returns its line."""
    return kernel_call_lines(exported, platform, {"tpu": MOSAIC_CALL, "gpu": TRITON_CALL}[platform], what)[0]


def assert_triton_params(call: str, config: KernelConfig, name: str, what: str) -> None:
    """The config's launch parameters reached the Triton call."""
    assert f'name = "{name}"' in call, what
    assert f"num_warps = {config.num_warps} : i32" in call, what
    if hasattr(config, "num_stages"):
        assert f"num_stages = {config.num_stages} : i32" in call, what


def configs_to_lower(backend: Any, problem: Any) -> list[KernelConfig]:
    """The default config, then the smallest and the largest of the search space (by product of fields)."""
    space = backend.search_space(problem)
    rest = sorted(space[1:], key=lambda c: (math.prod(dataclasses.astuple(c)), dataclasses.astuple(c)))
    picked = list(dict.fromkeys([space[0], *rest[:1], *rest[-1:]]))
    for config in picked:
        assert backend.config_error(config, problem) is None, config
    return picked


def direction_call(backend: RaggedDotBackend, problem: RaggedDotProblem, config: KernelConfig, with_offset: bool
                   ) -> tuple[Callable, list[Any]]:
    """A fresh function running `problem.direction` through the backend's gmm / tgmm, and its (abstract)
    float arguments."""
    a_dtype, b_dtype, _ = (jnp.dtype(d) for d in problem.operand_dtypes())
    m, k, n, g = problem.m, problem.k, problem.n, problem.groups
    a_shape, b_shape = {"fwd": ((m, k), (g, k, n)), "dlhs": ((m, n), (g, k, n)), "drhs": ((m, k), (m, n))}[
        problem.direction]
    args = [S(a_shape, a_dtype), S(b_shape, b_dtype), S((problem.num_group_sizes,), jnp.int32)]

    def fn(a, b, group_sizes, group_offset=None):
        return backend.run(problem, config, a, b, group_sizes, group_offset)

    return fn, args + ([S((), jnp.int32)] if with_offset else [])


def output_shape(problem: RaggedDotProblem) -> tuple[int, ...]:
    """The shape of `problem.direction`'s result."""
    m, k, n, g = problem.m, problem.k, problem.n, problem.groups
    return {"fwd": (m, n), "dlhs": (m, k), "drhs": (g, k, n)}[problem.direction]


def quantized_lowering_cases() -> Iterator[tuple[str, RaggedDotProblem, Any, Any, jax.Array]]:
    """(name, problem, a, b, group_sizes) of quantized problems at shapes a chip's kernels tile: weight-only
    and w8a8 (int8 and fp8) forwards, the weights' dlhs and the activations' drhs."""
    m, k, n, g = 256, 512, 256, 4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    d = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    sizes = jnp.asarray([64, 0, 100, 92], jnp.int32)
    w_sub, w_chan = quantize(w, "int8", axis=1, block_size=128), quantize(w, "float8_e4m3fn", axis=1)
    x_row, x_sub = quantize(x, "int8", axis=1), quantize(x, "int8", axis=1, block_size=128)
    x_fp8 = quantize(x, "float8_e4m3fn", axis=1, block_size=128)
    w_fp8 = quantize(w, "float8_e4m3fn", axis=1, block_size=256)
    cases = {"fwd_weight_sub_channel": ("fwd", x, w_sub), "fwd_w8a8": ("fwd", x_row, w_sub),
             "fwd_w8a8_fp8_sub_channel": ("fwd", x_fp8, w_fp8),
             "dlhs_weight_per_channel_fp8": ("dlhs", d, w_chan), "dlhs_weight_sub_channel": ("dlhs", d, w_sub),
             "drhs_lhs_sub_channel": ("drhs", x_sub, d)}
    for name, (direction, a, b) in cases.items():
        lhs, rhs = (a, b) if direction == "fwd" else (x, b) if direction == "dlhs" else (a, w)
        yield name, RaggedDotProblem.from_arrays(lhs, rhs, sizes, direction=direction), a, b, sizes


class LoweringTests(BackendHooks):
    """Lowering for the backend's native chips (nothing runs)."""

    # ---- lowering for its native chips (jax.export; nothing runs)

    def export_direction(self, on_chip: Callable[[str], None], problem: RaggedDotProblem, *,
                         with_offset: bool = False, configs: list[KernelConfig] | None = None) -> None:
        """Export `problem.direction` for each native chip with each config (default: `configs_to_lower` where
        the chip has a kernel call, whose lowering rules depend on the blocks; else the default config): the
        module targets the chip, holds the chip's kernel call (`kernel_calls`) and has the right output."""
        for chip in self.lowering_chips():
            on_chip(chip)
            call = self.kernel_calls.get(chip)
            default = configs_to_lower(self.impl, problem) if call else [self.impl.default_config(problem)]
            for config in configs or default:
                what = f"{self.backend} on {chip} {problem.key_fields()} {config.label()}"
                fn, args = direction_call(self.impl, problem, config, with_offset)
                exported = export_for(chip, fn, *args)
                lines = kernel_call_lines(exported, chip, call, what)
                assert [(a.shape, a.dtype) for a in exported.out_avals] == [
                    (output_shape(problem), jnp.dtype(problem.operand_dtypes()[2]))], what
                if call == TRITON_CALL:
                    name = "moe_tune_tgmm" if problem.direction == "drhs" else "moe_tune_gmm"
                    assert_triton_params(lines[0], config, name, what)

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_lowers_for_its_chip(self, on_chip, direction):
        """Every input dtype; a kernel with a call on the chip with the default, smallest and largest configs of
        its search space."""
        for dtype in (*self.dtypes, *self.extra_dtypes):
            problem = RaggedDotProblem(LOWER_M, LOWER_K, LOWER_N, LOWER_GROUPS, dtype, dtype, dtype,
                                       direction=direction)
            self.export_direction(on_chip, problem)

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_lowers_for_its_chip_with_group_offset(self, on_chip, direction):
        """An expert-parallel shard: group_sizes covers 2 * GROUPS groups, the call computes GROUPS of them."""
        for dtype in self.dtypes[:2]:
            problem = RaggedDotProblem(LOWER_M, LOWER_K, LOWER_N, LOWER_GROUPS, dtype, dtype, dtype,
                                       direction=direction, total_groups=2 * LOWER_GROUPS)
            self.export_direction(on_chip, problem, with_offset=True, configs=[self.impl.default_config(problem)])

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_lowers_for_its_chip_with_mixed_dtypes(self, on_chip, direction):
        """Low-precision inputs with a float32 output (the usual training setup) and the reverse: the gradients'
        matmuls then multiply operands of two dtypes (e.g. dlhs = float32 dout @ bfloat16 rhs), which Triton's
        `tl.dot` (one operand type) once failed to lower while interpret mode promoted like `jnp.dot`."""
        for low in (d for d in (*self.dtypes, *self.extra_dtypes) if d != "float32"):
            for lhs_rhs, out in ((low, "float32"), ("float32", low)):
                problem = RaggedDotProblem(LOWER_M, LOWER_K, LOWER_N, LOWER_GROUPS, lhs_rhs, lhs_rhs, out,
                                           direction=direction)
                self.export_direction(on_chip, problem, configs=[self.impl.default_config(problem)])

    def test_quantized_lowers_for_its_chip(self, on_chip):
        """Quantized problems of every direction lower with the default config; where the chip has a kernel
        call, the 1-byte values are an operand of it (not dequantized to a float array before the kernel)."""
        for chip in self.lowering_chips():
            on_chip(chip)
            call = self.kernel_calls.get(chip)
            for name, problem, a, b, sizes in quantized_lowering_cases():
                if self.unsupported(problem) is not None:
                    continue
                config = self.impl.default_config(problem)
                what = f"{self.backend} on {chip} {name}"
                exported = export_for(chip, lambda a, b, s, c=config, p=problem: self.impl.run(p, c, a, b, s),
                                      a, b, sizes)
                assert [(x.shape, x.dtype) for x in exported.out_avals] == [
                    (output_shape(problem), jnp.dtype(problem.operand_dtypes()[2]))], what
                lines = kernel_call_lines(exported, chip, call, what)
                if not lines:
                    continue
                q = a if isinstance(a, QArray) else b
                byte_type = "xi8>" if q.dtype == jnp.int8 else "xf8E4M3FN>"
                # a kernel may read lhs transposed, [k, m] (megablox's tgmm, as JAX's Megablox does), still 1-byte
                shapes = {"x".join(map(str, q.shape)), "x".join(map(str, q.shape[::-1]))}
                assert any(f"{shape}{byte_type}" in lines[0].split(" : (")[-1] for shape in shapes), \
                    f"{what}: the {q.shape} 1-byte operand is not an operand of the kernel"
