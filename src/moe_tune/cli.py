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
        click.option("--tokens", type=click.IntRange(min=1), help="gather ops: tokens in the batch."),
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
@click.option("--samples", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timing samples (profiler-trace rounds) per candidate.")
@click.option("--max-candidates", type=click.IntRange(min=1), default=None,
              help="Keep only the first N candidates of the search space (the default config is first).")
@click.option("--profile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write the table (default: $MOE_TUNE_PROFILE_DIR, else the user cache dir).")
@click.option("--keep-trace", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the profiler traces (xplane) here, to open with xprof.")
@_handle_errors
def sweep(op, backend, distribution, direction, seed, workers, samples, max_candidates, profile_dir, keep_trace,
          **shape):
    """Sweep a kernel's configs for one shape and store the fastest correct one."""
    from moe_tune.tuner import SweepSpec, run_sweep

    spec, problems = _problems(op, direction, shape)
    impl = spec.backends.resolve(backend, devices.platform())
    for problem in problems:
        sweep_spec = SweepSpec(op, problem, backend=backend, distribution=distribution, seed=seed,
                               samples=samples, workers=workers, profile_dir=profile_dir,
                               max_candidates=max_candidates, keep_trace_dir=keep_trace)
        console.print(f"Sweeping [bold]{spec.describe(problem)}[/bold], backend [bold]{impl.name}[/bold], "
                      f"{distribution} groups (seed {seed}) on [bold]{devices.device_kind()}[/bold]", highlight=False)
        columns = [TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            result = run_sweep(sweep_spec, _Reporter(progress))
        _print_summary(result)


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
    method = entry["timing"]["method"]
    table.add_row("timed by", method + (f" ({entry['timing_fallback']})" if entry.get("timing_fallback") else ""))
    table.add_row("table", str(result.table_path))
    table.add_row("wall time", f"{result.wall_s:.1f} s")
    out.print(table)


@cli.command()
@click.option("--op", type=click.Choice(op_names()), default=None, help="Only this op.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "markdown"]), default="table",
              show_default=True)
@click.option("--profile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Only the tables under this dir (default: every profile dir, effective entries).")
@_handle_errors
def report(op, fmt, profile_dir):
    """Show the tuned tables."""
    from moe_tune.report import entries_frame

    frame = entries_frame(profile_dir, op)
    if fmt == "csv":
        click.echo(frame.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(frame.to_json(orient="records", indent=1))
    elif fmt == "markdown":
        click.echo(frame.to_markdown(index=False, floatfmt=".3f"))
    elif frame.empty:
        out.print("No tuned entries yet: run `moe-tune sweep`.")
    else:
        table = Table(title="Tuned configs", title_justify="left")
        shown = ["device_kind", "op", "direction", "backend", "shape", "dtype", "distribution", "config", "time_ms", "default_ms", "speedup", "tried", "failed", "wrong", "timing"]
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


def main() -> None:
    cli(prog_name="moe-tune")


if __name__ == "__main__":
    main()
