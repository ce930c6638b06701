"""`moe-tune`: sweep, report, lookup, ops. Thin: parses options, calls the tuner and profiles, renders."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moe_tune import devices, distributions
from moe_tune.errors import MoeTuneError, UsageError
from moe_tune.kernels import get_op, op_names
from moe_tune.kernels.ragged_dot.problem import SUPPORTED_DTYPES

console = Console(stderr=True)
# Wide when piped (CI logs, files) so that tables are not squeezed into 80 columns.
out = Console(width=None if sys.stdout.isatty() else 220)

STAGES = {"compile": "Compiling candidates", "check": "Checking vs reference", "time": "Timing (trace rounds)",
          "finalists": "Re-timing finalists"}


class _Reporter:
    """Draws the tuner's progress callbacks as rich progress bars."""

    def __init__(self, progress: Progress):
        self.progress, self.tasks = progress, {}

    def stage(self, name: str, total: int) -> None:
        self.tasks[name] = self.progress.add_task(STAGES.get(name, name), total=total)

    def advance(self, name: str, amount: int = 1) -> None:
        self.progress.advance(self.tasks[name], amount)


def _handle_errors(fn):
    """User mistakes become one line and exit 2; runtime failures one line and exit 1; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as e:  # plain click.echo: one unwrapped line, whatever the terminal width
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except MoeTuneError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


class _TokenList(click.ParamType):
    """`512` or `512,4096,16384` -> a list of positive ints."""

    name = "N[,N...]"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            counts = [int(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)
        if not counts or any(c < 1 for c in counts):
            self.fail(f"{value!r}: token counts must be positive integers", param, ctx)
        return counts


TOKEN_LIST = _TokenList()


def shape_options(fn):
    """--op and the problem's shape/dtype options, shared by `sweep` and `lookup`; each op takes some of them
    (`OpSpec.options`)."""
    options = [
        click.option("--op", type=click.Choice(op_names()), default="ragged_dot", show_default=True),
        click.option("--backend", default=None, help="Backend name (default: the platform's; see `moe-tune ops`)."),
        click.option("--m", type=click.IntRange(min=1), help="ragged_dot: rows of lhs (tokens x top_k on this shard)."),
        click.option("--k", type=click.IntRange(min=1), help="ragged_dot: contracting dim (hidden size for gate/up)."),
        click.option("--n", type=click.IntRange(min=1), help="ragged_dot: output dim (expert width for gate/up)."),
        click.option("--groups", "--g", "groups", type=click.IntRange(min=1), help="ragged_dot: experts on this shard."),
        click.option("--tokens", type=TOKEN_LIST,
                     help="gather ops: tokens in the batch; with --model, comma-separated counts per shard."),
        click.option("--hidden", type=click.IntRange(min=1), help="gather ops: hidden size (row width)."),
        click.option("--top-k", "top_k", type=click.IntRange(min=1), help="gather ops: experts per token."),
        click.option("--experts", type=click.IntRange(min=1), help="gather ops: routed experts (all shards)."),
        click.option("--ep", type=click.IntRange(min=1),
                     help="gather ops: expert-parallel size; the valid rows are about 1/ep of them."),
        click.option("--weighted/--unweighted", default=None, help="ragged_gather: with or without row weights."),
        click.option("--dtype", type=click.Choice(SUPPORTED_DTYPES), help="Input dtype."),
        click.option("--out-dtype", type=click.Choice(SUPPORTED_DTYPES), help="Output dtype (default: --dtype)."),
        click.option("--distribution", type=click.Choice(list(distributions.DISTRIBUTIONS)),
                     default=distributions.DEFAULT, show_default=True,
                     help="Distribution of rows (tokens) over groups (experts)."),
        click.option("--direction", type=click.Choice(["fwd", "dlhs", "drhs", "all"]), default="fwd",
                     show_default=True, help="Forward pass, a gradient (dlhs, drhs), or all three."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _problems(op_name: str, direction: str, shape: dict[str, Any]):
    """The op's spec and one problem per requested direction (`all`: every direction the op has)."""
    spec = get_op(op_name)
    directions = spec.directions if direction == "all" else (direction,)
    unknown = [d for d in directions if d not in spec.directions]
    if unknown:
        raise UsageError(f"op {op_name!r} has no direction {unknown[0]!r}; it has {', '.join(spec.directions)}")
    given = {k: v for k, v in shape.items() if v is not None}
    if isinstance(given.get("tokens"), list):
        if len(given["tokens"]) > 1:
            raise UsageError("several --tokens counts need --model; for one op give one count")
        given["tokens"] = given["tokens"][0]
    foreign = [k for k in given if k not in spec.options]
    if foreign:
        raise UsageError(f"{_flag(foreign[0])} does not apply to {op_name}; its shape options are "
                         f"{' '.join(_flag(o) for o in spec.options)}")
    options = spec.default_problem_options()
    options.update(given)
    return spec, [spec.problem(**options, direction=d) for d in directions]


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
@click.option("--strategy", type=click.Choice(["grid", "random", "coordinate"]), default="grid", show_default=True,
              help="grid: every candidate; random: a seeded sample (needs --budget or --time-budget); "
                   "coordinate: coordinate descent from the default config.")
@click.option("--budget", type=int, default=None, help="Try at most N candidates (the default config included).")
@click.option("--time-budget", type=float, default=None, metavar="SECONDS",
              help="Start no new candidates after this many seconds (finished ones are kept).")
@click.option("--fresh", is_flag=True, help="Delete this sweep's log and start over instead of resuming.")
@click.option("--model", default=None,
              help="Sweep every kernel and direction of one layer of this preset (see `moe-tune models`) at "
                   "--tokens (default 4096), --ep and --dtype (default bfloat16).")
@_handle_errors
def sweep(op, backend, distribution, direction, seed, workers, samples, race, max_candidates, profile_dir, keep_trace,
          strategy, budget, time_budget, fresh, model, **shape):
    """Sweep a kernel's configs for one shape (or a whole model's kernels) and store the fastest correct ones.

    Every finished candidate is appended to a sweep log beside the tables; running the same sweep again
    resumes it (finished candidates are not run again). Ctrl-C keeps what finished."""
    from moe_tune.tuner import SweepInterrupted, SweepSpec, compile_cache, run_sweep

    compile_cache.enable()
    options = dict(distribution=distribution, seed=seed, workers=workers, profile_dir=profile_dir,
                   max_candidates=max_candidates, keep_trace_dir=keep_trace, strategy=strategy, budget=budget,
                   time_budget_s=time_budget, fresh=fresh)
    if samples is not None:
        options["samples"] = samples
    if race is not None:
        options["race"] = race or None
    if model is not None:
        return _sweep_model(model, backend, direction, shape, options)
    spec, problems = _problems(op, direction, shape)
    impl = spec.backends.resolve(backend, devices.platform())
    for problem in problems:
        sweep_spec = SweepSpec(op, problem, backend=backend, **options)
        console.print(f"Sweeping [bold]{spec.describe(problem)}[/bold], backend [bold]{impl.name}[/bold], "
                      f"{distribution} groups (seed {seed}), strategy {strategy} on "
                      f"[bold]{devices.device_kind()}[/bold]", highlight=False)
        try:
            with Progress(*_PROGRESS_COLUMNS, console=console, transient=False) as progress:
                result = run_sweep(sweep_spec, _Reporter(progress))
        except SweepInterrupted as e:
            click.echo(f"interrupted: {e}", err=True)
            sys.exit(130)
        _print_summary(result)


_PROGRESS_COLUMNS = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def _sweep_model(model: str, backend, direction: str, shape: dict[str, Any], options: dict[str, Any]) -> None:
    """`sweep --model`: every kernel case of one layer, then one summary table."""
    from moe_tune import models
    from moe_tune.tuner import SweepInterrupted
    from moe_tune.tuner.model_sweep import model_cases, sweep_model

    ctx = click.get_current_context()
    explicit = [name for name in ("op", "direction") if ctx.get_parameter_source(name).name != "DEFAULT"]
    explicit += [name for name, value in shape.items() if value is not None and name not in ("tokens", "ep", "dtype")]
    if backend is not None:
        explicit.append("backend")
    if explicit:
        raise UsageError(f"--model sweeps every kernel of the model's layer; {_flag(explicit[0])} does not apply "
                         "(only --tokens, --ep and --dtype shape it)")
    preset = models.get_preset(model)
    tokens, ep, dtype = shape.get("tokens") or [4096], shape.get("ep") or 1, shape.get("dtype") or "bfloat16"
    model_cases(preset, tokens, ep=ep, dtype=dtype)  # every count and the ep are checked before anything runs
    with Progress(*_PROGRESS_COLUMNS, console=console, transient=True) as progress:
        def heading(count, case, i, total):
            progress.console.print(f"[{i + 1}/{total}] {case.role}: [bold]{get_op(case.op).describe(case.problem)}"
                                   f"[/bold] ({count} tokens per shard)", highlight=False)
        try:
            results = sweep_model(preset, tokens, ep=ep, dtype=dtype, sweep_options=options, on_case=heading,
                                  reporter_for=lambda count, case: _Reporter(progress))
        except SweepInterrupted as e:
            click.echo(f"interrupted: {e}", err=True)
            sys.exit(130)
    table = Table(title=f"{model}: {len(results)} kernel sweeps on {devices.device_kind()} (ep={ep}, {dtype})",
                  title_justify="left")
    for column in ("tokens", "op", "role", "direction", "winner", "time_ms", "speedup", "candidates"):
        table.add_column(column, justify="right" if column in ("tokens", "time_ms", "speedup") else "left")
    for r in results:
        fields = r.case.problem.key_fields()
        if r.error is not None:
            table.add_row(str(r.tokens), r.case.op, r.case.role, fields["direction"], f"failed: {r.error}", "-", "-",
                          "-")
            continue
        entry, counts = r.result.entry, r.result.entry["candidates"]
        table.add_row(str(r.tokens), r.case.op, r.case.role, fields["direction"], r.result.best.config.label(),
                      f"{entry['timing']['median_s'] * 1e3:.3f}", f"{entry.get('speedup_over_default') or 0:.2f}x",
                      f"{counts['tried']} tried, {counts['failed']} failed, {counts['wrong']} wrong")
    out.print(table)
    if any(r.error for r in results):
        sys.exit(1)


def _print_summary(result) -> None:
    entry, best, default = result.entry, result.best, result.default
    counts = entry["candidates"]
    table = Table(title=f"Sweep result: {entry['op']} {entry['fields'].get('direction', '')}", show_header=False,
                  title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("winner", f"{best.config.label()}  {best.timing.median_s * 1e3:.3f} ms "
                            f"(spread {best.timing.spread:.1%}, {best.timing.samples} samples)")
    if default.timing is not None:
        table.add_row("default", f"{default.config.label()}  {default.timing.median_s * 1e3:.3f} ms")
        kept = " (the best was within noise of the default, so the default is kept)" if entry.get(
            "within_noise_of_default") else ""
        table.add_row("speedup", f"{entry['speedup_over_default']:.2f}x over the default{kept}")
    else:
        table.add_row("default", f"{default.config.label()}  {default.status}: {default.reason}")
    table.add_row("candidates", f"{counts['tried']} tried, {counts['ok']} ok, {counts['failed']} failed, "
                                f"{counts['wrong']} wrong")
    for failure in entry["failures"][:5]:
        label = " ".join(f"{k}={v}" for k, v in failure["config"].items())
        table.add_row(f"  {failure['status']}", f"{label}: {failure.get('reason', '')}")
    search = entry["search"]
    limits = ", ".join(x for x in (f"budget {search['budget']}" if search["budget"] else "",
                                   f"time budget {search['time_budget_s']:g} s" if search["time_budget_s"] else "") if x)
    table.add_row("search", f"{search['strategy']}{f' ({limits})' if limits else ''}: {counts['tried']} of "
                            f"{search['space']} candidates, stopped: {search['stopped']}")
    recompiled = f", {search['recompiled_finalists']} finalist compiles" if search["recompiled_finalists"] else ""
    table.add_row("resumed", f"{search['resumed']} candidates from the sweep log{recompiled}")
    method = entry["timing"]["method"]
    table.add_row("timed by", method + (f" ({entry['timing_fallback']})" if entry.get("timing_fallback") else ""))
    table.add_row("table", str(result.table_path))
    table.add_row("sweep log", str(result.log_path))
    table.add_row("wall time", f"{result.wall_s:.1f} s")
    out.print(table)


@cli.command()
@click.option("--op", type=click.Choice(op_names()), default=None, help="Only this op.")
@click.option("--direction", type=click.Choice(["fwd", "dlhs", "drhs"]), default=None, help="Only this direction.")
@click.option("--device", default=None, help="Only this device kind (e.g. cpu, nvidia_h100_80gb_hbm3).")
@click.option("--backend", default=None, help="Only this backend.")
@click.option("--dtype", type=click.Choice(SUPPORTED_DTYPES), default=None, help="Only entries with this dtype.")
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
@_handle_errors
def report(op, direction, device, backend, dtype, sort, desc, fmt, plot, sweep_log, profile_dir):
    """Show the tuned tables (or one sweep's candidates, with --sweep LOG)."""
    from moe_tune import report as reports

    if sweep_log is not None:
        return _report_sweep_log(reports, sweep_log, fmt)
    frame = reports.select(reports.entries_frame(profile_dir, op), sort=sort, descending=desc, op=op,
                           direction=direction, device=device, backend=backend, dtype=dtype)
    if plot is not None:
        from moe_tune.plots import plot_entries

        entries = {entry.get("key"): entry for _, _, entry in reports.effective_entries(profile_dir, op)}
        path = plot_entries([entries[key] for key in frame["key"]], plot)
        console.print(f"plot written to {path}", highlight=False)
    _render(frame, fmt, title="Tuned configs", empty="No tuned entries match: run `moe-tune sweep`, or loosen the filters.",
            shown=["device_kind", "op", "direction", "backend", "shape", "dtype", "distribution", "config", "time_ms",
                   "default_ms", "speedup", "tried", "failed", "wrong", "timing"])


def _report_sweep_log(reports, path: Path, fmt: str) -> None:
    header, frame, finals = reports.sweep_log_frame(path)
    if fmt == "table":
        out.print(f"sweep log {path}\n  key: {header.get('key')}\n  started: {header.get('started')}", highlight=False)
        for final in finals:
            state = "interrupted" if final.get("interrupted") else "finished"
            out.print(f"  {state} {final.get('finished', '')}: winner {final.get('winner')}", highlight=False)
    _render(frame, fmt, title=f"{len(frame)} candidates", empty="The log has no finished candidate yet.",
            shown=list(reports.LOG_COLUMNS))


def _render(frame, fmt: str, *, title: str, empty: str, shown: list[str]) -> None:
    """A DataFrame as csv / json / markdown on stdout, or as a rich table of the `shown` columns."""
    if fmt == "csv":
        click.echo(frame.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(frame.to_json(orient="records", indent=1))
    elif fmt == "markdown":
        click.echo(frame.to_markdown(index=False, floatfmt=".3f"))
    elif frame.empty:
        out.print(empty)
    else:
        table = Table(title=title, title_justify="left")
        for column in shown:
            table.add_column(column, justify="right" if frame[column].dtype.kind in "if" else "left")
        for _, row in frame.iterrows():
            table.add_row(*(_cell(row[c]) for c in shown))
        out.print(table)


def _cell(value) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:.3f}"
    return str(value)


@cli.command()
@shape_options
@click.option("--device-kind", default=None, help="Look up tables of another device kind (default: this one).")
@_handle_errors
def lookup(op, backend, distribution, direction, device_kind, **shape):
    """Explain which config the runtime would use for a shape, and why."""
    from moe_tune.profiles import lookup as do_lookup

    spec, problems = _problems(op, direction, shape)
    for problem in problems:
        result = do_lookup(op, problem, backend=backend, distribution=distribution, device_kind=device_kind,
                           strict=True)
        out.print(f"{spec.describe(problem)} on {result.device_kind}, backend {result.backend}", highlight=False)
        out.print(f"  source: [bold]{result.source}[/bold] ({result.reason})", highlight=False)
        out.print(f"  config: {result.config.label()}", highlight=False)
        if result.entry is not None:
            timing = result.entry.get("timing", {})
            speedup = result.entry.get("speedup_over_default")
            out.print(f"  tuned time: {timing.get('median_s', float('nan')) * 1e3:.3f} ms"
                      + (f", {speedup:.2f}x over default" if speedup else ""), highlight=False)
        out.print(f"  key: {result.key}", highlight=False)


@cli.command()
def ops():
    """List ops, their backends and tunables."""
    table = Table(title=f"Ops and backends (platform: {devices.platform()})", title_justify="left")
    for column in ("op", "backend", "default on", "tunables", "description"):
        table.add_column(column)
    for name in op_names():
        spec = get_op(name)
        for backend_name in spec.backends.names():
            impl = spec.backends.get(backend_name)
            defaults = [p for p in ("cpu", "gpu", "tpu") if spec.backends.default_for(p).name == backend_name]
            table.add_row(name, backend_name, ",".join(defaults) or "-", ", ".join(impl.tunables()) or "-",
                          impl.description)
    out.print(table)


@cli.command()
@click.argument("name", required=False)
@click.option("--tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Tokens per expert-parallel shard (with NAME: the kernel calls of one layer).")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True, help="Expert-parallel size.")
@click.option("--dtype", type=click.Choice(SUPPORTED_DTYPES), default="bfloat16", show_default=True)
@_handle_errors
def models(name, tokens, ep, dtype):
    """List the model presets, or the tunable kernel calls of one layer of model NAME."""
    from moe_tune import models as presets

    if name is None:
        table = Table(title="Model presets (routed-expert shapes)", title_justify="left")
        for column in ("model", "hidden", "expert_intermediate", "experts", "top_k", "shared_experts"):
            table.add_column(column, justify="left" if column == "model" else "right")
        for preset in presets.presets().values():
            table.add_row(preset.name, *(str(getattr(preset, f)) for f in
                                         ("hidden", "expert_intermediate", "experts", "top_k", "shared_experts")))
        out.print(table)
        return
    preset = presets.get_preset(name)
    table = Table(title=f"{name}: one MoE layer, {tokens} tokens per shard, ep={ep}, {dtype}", title_justify="left")
    for column in ("op", "role", "problem"):
        table.add_column(column)
    for case in presets.kernel_problems(preset, tokens, ep=ep, dtype=dtype):
        table.add_row(case.op, case.role, get_op(case.op).describe(case.problem))
    out.print(table)


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@_handle_errors
def validate(paths):
    """Check tables (files or dirs; default: every profile dir): schema, keys, configs. Exit 1 on any error."""
    from moe_tune.profiles import validate_paths

    result = validate_paths(list(paths) or None)
    for line in result.lines():
        click.echo(line)
    if not result.ok:
        sys.exit(1)


@cli.command()
@click.argument("out_path", metavar="OUT", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("in_paths", metavar="IN...", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@_handle_errors
def merge(out_path, in_paths):
    """Merge tables of one op and device kind from several machines into OUT, keeping the faster entry."""
    from moe_tune.profiles import merge_tables

    for line in merge_tables(out_path, list(in_paths)).lines():
        click.echo(line)


@cli.command()
@shape_options
@click.option("--model", default=None, help="Bench every kernel of one layer of this preset instead of one op.")
@click.option("--samples", type=click.IntRange(min=1), default=7, show_default=True)
@_handle_errors
def bench(op, backend, distribution, direction, model, samples, **shape):
    """Time the config the runtime would use against the default and the baselines, on this device.

    ragged_dot: vs jax.lax.ragged_dot and a dense matmul of the same FLOPs; dispatch / combine: vs the
    plain-JAX fallback and a copy of the same bytes."""
    from moe_tune import bench as benches

    if model is not None:
        from moe_tune import models

        tokens, ep, dtype = shape.get("tokens") or [4096], shape.get("ep") or 1, shape.get("dtype") or "bfloat16"
        cases = [(c.op, c.problem) for t in tokens for c in models.kernel_problems(models.get_preset(model), t,
                                                                                 ep=ep, dtype=dtype)]
    else:
        spec, problems = _problems(op, direction, shape)
        cases = [(op, p) for p in problems]
    table = Table(title=f"bench on {devices.device_kind()} (median of {samples} trace samples)", title_justify="left")
    for column in ("kernel", "config (source)", "tuned ms", "default ms", "baseline ms", "vs baseline", "reference"):
        table.add_column(column, justify="left" if column in ("kernel", "config (source)", "reference") else "right")
    for case_op, problem in cases:
        r = benches.bench_case(case_op, problem, backend=backend, samples=samples)
        t = r["times_s"]
        if case_op == "ragged_dot":
            base = t["xla"]
            ref = (f"roofline {r['roofline_s'] * 1e3:.3f} ms, {r['roofline_bound']}-bound (tuned/roofline "
                   f"{r['ratios']['tuned_vs_roofline']:.2f}); dense {t['dense'] * 1e3:.3f} ms")
            vs = f"xla/tuned {r['ratios']['xla_vs_tuned']:.2f}"
        else:
            base = t["fallback"]
            ref = (f"copy roofline {r['roofline_s'] * 1e3:.3f} ms ({r['copy_gbps']:.1f} GB/s); output write "
                   f"{t['output_write'] * 1e3:.3f} ms")
            vs = f"fallback/tuned {r['ratios']['fallback_vs_tuned']:.2f}"
        table.add_row(get_op(case_op).describe(problem), f"{' '.join(f'{k}={v}' for k, v in r['tuned_config'].items())}"
                      f" ({r['lookup_source']})", f"{t['tuned'] * 1e3:.3f}", f"{t['default'] * 1e3:.3f}",
                      f"{base * 1e3:.3f}", vs, ref)
    out.print(table)


def main() -> None:
    cli(prog_name="moe-tune")


if __name__ == "__main__":
    main()
