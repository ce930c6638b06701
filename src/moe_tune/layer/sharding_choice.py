"""`moe_sharding`: how the MoE layer across devices (`layer/sharded.py`) moves its tokens, as a measured choice
stored and looked up like any op's config.

The problem is one sharded layer: the tokens one device holds, the layer's dims (`intermediate` the whole
expert width, split over `tp`), the mesh (`ep` devices along the expert axis, `tp` along the tensor axis), the
dtype and the weights' quantization; the table's device kind is the rest of the key. Its one backend (`mesh`)
has three tunables:

- `strategy`: `all_gather` or `all_to_all` (`exchange.STRATEGIES`);
- `token_chunks`: the token chunks that would let XLA overlap the collectives with the matmuls. The layer
  runs its tokens in one piece, so 1 is the only value and the only candidate;
- `exchange`: the all-to-all's implementation, `ragged` (`jax.lax.ragged_all_to_all`) or `fixed` (a
  fixed-capacity `all_to_all`). The layer runs the platform's own (`exchange.has_ragged_all_to_all`), so the
  one candidate is the platform's; a config naming the other is refused (`config_error`).

A sweep times the whole sharded layer each way on the mesh of the machine it runs on (`jax.devices()`), `fwd`
the forward, `bwd` the forward and backward together, against the one-device layer in float64
(`layer/reference.py`). `moe_mlp(..., ep_strategy=None)` asks the `fwd` entry (`strategy_for`, called by
`sharded.resolve_strategy`) by the layer's local shapes and dtype: the float weights' key, whatever the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from moe_tune.core import devices
from moe_tune.core.errors import UsageError
from moe_tune.core.quant_format import QuantFormat
from moe_tune.kernels.base import Backend, BackendRegistry, KernelConfig
from moe_tune.kernels.options import ShapeOption
from moe_tune.kernels.ragged_dot.problem import check_positive, dtype_name, supported_dtype
from moe_tune.layer import exchange
from moe_tune.layer.fusion_choice import FusionProblem
from moe_tune.layer.exchange import STRATEGIES

EXCHANGES = ("ragged", "fixed")
DIRECTIONS = ("fwd", "bwd")
TP = ShapeOption("tp", int, "moe_sharding: tensor-parallel size (devices along the tensor axis, each holding "
                 "intermediate / tp of every expert).", listable=True)
DEFAULT_OPTIONS = {"tokens": 256, "hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "ep": 8,
                   "tp": 1, "dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class ShardingProblem:
    """One sharded `moe_mlp` layer: `tokens` on each device of the expert axis (the layer holds tokens x ep),
    hidden size, one expert's whole FFN width (`intermediate`, split over `tp`), routed experts, top_k, the
    mesh (`ep` x `tp` devices), dtype of activations and weights, and the weights' quantization (`FusionProblem`'s
    rule: rhs_qdtype, rhs_qblock elements per scale along each weight's k, None one scale per channel)."""

    SIZE_FIELDS: ClassVar[tuple[str, ...]] = ("tokens",)
    OPTIONAL_KEY_FIELDS: ClassVar[tuple[str, ...]] = ("rhs_qdtype", "rhs_qblock")

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    ep: int = 8
    tp: int = 1
    dtype: str = "float32"
    direction: str = "fwd"  # fwd: the forward timed; bwd: forward and backward timed together
    rhs_qdtype: str | None = None
    rhs_qblock: int | None = None

    def __post_init__(self) -> None:
        check_positive(self, ("tokens", "hidden", "intermediate", "experts", "top_k", "ep", "tp"))
        if self.ep * self.tp < 2:
            raise UsageError("moe_sharding chooses how tokens travel between devices: ep x tp must be at least 2")
        if self.experts % self.ep or self.top_k > self.experts:
            raise UsageError(f"ep ({self.ep}) must divide experts ({self.experts}) and top_k ({self.top_k}) not "
                             "exceed it")
        if self.intermediate % self.tp:
            raise UsageError(f"tp ({self.tp}) must divide intermediate ({self.intermediate})")
        if self.direction not in DIRECTIONS:
            raise UsageError(f"moe_sharding's directions are {' and '.join(DIRECTIONS)} (forward+backward); got "
                             f"{self.direction!r}")
        object.__setattr__(self, "dtype", supported_dtype(self.dtype))
        if self.rhs_qdtype is None:
            if self.rhs_qblock is not None:
                raise UsageError("rhs_qblock given without rhs_qdtype")
            return
        form = QuantFormat.parse(self.rhs_qdtype, self.rhs_qblock, dtype_arg="rhs_qdtype", block_arg="rhs_qblock")
        for axis, size in (("hidden", self.hidden), ("intermediate / tp", self.intermediate // self.tp)):
            form.along(size, axis=axis, block_arg="rhs_qblock")  # each device's k: hidden, and its slice of f
        object.__setattr__(self, "rhs_qdtype", form.dtype)
        object.__setattr__(self, "rhs_qblock", form.block)

    @property
    def devices(self) -> int:
        """Devices of the mesh: ep x tp."""
        return self.ep * self.tp

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    def whole_layer(self) -> FusionProblem:
        """The same layer on one device (every token, every expert, the whole width): the reference's and the
        inputs' problem, in this problem's direction."""
        return FusionProblem(tokens=self.tokens * self.ep, hidden=self.hidden, intermediate=self.intermediate,
                             experts=self.experts, top_k=self.top_k, ep=1, dtype=self.dtype, direction=self.direction,
                             rhs_qdtype=self.rhs_qdtype, rhs_qblock=self.rhs_qblock)

    def key_fields(self) -> dict[str, Any]:
        fields = {"direction": self.direction, "tokens": self.tokens, "hidden": self.hidden,
                  "intermediate": self.intermediate, "experts": self.experts, "top_k": self.top_k, "ep": self.ep,
                  "tp": self.tp, "dtype": self.dtype}
        if self.rhs_qdtype is not None:
            fields.update(rhs_qdtype=self.rhs_qdtype, rhs_qblock=self.rhs_qblock)
        return fields

    @classmethod
    def from_key_fields(cls, fields: dict[str, Any]) -> "ShardingProblem":
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})


def platform_exchange(platform: str | None = None) -> str:
    """The all-to-all the layer runs on `platform` (None: the judged one): `ragged` where it has
    `jax.lax.ragged_all_to_all`, else `fixed`."""
    platform = devices.platform() if platform is None else platform
    return "ragged" if platform in exchange.RAGGED_ALL_TO_ALL_PLATFORMS else "fixed"


@dataclasses.dataclass(frozen=True)
class ShardingConfig(KernelConfig):
    """strategy: `all_gather` or `all_to_all`; token_chunks: pieces the tokens run in (1: whole); exchange:
    the all-to-all's implementation (`ragged` or `fixed`)."""

    strategy: str = "all_gather"
    token_chunks: int = 1
    exchange: str = "fixed"


class MeshChoice(Backend[ShardingConfig, ShardingProblem]):
    op = "moe_sharding"
    name = "mesh"
    revision = 1  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = ShardingConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "the whole sharded moe_mlp layer, tokens gathered or exchanged (each with its kernels' tuned configs)"

    def default_config(self, problem: ShardingProblem | None) -> ShardingConfig:
        """`all_to_all` where the platform has a ragged all-to-all (only the routed rows travel), `all_gather`
        elsewhere (the fixed-capacity all-to-all moves worst-case buffers); not measured: a sweep measures
        your layer and mesh."""
        kind = platform_exchange()
        return ShardingConfig(strategy="all_to_all" if kind == "ragged" else "all_gather", exchange=kind)

    def candidate_values(self, problem: ShardingProblem):
        return {"strategy": list(STRATEGIES), "token_chunks": [1], "exchange": [platform_exchange()]}

    def config_error(self, config: ShardingConfig, problem: ShardingProblem) -> str | None:
        if config.strategy not in STRATEGIES:
            return f"strategy must be one of {', '.join(STRATEGIES)}, got {config.strategy!r}"
        if config.token_chunks != 1:
            return f"the layer runs its tokens in one piece: token_chunks must be 1, got {config.token_chunks!r}"
        if config.exchange not in EXCHANGES:
            return f"exchange must be one of {', '.join(EXCHANGES)}, got {config.exchange!r}"
        if config.exchange != platform_exchange():
            return f"the layer runs the {platform_exchange()} all-to-all here, not {config.exchange!r}"
        return None


BACKENDS = BackendRegistry("moe_sharding", platform_defaults={"cpu": "mesh"})

BACKENDS.register(MeshChoice())


def strategy_for(*, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, ep: int, tp: int,
                 dtype: Any) -> str:
    """The strategy the tables measured fastest for one device's layer (`intermediate`: this device's slice,
    intermediate / tp), for the forward and float weights, else `MeshChoice.default_config`'s. A layer no
    problem describes (one device) gets the default."""
    from moe_tune.kernels import get_op  # the op object is this room's (`layer.sharding_op`), registered with the kernels'

    default = BACKENDS.get("mesh").default_config(None).strategy
    try:
        problem = ShardingProblem(tokens=tokens, hidden=hidden, intermediate=intermediate * tp, experts=experts,
                                  top_k=top_k, ep=ep, tp=tp, dtype=dtype_name(dtype))
    except UsageError:
        return default
    return get_op("moe_sharding").resolve_config(None, problem).config.strategy
