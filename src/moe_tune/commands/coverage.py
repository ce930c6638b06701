"""`moe-tune coverage`: which kernel calls of a model's layer the tables answer for, and how (the logic is
`campaign/coverage.py`; this module parses and renders, and `cli.py` registers it)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from moe_tune.commands import render as render
from moe_tune.core import distributions
from moe_tune.layer import models as presets
from moe_tune.commands.options import DTYPES, INT_LIST, handle_errors, quant_flags, quant_options


@click.command()
@click.option("--model", required=True, help="A preset (see `moe-tune models`), several comma-separated, or `all`.")
@click.option("--tokens", type=INT_LIST, default=str(presets.LAYER_DEFAULTS["tokens"]), show_default=True,
              help="Tokens per device of the expert axis, comma-separated.")
@click.option("--ep", type=INT_LIST, default=str(presets.LAYER_DEFAULTS["ep"]), show_default=True,
              help="Expert-parallel sizes, comma-separated (> 1: the layer across that many devices).")
@click.option("--tp", type=click.IntRange(min=1), default=None,
              help="Tensor-parallel size: the layer across an ep x tp mesh (sharded_moe_mlp), each expert's width "
                   "split tp ways (default 1).")
@click.option("--dtype", type=DTYPES, default=presets.LAYER_DEFAULTS["dtype"], show_default=True)
@click.option("--direction", type=click.Choice(presets.LAYER_DIRECTIONS), default=presets.LAYER_DEFAULTS["direction"],
              show_default=True, help="What the layer runs: fwd (serving) or all (training: gradients too).")
@click.option("--distribution", type=click.Choice(list(distributions.DISTRIBUTIONS)), default=None,
              help="The routing lookups assume (default: as the runtime does: $MOE_TUNE_DISTRIBUTION, else "
                   f"{distributions.DEFAULT}).")
@click.option("--backend", default=None, help="Ask about this backend's entries, for the ops that have it (default: "
              "each op's default on the device kind asked).")
@click.option("--device-kind", default=None, help="Ask about another device kind's tables (default: this one): a chip "
              "moe-tune knows or a device kind with tables.")
@click.option("--profile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also read the sweep times recorded here (the estimate); lookups read every profile dir.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@quant_flags
@handle_errors
def coverage(model, tokens, ep, tp, dtype, direction, distribution, backend, device_kind, profile_dir, fmt, **quant):
    """List every kernel call of one layer of MODEL and how lookup answers it (exact, interval, robust, nearest,
    default), with the entry's age and staleness, and what tuning the others would take. At --ep x --tp >= 2 the
    layer across that mesh (--tokens per device of the expert axis), its collectives listed after its kernels
    with their bytes."""
    from moe_tune.campaign.coverage import age_text
    from moe_tune.campaign.coverage import coverage as cover

    found = cover(model.split(","), tokens, ep, dtype=dtype, quant=quant_options(quant), direction=direction,
                  distribution=distribution, backend=backend, device_kind=device_kind, profile_dir=profile_dir,
                  tp=tp)
    if fmt == "json":
        click.echo(json.dumps(found.to_json(), indent=1))
        return
    for note in found.notes:
        click.echo(f"note: {note}", err=True)
    render.table(f"coverage on {found.device_kind}, {found.distribution} routing",
                 ("kernel call", "op", "lookup", "config", "age", "stale", "to tune", "why"),
                 [(c.call, c.op, c.source, c.config, age_text(c.age_days), c.stale or "-",
                   c.estimate or "-", c.reason) for c in (*found.calls, *found.collectives)])
    click.echo(found.total())
