"""The shape options of an op, declared as data: what `KernelOp.problem(**options)` takes, and what the CLI
turns into flags (`--top-k`, `--weighted/--unweighted`, ...) and model presets fill in.

An option shared by several ops (dtype, the gather ops' tokens / hidden / top_k ...) is declared once here and
listed by each op that takes it, so its flag and help text are the same everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_tune.kernels.ragged_dot.problem import SUPPORTED_DTYPES
from moe_tune.core.quant_format import ACTIVATION_QDTYPES, QUANT_NAMES


@dataclasses.dataclass(frozen=True)
class ShapeOption:
    """One keyword of `KernelOp.problem()`.

    type: `int` (a positive integer), `str`, `bool` (a flag pair: `--name` / `negative_flag`), or a tuple of
    strings (one of these choices). default: None means "not given": the op's `default_problem_options()` (or
    the problem's own default) supplies it. listable: the CLI accepts `N[,N...]`: several values make a
    campaign (`sweep --op`: one sweep per combination; `sweep --model`: token counts and ep sizes); elsewhere one
    value is taken. aliases: extra flags (e.g. `--g` for `--groups`).
    """

    name: str
    type: type | tuple[str, ...]
    help: str
    default: Any = None
    listable: bool = False
    aliases: tuple[str, ...] = ()
    negative_flag: str | None = None  # bool options: the flag that sets False (default `--no-<name>`)

    @property
    def flag(self) -> str:
        """`--top-k` for `top_k`."""
        return "--" + self.name.replace("_", "-")

    @property
    def off_flag(self) -> str:
        """The flag that turns a bool option off."""
        return self.negative_flag or "--no-" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.type if isinstance(self.type, tuple) else None


DTYPE = ShapeOption("dtype", SUPPORTED_DTYPES, "Input dtype.")
OUT_DTYPE = ShapeOption("out_dtype", SUPPORTED_DTYPES, "Output dtype (default: --dtype).")

# ragged_dot
M = ShapeOption("m", int, "ragged_dot: rows of lhs (tokens x top_k on this shard).", listable=True)
K = ShapeOption("k", int, "ragged_dot: contracting dim (hidden size for gate/up).", listable=True)
N = ShapeOption("n", int, "ragged_dot: output dim (expert width for gate/up).", listable=True)
GROUPS = ShapeOption("groups", int, "ragged_dot: experts on this shard.", aliases=("--g",), listable=True)
RHS_QUANT = ShapeOption("rhs_quant", QUANT_NAMES, "ragged_dot, fused_moe: quantize the weights (rhs) to this dtype, "
                        "one scale per channel (or per --quant-block along k; int4 usually 128; mxfp4: blocks of 32, "
                        "OCP MX); its key gains the quantization fields.")
LHS_QUANT = ShapeOption("lhs_quant", ACTIVATION_QDTYPES,
                        "ragged_dot: quantize the activations (lhs) too (w8a8), one scale per row (or per "
                        "--quant-block along k).")
LHS_DYNAMIC = ShapeOption("lhs_dynamic", bool, "ragged_dot: with --lhs-quant, the kernel quantizes the float "
                          "activations where it loads each tile (dynamic w8a8: scales from the tile, per row and "
                          "block: --quant-block, else the weights' block) instead of reading quantized ones.",
                          negative_flag="--lhs-stored")
QUANT_BLOCK = ShapeOption("quant_block", int, "ragged_dot: elements along k sharing one scale (sub-channel; "
                          "default: all of k) for the quantized operands.")
QUANT = (RHS_QUANT, LHS_QUANT, QUANT_BLOCK, LHS_DYNAMIC)

# the gather ops
TOKENS = ShapeOption("tokens", int, "gather ops: tokens in the batch; with --model, comma-separated counts per "
                     "shard.", listable=True)
HIDDEN = ShapeOption("hidden", int, "gather ops: hidden size (row width).", listable=True)
TOP_K = ShapeOption("top_k", int, "gather ops: experts per token.", listable=True)
EXPERTS = ShapeOption("experts", int, "gather ops: routed experts (all shards).", listable=True)
EP = ShapeOption("ep", int, "gather ops: expert-parallel size; the valid rows are about 1/ep of them; with --model, "
                 "comma-separated sizes.", listable=True)
WEIGHTED = ShapeOption("weighted", bool, "ragged_gather: with or without row weights.",
                       negative_flag="--unweighted")


def names(options: tuple[ShapeOption, ...]) -> tuple[str, ...]:
    return tuple(option.name for option in options)
