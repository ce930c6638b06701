"""`LayerShape`: one MoE layer's shape as the ops read it when they list the calls the layer makes
(`KernelOp.layer_calls`): the layer (`moe_tune.layer.models`) builds it from a model preset, each op turns it
into its own problems."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# The layer's quantization options (kernels/kernel_op.py `QUANT`): which operands of its matmuls are quantized.
QUANT_OPTIONS = ("rhs_quant", "lhs_quant", "quant_block", "lhs_dynamic")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One shard's `moe_mlp` layer: `tokens` it routes, model width `hidden`, one expert's FFN width
    `intermediate`, routed `experts` (the shard holds experts / ep), `top_k`, expert-parallel size `ep`, the
    dtype of activations and weights, and the quantization options of its matmuls (`quant`, the given ones:
    rhs_quant, lhs_quant, quant_block, lhs_dynamic)."""

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    ep: int
    dtype: str
    quant: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def m(self) -> int:
        """Rows of the expert-ordered buffer: every (token, k) entry gets one (static)."""
        return self.tokens * self.top_k

    @property
    def groups(self) -> int:
        """Experts on this shard."""
        return self.experts // self.ep

    def given_quant(self) -> dict[str, Any]:
        """The quantization options given (None and False left out)."""
        return {name: value for name, value in self.quant.items() if value is not None and value is not False}

    @property
    def quantized_weights(self) -> bool:
        return self.quant.get("rhs_quant") is not None

    @property
    def quantized_activations(self) -> bool:
        """Activations stored quantized, or quantized in the kernel (`lhs_dynamic`)."""
        return self.quant.get("lhs_quant") is not None or bool(self.quant.get("lhs_dynamic"))

    def weight_quant(self) -> dict[str, Any]:
        """The weights' quantization options alone (rhs_quant, quant_block): what the fused ops take."""
        return {name: self.quant[name] for name in ("rhs_quant", "quant_block") if self.quant.get(name) is not None}

    def gather_options(self) -> dict[str, Any]:
        """The gather ops' options of the layer (dispatch, combine and their gradients)."""
        return {"tokens": self.tokens, "hidden": self.hidden, "top_k": self.top_k, "experts": self.experts,
                "ep": self.ep, "dtype": self.dtype}
