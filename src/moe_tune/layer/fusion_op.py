"""The `moe_fusion` op: the layer-level choice of `layer.fusion_choice` as an op object the tuner sweeps,
timing `moe_mlp` itself fused and unfused. It lives in the layer room (it runs the layer) and is registered
with the kernels' ops by `moe_tune.layer` (`kernels.register_op`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from moe_tune.kernels import kernel_op as opt
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.core.errors import UsageError
from moe_tune.core.quant import QArray, dequantize_host
from moe_tune.kernels.kernel_op import BenchPlan, KernelOp
from moe_tune.kernels.layer_shape import LayerShape
from moe_tune.layer.fusion_choice import (BACKENDS, DEFAULT_OPTIONS, DIRECTIONS, INTERMEDIATE, LAYER_OPERANDS,
                                          WEIGHTS, FusionProblem, layer_inputs, sweep_memory, training_check)
from moe_tune.layer.moe import moe_mlp
from moe_tune.layer.reference import check_parts, check_vector, layer_reference, training_reference


class MoeFusionOp(KernelOp):
    name = "moe_fusion"
    directions = DIRECTIONS
    backends = BACKENDS
    fallback = "layer"
    description = "moe_mlp's experts fused or unfused: a measured choice per layer shape"
    problem_class = FusionProblem
    options = (opt.TOKENS, opt.HIDDEN, INTERMEDIATE, opt.EXPERTS, opt.TOP_K, opt.EP, opt.RHS_QUANT, opt.QUANT_BLOCK,
               opt.DTYPE)

    def problem(self, *, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, ep: int = 1,
                dtype: str = "float32", rhs_quant: str | None = None, quant_block: int | None = None,
                direction: str = "fwd") -> FusionProblem:
        """`rhs_quant` / `quant_block`: the three expert weights quantized (QArrays scaled along their k), as
        ragged_dot's weights (None: one scale per channel; mxfp4: blocks of 32)."""
        if quant_block is not None and rhs_quant is None:
            raise UsageError("quant_block (--quant-block) needs rhs_quant (--rhs-quant)")
        return FusionProblem(tokens=tokens, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                             ep=ep, dtype=dtype, direction=direction, rhs_qdtype=rhs_quant, rhs_qblock=quant_block)

    def default_problem_options(self) -> dict[str, Any]:
        return dict(DEFAULT_OPTIONS)

    def make_inputs(self, problem: FusionProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
        return layer_inputs(problem, distribution, seed)

    def distribution_record(self, problem, distribution, seed, inputs) -> dict[str, Any]:
        return {"experts": problem.experts, "ep": problem.ep}

    def reference(self, problem: FusionProblem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """Of the dequantized weights where quantized (one expert's float64 copy at a time)."""
        inputs = {**inputs, **{name: _PerExpert(inputs[name]) for name in WEIGHTS if isinstance(inputs[name], QArray)}}
        if problem.direction == "bwd":
            return check_vector(check_parts(training_reference(problem, inputs)), np)
        return layer_reference(problem, inputs)

    def run(self, backend: Backend, config: KernelConfig, problem: FusionProblem,
            inputs: Mapping[str, jax.Array]) -> jax.Array:
        layer = lambda *operands: moe_mlp(*operands, problem.top_k, expert_offset=0 if problem.ep > 1 else None,
                                            fused=config.fused)
        operands = tuple(inputs[name] for name in LAYER_OPERANDS)
        if problem.direction == "fwd":
            return layer(*operands)
        # the training step: every gradient of sum(out * cotangent) is computed; the checked part returned
        # (`layer_reference`): dx, d(router logits), and the checked experts' weight gradients, taken by traced
        # indices (an input), so that no weight gradient can be dropped as unused (tests/test_moe_fusion_check.py)
        if problem.rhs_qdtype is not None:  # quantized weights are constants: the gradients of x and the logits
            weights = operands[2:]
            _, pullback = jax.vjp(lambda x, logits: layer(x, logits, *weights), *operands[:2])
        else:
            _, pullback = jax.vjp(layer, *operands)
        return training_check(pullback(inputs["cotangent"]), inputs["checked_experts"])

    def memory_estimate(self, problem: FusionProblem) -> int:
        """What a sweep of `problem` holds at least, compiling in its own process (`--workers 1`):
        `sweep_memory(problem, workers=1)`. Each compile worker adds its share (`memory_parts`)."""
        return sweep_memory(problem, workers=1)

    def sweep_memory(self, problem: FusionProblem, workers: int) -> int:
        return sweep_memory(problem, workers)

    def tolerance(self, problem: FusionProblem, config: KernelConfig | None = None) -> float:
        """The dtype's (`kernel_op.TOLERANCE`); a bf16/f16 training step's twice that: its gradients pass
        through more roundings in the layer's dtype than the forward (dh, the activation's derivative), and
        each part is checked at its own scale, so a few-row expert's gradient shows its own rounding
        (measured: up to 1.8e-2 at qwen3-30b-a3b 256 tokens ep 4 bf16, the fewest-loaded expert's dw_up,
        both ways; wrong gradients give 0.1-1, tests/test_moe_fusion_check.py). float32 errors are ~2e-6."""
        base = super().tolerance(problem)
        return 2 * base if problem.direction == "bwd" and problem.dtype != "float32" else base

    def layer_calls(self, layer: LayerShape, runs: str | None) -> list[tuple[str, FusionProblem]]:
        """The choice between the two paths (`fused or not`; quantized weights keyed on their quantization,
        none with quantized activations, which run unfused): serving's forward, and for training also the
        forward+backward (bwd). Timed with both paths' kernels tuned: last."""
        if runs is None or layer.quantized_activations:
            return []
        options = dict(tokens=layer.tokens, hidden=layer.hidden, intermediate=layer.intermediate,
                       experts=layer.experts, top_k=layer.top_k, ep=layer.ep, dtype=layer.dtype, **layer.weight_quant())
        return [("fused or not", self.problem(**options, direction=d)) for d in (("fwd",) if runs == "fwd" else DIRECTIONS)]

    def bench_plan(self, problem: FusionProblem, backend: Backend, tuned: KernelConfig, inputs: Mapping[str, Any], *,
                   distribution: str, seed: int) -> BenchPlan:
        """The layer fused and unfused (each with its kernels' looked-up configs): `tuned` and `default` are
        one of them (timed once). No roofline."""
        paths = {"fused": True, "unfused": False}
        path = {fused: name for name, fused in paths.items()}
        return BenchPlan(
            baseline="unfused", advice="pass fused=False to moe_mlp for this shape",
            variants={name: (lambda x, fused=fused: self.run(backend, backend.config_cls(fused=fused), problem, x))
                      for name, fused in paths.items()},
            same_as={"tuned": path[bool(tuned.fused)], "default": path[bool(backend.default_config(problem).fused)]},
            ratios={"unfused_vs_fused": ("unfused", "fused")}, shown=("fused", "unfused"))

    def describe(self, problem: FusionProblem) -> str:
        p = problem
        ep = f" ep={p.ep}" if p.ep > 1 else ""
        quant = f" rhs {p.rhs_format.label()}" if p.rhs_format else ""
        return (f"moe_fusion {p.direction} tokens={p.tokens} hidden={p.hidden} intermediate={p.intermediate} experts={p.experts} "
                f"top_k={p.top_k} {p.dtype}{quant}{ep}")


class _PerExpert:
    """A QArray of NumPy arrays [experts, k, n] read one expert at a time, dequantized in float64 (what the
    layer's references read: `inputs[name][e]`, `inputs[name].shape`)."""

    def __init__(self, q: QArray) -> None:
        self.q, self.shape = q, q.shape

    def __getitem__(self, e: int) -> np.ndarray:
        return dequantize_host(QArray(self.q.qvalue[e:e + 1], self.q.scale[e:e + 1]))[0]


MOE_FUSION = MoeFusionOp()
