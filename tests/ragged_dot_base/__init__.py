"""The tests every ragged_dot backend inherits: `RaggedDotBackendTests`.

A backend's test class subclasses the base once and names the backend; everything below then runs for it:

    from ragged_dot_base import RaggedDotBackendTests

    class TestMine(RaggedDotBackendTests):
        backend = "mine"                  # its registered name
        backend_instance = MyRaggedDot()  # only for a backend not in the registry (registered per test)

What it gets, each checked against a float64 reference at small shapes (Pallas backends run in interpret
mode off their chip), one mixin per concern:
- float modes (`floats.FloatTests`): float32 and bfloat16 inputs (plus `extra_dtypes`), mixed input / output
  dtypes, fixed cases (empty groups, rows past sum(group_sizes), sum(group_sizes) > m, expert-parallel shards
  via group_offset), dimension edge cases, random problems (hypothesis), jit, vmap;
- the gradients through the public op's custom VJP (dlhs, drhs), per-direction configs
  (`gradients.GradientTests`);
- quantized operands (`moe_tune.QArray`) in every direction (`quantized.QuantizedTests`), at the kernel
  (`Backend.run`): int8 per channel, int8 / float8_e4m3fn in sub-channel blocks, lhs and rhs quantized
  (w8a8), group_offset shards with sliced weights; and through the public op with its gradients. A mode whose
  problem the backend cannot run (its default config's `config_error`) is skipped with that reason, as the op
  falls back;
- lowering for its native chips (`platforms`; cpu only when it has no other), through `jax.export` with
  `moe_tune.core.devices.platform` patched (`lowering.LoweringTests`): float, mixed-dtype, group_offset and
  quantized problems in every direction; where `kernel_calls` names the chip's custom call, exactly one such
  call, holding the 1-byte operand for quantized problems;
- bad inputs and configs (`bad_inputs.BadInputTests`).

A subclass tunes the cost (`k`, `n`, `max_*`, `max_examples`, `sampled_configs`, `quant_shard_directions`)
and the configs tried (`extra_configs`, `quantized_configs`), and lists the configs its backend must reject
(`invalid_configs`): the attributes and hooks of `hooks.BackendHooks`, which every mixin builds on. The
shared cases, tolerances and float64 reference checks are in `helpers`. Backend-specific tests stay in the
subclass's own file.
"""

from __future__ import annotations

from .bad_inputs import BadInputTests
from .floats import FloatTests
from .gradients import GradientTests
from .hooks import BackendHooks
from .lowering import MOSAIC_CALL, TRITON_CALL, LoweringTests
from .quantized import QuantizedTests

__all__ = ["MOSAIC_CALL", "TRITON_CALL", "BackendHooks", "RaggedDotBackendTests"]


class RaggedDotBackendTests(FloatTests, GradientTests, QuantizedTests, LoweringTests, BadInputTests):
    """Tests every ragged_dot backend passes. Subclasses set `backend` (and `backend_instance` for a backend
    not in the registry) and may override the class attributes and hooks of `BackendHooks`."""
