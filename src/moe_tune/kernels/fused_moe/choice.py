"""`moe_fusion`: whether `moe_mlp` runs its experts fused (`fused_moe` kernels) or unfused (gather, three
ragged_dots, gather-reduce), as a measured choice stored and looked up like any op's config.

The problem is one MoE layer's shape; its one backend (`layer`) has one tunable, `fused`, whose two values a
sweep times by running the whole layer each way (each way's kernels with their own tuned configs) against a
float64 reference of the layer. Two directions, chosen apart: `fwd` times the layer's forward (inference),
`bwd` its forward and backward together (a training step: the gradients in x, the router logits and the three
weights, checked against float64 ones). `moe_mlp(..., fused=None)` looks the winners up per shape at trace
time: the `fwd` one runs where the layer is only evaluated, the `bwd` one where it is differentiated
(`layer.serve_or_train`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune import distributions
from moe_tune.errors import UsageError
from moe_tune.kernels import options as opt
from moe_tune.kernels.base import Backend, BackendRegistry, KernelConfig
from moe_tune.kernels.fused_moe.layer import can_fuse
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.kernels.options import ShapeOption
from moe_tune.kernels.ragged_dot.problem import SUPPORTED_DTYPES, dtype_name

INTERMEDIATE = ShapeOption("intermediate", int, "moe_fusion: one expert's FFN width.", listable=True)
DIRECTIONS = ("fwd", "bwd")
DEFAULT_OPTIONS = {"tokens": 256, "hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "ep": 1,
                   "dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class FusionProblem:
    """One `moe_mlp` layer: tokens on this shard, hidden size, expert width, routed experts, top_k,
    expert-parallel size (the shard holds experts / ep experts), dtype of activations and weights."""

    SIZE_FIELDS: ClassVar[tuple[str, ...]] = ("tokens",)

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    ep: int = 1
    dtype: str = "float32"
    direction: str = "fwd"  # fwd: the forward timed; bwd: forward and backward timed together

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "intermediate", "experts", "top_k", "ep"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        if self.experts % self.ep or self.top_k > self.experts:
            raise UsageError(f"ep ({self.ep}) must divide experts ({self.experts}) and top_k ({self.top_k}) not "
                             "exceed it")
        if self.direction not in DIRECTIONS:
            raise UsageError(f"moe_fusion's directions are {' and '.join(DIRECTIONS)} (forward+backward); got "
                             f"{self.direction!r}")
        canonical = dtype_name(self.dtype)
        if canonical not in SUPPORTED_DTYPES:
            raise UsageError(f"dtype {canonical} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
        object.__setattr__(self, "dtype", canonical)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    def key_fields(self) -> dict[str, Any]:
        return {"direction": self.direction, "tokens": self.tokens, "hidden": self.hidden,
                "intermediate": self.intermediate, "experts": self.experts, "top_k": self.top_k, "ep": self.ep,
                "dtype": self.dtype}

    @classmethod
    def from_key_fields(cls, fields: dict[str, Any]) -> "FusionProblem":
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})


@dataclasses.dataclass(frozen=True)
class FusionConfig(KernelConfig):
    """fused: the experts on the fused kernels (True) or the unfused ones (False)."""

    fused: bool = True


class LayerChoice(Backend[FusionConfig, FusionProblem]):
    op = "moe_fusion"
    name = "layer"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = FusionConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "the whole moe_mlp layer, fused or unfused (each with its kernels' tuned configs)"

    def default_config(self, problem: FusionProblem) -> FusionConfig:
        # CPU, benchmarks/results/fused_cpu_2core_2026-11-25_session12: the fused forward 1.17-2.11x faster at
        # prefill (4096 tokens, ep 4), at decode within that loaded run's noise; a sweep measures your shape
        return FusionConfig(fused=True)

    def candidate_values(self, problem: FusionProblem):
        return {"fused": [True, False]}

    def config_error(self, config: FusionConfig, problem: FusionProblem) -> str | None:
        return None if isinstance(config.fused, bool) else f"fused must be a bool, got {config.fused!r}"


BACKENDS = BackendRegistry("moe_fusion", platform_defaults={"cpu": "layer"})

# The layer the choice times, `moe_tune.moe.moe_mlp`: it registers itself here when imported (`register_layer`),
# since kernels never import the layer built on them (no import circle: tests/test_structure.py).
_LAYER: list[Callable[..., jax.Array]] = []


def register_layer(layer: Callable[..., jax.Array]) -> None:
    """Make `layer` (moe_mlp's signature) what `moe_fusion` sweeps time."""
    _LAYER[:] = [layer]
BACKENDS.register(LayerChoice())


def layer_inputs(problem: FusionProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
    """x, router logits and the shard's expert weights. The logits are random plus a per-expert bias of the
    log of the named distribution's group sizes, so that the routing follows it roughly."""
    rng = np.random.default_rng(seed)
    p, dtype = problem, jnp.dtype(problem.dtype)
    sizes = distributions.group_sizes(distribution, p.tokens * p.top_k, p.experts, seed)
    logits = rng.standard_normal((p.tokens, p.experts), np.float32) + np.log1p(sizes).astype(np.float32)
    normal = lambda *shape, fan_in: (rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)).astype(dtype)
    local = p.local_experts
    return {"x": normal(p.tokens, p.hidden, fan_in=1), "router_logits": logits,
            "w_gate": normal(local, p.hidden, p.intermediate, fan_in=p.hidden),
            "w_up": normal(local, p.hidden, p.intermediate, fan_in=p.hidden),
            "w_down": normal(local, p.intermediate, p.hidden, fan_in=p.intermediate)}


def _routed(problem: FusionProblem, inputs: Mapping[str, np.ndarray]
            ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(the inputs in float64, the router's softmax probabilities [tokens, experts], the top_k experts of each
    token [tokens, top_k], highest first, ties to the lower index)."""
    f64 = {k: np.asarray(v, np.float64) for k, v in inputs.items()}
    logits = f64["router_logits"]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return f64, probs, np.argsort(-probs, axis=1, kind="stable")[:, :problem.top_k]


def layer_reference(problem: FusionProblem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Float64 `moe_mlp` (softmax, top_k renormalized, SiLU-gated experts) of the shard's experts [0, experts/ep)."""
    f64, probs, chosen = _routed(problem, inputs)
    weights = np.take_along_axis(probs, chosen, axis=1)
    weights /= weights.sum(axis=1, keepdims=True)
    out = np.zeros((problem.tokens, problem.hidden))
    for e in range(problem.local_experts):
        t, j = np.nonzero(chosen == e)
        if t.size:
            x = f64["x"][t]
            gate, up = x @ f64["w_gate"][e], x @ f64["w_up"][e]
            out[t] += weights[t, j][:, None] * ((gate / (1 + np.exp(-gate)) * up) @ f64["w_down"][e])
    return out


LAYER_OPERANDS = ("x", "router_logits", "w_gate", "w_up", "w_down")


def layer_reference_grads(problem: FusionProblem, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Float64 gradients of sum(`layer_reference`) in the `LAYER_OPERANDS` order: x, router logits (through
    the softmax and the renormalized top_k weights; the choice of experts is constant), w_gate, w_up, w_down."""
    f64, probs, chosen = _routed(problem, inputs)
    picked = np.take_along_axis(probs, chosen, axis=1)
    total = picked.sum(axis=1, keepdims=True)
    weights = picked / total
    grads = {name: np.zeros_like(f64[name]) for name in LAYER_OPERANDS}
    dweights = np.zeros_like(weights)
    for e in range(problem.local_experts):
        t, j = np.nonzero(chosen == e)
        if not t.size:
            continue
        x, w = f64["x"][t], weights[t, j][:, None]
        gate, up = x @ f64["w_gate"][e], x @ f64["w_up"][e]
        sig = 1 / (1 + np.exp(-gate))
        act = gate * sig
        h = act * up
        dweights[t, j] = (h @ f64["w_down"][e]).sum(axis=1)  # d(sum of out) / d(top-k weight)
        dout = np.broadcast_to(w, (t.size, problem.hidden))
        grads["w_down"][e] = h.T @ dout
        dh = dout @ f64["w_down"][e].T
        dgate, dup = dh * up * sig * (1 + gate * (1 - sig)), dh * act
        grads["w_gate"][e], grads["w_up"][e] = x.T @ dgate, x.T @ dup
        np.add.at(grads["x"], t, dgate @ f64["w_gate"][e].T + dup @ f64["w_up"][e].T)
    # weights = picked / total, picked = the chosen softmax probabilities
    dpicked = dweights / total - (dweights * picked).sum(axis=1, keepdims=True) / total ** 2
    dprobs = np.zeros_like(probs)
    np.put_along_axis(dprobs, chosen, dpicked, axis=1)
    grads["router_logits"] = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
    return [grads[name] for name in LAYER_OPERANDS]


class MoeFusionOp(KernelOp):
    name = "moe_fusion"
    directions = DIRECTIONS
    backends = BACKENDS
    fallback = "layer"
    description = "moe_mlp's experts fused or unfused: a measured choice per layer shape"
    problem_class = FusionProblem
    options = (opt.TOKENS, opt.HIDDEN, INTERMEDIATE, opt.EXPERTS, opt.TOP_K, opt.EP, opt.DTYPE)

    def problem(self, *, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, ep: int = 1,
                dtype: str = "float32", direction: str = "fwd", **_: Any) -> FusionProblem:
        return FusionProblem(tokens=tokens, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                             ep=ep, dtype=dtype, direction=direction)

    def default_problem_options(self) -> dict[str, Any]:
        return dict(DEFAULT_OPTIONS)

    def make_inputs(self, problem: FusionProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
        return layer_inputs(problem, distribution, seed)

    def distribution_record(self, problem, distribution, seed, inputs) -> dict[str, Any]:
        return {"experts": problem.experts, "ep": problem.ep}

    def reference(self, problem: FusionProblem, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        if problem.direction == "bwd":
            return np.concatenate([g.ravel() for g in layer_reference_grads(problem, inputs)])
        return layer_reference(problem, inputs)

    def run(self, backend: Backend, config: KernelConfig, problem: FusionProblem,
            inputs: Mapping[str, jax.Array]) -> jax.Array:
        if not _LAYER:
            raise RuntimeError("moe_fusion runs moe_tune.moe.moe_mlp: import moe_tune first")
        layer = lambda *operands: _LAYER[0](*operands, problem.top_k, expert_offset=0 if problem.ep > 1 else None,
                                            fused=config.fused)
        operands = tuple(inputs[name] for name in LAYER_OPERANDS)
        if problem.direction == "fwd":
            return layer(*operands)
        # the training step: loss = sum of the output; every gradient flattened into one checked array (f32)
        loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))
        grads = jax.grad(loss, argnums=tuple(range(len(operands))))(*operands)
        return jnp.concatenate([g.astype(jnp.float32).ravel() for g in grads])

    def memory_estimate(self, problem: FusionProblem) -> int:
        """The weights and activations on the host and the device, their float64 copies for the reference,
        and the layer's expert-ordered buffers."""
        p, size = problem, jnp.dtype(problem.dtype).itemsize
        weights = 3 * p.local_experts * p.hidden * p.intermediate
        acts = p.tokens * (p.hidden + p.experts)
        rows = p.tokens * p.top_k * (2 * p.hidden + 3 * p.intermediate)
        if p.direction == "bwd":  # the gradients (and their float64 references) and the backward's row buffers
            return (2 * size + 8) * 2 * (weights + acts) + 4 * 3 * rows
        return (2 * size + 8) * (weights + acts) + 4 * rows

    def describe(self, problem: FusionProblem) -> str:
        p = problem
        ep = f" ep={p.ep}" if p.ep > 1 else ""
        return (f"moe_fusion {p.direction} tokens={p.tokens} hidden={p.hidden} intermediate={p.intermediate} experts={p.experts} "
                f"top_k={p.top_k} {p.dtype}{ep}")


MOE_FUSION = MoeFusionOp()


def use_fused(fused: bool | None, *, tokens: int, hidden: int, intermediate: int, experts: int, local: int,
              top_k: int, dtype: Any, weights: tuple, distribution: str | None = None, direction: str = "fwd") -> bool:
    """Whether `moe_mlp` runs its experts fused: `fused` when given, else the tables' measured choice for the
    layer's shape and `direction` (fwd: inference, bwd: a training step; else `LayerChoice.default_config`),
    False where the fused path cannot run the weights (`layer.can_fuse`). `local`: the experts the weights hold
    (ep = experts / local)."""
    if fused is not None:
        return bool(fused)
    if can_fuse(*weights) is not None:
        return False
    problem = FusionProblem(tokens=tokens, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                            ep=experts // local if experts % local == 0 else 1, dtype=dtype_name(dtype),
                            direction=direction)
    options = {} if distribution is None else {"distribution": distribution}
    return bool(MOE_FUSION.resolve_config(None, problem, **options).config.fused)
