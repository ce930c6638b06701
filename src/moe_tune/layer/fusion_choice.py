"""`moe_fusion`: whether `moe_mlp` runs its experts fused (`fused_moe` kernels) or unfused (gather, three
ragged_dots, gather-reduce), as a measured choice stored and looked up like any op's config.

The problem is one MoE layer's shape; its one backend (`layer`) has one tunable, `fused`, whose two values a
sweep times by running the whole layer each way (each way's kernels with their own tuned configs) against a
float64 reference of the layer. Two directions, chosen apart: `fwd` times the layer's forward (inference),
`bwd` its forward and backward together (a training step: every gradient, in x, the router logits and the three
weights, computed; dx, d(router logits) and 4 experts' weight gradients checked against float64 ones,
`layer_reference.py`). `memory_parts` / `sweep_memory`: what a sweep of a shape holds.
`moe_mlp(..., fused=None)` looks the winners up per shape at trace time: the `fwd` one runs where the layer
is only evaluated, the `bwd` one where it is differentiated (`layer.serve_or_train`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core import devices, distributions
from moe_tune.core.errors import UsageError
from moe_tune.kernels.base import Backend, BackendRegistry, KernelConfig
from moe_tune.layer.fused_layer import can_fuse
from moe_tune.kernels import get_op
from moe_tune.layer.reference import SEEDED_CHECKED, check_parts, check_size, check_vector, checked_experts
from moe_tune.kernels.kernel_op import ShapeOption
from moe_tune.kernels.ragged_dot.problem import RHS_LAYOUT, check_positive, dtype_name, supported_dtype
from moe_tune.core.quant import QArray, check_operand, quantize
from moe_tune.core.quant_format import QuantFormat

INTERMEDIATE = ShapeOption("intermediate", int, "moe_fusion: one expert's FFN width.", listable=True)
DIRECTIONS = ("fwd", "bwd")
DEFAULT_OPTIONS = {"tokens": 256, "hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "ep": 1,
                   "dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class FusionProblem:
    """One `moe_mlp` layer: tokens on this shard, hidden size, expert width, routed experts, top_k,
    expert-parallel size (the shard holds experts / ep experts), dtype of activations and weights."""

    SIZE_FIELDS: ClassVar[tuple[str, ...]] = ("tokens",)
    OPTIONAL_KEY_FIELDS: ClassVar[tuple[str, ...]] = ("rhs_qdtype", "rhs_qblock")

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    ep: int = 1
    dtype: str = "float32"
    direction: str = "fwd"  # fwd: the forward timed; bwd: forward and backward timed together
    # quantized expert weights (all three QArrays scaled along their k: hidden for gate and up, intermediate
    # for down), `QuantFormat`'s rule: rhs_qblock elements per scale, None one scale per channel (mxfp4: 32)
    rhs_qdtype: str | None = None
    rhs_qblock: int | None = None

    def __post_init__(self) -> None:
        check_positive(self, ("tokens", "hidden", "intermediate", "experts", "top_k", "ep"))
        if self.experts % self.ep or self.top_k > self.experts:
            raise UsageError(f"ep ({self.ep}) must divide experts ({self.experts}) and top_k ({self.top_k}) not "
                             "exceed it")
        if self.direction not in DIRECTIONS:
            raise UsageError(f"moe_fusion's directions are {' and '.join(DIRECTIONS)} (forward+backward); got "
                             f"{self.direction!r}")
        object.__setattr__(self, "dtype", supported_dtype(self.dtype))
        if self.rhs_qdtype is None:
            if self.rhs_qblock is not None:
                raise UsageError("rhs_qblock given without rhs_qdtype")
            return
        form = QuantFormat.parse(self.rhs_qdtype, self.rhs_qblock, dtype_arg="rhs_qdtype", block_arg="rhs_qblock")
        for axis, size in (("hidden", self.hidden), ("intermediate", self.intermediate)):
            form.along(size, axis=axis, block_arg="rhs_qblock")  # gate and up along hidden, down along intermediate
        object.__setattr__(self, "rhs_qdtype", form.dtype)
        object.__setattr__(self, "rhs_qblock", form.block)

    @property
    def rhs_format(self) -> QuantFormat | None:
        """The expert weights' quantization (block None: one scale per channel), None for float weights."""
        return None if self.rhs_qdtype is None else QuantFormat(self.rhs_qdtype, self.rhs_qblock)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    def key_fields(self) -> dict[str, Any]:
        fields = {"direction": self.direction, "tokens": self.tokens, "hidden": self.hidden,
                  "intermediate": self.intermediate, "experts": self.experts, "top_k": self.top_k, "ep": self.ep,
                  "dtype": self.dtype}
        if self.rhs_qdtype is not None:  # only when quantized: the float layers' keys stay what they were
            fields.update(rhs_qdtype=self.rhs_qdtype, rhs_qblock=self.rhs_qblock)
        return fields

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
        """Fused where it was measured faster or not measured; a sweep measures your shape.

        - CPU (FINDINGS.md: fused layer prefill, fused layer decode): the fused forward 1.17-2.11x faster at
          prefill (4096 tokens, ep 4), at decode within that loaded run's noise.
        - GPU (FINDINGS.md: H100 MoE layer): unfused, whose forward was
          1.17x (qwen3-30b-a3b 4096 tokens), 1.93x (256 tokens) and 1.17x (deepseek-v3 ep 8) faster than the
          fused triton kernels'; forward+backward: fused 1.07x faster (4096 tokens, a 20% spread), unfused 1.13x
          (256) and 1.01x (deepseek-v3) faster.
        - TPU: fused (pallas_tpu), not yet timed on a TPU."""
        return FusionConfig(fused=devices.platform() != "gpu")

    def candidate_values(self, problem: FusionProblem):
        return {"fused": [True, False]}

    def config_error(self, config: FusionConfig, problem: FusionProblem) -> str | None:
        return None if isinstance(config.fused, bool) else f"fused must be a bool, got {config.fused!r}"


BACKENDS = BackendRegistry("moe_fusion", platform_defaults={"cpu": "layer"})

BACKENDS.register(LayerChoice())


def layer_inputs(problem: FusionProblem, distribution: str, seed: int) -> dict[str, np.ndarray]:
    """x, router logits and the shard's expert weights; for `bwd` also the loss's cotangent [tokens, hidden]
    (in the layer's dtype) and the experts whose weight gradients are checked (`layer_reference`). The logits
    are random plus a per-expert bias of the log of the named distribution's group sizes, so that the routing
    follows it roughly."""
    rng = np.random.default_rng(seed)
    p, dtype = problem, jnp.dtype(problem.dtype)
    sizes = distributions.group_sizes(distribution, p.tokens * p.top_k, p.experts, seed)
    logits = rng.standard_normal((p.tokens, p.experts), np.float32) + np.log1p(sizes).astype(np.float32)
    normal = lambda *shape, fan_in: (rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)).astype(dtype)
    local = p.local_experts
    inputs = {"x": normal(p.tokens, p.hidden, fan_in=1), "router_logits": logits,
              "w_gate": normal(local, p.hidden, p.intermediate, fan_in=p.hidden),
              "w_up": normal(local, p.hidden, p.intermediate, fan_in=p.hidden),
              "w_down": normal(local, p.intermediate, p.hidden, fan_in=p.intermediate)}
    if p.rhs_qdtype is not None:  # QArrays of NumPy arrays, scaled along each weight's k (axis 1)
        for name in WEIGHTS:
            q = quantize(inputs[name].astype(np.float32), p.rhs_qdtype, axis=1, block_size=p.rhs_qblock)
            inputs[name] = jax.tree.map(np.asarray, q)
    if p.direction == "bwd":
        inputs["cotangent"] = normal(p.tokens, p.hidden, fan_in=1)
        # quantized weights are constants: no weight gradient to check
        inputs["checked_experts"] = (checked_experts(p, logits, rng) if p.rhs_qdtype is None
                                     else np.zeros((0,), np.int32))
    return inputs


def weights_quant(weights: tuple) -> dict[str, Any] | None:
    """The `FusionProblem` quantization fields of `moe_mlp`'s (w_gate, w_up, w_down): {} for float weights,
    rhs_qdtype / rhs_qblock when all three are QArrays of one dtype in one block (None: one scale per channel,
    each along its k), None for weights no problem describes (mixed float and quantized, two dtypes or
    blocks): the choice's default."""
    if not any(isinstance(w, QArray) for w in weights):
        return {}
    if not all(isinstance(w, QArray) for w in weights) or len({w.dtype.name for w in weights}) != 1:
        return None
    blocks = [check_operand(w, name=name, layout=RHS_LAYOUT) for name, w in zip(WEIGHTS, weights)]
    per_channel = all(block == w.shape[1] for block, w in zip(blocks, weights))
    if not per_channel and len(set(blocks)) != 1:
        return None
    return {"rhs_qdtype": weights[0].dtype.name, "rhs_qblock": None if per_channel else blocks[0]}


LAYER_OPERANDS = ("x", "router_logits", "w_gate", "w_up", "w_down")
WEIGHTS = LAYER_OPERANDS[2:]


def training_check(grads: Sequence[jax.Array], checked: jax.Array) -> jax.Array:
    """What a `bwd` candidate returns for the check: from a training step's gradients [dx, d(router logits),
    dw_gate, dw_up, dw_down] (every local expert's), the `check_vector` (float32) of dx, d(router logits) and
    the `checked` experts' (int32 [n], traced) weight gradients, `layer_reference`'s order."""
    dx, dlogits, *dw = grads
    taken = [jnp.take(g, checked, axis=0) for g in dw]
    return check_vector(check_parts([g.astype(jnp.float32) for g in (dx, dlogits, *taken)]), jnp)




def use_fused(fused: bool | None, *, tokens: int, hidden: int, intermediate: int, experts: int, local: int,
              top_k: int, dtype: Any, weights: tuple, distribution: str | None = None, direction: str = "fwd") -> bool:
    """Whether `moe_mlp` runs its experts fused: `fused` when given, else the tables' measured choice for the
    layer's shape and `direction` (fwd: inference, bwd: a training step; else `LayerChoice.default_config`),
    False where the fused path cannot run the weights (`layer.can_fuse`). `local`: the experts the weights hold
    (ep = experts / local)."""
    if fused is not None and not isinstance(fused, (bool, np.bool_)):
        raise UsageError(f"fused must be True, False or None (the tables' choice), got {fused!r}")
    if fused is not None:
        return bool(fused)
    if can_fuse(*weights) is not None:
        return False
    quant = weights_quant(weights)
    if quant is None:  # weights no problem describes: the choice's default
        return bool(BACKENDS.get("layer").default_config(None).fused)
    problem = FusionProblem(tokens=tokens, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                            ep=experts // local if experts % local == 0 else 1, dtype=dtype_name(dtype),
                            direction=direction, **quant)
    options = {} if distribution is None else {"distribution": distribution}
    # the op object is the layer room's (`layer.fusion_op`), registered with the kernels' ops
    return bool(get_op("moe_fusion").resolve_config(None, problem, **options).config.fused)


# A sweep process beyond its arrays (JAX, moe_tune, compiled programs, the profiler): the peak PSS of a whole
# `moe-tune sweep --op moe_fusion --direction bwd --workers 1` at 16 tokens, hidden 32 (benchmarks/memwatch.py)
PROCESS_BYTES = 360 << 20


def memory_parts(problem: FusionProblem) -> dict[str, int]:
    """Bytes a `moe_fusion` sweep of `problem` holds, by holder (FINDINGS.md: moe_fusion choices compares
    `sweep_memory` with measured peaks):
    - host: the inputs (`layer_inputs`);
    - device: their copy that the candidates run on (`jax.device_put` copies on CPU too);
    - reference: the float64 reference (fwd: the output; bwd: the check vector of `layer_reference`, which at
      its peak, building the vector, holds about three of them);
    - run: one candidate's outputs (bwd: every gradient, in the inputs' dtypes, and the check vector) and its
      temp buffers (the expert-ordered rows: [tokens*top_k, 2 hidden + 3 intermediate] a pass, three passes
      for a training step; cf. benchmarks/results/fused_memory_cpu_*);
    - worker: what each compile worker process adds (`--workers` >= 2): its own device copy of the inputs, one
      candidate's run, and the process itself (the shared file is mapped, not copied);
    - shared: with workers, the inputs and the reference written once to a shared-memory file
      (`tuner/candidate.py`);
    - process: the sweep's own Python process with JAX."""
    p, size = problem, jnp.dtype(problem.dtype).itemsize
    weights = 3 * p.local_experts * p.hidden * p.intermediate
    host = size * (weights + p.tokens * p.hidden) + 4 * p.tokens * p.experts
    passes = 3 if p.direction == "bwd" else 1
    temp = passes * size * p.tokens * p.top_k * (2 * p.hidden + 3 * p.intermediate)
    if p.direction == "bwd":
        host += size * p.tokens * p.hidden + 4 * min(2 + SEEDED_CHECKED, p.local_experts)  # cotangent, experts
        reference = 8 * check_size(p)
        run = host - size * p.tokens * p.hidden + 4 * check_size(p) + temp  # the gradients: no cotangent's
    else:
        reference = 8 * p.tokens * p.hidden
        run = size * p.tokens * p.hidden + temp
    return {"host": host, "device": host, "reference": reference, "run": run,
            "worker": host + run + PROCESS_BYTES, "shared": host + reference, "process": PROCESS_BYTES}


def sweep_memory(problem: FusionProblem, workers: int) -> int:
    """Peak bytes of a sweep with `workers` compile workers (1: none, compiled in the sweep's process), the
    larger of: building the reference (the host inputs, the reference's working set) and running the
    candidates (host inputs, their device copy, the reference, one candidate's run, and with workers the
    shared file and every worker's share: the workers keep their device copies while the sweep times)."""
    m = memory_parts(problem)
    building = m["process"] + m["host"] + (3 if problem.direction == "bwd" else 1) * m["reference"]
    running = m["process"] + m["host"] + m["device"] + m["reference"] + m["run"]
    if workers > 1:
        running += m["shared"] + workers * m["worker"]
    return max(building, running)
