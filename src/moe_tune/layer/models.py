"""Model presets: the expert-layer shapes of well-known MoE models, and the kernel calls of one of their layers.

The shapes live in `moe_tune/data/models.json` (its `_about` text defines the fields); `kernel_problems`
turns a preset into the tunable problems of one MoE layer, each built by its op object (`KernelOp.problem`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op, op_names
from moe_tune.kernels.layer_shape import LayerShape

DATA_FILE = "data/models.json"
# What one layer of a preset is swept, benched and listed at unless told otherwise (the one place these live).
# (`direction`: `all` tunes what training runs, `fwd` what serving runs: `layer_runs`)
LAYER_DEFAULTS = {"tokens": 4096, "ep": 1, "dtype": "float32", "direction": "all"}
LAYER_DIRECTIONS = ("fwd", "all")


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """The routed-expert shapes of one model's MoE layer, from its published config.

    Each routed expert is a gated MLP: gate and up projections [hidden -> expert_intermediate], down
    projection [expert_intermediate -> hidden].

    Attributes:
      name: the preset's name (`deepseek-v3`).
      hidden: model width (d_model).
      expert_intermediate: one routed expert's FFN width.
      experts: routed experts per MoE layer.
      top_k: experts per token.
      shared_experts: always-on experts (not routed; not part of the ragged kernels).
    """

    name: str
    hidden: int
    expert_intermediate: int
    experts: int
    top_k: int
    shared_experts: int


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One tunable kernel call of a MoE layer: the op's name, its role in the layer (`gate/up`, `down`,
    `dispatch`, `combine`) and the problem object its op object built (`RaggedDotProblem` or `GatherProblem`)."""

    op: str
    role: str
    problem: Any


@functools.cache
def presets() -> dict[str, ModelPreset]:
    """All presets by name, read once from the package's models.json (entries starting with `_` are notes)."""
    text = resources.files("moe_tune").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return {name: ModelPreset(name=name, **fields) for name, fields in json.loads(text).items()
            if not name.startswith("_")}


def get_preset(name: str) -> ModelPreset:
    """The preset called `name`; UsageError naming the close matches and every preset otherwise."""
    known = presets()
    if name in known:
        return known[name]
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise UsageError(f"unknown model {name!r}; {hint}known models: {', '.join(known)}")


def layer_settings(tokens: int | list[int] | None = None, ep: int | None = None,
                   dtype: str | None = None) -> tuple[list[int], int, str]:
    """(token counts, ep, dtype) of a layer's cases, `LAYER_DEFAULTS` filling what is not given."""
    counts = [tokens] if isinstance(tokens, int) else tokens
    return (counts or [LAYER_DEFAULTS["tokens"]], ep or LAYER_DEFAULTS["ep"], dtype or LAYER_DEFAULTS["dtype"])


def layer_cases(preset: ModelPreset, tokens: int | list[int] | None = None, *, ep: int | None = None,
                dtype: str | None = None, quant: Mapping[str, Any] | None = None,
                direction: str | None = None, tp: int | None = None) -> list[tuple[int, KernelCase]]:
    """(tokens, case) for every token count and every kernel call of one layer; every count is checked
    before anything runs. `quant`: see `kernel_problems`. `direction` None: every tunable kernel call of the
    shard layer of `tokens` routed tokens (`kernel_problems`). With a direction, what serving (`fwd`) or
    training (`all`) runs: on one device (`ep` and `tp` 1) the layer of `tokens` tokens (`layer_runs`); with
    `ep` x `tp` >= 2 (`tp` None: 1) the layer across that mesh, `tokens` per device of the expert axis, under
    every strategy (`sharded_runs`; its first group is the shard layer on `tokens`, `layer_runs` at the same
    count and ep)."""
    counts, ep, dtype = layer_settings(tokens, ep, dtype)
    if direction is None:
        return [(t, case) for t in counts for case in kernel_problems(preset, t, ep=ep, dtype=dtype, quant=quant)]
    if ep == 1 and tp in (None, 1):
        return [(t, case) for t in counts
                for case in layer_runs(preset, t, ep=ep, dtype=dtype, quant=quant, direction=direction)]
    return [(t, case) for t in counts  # the layer across devices: `tokens` per device of the expert axis
            for case in sharded_runs(preset, t, ep=ep, tp=1 if tp is None else tp, dtype=dtype, quant=quant,
                                     direction=direction)]


def layer_runs(preset: ModelPreset, tokens: int, *, dtype: str, ep: int = 1, quant: Mapping[str, Any] | None = None,
               direction: str = "all") -> list[KernelCase]:
    """The kernel calls one layer of `moe_tune.moe_mlp` looks up, to tune, each op's answer
    (`KernelOp.layer_calls`, in the ops' order: the choice between the fused and unfused paths, timed with both
    paths' kernels tuned, last): serving (`fwd`) evaluates the layer, training (`all`) differentiates it and
    evaluates it between steps. E.g. training runs the ragged_dot gradients of the float operands only (a
    `QArray` is a constant), the backward's gathers, and the fused dispatch both with its activation
    (evaluated) and without it (differentiated: its backward needs the pre-activation product). UsageError
    for another direction."""
    if direction not in LAYER_DIRECTIONS:
        raise UsageError(f"a model's layer is tuned for serving (--direction fwd) or training (--direction all), "
                         f"not {direction!r}")
    return _calls(layer_shape(preset, tokens, ep=ep, dtype=dtype, quant=quant), direction)


def fused_runs(preset: ModelPreset, tokens: int, *, ep: int, dtype: str, quant: Mapping[str, Any],
               direction: str) -> list[KernelCase]:
    """The fused path's calls of `layer_runs` (`fused_moe`), then the choice between the two paths
    (`moe_fusion`)."""
    layer = layer_shape(preset, tokens, ep=ep, dtype=dtype, quant=quant)
    return _calls(layer, direction, ops=("fused_moe", "moe_fusion"))


def layer_shape(preset: ModelPreset, tokens: int, *, ep: int = 1, dtype: str = "bfloat16",
                quant: Mapping[str, Any] | None = None) -> LayerShape:
    """One shard's layer of `preset` for `tokens` tokens (checked: UsageError for a bad count or ep)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise UsageError(f"tokens must be a positive integer, got {tokens!r}")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise UsageError(f"ep must be a positive integer, got {ep!r}")
    if preset.experts % ep:
        raise UsageError(f"ep ({ep}) must divide {preset.name}'s {preset.experts} experts")
    return LayerShape(tokens=tokens, hidden=preset.hidden, intermediate=preset.expert_intermediate,
                      experts=preset.experts, top_k=preset.top_k, ep=ep, dtype=dtype, quant=dict(quant or {}))


# The kernels the all_to_all strategy runs on one device (`exchange.all_to_all_layer`): the dispatch and the
# combine on its own tokens, the grouped matmuls on the rows it receives (never the fused path).
EXCHANGE_GATHERS = ("ragged_gather", "ragged_gather_reduce")
EXCHANGE_MATMULS = ("ragged_dot",)


def sharded_runs(preset: ModelPreset, tokens: int, *, ep: int, tp: int = 1, dtype: str,
                 quant: Mapping[str, Any] | None = None, direction: str = "all") -> list[KernelCase]:
    """The kernel calls one device of `moe_tune.sharded_moe_mlp` looks up, `tokens` per device of an expert
    axis of `ep` devices (and `tp` of a tensor axis: each expert's width / tp), under every way the layer runs
    (`layer/sharded.py`), each call once (by its op's key):

    - `all_gather`: the shard layer (`layer_runs`) on every device's tokens, tokens x ep (x gathered tiled
      over the expert axis), this device's experts;
    - `all_to_all` (`exchange.all_to_all_layer`): the dispatch and combine on this device's `tokens`, the
      grouped matmuls on the receive buffer, `exchange.worst_rows` rows in `experts / ep` groups;
    - tokens replicated over the expert axis (decode): the shard layer on `tokens` (first, its roles
      unprefixed: `layer_runs`'s calls at the same count);
    - the strategy's own lookup (`moe_sharding`, `KernelOp.mesh_calls`);
    - for each token chunk count C > 1 the strategy's sweep tries (`sharding_choice.chunk_candidates`), the
      calls above at tokens / C per device (each chunk runs the layer on its tokens), roles prefixed
      `C chunks:`, so that a tuned strategy with chunks finds its kernels' entries too.

    The layer without a capacity (`capacity_factor=None`). `direction` as `layer_runs` (None: every
    tunable kernel call, the strategy's lookup left out). UsageError for an ep or tp that does not divide."""
    if direction is not None and direction not in LAYER_DIRECTIONS:
        raise UsageError(f"a model's layer is tuned for serving (--direction fwd) or training (--direction all), "
                         f"not {direction!r}")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or preset.expert_intermediate % tp:
        raise UsageError(f"tp ({tp!r}) must be a positive integer dividing {preset.name}'s expert width "
                         f"{preset.expert_intermediate}")
    from moe_tune.layer.sharding_choice import chunk_candidates

    shard = dataclasses.replace(layer_shape(preset, tokens, ep=ep, dtype=dtype, quant=quant),
                                intermediate=preset.expert_intermediate // tp)
    if ep == 1:  # a tensor axis alone: the one-device layer on each device's slice of the width
        return _calls(shard, direction)
    cases = [*_strategies_calls(shard, direction),
             *(KernelCase(op=SHARDING_OP, role=role, problem=problem)
               for role, problem in get_op(SHARDING_OP).mesh_calls(shard, tp, direction))]
    for chunks in chunk_candidates(tokens)[1:]:
        part = dataclasses.replace(shard, tokens=tokens // chunks)
        cases += _labelled(f"{chunks} chunks:", _strategies_calls(part, direction))
    unique: dict[tuple, KernelCase] = {}
    for case in cases:
        unique.setdefault((case.op, tuple(case.problem.key_fields().items())), case)
    return list(unique.values())


SHARDING_OP = "moe_sharding"


def _strategies_calls(shard: LayerShape, direction: str | None) -> list[KernelCase]:
    """The kernel calls of one device's layer `shard` (`tokens` per device, its experts and width) under each
    strategy (`sharded_runs`' first three groups), the replicated-tokens layer first and unprefixed."""
    from moe_tune.layer.exchange import worst_rows

    received = dataclasses.replace(shard, tokens=worst_rows(shard.tokens, shard.top_k, shard.ep, shard.groups),
                                   top_k=1)
    return [*_calls(shard, direction),  # named as the shard layer's calls: the one on these tokens
            *_labelled("all_gather", _calls(dataclasses.replace(shard, tokens=shard.tokens * shard.ep), direction)),
            *_labelled("all_to_all", _calls(shard, direction, ops=EXCHANGE_GATHERS)
                       + _calls(received, direction, ops=EXCHANGE_MATMULS))]


def _labelled(prefix: str, cases: list[KernelCase]) -> list[KernelCase]:
    return [dataclasses.replace(case, role=f"{prefix} {case.role}") for case in cases]


def collectives(preset: ModelPreset, tokens: int, *, ep: int, tp: int = 1, dtype: str) -> list[tuple[str, int]]:
    """(name, operand bytes one device hands it) of each collective one forward of the sharded layer runs,
    `tokens` per device (`layer/sharded.py`, `layer/exchange.py`; without a capacity; the backward runs their
    transposes): under `all_gather` the gathers of x, the routing weights and the chosen experts and the
    reduce-scatter of the partial outputs; under `all_to_all` the gather of every device's counts per expert
    and the exchange there and back (`ragged` on TPU / GPU: the rows; `fixed` elsewhere: [ep, chunk, hidden]
    buffers); with tp > 1 the sum of the outputs over the tensor axis. Not tuned kernels."""
    import jax.numpy as jnp

    from moe_tune.layer.exchange import worst_rows

    size = jnp.dtype(dtype).itemsize
    local, top_k, hidden = preset.experts // ep, preset.top_k, preset.hidden
    entries, received = tokens * top_k, worst_rows(tokens, top_k, ep, local)
    chunk = tokens * min(top_k, local)  # the fixed-capacity exchange's rows per peer
    rows = [("all_gather: all_gather x", tokens * hidden * size),
            ("all_gather: all_gather routing weights (float32)", entries * 4),
            ("all_gather: all_gather chosen experts (int32)", entries * 4),
            ("all_gather: psum_scatter partial outputs", tokens * ep * hidden * size),
            ("all_to_all: all_gather counts per expert (int32)", preset.experts * 4),
            ("all_to_all: ragged_all_to_all rows there", entries * hidden * size),
            ("all_to_all: ragged_all_to_all rows back", received * hidden * size),
            ("all_to_all: fixed all_to_all rows there", ep * chunk * hidden * size),
            ("all_to_all: fixed all_to_all rows back", ep * chunk * hidden * size)]
    if tp > 1:
        rows.append(("psum outputs over the tensor axis", tokens * hidden * size))
    return rows


def left_out(op: str, problem: Any, devices: int | None = None) -> str | None:
    """Why a process with `devices` devices (None: this one) cannot run `op`'s `problem` (the sharded layer's
    strategy on a mesh larger than its devices: `sharding_op.left_out_here`), None when it can."""
    from moe_tune.layer.sharding_op import left_out_here

    return left_out_here(problem, devices) if op == SHARDING_OP else None


def runnable_here(cases: list[Any], devices: int | None = None) -> tuple[list[Any], list[str]]:
    """(the cases a process with `devices` devices (None: this one; a Ray task: 1) can sweep, a note for each
    left out): the sharded layer's strategy needs as many devices as its mesh (`sharding_op.left_out_here`);
    every other case runs on one."""
    kept, left = [], {}
    for case in cases:
        why = left_out(case.op, case.problem, devices)
        if why is None:
            kept.append(case)
        else:
            left[why] = left.get(why, 0) + 1
    return kept, [f"{why}: {count} sweep(s) left out" for why, count in left.items()]


def _calls(layer: LayerShape, runs: str | None, ops: tuple[str, ...] | None = None) -> list[KernelCase]:
    """Every op's calls in `layer` for `runs` (`KernelOp.layer_calls`), in the ops' order."""
    return [KernelCase(op=name, role=role, problem=problem) for name in (ops or op_names())
            for role, problem in get_op(name).layer_calls(layer, runs)]


def kernel_problems(preset: ModelPreset, tokens: int, *, ep: int = 1, dtype: str = "bfloat16",
                    quant: Mapping[str, Any] | None = None) -> list[KernelCase]:
    """Every tunable kernel call of one unfused MoE layer of `preset` in every direction of its ops, for
    `tokens` tokens per expert-parallel shard (each op's `layer_calls(layer, None)`).

    Convention: `tokens` is the number of tokens one shard routes (x [tokens, hidden] on that shard); with
    `ep` shards there are `ep * tokens` tokens in the layer. Each shard holds `groups = experts / ep` experts
    (`ep` must divide `experts`).

    - ragged_dot, roles `gate/up` (lhs [m, hidden] x rhs [groups, hidden, expert_intermediate]; gate and up
      have the same shape, so one case) and `down` (lhs [m, expert_intermediate] x rhs [groups,
      expert_intermediate, hidden]), each in directions fwd, dlhs and drhs. m = tokens * top_k: it is the
      static row count of the expert-ordered buffer in `moe_tune.layer.moe.moe_mlp` (every (token, k) entry gets a
      row; a shard only multiplies the rows of its own experts, about m / ep of them, but the kernel and its
      table key see the static m), and it is also the average number of rows a shard receives after an
      all-to-all dispatch (ep shards each send tokens * top_k rows, spread over ep shards).
    - dispatch, `ragged_gather`: x [tokens, hidden] -> [tokens * top_k, hidden] in expert order.
    - combine: [tokens * top_k, hidden] -> [tokens, hidden]; `ragged_gather_reduce` (rows masked to the
      shard's experts) when ep > 1, `dense_gather_reduce` (no mask) when ep == 1.

    `dtype` is the dtype of activations and weights (all operands). `quant`: the ragged_dot quantization
    options (`rhs_quant`, `lhs_quant`, `quant_block`; kernels/kernel_op.py `QUANT`) for a quantized layer:
    only the ragged_dot cases take them, the gathers stay float.
    """
    return _calls(layer_shape(preset, tokens, ep=ep, dtype=dtype, quant=quant), None)
