"""`moe-tune plan`'s output: one slice plan (`targets/slice_plan.py`) as a table and its recommendation, or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from moe_tune.commands.render import table
from moe_tune.targets.slice_plan import SlicePlan, StrategyPlan, ep_strategy_argument

COLUMNS = ("strategy", "compiled", "fits", "GB/chip", "sent GB/chip", "collectives", "floor ms", "bound",
           "compiler ms", "compile s")
_NUMBERS = ("GB/chip", "sent GB/chip", "floor ms", "compiler ms", "compile s")


def _fits(p: StrategyPlan) -> str:
    return "-" if p.fits is None else "yes" if p.fits else "no"


def _gb(p: StrategyPlan) -> str:
    if p.compiled.ok:
        return f"{p.chip_bytes / 1e9:.2f}"
    return f">{p.chip_bytes / 1e9:.1f}" if p.compiled.out_of_memory and p.chip_bytes else "-"


def _collectives(p: StrategyPlan) -> str:
    return ", ".join(f"{kind} x{c['count']}" for kind, c in p.collectives.items()) or "-"


def _compiled(p: StrategyPlan) -> str:
    c = p.compiled
    if not c.ok:
        return "out of HBM" if c.out_of_memory else "rejected"
    return {"xla": "xla backends", "sparsecore": "sparsecore"}.get(c.backend, "yes")


def _estimate(p: StrategyPlan) -> str:
    """The compiler's estimate in ms; `<0` where it gave a value that is not a duration (`lines` says so)."""
    if p.compiler_estimate_s is not None:
        return f"{p.compiler_estimate_s * 1e3:.3g}"
    return "<0" if p.compiled.cost.get("optimal_seconds", 0) < 0 else "-"


def row(p: StrategyPlan) -> Sequence[Any]:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.3g}"
    return (p.strategy, _compiled(p), _fits(p), _gb(p), f"{p.collective_bytes / 1e9:.3g}" if p.compiled.ok else "-",
            _collectives(p), ms(p.floor_s), p.bound or "-", _estimate(p), f"{p.compiled.compile_s:.1f}")


def title(plan: SlicePlan) -> str:
    mesh = f"expert {plan.expert}" + (f" x tensor {plan.tensor}" if plan.tensor > 1 else "")
    capacity = "" if plan.capacity_factor is None else f", capacity factor {plan.capacity_factor:g}"
    return (f"{plan.model}, {plan.tokens} tokens per expert shard, {plan.dtype}, on {plan.slice} ({plan.chips} "
            f"{plan.chip} chips, {mesh}{capacity}): the layer's forward pass")


def lines(plan: SlicePlan) -> list[str]:
    """What follows the table: the rejections, the fallbacks, the chip's facts, the recommendation and the note."""
    out = []
    for p in plan.strategies:
        if not p.compiled.ok:
            out.append(f"{p.strategy}: {p.compiled.message}")
        elif p.compiled.fallback_reason:
            on = {"xla": "the XLA backends", "platform": "the chip's kernels"}.get(p.compiled.backend,
                                                                                p.compiled.backend)
            out.append(f"{p.strategy}: compiled on {on}; refused first: {p.compiled.fallback_reason}")
    negative = [p.strategy for p in plan.strategies if p.compiled.cost.get("optimal_seconds", 0) < 0]
    if negative:
        out.append(f"{', '.join(negative)}: the compiler's optimal_seconds is negative (not a duration; not used)")
    f = plan.facts
    out.append(f"{plan.chip} per chip: {f['hbm_bytes'] / 1e9:.1f} GB HBM at {f['hbm_bandwidth'] / 1e9:.0f} GB/s, "
               f"{f['peak_bf16_flops'] / 1e12:.0f} TFLOP/s bf16, {f['interconnect_bandwidth'] / 1e9:.0f} GB/s "
               f"interconnect (both directions) [{f['source']}]; the layer per chip: "
               f"{plan.work.flops / 1e9:.1f} GFLOP, {plan.work.hbm_bytes / 1e9:.2f} GB of HBM traffic")
    if plan.recommended is not None:
        out.append(f"recommended: ep_strategy={ep_strategy_argument(plan.recommended)}: {plan.reason}")
    else:
        out.append(plan.reason)
    out.append(f"note: {plan.note}")
    return out


def show(plan: SlicePlan, fmt: str) -> None:
    """The plan on stdout: a table and lines, or `--format json` (the plan's every field)."""
    if fmt == "json":
        click.echo(json.dumps(plan.to_dict(), indent=2))
        return
    table(title(plan), COLUMNS, [row(p) for p in plan.strategies], right=_NUMBERS, compact=True)
    for line in lines(plan):
        click.echo(line)
