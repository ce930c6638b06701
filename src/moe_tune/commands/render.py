"""How `moe-tune` shows things: rich progress bars for the tuner's progress callbacks, a campaign's plan and
progress, one sweep's detailed result, the one summary table of a campaign's sweeps (read from the typed table
`Entry`), bench comparisons and report frames."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moe_tune.kernels import get_op
from moe_tune.profiles.verdict import marks, verdict_words
from moe_tune.profiles.verdict import verdict_of

if TYPE_CHECKING:
    from pathlib import Path

    from moe_tune.commands.bench import Comparison
    from moe_tune.commands.breakdown import Breakdown
    from moe_tune.campaign.request import PlannedSweep
    from moe_tune.campaign.request import Campaign, SweepOutcome
    from moe_tune.campaign.runner import Planned
    from moe_tune.profiles import LookupResult
    from moe_tune.profiles.entry import Entry
    from moe_tune.tuner import SweepResult

console = Console(stderr=True)
# Wide when piped (CI logs, files) so that tables are not squeezed into 80 columns.
out = Console(width=None if sys.stdout.isatty() else 220)

STAGES = {"compile": "Compiling candidates", "check": "Checking vs reference", "time": "Timing (trace rounds)",
          "finalists": "Re-timing finalists"}


class ProgressReporter:
    """Draws the tuner's progress callbacks (`tuner.Reporter`) as rich progress bars."""

    def __init__(self, progress: Progress):
        self.progress, self.tasks = progress, {}

    def stage(self, name: str, total: int) -> None:
        """Start stage `name` with `total` steps; a stage started again starts its bar over."""
        if name in self.tasks:
            self.progress.reset(self.tasks[name], total=total)
        else:
            self.tasks[name] = self.progress.add_task(STAGES.get(name, name), total=total)

    def advance(self, name: str, amount: float = 1) -> None:
        self.progress.advance(self.tasks[name], amount)


class CampaignProgress:
    """A campaign on Ray (`campaign.ray_runner.CampaignReporter`): the overall count, one progress line per
    running sweep (its current stage, and where it runs), and one printed line per sweep as it ends."""

    def __init__(self, progress: Progress, sweeps: Sequence[PlannedSweep]):
        self.progress, self.labels = progress, {s.key: s.label for s in sweeps}
        self.overall = None
        self.lines: dict[str, Any] = {}

    def running(self, sweeps: dict[str, dict[str, Any]]) -> None:
        if self.overall is None:
            self.overall = self.progress.add_task("sweeps done", total=len(self.labels))
        for key in [k for k in self.lines if k not in sweeps]:
            self.progress.remove_task(self.lines.pop(key))
        for key, state in sweeps.items():
            stage = STAGES.get(state.get("stage"), "starting")
            text = f"{self.labels.get(key, key)} on {where(state.get('device'))}: {stage}"
            if key not in self.lines:
                self.lines[key] = self.progress.add_task(text, total=None)
            self.progress.update(self.lines[key], description=text, completed=state.get("completed", 0),
                                 total=state.get("total") or None)

    def finished(self, outcome: SweepOutcome) -> None:
        if self.overall is not None:
            self.progress.advance(self.overall)
        self.progress.console.print(outcome_line(outcome), highlight=False)


class CampaignView:
    """A campaign as the CLI shows it while it runs (a `campaign.runner.View`): its plan, its progress, how
    its sweeps ended, each pass's lines."""

    def plan(self, planned: Planned, campaign: Campaign, *, listed: bool) -> None:
        campaign_plan(planned, listed=listed)

    def progress(self, planned: Planned, campaign: Campaign):
        return sweep_progress(planned, detailed=campaign.one_shape)

    def outcomes(self, outcomes: Sequence[SweepOutcome], planned: Planned, campaign: Campaign) -> None:
        title = None if campaign.layer is None else (
            f"{campaign.layer[0]}: {len(planned.todo)} kernel sweeps on {planned.device_kind} {campaign.layer[1]}")
        sweep_outcomes(outcomes, title=title, detailed=campaign.one_shape)

    def line(self, text: str) -> None:  # unwrapped, on stderr: stdout stays the tables
        click.echo(text, err=True)


@contextmanager
def sweep_progress(campaign: Planned, *, detailed: bool) -> Iterator[dict[str, Any]]:
    """The progress display of a campaign's run, as the runner's hooks (`campaign.runner.run`): on Ray, a
    line per running sweep; here, a heading per sweep and its stages' bars (`detailed`: one shape, the
    heading says how it is swept and the bars stay)."""
    with progress(transient=not detailed) as bars:
        if campaign.accelerator is not None:
            yield {"reporter": CampaignProgress(bars, campaign.todo)}
            return
        total, s = len(campaign.todo), campaign.settings

        def heading(i: int, sweep: PlannedSweep) -> ProgressReporter:
            if detailed:
                bars.console.print(
                    f"Sweeping [bold]{get_op(sweep.op).describe(sweep.problem)}[/bold], backend [bold]{sweep.backend}"
                    f"[/bold], {s.distribution} groups (seed {s.seed}), strategy {s.strategy} on "
                    f"[bold]{campaign.device_kind}[/bold]", highlight=False)
            else:
                bars.console.print(f"[{i + 1}/{total}] [bold]{sweep.label}[/bold]", highlight=False)
            return ProgressReporter(bars)

        yield {"on_sweep": heading}


def where(device: dict[str, Any] | None) -> str:
    """`host GPU 3`: a campaign's device record, short (`-` when unknown)."""
    if not device:
        return "-"
    ids = " ".join(f"{name} {','.join(ids)}" for name, ids in (device.get("accelerator_ids") or {}).items())
    return f"{device['host']} {ids or device['device']}"


def outcome_line(outcome: SweepOutcome) -> str:
    if outcome.error is not None:
        return f"failed {outcome.sweep.label}: {outcome.error}"
    entry = outcome.entry
    return (f"done {outcome.sweep.label}: {' '.join(f'{k}={v}' for k, v in entry.config.items())} "
            f"{_ms(entry.median_s)} ms, {entry.speedup_over_default or 0:.2f}x, on {where(outcome.device)}")


def campaign_plan(campaign: Planned, *, listed: bool) -> None:
    """What a campaign will do: its size, its share, what the table already holds and what it sweeps again
    (tuned with less than asked); `listed` (--dry-run): every sweep in the order it runs, with its shape,
    candidate count and estimated time (`campaign.estimate`), and those the run would refuse, then those it
    skips."""
    from moe_tune.campaign import estimate

    c = campaign
    share = f"; share {c.share[0]}/{c.share[1]}: {len(c.todo) + len(c.done)} sweeps" if c.share else ""
    held = (f"{len(c.done)} already in the table, " if c.skip_done else
            "every sweep runs (resuming its log), ")
    again = f" ({len(c.again)} swept again: tuned with less than asked)" if c.again else ""
    history = estimate.recorded(c.device_kind, {s.op for s in c.planned}, c.settings.profile_dir)
    costs = {s.key: estimate.estimate(s, c.settings, history) for s in c.todo}
    known = [cost.seconds for cost in costs.values() if cost.seconds is not None]
    total = f", about {estimate.duration(sum(known))}" + (" for those with a recorded sweep of their kind" if len(
        known) < len(costs) else "") if known else ""
    refused = f"; the run would refuse {len(c.refused)}" if c.refused else ""
    out.print(f"Campaign on {c.device_kind} ({c.platform}): {c.cases} kernel cases, {len(c.planned)} sweeps after "
              f"removing duplicates{share}; {held}{len(c.todo)} to run{again}{total}{refused}", highlight=False)
    for note in c.notes:
        out.print(f"  note: {note}", highlight=False)
    for s in c.todo:
        if s.key in c.again:
            out.print(f"  again: {s.label}: {c.again[s.key]}", highlight=False)
    if listed:
        shapes = {s.key: get_op(s.op).describe(s.problem) for s in c.todo + c.done}
        named = any(shapes[s.key] != s.label for s in c.todo + c.done)  # a model's cases: name and shape

        def row(number: Any, s: PlannedSweep, cost: str, state: str) -> tuple:
            return (number, s.label, *([shapes[s.key]] if named else []), s.backend, cost, state)

        def state(s: PlannedSweep) -> str:
            if s.key in c.refused:  # the reason without the sweep's own shape, which the row shows
                return f"refused: {c.refused[s.key].removeprefix(shapes[s.key] + ' ')}"
            return f"again: {c.again[s.key]}" if s.key in c.again else "to run"

        rows = [row(i + 1, s, costs[s.key].text, state(s)) for i, s in enumerate(c.todo)]
        rows += [row("-", s, "-", "done (--fresh sweeps it again)") for s in c.done]
        table("Plan, in the order it runs (largest first)",
              ("#", "sweep", *(["shape"] if named else []), "backend", "cost", "state"), rows, right=("#",))


def sweep_outcomes(outcomes: Sequence[SweepOutcome], *, title: str | None, detailed: bool) -> None:
    """How a campaign's sweeps ended: `detailed` (one shape), each sweep's own summary (`sweep_summary`) or
    its error; else one table, one row per sweep, titled `title` (one model's layer) or by the count."""
    if detailed:
        for o in outcomes:
            if o.result is not None:
                sweep_summary(o.result)
            else:
                click.echo(f"error: {o.error}", err=True)
        return
    failed = sum(o.error is not None for o in outcomes)
    heading = f"{title or f'{len(outcomes)} sweeps'}, {failed} failed"
    rows = []
    for o in outcomes:
        direction = o.sweep.problem.key_fields().get("direction", "-")
        if o.error is not None:
            rows.append((o.sweep.label, o.sweep.op, direction, f"failed: {o.error}", "-", "-", "-", "-",
                         where(o.device), "-"))
            continue
        rows.append((o.sweep.label, o.sweep.op, direction, " ".join(f"{k}={v}" for k, v in o.entry.config.items()),
                     _ms(o.entry.median_s), f"{o.entry.speedup_over_default or 0:.2f}x", verdict_words(o.entry),
                     _counts(o.entry), where(o.device), f"{o.attempts} start(s), {o.resumed} resumed"))
    table(heading, ("sweep", "op", "direction", "winner", "time_ms", "speedup", "verdict", "candidates", "where",
                    "runs"), rows, right=("time_ms", "speedup"))


@contextmanager
def progress(*, transient: bool) -> Iterator[Progress]:
    columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=transient) as bars:
        yield bars


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[str] = (),
          compact: bool = False, wrap: Sequence[str] = (), console: Console | None = None) -> None:
    """A rich table on stdout (or `console`); `right`: the columns to right-align (numbers). The first column
    names the row and is kept on one line; the others wrap when the table is too wide. `compact`: no
    vertical rules, and one line per row wherever it fits: printed to a pipe or a file, the table is as wide
    as its rows; on a terminal too narrow for them, only the `wrap` columns wrap (at spaces, or folded). A
    cell is never cut short."""
    shown = Table(title=title, title_justify="left",
                  **(dict(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True) if compact else {}))
    for i, column in enumerate(columns):
        wraps = column in wrap if compact else i != 0
        shown.add_column(column, justify="right" if column in right else "left", no_wrap=not wraps,
                         overflow="fold" if wraps else "ellipsis")
    for row in rows:
        shown.add_row(*(str(cell) for cell in row))
    target = console or out
    width = None
    if compact and not target.is_terminal:  # a file or a pipe: every row on one line, whatever its width
        width = max(target.width, Measurement.get(target, target.options, shown).maximum)
    target.print(shown, width=width)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def sweep_summary(result: SweepResult) -> None:
    """One sweep's result (`tuner.SweepResult`): winner, default, speedup, candidates, search, where it went."""
    entry, best, default = result.entry, result.best, result.default
    shown = Table(title=f"Sweep result: {entry.op} {entry.direction or ''}", show_header=False,
                  title_justify="left")
    shown.add_column(style="bold")
    shown.add_column()
    shown.add_row("winner", f"{best.config.label()}  {_ms(best.timing.median_s)} ms "
                            f"(spread {best.timing.spread:.1%}, {best.timing.samples} samples)")
    if default.timing is not None:
        shown.add_row("default", f"{default.config.label()}  {_ms(default.timing.median_s)} ms")
        shown.add_row("speedup", f"{entry.speedup_over_default:.2f}x over the default")
    else:
        shown.add_row("default", f"{default.config.label()}  {default.status}: {default.reason}")
    flags = marks(entry)
    shown.add_row("verdict", verdict_of(entry).text + (f" ({', '.join(flags)})" if flags else ""))
    shown.add_row("candidates", _counts(entry, "ok"))
    for failure in entry.failures[:5]:
        label = " ".join(f"{k}={v}" for k, v in failure["config"].items())
        shown.add_row(f"  {failure['status']}", f"{label}: {failure.get('reason', '')}")
    search = entry.search
    limits = ", ".join(x for x in (f"budget {search['budget']}" if search["budget"] else "",
                                   f"time budget {search['time_budget_s']:g} s" if search["time_budget_s"] else "") if x)
    shown.add_row("search", f"{search['strategy']}{f' ({limits})' if limits else ''}: {entry.count('tried')} of "
                            f"{search['space']} candidates, stopped: {search['stopped']}")
    if search.get("start"):  # older entries do not say
        shown.add_row("start", search["start"])
    recompiled = f", {search['recompiled_finalists']} finalist compiles" if search["recompiled_finalists"] else ""
    shown.add_row("resumed", f"{search['resumed']} candidates from the sweep log{recompiled}")
    shown.add_row("timed by", entry.timing_method + (f" ({entry.timing_fallback})" if entry.timing_fallback else ""))
    shown.add_row("table", str(result.table_path))
    shown.add_row("sweep log", str(result.log_path))
    shown.add_row("wall time", f"{result.wall_s:.1f} s")
    out.print(shown)


def _counts(entry: Entry, *names: str) -> str:
    """`3 tried, 1 ok, 1 failed, 1 wrong` (with `names` among the counts after `tried`)."""
    parts = ["tried", *names, "failed", "wrong"]
    return ", ".join(f"{entry.count(name)} {name}" for name in parts)


def bench_table(title: str, cases: Sequence[tuple[str, Comparison]]) -> None:
    """`moe-tune bench`: (kernel description, `bench.Comparison`) pairs, one row each."""
    rows = []
    for kernel, c in cases:
        config = " ".join(f"{k}={v}" for k, v in c.tuned_config.items())
        rows.append((kernel, f"{config} ({c.lookup_source})", _ms(c.times_s["tuned"]), _ms(c.times_s["default"]),
                     _ms(c.times_s[c.baseline]), c.vs_baseline(), c.reference()))
    table(title, ("kernel", "config (source)", "tuned ms", "default ms", "baseline ms", "vs baseline", "reference"),
          rows, right=("tuned ms", "default ms", "baseline ms", "vs baseline"))
    for kernel, c in cases:  # what to make of it, and the next step (unwrapped: one line each)
        for note in c.notes():
            click.echo(f"note: {kernel}: {note}")


def lookup_result(description: str, result: LookupResult) -> None:
    """Which config the runtime would use (`profiles.LookupResult`), and why."""
    out.print(f"{description} on {result.device_kind}, backend {result.backend}", highlight=False)
    out.print(f"  source: [bold]{result.source}[/bold] ({result.reason})", highlight=False)
    out.print(f"  config: {result.config.label()}", highlight=False)
    if result.interval is not None:
        field, lo, hi = result.interval
        out.print(f"  interval: {field} in [{lo}, {hi}) (the times below are of the tuned count it was won at)",
                  highlight=False)
    if result.entry is not None:
        median, speedup = result.entry.median_s, result.entry.speedup_over_default
        out.print(f"  tuned time: {(median if median is not None else float('nan')) * 1e3:.3f} ms"
                  + (f", {speedup:.2f}x over default" if speedup else ""), highlight=False)
        flags = marks(result.entry)
        out.print(f"  verdict: {verdict_of(result.entry).label}" + (f" ({', '.join(flags)})" if flags else ""),
                  highlight=False, markup=False)
    out.print(f"  key: {result.key}", highlight=False)


def sweep_log(path: Path, header: dict[str, Any], data, finals: Sequence[dict[str, Any]], fmt: str, *,
              shown: list[str]) -> None:
    """`report --sweep LOG`: the log's key and runs (as a table), then every candidate (`report.sweep_log_frame`)."""
    if fmt == "table":
        out.print(f"sweep log {path}\n  key: {header.get('key')}\n  started: {header.get('started')}", highlight=False)
        for final in finals:
            state = "interrupted" if final.get("interrupted") else "finished"
            verdict = f" ({final['verdict']})" if final.get("verdict") else ""
            out.print(f"  {state} {final.get('finished', '')}: winner {final.get('winner')}{verdict}", highlight=False)
    frame(data, fmt, title=f"{len(data)} candidates (median_ms: sweep round, final_ms: final round)",
          empty="The log has no finished candidate yet.", shown=shown)


def frame(data, fmt: str, *, title: str, empty: str, shown: list[str], compact: bool = False,
          console: Console | None = None) -> None:
    """A DataFrame as csv / json / markdown on stdout, or as a rich table of the `shown` columns (`compact`:
    see `table`)."""
    if fmt == "csv":
        click.echo(data.to_csv(index=False), nl=False)
    elif fmt == "json":
        click.echo(data.to_json(orient="records", indent=1))
    elif fmt == "markdown":
        click.echo(data.to_markdown(index=False, floatfmt=".3f"))
    elif data.empty:
        out.print(empty)
    else:
        from moe_tune.commands.report import HEADERS, WRAP_COLUMNS

        table(title, [HEADERS.get(c, c) for c in shown], [[_cell(row[c]) for c in shown] for _, row in data.iterrows()],
              right=[HEADERS.get(c, c) for c in shown if data[c].dtype.kind in "if"], compact=compact,
              wrap=[HEADERS.get(c, c) for c in shown if c in WRAP_COLUMNS], console=console)


def breakdown_report(entries: Sequence[Entry], fmt: str, *, via, runs: int, top: int, keep_trace) -> None:
    """`report --breakdown`: the first selected entry's winner and default, per op."""
    from moe_tune.commands.breakdown import profile_entry
    from moe_tune.core.errors import UsageError
    from moe_tune.profiles.verdict import verdict_of
    from moe_tune.commands.report import breakdown_check

    if not entries:
        raise UsageError("nothing to break down: no tuned entry matches (run `moe-tune sweep`, or loosen the filters)")
    entry = entries[0]
    more = f" (the first of {len(entries)} selected; pick one with --key)" if len(entries) > 1 else ""
    # plain lines on stderr (unwrapped: the key is long; stdout stays the tables, or pure CSV / JSON)
    click.echo(f"breakdown of {entry.key}{more}\n  verdict: {verdict_of(entry).label}", err=True)
    found = profile_entry(entry, source=via, runs=runs, keep_trace=keep_trace)
    breakdowns(found, fmt, top=top)
    for line in breakdown_check(entry, found):  # the winner/default ratio, and whether it contradicts the verdict
        click.echo(line, err=True)
    if keep_trace is not None:
        click.echo(f"traces kept in {keep_trace}: open them with `xprof --logdir {keep_trace}`", err=True)


def ops_table() -> None:
    """`moe-tune ops`: every op's backends, the platforms each is the default on, their tunables."""
    from moe_tune.core import devices
    from moe_tune.kernels import op_names

    rows = []
    for name in op_names():
        registry = get_op(name).backends
        for backend_name in registry.names():
            impl = registry.get(backend_name)
            defaults = [p for p in ("cpu", "gpu", "tpu") if registry.default_for(p).name == backend_name]
            rows.append((name, backend_name, ",".join(defaults) or "-", ", ".join(impl.tunables()) or "-",
                         impl.description))
    table(f"Ops and backends (platform: {devices.platform()})",
          ("op", "backend", "default on", "tunables", "description"), rows)


def presets_table(presets: Sequence[Any]) -> None:
    """`moe-tune models`: the model presets' routed-expert shapes."""
    fields = ("hidden", "expert_intermediate", "experts", "top_k", "shared_experts")
    table("Model presets (routed-expert shapes)", ("model", *fields),
          [(p.name, *(getattr(p, f) for f in fields)) for p in presets], right=fields)


def layer_table(name: str, cases: Sequence[Any], notes: Sequence[str], *, dtype: str, training: bool) -> None:
    """`moe-tune models NAME`: the kernel calls (`campaign.request.Case`) one layer of NAME runs, after its notes."""
    for note in notes:
        click.echo(f"note: {note}", err=True)
    what = "training: forward and backward" if training else "serving: forward"
    table(f"{name}: the kernel calls one device of a MoE layer runs ({what}), {dtype}",
          ("kernel call", "op", "problem"),
          [(case.label, case.op, get_op(case.op).describe(case.problem)) for case in cases])


UNTRACED_NOTE = 0.2  # a breakdown whose op events miss this share of its wall time or more says so


def breakdowns(found: Sequence[Breakdown], fmt: str, *, top: int) -> None:
    """`report --breakdown`: a table per config of its largest `top` ops, or every op of every config as one
    csv / json / markdown frame."""
    from moe_tune.commands.report import breakdown_frame

    if fmt != "table":
        return frame(breakdown_frame(found), fmt, title="", empty="", shown=[])
    for b in found:
        ops = breakdown_frame([b], top)
        groups = ["group"] if any(o.group for o in b.ops) else []
        untraced = (f"; {b.untraced_share:.0%} of its {_ms(b.wall_s)} ms of wall time is in no op's event (XLA "
                    f"CPU's own threads: its dots among them)" if b.untraced_share >= UNTRACED_NOTE else "")
        frame(ops, fmt, title=f"{b.label}: {ops['config'][0]}, {_ms(b.total_s)} ms of op time per run ({b.source}, "
                              f"{b.runs} runs){untraced}",
              empty="no ops", shown=["rank", "op", *groups, "ms_per_run", "share", "cumulative", "calls_per_run"])


def _cell(value) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:.3f}"
    return str(value)
