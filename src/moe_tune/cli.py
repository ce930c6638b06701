"""`moe-tune`: sweep, report, lookup, bench, ops, models, validate, merge. Thin: parses options (generated in
`cli_options` from the ops, strategies and dtypes), calls the tuner and profiles, renders (`cli_render`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from moe_tune import cli_render as render
from moe_tune import devices, distributions
from moe_tune import models as presets
from moe_tune.cli_options import (
    DTYPES, campaign_options, handle_errors, model_only, one, problems, quant_flags, quant_options, several,
    shape_options, shard_of,
)
from moe_tune.cli_options import directions as all_directions
from moe_tune.cli_render import ProgressReporter, console, out, progress
from moe_tune.kernels import get_op, op_names
from moe_tune.tuner.strategies import STRATEGIES


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moe-tune")
def cli() -> None:
    """Tune the ragged kernels of MoE layers (tile sizes, block shapes) and store the best configs."""


@cli.command()
@shape_options
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of inputs and group sizes.")
@click.option("--workers", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default=True,
              help="Parallel compile workers.")
@click.option("--samples", type=click.IntRange(min=1), default=None,
              help="Timing samples (profiler-trace rounds) per candidate (default: the tuner's); the "
                   "finalists get twice as many.")
@click.option("--race", type=click.FloatRange(min=0), default=None, metavar="FACTOR",
              help="After the first timing round, stop timing candidates more than FACTOR times slower than the "
                   "best so far (default: the tuner's, 1.5); 0 times every candidate fully.")
@click.option("--max-candidates", type=click.IntRange(min=1), default=None,
              help="Keep only the first N candidates of the search space (the default config is first).")
@click.option("--profile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write the table (default: $MOE_TUNE_PROFILE_DIR, else the user cache dir).")
@click.option("--keep-trace", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the profiler traces (xplane) here, to open with xprof.")
@click.option("--strategy", type=click.Choice(list(STRATEGIES)), default="grid", show_default=True,
              help="; ".join(f"{name}: {s.summary}" for name, s in STRATEGIES.items()) + ".")
@click.option("--budget", type=int, default=None, help="Try at most N candidates (the default config included).")
@click.option("--time-budget", type=float, default=None, metavar="SECONDS",
              help="Start no new candidates after this many seconds (finished ones are kept).")
@click.option("--fresh", is_flag=True, help="Delete this sweep's log and start over instead of resuming.")
@click.option("--model", default=None,
              help="Sweep every kernel and direction of one layer of this preset (see `moe-tune models`; several "
                   "comma-separated, or `all`) at --tokens, --ep and --dtype (defaults: " + ", ".join(
                       f"{k} {v}" for k, v in presets.LAYER_DEFAULTS.items()) + ").")
@campaign_options
@handle_errors
def sweep(op, backend, distribution, direction, seed, workers, samples, race, max_candidates, profile_dir, keep_trace,
          strategy, budget, time_budget, fresh, model, ray_address, shard, dry_run, **shape):
    """Sweep a kernel's configs for one shape (or a whole model's kernels) and store the fastest correct ones.

    Every finished candidate is appended to a sweep log beside the tables; running the same sweep again
    resumes it (finished candidates are not run again). Ctrl-C keeps what finished. Several models or ep
    sizes, several values of a shape flag (`--m 256,1024`: one sweep per shape), --ray, --shard and
    --dry-run run a campaign: its sweeps planned once (duplicates removed, those the table holds skipped
    unless --fresh, largest first)."""
    from moe_tune.tuner import SweepSpec, compile_cache, preflight, run_sweep

    distribution = distribution or distributions.DEFAULT
    options = dict(distribution=distribution, seed=seed, workers=workers, profile_dir=profile_dir,
                   max_candidates=max_candidates, keep_trace_dir=keep_trace, strategy=strategy, budget=budget,
                   time_budget_s=time_budget, fresh=fresh)
    if samples is not None:
        options["samples"] = samples
    if race is not None:
        options["race"] = race or None
    campaign = dict(ray_address=ray_address, share=shard_of(shard), dry_run=dry_run)
    if model is not None:
        return _sweep_model(model, backend, shape, options, campaign)
    is_campaign = any(campaign.values()) or several(shape)
    cases = problems(op, direction, shape, grid=is_campaign)
    if is_campaign:
        from moe_tune.campaign.plan import op_cases

        return _sweep_campaign(op_cases(op, cases), backend, options, campaign)
    specs = [SweepSpec(op, problem, backend=backend, **options) for problem in cases]
    for sweep_spec in specs:  # every sweep's shape, memory and profile dir, before anything is printed
        preflight(sweep_spec)
    compile_cache.enable()
    impl = get_op(op).backends.resolve(backend, devices.platform())
    for problem, sweep_spec in zip(cases, specs):
        console.print(f"Sweeping [bold]{get_op(op).describe(problem)}[/bold], backend [bold]{impl.name}[/bold], "
                      f"{distribution} groups (seed {seed}), strategy {strategy} on "
                      f"[bold]{devices.device_kind()}[/bold]", highlight=False)
        with progress(transient=False) as bars:
            result = run_sweep(sweep_spec, ProgressReporter(bars))
        render.sweep_summary(result)


def _sweep_model(model: str, backend, shape: dict, options: dict, campaign: dict) -> None:
    """`sweep --model`: every kernel case of one layer, then one summary table (several models or ep sizes,
    or a campaign flag: a campaign)."""
    from moe_tune.tuner import compile_cache
    from moe_tune.tuner.model_sweep import preflight, sweep_model

    ctx = click.get_current_context()
    explicit = [name for name in ("op", "direction") if ctx.get_parameter_source(name).name != "DEFAULT"]
    model_only(shape, explicit=explicit + (["backend"] if backend is not None else []))
    models, eps = model.split(","), shape.get("ep") or [presets.LAYER_DEFAULTS["ep"]]
    tokens, _, dtype = presets.layer_settings(shape.get("tokens"), None, shape.get("dtype"))
    quant = quant_options(shape)  # only the ragged_dot kernels are quantized
    if len(models) > 1 or len(eps) > 1 or models == ["all"] or any(campaign.values()):
        from moe_tune.campaign.plan import model_campaign_cases

        cases, notes = model_campaign_cases(models, tokens, eps, dtype=dtype, quant=quant)
        return _sweep_campaign(cases, None, options, campaign, notes)
    preset, ep = presets.get_preset(model), eps[0]
    preflight(preset, tokens, ep=ep, dtype=dtype, sweep_options=options, quant=quant)  # before anything is printed
    compile_cache.enable()
    with progress(transient=True) as bars:
        def heading(count, case, i, total):
            bars.console.print(f"[{i + 1}/{total}] {case.role}: [bold]{get_op(case.op).describe(case.problem)}"
                               f"[/bold] ({count} tokens per shard)", highlight=False)

        results = sweep_model(preset, tokens, ep=ep, dtype=dtype, sweep_options=options, on_case=heading,
                              reporter_for=lambda count, case: ProgressReporter(bars), quant=quant)
    render.model_sweep_summary(f"{model}: {len(results)} kernel sweeps on {devices.device_kind()} (ep={ep}, {dtype})",
                               results)
    if any(r.error for r in results):
        sys.exit(1)


def _sweep_campaign(cases, backend, options: dict, campaign: dict, notes=()) -> None:
    """A campaign (`moe_tune.campaign`): plan it, print the plan (--dry-run) or run it, then a summary."""
    from moe_tune.campaign import engine
    from moe_tune.tuner import compile_cache

    planned = engine.prepare(cases, options, backend=backend, ray_address=campaign["ray_address"],
                             share=campaign["share"], notes=notes)
    render.campaign_plan(planned, listed=campaign["dry_run"])
    if campaign["dry_run"] or not planned.todo:
        return
    compile_cache.enable()
    with progress(transient=True) as bars:
        outcomes = engine.execute(planned, options, reporter=render.CampaignProgress(bars, planned.todo),
                                  on_sweep=render.campaign_heading(bars, len(planned.todo)))
    render.campaign_summary(outcomes)
    if any(o.error for o in outcomes):
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
def report(op, direction, device, backend, dtype, sort, desc, fmt, plot, sweep_log, profile_dir, key, breakdown, via,
           runs, top, keep_trace):
    """Show the tuned tables (or one sweep's candidates, with --sweep LOG; or where one entry's time goes, with
    --breakdown)."""
    from moe_tune import report as reports
    from moe_tune.errors import UsageError

    if sweep_log is not None:
        header, frame, finals = reports.sweep_log_frame(sweep_log)
        if fmt == "table":
            out.print(f"sweep log {sweep_log}\n  key: {header.get('key')}\n  started: {header.get('started')}",
                      highlight=False)
            for final in finals:
                state = "interrupted" if final.get("interrupted") else "finished"
                verdict = f" ({final['verdict']})" if final.get("verdict") else ""
                out.print(f"  {state} {final.get('finished', '')}: winner {final.get('winner')}{verdict}",
                          highlight=False)
        title = f"{len(frame)} candidates (median_ms: sweep round, final_ms: final round)"
        return render.frame(frame, fmt, title=title,
                            empty="The log has no finished candidate yet.",
                            shown=list(reports.LOG_COLUMNS))
    frame = reports.select(reports.entries_frame(profile_dir, op), sort=sort, descending=desc, op=op,
                           direction=direction, device=device, backend=backend, dtype=dtype, key=key)
    if not breakdown and (via is not None or keep_trace is not None):
        raise UsageError("--via and --keep-trace apply to --breakdown")
    if breakdown:
        return _breakdown(reports.selected_entries(frame, profile_dir, op), fmt, via=via, runs=runs, top=top,
                          keep_trace=keep_trace)
    if plot is not None:
        from moe_tune.plots import plot_entries

        path = plot_entries(reports.selected_entries(frame, profile_dir, op), plot)
        console.print(f"plot written to {path}", highlight=False)
    render.frame(frame, fmt, title="Tuned configs",
                 empty="No tuned entries match: run `moe-tune sweep`, or loosen the filters.",
                 shown=reports.table_columns(frame))


def _breakdown(entries, fmt: str, *, via, runs: int, top: int, keep_trace) -> None:
    """`report --breakdown`: the first selected entry's winner and default, per op."""
    from moe_tune.breakdown import profile_entry
    from moe_tune.errors import UsageError
    from moe_tune.profiles.verdict import verdict_of

    if not entries:
        raise UsageError("nothing to break down: no tuned entry matches (run `moe-tune sweep`, or loosen the filters)")
    entry = entries[0]
    more = f" (the first of {len(entries)} selected; pick one with --key)" if len(entries) > 1 else ""
    # plain lines on stderr (unwrapped: the key is long; stdout stays the tables, or pure CSV / JSON)
    click.echo(f"breakdown of {entry.key}{more}\n  verdict: {verdict_of(entry).label}", err=True)
    render.breakdowns(profile_entry(entry, source=via, runs=runs, keep_trace=keep_trace), fmt, top=top)
    if keep_trace is not None:
        click.echo(f"traces kept in {keep_trace}: open them with `xprof --logdir {keep_trace}`", err=True)


@cli.command()
@shape_options
@click.option("--device-kind", default=None, help="Look up tables of another device kind (default: this one).")
@handle_errors
def lookup(op, backend, distribution, direction, device_kind, **shape):
    """Explain which config the runtime would use for a shape, and why."""
    spec = get_op(op)
    for problem in problems(op, direction, shape):
        result = spec.lookup(problem, backend=backend, distribution=distribution, device_kind=device_kind, strict=True)
        render.lookup_result(spec.describe(problem), result)


@cli.command()
def ops():
    """List ops, their backends and tunables."""
    rows = []
    for name in op_names():
        registry = get_op(name).backends
        for backend_name in registry.names():
            impl = registry.get(backend_name)
            defaults = [p for p in ("cpu", "gpu", "tpu") if registry.default_for(p).name == backend_name]
            rows.append((name, backend_name, ",".join(defaults) or "-", ", ".join(impl.tunables()) or "-",
                         impl.description))
    render.table(f"Ops and backends (platform: {devices.platform()})",
                 ("op", "backend", "default on", "tunables", "description"), rows)


@cli.command()
@click.argument("name", required=False)
@click.option("--tokens", type=click.IntRange(min=1), default=presets.LAYER_DEFAULTS["tokens"], show_default=True,
              help="Tokens per expert-parallel shard (with NAME: the kernel calls of one layer).")
@click.option("--ep", type=click.IntRange(min=1), default=presets.LAYER_DEFAULTS["ep"], show_default=True,
              help="Expert-parallel size.")
@click.option("--dtype", type=DTYPES, default=presets.LAYER_DEFAULTS["dtype"], show_default=True)
@quant_flags
@handle_errors
def models(name, tokens, ep, dtype, **quant):
    """List the model presets, or the tunable kernel calls of one layer of model NAME."""
    if name is None:
        fields = ("hidden", "expert_intermediate", "experts", "top_k", "shared_experts")
        return render.table("Model presets (routed-expert shapes)", ("model", *fields),
                            [(p.name, *(getattr(p, f) for f in fields)) for p in presets.presets().values()],
                            right=fields)
    cases = presets.kernel_problems(presets.get_preset(name), tokens, ep=ep, dtype=dtype, quant=quant_options(quant))
    render.table(f"{name}: one MoE layer, {tokens} tokens per shard, ep={ep}, {dtype}", ("op", "role", "problem"),
                 [(case.op, case.role, get_op(case.op).describe(case.problem)) for case in cases])


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@handle_errors
def validate(paths):
    """Check tables (files or dirs; default: every profile dir): schema, keys, configs. Exit 1 on any error."""
    from moe_tune.profiles import validate_paths

    result = validate_paths(list(paths) or None, get_op=get_op)
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
@shape_options
@click.option("--model", default=None, help="Bench every kernel of one layer of this preset instead of one op.")
@click.option("--samples", type=click.IntRange(min=1), default=7, show_default=True)
@handle_errors
def bench(op, backend, distribution, direction, model, samples, **shape):
    """Time the config the runtime would use against the default and the baselines, on this device.

    ragged_dot: vs jax.lax.ragged_dot and a dense matmul of the same FLOPs; dispatch / combine: vs the
    plain-JAX fallback and a copy of the same bytes."""
    from moe_tune import bench as benches

    if model is not None:
        cases = [(case.op, case.problem) for _, case in presets.layer_cases(
            presets.get_preset(model), shape.get("tokens"), ep=one(shape, "ep"), dtype=shape.get("dtype"),
            quant=quant_options(shape))]
    else:
        cases = [(op, problem) for problem in problems(op, direction, shape)]
    distribution = distribution or distributions.DEFAULT
    compared = [(get_op(case_op).describe(problem), benches.bench_case(
        case_op, problem, backend=backend, samples=samples, distribution=distribution)) for case_op, problem in cases]
    render.bench_table(f"bench on {devices.device_kind()}, {distribution} routing (median of {samples} trace samples)",
                       compared)


def main() -> None:
    cli(prog_name="moe-tune")


if __name__ == "__main__":
    main()
