"""`moe_sharding`: how the MoE layer across devices (`layer/sharded.py`) moves its tokens, as a measured choice
stored and looked up like any op's config.

The problem is one sharded layer: the tokens one device holds, the layer's dims (`intermediate` the whole
expert width, split over `tp`), the mesh (`ep` devices along the expert axis, `tp` along the tensor axis), the
dtype and the weights' quantization; the table's device kind is the rest of the key. Its one backend (`mesh`)
has five tunables:

- `strategy`: `all_gather`, `all_to_all` or, on TPU only, `in_kernel` (`exchange.STRATEGIES`);
- `token_chunks`: C consecutive chunks of t / C tokens, each its own exchange, experts and combine, which
  lets XLA overlap one chunk's collectives with another's grouped matmuls (MaxText's num_moe_token_chunks);
  candidates 1, 2 and 4 where C divides the tokens and leaves at least `MIN_CHUNK_TOKENS` per chunk;
- `exchange`: the all-to-all's implementation, `fixed` (a fixed-capacity `jax.lax.all_to_all`, everywhere) or
  `ragged` (`jax.lax.ragged_all_to_all`, only where the platform has it: TPU, GPU). It only matters to
  `all_to_all`: `all_gather` takes the platform's default exchange alone, so no candidate is timed twice;
- `wire`: the dtype dispatched rows travel in (`layer/wire.py`), `native` (the activations') or `fp8`
  (float8_e4m3fn with float32 scales, fed to the gate/up grouped matmuls as they arrived), both for
  all_gather and all_to_all;
- `row_tile`: the row tile of `in_kernel`'s two fused kernels (`in_kernel_rules.ROW_TILES`), 0 for the VMEM
  rules' largest (each kernel its own); other strategies take 0 only, and the candidates hold only values the
  rules accept for the layer that run other tiles than 0's, so no layer is timed twice.

A sweep times the whole sharded layer each way on the mesh of the machine it runs on (`jax.devices()`), `fwd`
the forward, `bwd` the forward and backward together, against the one-device layer in float64
(`layer/reference.py`). `moe_mlp(..., ep_strategy=None)` asks the `fwd` entry (`config_for`, called by
`sharded.resolve_strategy`) by the layer's local shapes, dtype and its weights' quantization.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from moe_tune.core import devices
from moe_tune.core.errors import UsageError
from moe_tune.core.quant_format import QuantFormat
from moe_tune.kernels.base import Backend, BackendRegistry, KernelConfig, positive_int_error
from moe_tune.kernels.kernel_op import ShapeOption
from moe_tune.kernels.pallas_util import round_up
from moe_tune.kernels.ragged_dot.problem import check_positive, dtype_name, supported_dtype
from moe_tune.layer import exchange
from moe_tune.layer.fusion_choice import FusionProblem, weights_quant
from moe_tune.layer.exchange import STRATEGIES
from moe_tune.layer.in_kernel_rules import ROW_ALIGN, ROW_TILES
from moe_tune.layer.wire import WIRES

EXCHANGES = ("ragged", "fixed")
IN_KERNEL_PLATFORMS = ("tpu", "cpu")  # in_kernel's kernels: compiled on TPU, interpreted on CPU
TOKEN_CHUNKS = (1, 2, 4)  # the candidates' token chunks
MIN_CHUNK_TOKENS = 8  # a candidate's chunks hold at least this many tokens
DIRECTIONS = ("fwd", "bwd")
FP8_STRATEGIES = ("all_gather", "all_to_all")  # the strategies whose dispatch the fp8 wire serves


def chunk_candidates(tokens: int) -> list[int]:
    """The token chunks a sweep tries for a device holding `tokens` tokens: those of `TOKEN_CHUNKS` that divide
    them and leave at least `MIN_CHUNK_TOKENS` per chunk (1 always)."""
    return [c for c in TOKEN_CHUNKS if c == 1 or (tokens % c == 0 and tokens // c >= MIN_CHUNK_TOKENS)]


TP = ShapeOption("tp", int, "moe_sharding: tensor-parallel size (devices along the tensor axis, each holding "
                 "intermediate / tp of every expert); with --model, one size (default 1).", listable=True)
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
    return "ragged" if exchange.has_ragged_all_to_all(platform) else "fixed"


@dataclasses.dataclass(frozen=True)
class ShardingConfig(KernelConfig):
    """strategy: `all_gather`, `all_to_all` or `in_kernel` (TPU, and interpret mode on CPU); token_chunks: the
    consecutive chunks a device's tokens run in, each its own exchange, experts and combine (1: whole); exchange:
    the all-to-all's implementation (`fixed` everywhere, `ragged` where the platform has
    `jax.lax.ragged_all_to_all`); wire: the dtype the dispatched rows travel in, `native` (the activations') or
    `fp8` (`layer/wire.py`; the return path stays native); row_tile: `in_kernel`'s fused kernels' row tile (one
    of `in_kernel_rules.ROW_TILES`; 0: the VMEM rules' largest). A table entry written before `wire` or
    `row_tile` existed reads as `native` / 0 (the fields' defaults)."""

    strategy: str = "all_gather"
    token_chunks: int = 1
    exchange: str = "fixed"
    wire: str = "native"
    row_tile: int = 0


class MeshChoice(Backend[ShardingConfig, ShardingProblem]):
    op = "moe_sharding"
    name = "mesh"
    revision = 2  # bump on changes that can change the fastest or a valid config (Backend.revision)
    config_cls = ShardingConfig
    platforms = ("cpu", "gpu", "tpu")
    description = "the whole sharded moe_mlp layer, tokens gathered or exchanged (each with its kernels' tuned configs)"

    def default_config(self, problem: ShardingProblem | None) -> ShardingConfig:
        """`all_to_all` where the platform has a ragged all-to-all (only the routed rows travel), `all_gather`
        elsewhere (the fixed-capacity all-to-all moves worst-case buffers); not measured: a sweep measures
        your layer and mesh."""
        return default_sharding()

    def candidate_values(self, problem: ShardingProblem):
        """Both strategies x token chunks 1, 2, 4 (those dividing the tokens with `MIN_CHUNK_TOKENS` or more per
        chunk) x the platform's exchanges (`fixed`; and `ragged` on TPU and GPU) x the wires x row tiles (0, and
        where in_kernel is offered `ROW_TILES`: `config_error` keeps those the rules accept for in_kernel)."""
        chunks = chunk_candidates(problem.tokens)
        kinds = ["fixed"] + (["ragged"] if exchange.has_ragged_all_to_all() else [])
        # in_kernel only where its kernels compile: elsewhere they would be timed in interpret mode
        strategies = [s for s in STRATEGIES if s != "in_kernel" or devices.platform() == "tpu"]
        row_tiles = [0, *ROW_TILES] if "in_kernel" in strategies else [0]
        return {"strategy": strategies, "token_chunks": chunks, "exchange": kinds, "wire": list(WIRES),
                "row_tile": row_tiles}

    def config_error(self, config: ShardingConfig, problem: ShardingProblem) -> str | None:
        """`layer_config_error`'s rules for the problem's tokens; `all_gather` with the platform's default
        exchange only (it runs no all-to-all: another exchange would time the same layer twice); `in_kernel` on
        TPU only (elsewhere its kernels would be timed in interpret mode), a non-zero row_tile only where the
        rules accept it and it runs other tiles than 0 (`row_tile_error`)."""
        reason = layer_config_error(config, tokens=problem.tokens)
        if reason is None and config.strategy == "in_kernel" and devices.platform() != "tpu":
            reason = "strategy in_kernel is tuned on TPU only: elsewhere its kernels run in interpret mode"
        if reason is None and config.row_tile:
            reason = row_tile_error(config, problem)
        if reason is None and config.strategy == "all_gather" and config.exchange != platform_exchange():
            reason = (f"all_gather runs no all-to-all: its exchange is the platform's {platform_exchange()!r}, "
                      f"got {config.exchange!r}")
        return reason


def _local_layer(problem: ShardingProblem, tokens: int) -> tuple:
    """Shape stand-ins of one device's x [tokens, d] and w_gate [local, d, f / tp] / w_down [local, f / tp, d]
    (a QArray of them when the problem is quantized), for the in_kernel tile rules."""
    import jax
    import jax.numpy as jnp

    from moe_tune.core.quant import QArray

    dtype = jnp.dtype(problem.dtype)
    f = problem.intermediate // problem.tp

    def weights(k: int, n: int):
        shape = (problem.local_experts, k, n)
        if problem.rhs_qdtype is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        rows = 1 if problem.rhs_qblock is None else k // problem.rhs_qblock
        return QArray(jax.ShapeDtypeStruct(shape, jnp.dtype(problem.rhs_qdtype)),
                      jax.ShapeDtypeStruct((problem.local_experts, rows, n), jnp.float32))

    return jax.ShapeDtypeStruct((tokens, problem.hidden), dtype), weights(problem.hidden, f), weights(f, problem.hidden)


def row_tile_error(config: ShardingConfig, problem: ShardingProblem) -> str | None:
    """Why a non-zero in_kernel `config.row_tile` (`layer_config_error` refuses it for the others) is no candidate
    for `problem` on the judged chip, or None: at most the rows one device receives from one token chunk
    (rounded up to 16; past them 0 runs the same tile), accepted by both fused kernels' rules
    (`in_kernel.fused_refusal`), and other tiles than 0's (the same kernels would be timed twice)."""
    from moe_tune.layer.in_kernel import fused_refusal
    from moe_tune.layer.in_kernel_gmm import gate_up_tiles
    from moe_tune.layer.in_kernel_return import down_tiles

    tokens = problem.tokens // config.token_chunks
    rows_in = exchange.receive_rows(tokens, problem.top_k, problem.ep, problem.local_experts, None)
    if config.row_tile > round_up(rows_in, ROW_ALIGN):
        return f"row_tile {config.row_tile} is past the {rows_in} rows a device receives: row_tile 0 runs that tile"
    x, w_gate, w_down = _local_layer(problem, tokens)
    reason = fused_refusal(x, w_gate, w_down, "silu", rows_in, problem.top_k, config.row_tile)
    if reason is not None:
        return reason

    def chosen(row_tile: int) -> tuple:
        gate_up = gate_up_tiles(x, w_gate, rows_in, row_tile)
        return gate_up, down_tiles(round_up(rows_in, gate_up[0]), w_down, x.dtype, row_tile)

    if fused_refusal(x, w_gate, w_down, "silu", rows_in, problem.top_k) is None and chosen(0) == chosen(
            config.row_tile):
        return f"row_tile {config.row_tile} runs the tiles row_tile 0 runs"
    return None


def default_sharding(platform: str | None = None) -> ShardingConfig:
    """The layer's config on `platform` (None: the judged one) when nothing is measured: `all_to_all` over the
    ragged all-to-all where the platform has one, `all_gather` elsewhere; tokens in one piece."""
    kind = platform_exchange(platform)
    return ShardingConfig(strategy="all_to_all" if kind == "ragged" else "all_gather", token_chunks=1, exchange=kind)


def layer_config_error(config: ShardingConfig, *, tokens: int, platform: str | None = None) -> str | None:
    """Why the layer cannot run `config` on a device holding `tokens` tokens on `platform` (None: the judged
    one), or None: a known strategy and exchange, token_chunks a positive int dividing the tokens, the ragged
    exchange only where the platform has it."""
    if config.strategy not in STRATEGIES:
        return f"strategy must be one of {', '.join(STRATEGIES)}, got {config.strategy!r}"
    reason = positive_int_error("token_chunks", config.token_chunks)
    if reason is not None:
        return reason
    if tokens % config.token_chunks:
        return (f"token_chunks {config.token_chunks} does not divide the {tokens} tokens of one device: each chunk "
                "runs the same number of tokens")
    if config.exchange not in EXCHANGES:
        return f"exchange must be one of {', '.join(EXCHANGES)}, got {config.exchange!r}"
    if config.wire not in WIRES:
        return f"wire must be one of {', '.join(WIRES)}, got {config.wire!r}"
    if config.row_tile != 0 and config.row_tile not in ROW_TILES:
        return (f"row_tile must be 0 (the VMEM rules' largest) or one of {', '.join(map(str, ROW_TILES))}, got "
                f"{config.row_tile!r}")
    if config.row_tile and config.strategy != "in_kernel":
        return (f"row_tile tiles the rows of in_kernel's fused kernels; {config.strategy!r} has none: pass "
                "row_tile=0")
    if config.wire == "fp8" and config.strategy not in FP8_STRATEGIES:
        return (f"wire 'fp8' quantizes the rows the {' and '.join(FP8_STRATEGIES)} strategies send, not "
                f"{config.strategy!r}'s: pass wire='native'")
    judged = devices.platform() if platform is None else platform
    if config.strategy == "in_kernel" and judged not in IN_KERNEL_PLATFORMS:
        return ("strategy 'in_kernel' moves rows by remote DMA inside Pallas TPU kernels: it runs on TPU (and in "
                "interpret mode on CPU), not on this platform: pass 'all_to_all' or 'all_gather'")
    if config.exchange == "ragged" and not exchange.has_ragged_all_to_all(platform):
        return ("exchange 'ragged' needs jax.lax.ragged_all_to_all, which this platform lacks (it runs on "
                f"{' and '.join(exchange.RAGGED_ALL_TO_ALL_PLATFORMS)}): pass exchange='fixed'")
    return None


BACKENDS = BackendRegistry("moe_sharding", platform_defaults={"cpu": "mesh"})

BACKENDS.register(MeshChoice())


def config_for(*, tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, ep: int, tp: int,
               dtype: Any, weights: tuple = ()) -> ShardingConfig:
    """The config the tables measured fastest for one device's layer (`intermediate`: this device's slice,
    intermediate / tp), for the forward and the quantization of `weights` (this device's w_gate, w_up, w_down:
    `fusion_choice.weights_quant`; none given: float weights), else `default_sharding()`. A layer no problem
    describes (one device, weights of mixed formats) gets the default; so does a looked-up entry this layer
    cannot run (token chunks that do not divide its tokens: `KernelOp.resolve_config`)."""
    from moe_tune.kernels import get_op  # the op object is this room's (`layer.sharding_op`), registered with the kernels'

    quant = weights_quant(weights)
    if quant is None:
        return default_sharding()
    try:
        problem = ShardingProblem(tokens=tokens, hidden=hidden, intermediate=intermediate * tp, experts=experts,
                                  top_k=top_k, ep=ep, tp=tp, dtype=dtype_name(dtype), **quant)
    except UsageError:
        return default_sharding()
    return get_op("moe_sharding").resolve_config(None, problem).config
