"""The `moe_sharding` op: the layer-level choice of `layer.sharding_choice` as an op object the tuner sweeps,
timing the whole sharded layer (`sharded_moe_mlp` on a mesh of this process's devices) with each config
(strategy, token chunks, exchange). It
lives in the layer room (it runs the layer) and is registered with the kernels' ops by `moe_tune.layer`.

The mesh is the first ep x tp of `jax.devices()`, axes `expert` (ep) and `tensor` (tp, left out at 1). On CPU
the devices are host devices: `XLA_FLAGS=--xla_force_host_platform_device_count=N` set before JAX starts. CPU
collectives are memory copies inside one process: what a CPU sweep measures says nothing about chips."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from moe_tune.core.errors import UsageError
from moe_tune.kernels import kernel_op as opt
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import BenchPlan, KernelOp
from moe_tune.kernels.layer_shape import LayerShape
from moe_tune.layer.fusion_choice import INTERMEDIATE, LAYER_OPERANDS, layer_inputs, sweep_memory, training_check
from moe_tune.layer.fusion_op import MOE_FUSION
from moe_tune.layer.moe import sharded_moe_mlp
from moe_tune.layer.sharding_choice import (BACKENDS, DEFAULT_OPTIONS, DIRECTIONS, STRATEGIES, TP, ShardingProblem)
from moe_tune.layer.wire import FP8_WIRE_TOLERANCE

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
EXPERT_AXIS, TENSOR_AXIS = "expert", "tensor"


def left_out_here(problem: ShardingProblem, devices: int | None = None) -> str | None:
    """Why a process with `devices` devices (None: this one's) cannot time `problem` (fewer devices than its
    mesh), None when it can. A Ray task has one: `devices=1`."""
    have = jax.device_count() if devices is None else devices
    if have >= problem.devices:
        return None
    if devices is not None:
        return (f"moe_sharding at ep={problem.ep} tp={problem.tp} needs {problem.devices} devices in one process, "
                f"a Ray task holds {devices}: sweep it without --ray on a host with them")
    cpu = jax.default_backend() == "cpu"
    hint = (f"; on CPU set XLA_FLAGS={HOST_DEVICES_FLAG}={problem.devices} before JAX starts" if cpu else "")
    return (f"moe_sharding at ep={problem.ep} tp={problem.tp} needs {problem.devices} devices, this process has "
            f"{have}{hint}")


def layer_mesh(problem: ShardingProblem) -> jax.sharding.Mesh:
    """The mesh a sweep of `problem` runs on: the first ep x tp devices, axes (expert, tensor), or (expert,)
    at tp 1. UsageError when this process has fewer (`left_out_here`)."""
    why = left_out_here(problem)
    if why is not None:
        raise UsageError(why)
    chosen = np.array(jax.devices()[:problem.devices], dtype=object)
    if problem.tp == 1:
        return jax.sharding.Mesh(chosen, (EXPERT_AXIS,))
    return jax.sharding.Mesh(chosen.reshape(problem.ep, problem.tp), (EXPERT_AXIS, TENSOR_AXIS))


class MoeShardingOp(KernelOp):
    name = "moe_sharding"
    directions = DIRECTIONS
    backends = BACKENDS
    fallback = "mesh"
    description = "the MoE layer across devices: tokens gathered or exchanged, a measured choice per layer and mesh"
    problem_class = ShardingProblem
    options = (opt.TOKENS, opt.HIDDEN, INTERMEDIATE, opt.EXPERTS, opt.TOP_K, opt.EP, TP, opt.RHS_QUANT,
               opt.QUANT_BLOCK, opt.DTYPE)

    def problem(self, *, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, ep: int = 8,
                tp: int = 1, dtype: str = "float32", rhs_quant: str | None = None, quant_block: int | None = None,
                direction: str = "fwd") -> ShardingProblem:
        """`tokens` per device of the expert axis; `intermediate` one expert's whole width (each device of the
        tensor axis holds intermediate / tp); `rhs_quant` / `quant_block` as moe_fusion's."""
        if quant_block is not None and rhs_quant is None:
            raise UsageError("quant_block (--quant-block) needs rhs_quant (--rhs-quant)")
        return ShardingProblem(tokens=tokens, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                               ep=ep, tp=tp, dtype=dtype, direction=direction, rhs_qdtype=rhs_quant,
                               rhs_qblock=quant_block)

    def default_problem_options(self) -> dict[str, Any]:
        return dict(DEFAULT_OPTIONS)

    def make_inputs(self, problem: ShardingProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
        """The whole layer's inputs (`fusion_choice.layer_inputs` of `whole_layer`): x and router logits of
        every device's tokens, every expert's weights (split over the mesh by the layer's shard_map)."""
        return layer_inputs(problem.whole_layer(), distribution, seed)

    def distribution_record(self, problem, distribution, seed, inputs) -> dict[str, Any]:
        return {"experts": problem.experts, "ep": problem.ep, "tp": problem.tp}

    def reference(self, problem: ShardingProblem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """The one-device layer in float64 (`moe_fusion`'s reference of `whole_layer`)."""
        return MOE_FUSION.reference(problem.whole_layer(), inputs)

    def run(self, backend: Backend, config: KernelConfig, problem: ShardingProblem,
            inputs: Mapping[str, jax.Array]) -> jax.Array:
        mesh = layer_mesh(problem)
        tensor = TENSOR_AXIS if problem.tp > 1 else None
        layer = lambda *operands: sharded_moe_mlp(*operands, problem.top_k, mesh=mesh, expert_axis=EXPERT_AXIS,
                                                  tensor_axis=tensor, ep_strategy=config)
        operands = tuple(inputs[name] for name in LAYER_OPERANDS)
        if problem.direction == "fwd":
            return layer(*operands)
        if problem.rhs_qdtype is not None:  # quantized weights are constants: the gradients of x and the logits
            weights = operands[2:]
            _, pullback = jax.vjp(lambda x, logits: layer(x, logits, *weights), *operands[:2])
        else:
            _, pullback = jax.vjp(layer, *operands)
        return training_check(pullback(inputs["cotangent"]), inputs["checked_experts"])

    def memory_estimate(self, problem: ShardingProblem) -> int:
        """The whole layer's sweep on one device (`fusion_choice.sweep_memory`, no workers): the mesh's
        devices hold one split copy of the same arrays."""
        return sweep_memory(problem.whole_layer(), workers=1)

    def sweep_memory(self, problem: ShardingProblem, workers: int) -> int:
        return sweep_memory(problem.whole_layer(), workers)

    def tolerance(self, problem: ShardingProblem, config: KernelConfig | None = None) -> float:
        """moe_fusion's for the whole layer (a bf16/f16 training step twice the dtype's); for a config with
        `wire="fp8"` (or None: any candidate) at least the fp8 wire's (`wire.FP8_WIRE_TOLERANCE`: the rows'
        float8 rounding in the gate and up products), so the native candidates keep the dtype's check."""
        base = MOE_FUSION.tolerance(problem.whole_layer())
        if config is not None and getattr(config, "wire", "native") != "fp8":
            return base
        return max(base, FP8_WIRE_TOLERANCE)

    def layer_calls(self, layer: LayerShape, runs: str | None) -> list[tuple[str, ShardingProblem]]:
        """None: a one-device layer moves no tokens between devices (the sharded layer's are `mesh_calls`)."""
        return []

    def mesh_calls(self, layer: LayerShape, tp: int, runs: str | None) -> list[tuple[str, ShardingProblem]]:
        """The sharded layer's lookup of its config (`sharded.resolve_strategy`: the forward's entry, for
        serving and training alike) for `layer` (one device's: `tokens` per device, `ep`, `intermediate` its
        slice of the width) on ep x `tp` devices; none for None (the kernels compiled for a chip) or for an
        expert axis of one device (no tokens travel)."""
        if runs is None or layer.ep < 2:
            return []
        return [("ep strategy", self.problem(tokens=layer.tokens, hidden=layer.hidden, intermediate=layer.intermediate * tp,
                                             experts=layer.experts, top_k=layer.top_k, ep=layer.ep, tp=tp,
                                             dtype=layer.dtype, **layer.weight_quant()))]

    def bench_plan(self, problem: ShardingProblem, backend: Backend, tuned: KernelConfig, inputs: Mapping[str, Any], *,
                   distribution: str, seed: int) -> BenchPlan:
        """The layer with each strategy in one token chunk over the platform's exchange (each with its kernels'
        looked-up configs): `tuned` and `default` timed once as the variant they equal, `tuned` on its own
        when it chunks the tokens or takes the other exchange. No roofline."""
        default = backend.default_config(problem)
        # the strategies the backend offers here (in_kernel on TPU only: elsewhere it would time interpret mode)
        strategies = tuple(s for s in STRATEGIES if s in backend.candidate_values(problem)["strategy"])
        configs = {s: backend.coerce_config(backend.config_cls(strategy=s, exchange=default.exchange), problem)
                   for s in strategies}
        same_as = {role: s for role, chosen in (("tuned", tuned), ("default", default))
                   for s, config in configs.items() if chosen == config}
        return BenchPlan(
            baseline="all_gather", advice="pass ep_strategy='all_gather' to moe_mlp for this layer and mesh",
            variants={s: (lambda x, c=c: self.run(backend, c, problem, x)) for s, c in configs.items()},
            same_as=same_as, ratios={"all_gather_vs_all_to_all": ("all_gather", "all_to_all")}, shown=strategies)

    def describe(self, problem: ShardingProblem) -> str:
        p = problem
        quant = f" rhs {p.whole_layer().rhs_format.label()}" if p.rhs_qdtype else ""
        return (f"moe_sharding {p.direction} tokens={p.tokens} hidden={p.hidden} intermediate={p.intermediate} "
                f"experts={p.experts} top_k={p.top_k} {p.dtype}{quant} ep={p.ep} tp={p.tp}")


MOE_SHARDING = MoeShardingOp()
