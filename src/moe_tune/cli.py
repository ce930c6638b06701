"""`moe-tune`: sweep, report, lookup, bench, ops, models, validate, merge. Thin: parses options (generated in
`commands.options` from the ops, strategies and dtypes), calls the campaign runner, the tuner and profiles, renders
(`commands.render`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from moe_tune.commands import render as render
from moe_tune.core import devices, distributions
from moe_tune.core import settings as env
from moe_tune.layer import models as presets
from moe_tune.commands.options import (DTYPES, INT_LIST, bench_cases, handle_errors, problems, quant_flags,
                                       quant_options, shape_options, sweep_options)
from moe_tune.commands.options import directions as all_directions
from moe_tune.commands.render import console
from moe_tune.commands.coverage import coverage
from moe_tune.kernels import get_op, op_names
from moe_tune.targets.slice_plan import STRATEGIES as PLAN_WAYS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moe-tune")
def cli() -> None:
    """Tune the ragged kernels of MoE layers (tile sizes, block shapes) and store the best configs."""
    env.no_gpu_preallocation()  # before any command starts JAX's backend


@cli.command()
@shape_options(layer=True)
@sweep_options
def sweep(campaign):
    """Sweep a kernel's configs for one shape (or a whole model's kernels) and store the fastest correct ones.

    Every finished candidate is appended to a sweep log beside the tables; running the same sweep again
    resumes it (finished candidates are not run again). Ctrl-C keeps what finished. Several models or ep
    sizes, several values of a shape flag (`--m 256,1024`: one sweep per shape), a model's layer, --ray and
    --shard run a campaign: its sweeps planned once (duplicates removed, those the table holds with at least
    the budget asked skipped unless --fresh, largest first). --dry-run prints the plan the same command runs.
    --target CHIP compiles every candidate for a chip this machine does not have, with its real compiler, and
    stores which compile where the chip's tables live."""
    from moe_tune.campaign import runner

    if runner.run(campaign, render.CampaignView()):
        sys.exit(1)


@cli.command()
@click.option("--op", type=click.Choice(op_names()), default=None, help="Only this op.")
@click.option("--direction", type=click.Choice(all_directions()), default=None, help="Only this direction.")
@click.option("--device", default=None, help="Only this device kind (e.g. cpu, nvidia_h100_80gb_hbm3).")
@click.option("--backend", default=None, help="Only this backend.")
@click.option("--dtype", type=DTYPES, default=None, help="Only entries with this dtype.")
@click.option("--sort", "sort", default=None, help="Sort by a column (time_ms, speedup, shape, tuned_at, ...).")
@click.option("--desc", is_flag=True, help="Sort descending.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "markdown"]), default="table",
              show_default=True)
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also draw FILE.png: time per candidate config of the first selected entry, speedup per shape.")
@click.option("--sweep", "sweep_log", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Show every candidate of one sweep from its log (failed and wrong ones with their reasons).")
@click.option("--profile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Only the tables under this dir (default: every profile dir, effective entries).")
@click.option("--key", default=None, help="Only the entry with this key (the `key` column of --format csv/json).")
@click.option("--source", type=click.Choice(["mine", "user", "dir", "shipped"]), default=None,
              help="Only entries from: mine (every table but the shipped ones), the user cache dir, a profile dir "
                   "($MOE_TUNE_PROFILE_DIR or --profile-dir), the shipped tables.")
@click.option("--mine", is_flag=True, help="Only your own entries (= --source mine).")
@click.option("--columns", default=None, metavar="A,B,...", help="The table's columns (any of --format csv's).")
@click.option("--all", "all_columns", is_flag=True, help="Every column in the table, not the compact default.")
@click.option("--breakdown", is_flag=True,
              help="Re-run the first selected entry's winner and default under the profiler and show the time per "
                   "HLO op (GPU: and per kernel), largest first, with its share of the total.")
@click.option("--via", type=click.Choice(["trace", "xprof"]), default=None,
              help="Breakdown reader: the xplane's per-op events (CPU), or xprof's tools (trace_viewer on CPU, "
                   "hlo_stats on GPU/TPU, kernel_stats on GPU; needs the xprof extra). Default: trace on CPU, "
                   "else xprof.")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True,
              help="Breakdown: profiled runs per config (times are per run).")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="Breakdown table: the largest N ops, the rest summed in one row.")
@click.option("--keep-trace", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Breakdown: keep the traces here, to open with `xprof --logdir DIR`.")
@handle_errors
def report(op, direction, device, backend, dtype, sort, desc, fmt, plot, sweep_log, profile_dir, key, source, mine,
           columns, all_columns, breakdown, via, runs, top, keep_trace):
    """Show the tuned tables (or one sweep's candidates, with --sweep LOG; or where one entry's time goes, with
    --breakdown)."""
    from moe_tune.commands import report as reports
    from moe_tune.core.errors import UsageError

    if sweep_log is not None:
        return render.sweep_log(sweep_log, *reports.sweep_log_frame(sweep_log), fmt, shown=list(reports.LOG_COLUMNS))
    frame = reports.select(reports.entries_frame(profile_dir, op), sort=sort, descending=desc, op=op,
                           direction=direction, device=device, backend=backend, dtype=dtype, key=key,
                           source="mine" if mine else source)
    if not breakdown and (via is not None or keep_trace is not None):
        raise UsageError("--via and --keep-trace apply to --breakdown")
    if breakdown:
        return render.breakdown_report(reports.selected_entries(frame, profile_dir, op), fmt, via=via, runs=runs,
                                       top=top, keep_trace=keep_trace)
    if plot is not None:
        from moe_tune.commands.plots import plot_entries

        path = plot_entries(reports.selected_entries(frame, profile_dir, op), plot)
        console.print(f"plot written to {path}", highlight=False)
    render.frame(frame, fmt, title="Tuned configs",
                 empty="No tuned entries match: run `moe-tune sweep`, or loosen the filters.",
                 shown=reports.table_columns(frame, columns=columns and columns.split(","), everything=all_columns),
                 compact=not (columns or all_columns))


@cli.command()
@shape_options
@click.option("--device-kind", default=None, help="Look up tables of another device kind (default: this one).")
@handle_errors
def lookup(op, backend, distribution, direction, device_kind, **shape):
    """Explain which config the runtime would use for a shape, and why."""
    kernel_op = get_op(op)
    for problem in problems(op, direction, shape):
        result = kernel_op.lookup(problem, backend=backend, distribution=distribution, device_kind=device_kind,
                                  strict=True)
        render.lookup_result(kernel_op.describe(problem), result)


@cli.command()
def ops():
    """List ops, their backends and tunables."""
    render.ops_table()


@cli.command()
@click.argument("name", required=False)
@click.option("--tokens", type=INT_LIST, default=str(presets.LAYER_DEFAULTS["tokens"]), show_default=True,
              help="Tokens per device of the expert axis, comma-separated as for `sweep --model` (with NAME).")
@click.option("--ep", type=INT_LIST, default=str(presets.LAYER_DEFAULTS["ep"]), show_default=True,
              help="Expert-parallel sizes, comma-separated (> 1: the layer across that many devices).")
@click.option("--dtype", type=DTYPES, default=presets.LAYER_DEFAULTS["dtype"], show_default=True)
@click.option("--direction", type=click.Choice(presets.LAYER_DIRECTIONS), default=presets.LAYER_DEFAULTS["direction"],
              show_default=True, help="What the layer runs: fwd (serving) or all (training: gradients too).")
@quant_flags
@handle_errors
def models(name, tokens, ep, dtype, direction, **quant):
    """List the model presets, or the kernel calls one layer of model NAME runs (what `sweep --model` tunes)."""
    from moe_tune.campaign.request import model_campaign_cases

    if name is None:
        return render.presets_table(presets.presets().values())
    cases, notes = model_campaign_cases([name], tokens, ep, dtype=dtype, quant=quant_options(quant),
                                        direction=direction)
    render.layer_table(name, cases, notes, dtype=dtype, training=direction == "all")


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@handle_errors
def validate(paths):
    """Check tables (files or dirs; default: every profile dir): schema, keys, configs. Exit 1 on any error."""
    from moe_tune.profiles import validate_paths
    result = validate_paths(list(paths) or None, get_op=get_op, on_its_device=True)
    for line in result.lines():
        click.echo(line)
    if not result.ok:
        sys.exit(1)


@cli.command()
@click.argument("out_path", metavar="OUT", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("in_paths", metavar="IN...", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@handle_errors
def merge(out_path, in_paths):
    """Merge tables of one op and device kind from several machines into OUT, keeping the faster entry."""
    from moe_tune.profiles import merge_tables

    for line in merge_tables(out_path, list(in_paths)).lines():
        click.echo(line)


@cli.command()
@shape_options(layer=True)
@click.option("--model", default=None, help="Bench every kernel of one layer of this preset instead of one op.")
@click.option("--samples", type=click.IntRange(min=1), default=7, show_default=True)
@handle_errors
def bench(op, backend, distribution, direction, model, samples, **shape):
    """Time the config the runtime would use against the default and the baselines, on this device.

    ragged_dot: vs jax.lax.ragged_dot and a dense matmul of the same FLOPs; dispatch / combine: vs the
    plain-JAX fallback and a copy of the same bytes; each op's baselines are its own. --model: every kernel
    call the layer runs (training's unless --direction fwd; --op: that op's)."""
    from moe_tune.commands import bench as benches

    cases = bench_cases(op, direction, model, shape)  # --model: what the layer runs (--op, --direction as given)
    distribution = distribution or distributions.DEFAULT
    compared = [(get_op(case_op).describe(problem), benches.bench_case(
        case_op, problem, backend=backend, samples=samples, distribution=distribution)) for case_op, problem in cases]
    render.bench_table(f"bench on {devices.device_kind()}, {distribution} routing (median of {samples} trace samples)",
                       compared)


cli.add_command(coverage)  # `moe-tune coverage`: its options in coverage_cli.py, its logic in campaign/coverage.py


@cli.command()
@click.option("--model", required=True, help="A model preset (`moe-tune models`).")
@click.option("--tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Tokens per expert-axis shard.")
@click.option("--target", "slice_name", required=True, help="A slice: v5e:2x2, v5e:4x4, v5e:8x8, "
              "v6e:2x2, v6e:4x4, v5p:2x2x2, v5p:4x4x4, h100x4, h100x8, h200x8.")
@click.option("--strategy", "strategies", type=click.Choice(PLAN_WAYS),
              multiple=True, help="Only these ways (default: each the chip runs): the ep_strategy values (in_kernel "
              "on TPU only), and all_to_all over the fixed-capacity exchange.")
@click.option("--tensor", type=click.IntRange(min=1), default=None,
              help="Tensor-axis size (default: 1 where the experts split over every chip).")
@click.option("--capacity-factor", type=click.FloatRange(min=0, min_open=True), default=None)
@click.option("--backend", type=click.Choice(["xla", "sparsecore"]), default=None,
              help="xla: compile on the ops' XLA backends only; sparsecore: the gathers on the TPU's SparseCores "
              "(v5p, v6e), the other kernels the chip's.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@handle_errors
def plan(model, tokens, slice_name, strategies, tensor, capacity_factor, backend, fmt):
    """Plan the MoE layer across a slice this machine does not have: each ep_strategy compiled for the slice's
    chips with their real compiler; fits, memory and collectives per chip, a floor from the chips' published
    facts, the compiler's estimate, and a recommendation. Estimates, not times. Exit 1 when nothing fits."""
    from moe_tune.commands.slice_plan_view import show
    from moe_tune.targets.slice_plan import plan as plan_slice

    found = plan_slice(model, tokens, slice_name, strategies=strategies or None, tensor=tensor,
                       capacity_factor=capacity_factor, backend=backend)
    show(found, fmt)
    if not found.fits_any:
        sys.exit(1)


def main() -> None:
    cli(prog_name="moe-tune")


if __name__ == "__main__":
    main()
