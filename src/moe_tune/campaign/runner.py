"""A campaign from start to end: planned once for where it runs (`prepare`: on Ray, for the cluster's
accelerator; the share this process takes; what the target table already holds), checked before anything
runs (`preflight`; a dry run says what the run would refuse, `refusals`), then its passes in order (`run`):
the sweeps, once per distribution (here one after another, `run_here`, or one Ray task each,
`ray_runner.run_on_ray`), the ladder's boundaries, the robust choice; or compiling for a chip (`target`).
Each sweep writes its own entry and ends as one `SweepOutcome`; a sweep that fails is recorded and the next
one runs. One shape is a campaign of one sweep.

What the campaign shows goes through a `View` (the CLI's draws it; the default shows nothing). Ray is
imported only when a campaign runs on Ray: importing this module does not import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from moe_tune.campaign.request import Case, PlannedSweep, plan, represented, shard, split_done
from moe_tune.campaign.request import Campaign, SweepOutcome, error_text, local_device
from moe_tune.core.errors import TableError, UsageError
from moe_tune.profiles.table import table_path, writable_dir, write_dir
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.verdict import weaker_than
from moe_tune.profiles.table import read_table, table_entries
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.sweep import run_sweep

OnSweep = Callable[[int, PlannedSweep], Any]


@dataclasses.dataclass
class Planned:
    """A campaign's sweeps planned for where they run. planned: every sweep of the plan (duplicates removed,
    largest first); share: (index, count) of the `--shard` this process takes, or None; todo / done: this
    share's sweeps to run and those the target table already holds; platform, device_kind: what it is
    planned for (the accelerator's, probed through a Ray task on Ray); settings: how every sweep runs;
    accelerator: the Ray accelerator, or None (this process runs it); refused: key -> why the run would
    refuse that sweep (a dry run's `refusals`)."""

    planned: list[PlannedSweep]
    share: tuple[int, int] | None
    todo: list[PlannedSweep]
    done: list[PlannedSweep]
    cases: int  # kernel cases before duplicates were removed
    platform: str
    device_kind: str
    settings: SweepSettings
    accelerator: Any = None
    notes: list[str] = dataclasses.field(default_factory=list)
    # key -> why a sweep whose complete entry the table holds runs again (tuned with less than asked)
    again: dict[str, str] = dataclasses.field(default_factory=dict)
    skip_done: bool = True  # whether what the table holds is skipped (else every sweep runs, resuming its log)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)


def prepare(cases: Sequence[Case], settings: SweepSettings, *, backend: str | None = None,
            ray_address: str | None = None, share: tuple[int, int] | None = None, notes: Sequence[str] = (),
            skip_done: bool = True, dry_run: bool = False) -> Planned:
    """The one planning function: `--dry-run` prints what it returns, and the run runs its `todo`, in order.

    Connect to Ray (when `ray_address`, unless `dry_run`) and find its accelerator, then plan `cases` for it
    and take the share. `skip_done`: leave out the sweeps whose complete entry the target table holds
    (unless `settings.fresh`), except those tuned with less than `settings` ask (`weaker_entries`); without
    it (one shape) every sweep runs, resuming its log. A sweep standing for cases its key cannot tell apart
    (`plan.represented`) is swept as the case the table's entry was tuned for, else as its first."""
    accelerator, notes = None, list(notes)
    if ray_address is not None and dry_run:  # --dry-run never connects: planned for this machine, and said so
        notes.append("--dry-run does not connect to Ray: this plan is for this machine's device kind; on the "
                     "cluster it is made for the cluster's accelerators")
    if ray_address is not None and not dry_run:
        if ray_address != "local":  # a bounded wait, and a message naming the address as the user gave it
            from moe_tune.campaign.ray_address import wait_reachable

            wait_reachable(ray_address)
        try:
            from moe_tune.campaign import ray_runner
        except ImportError:
            raise UsageError("--ray needs Ray: pip install 'moe-tune[ray]'") from None
        ray_runner.connect(ray_address)
        accelerator = ray_runner.detect_accelerator(cpus_per_sweep=settings.workers)
        device = ray_runner.probe(accelerator)
        platform, device_kind = device["platform"], device["device_kind"]
    else:
        from moe_tune.core import devices

        platform, device_kind = devices.platform(), devices.device_kind()
    planned = plan(cases, platform=platform, distribution=settings.distribution, backend=backend)
    held = _held(planned, settings, device_kind)
    planned, stands = represented(planned, held)
    notes += stands
    mine = planned if share is None else shard(planned, *share)
    todo, done = split_done(mine, profile_dir=settings.profile_dir, device_kind=device_kind,
                            fresh=settings.fresh or not skip_done)
    again = weaker_entries(done, settings, held)
    run = {s.key for s in todo} | again.keys()
    todo = [s for s in mine if s.key in run]  # plan order: largest first
    done = [s for s in done if s.key not in again]
    return Planned(planned, share, todo, done, len(cases), platform, device_kind, settings, accelerator, notes,
                   again, skip_done)


def _held(sweeps: Sequence[PlannedSweep], settings: SweepSettings, device_kind: str) -> dict[str, dict]:
    """The target table's entries (JSON, by key) of the ops of `sweeps` (none of an unreadable table)."""
    directory = write_dir(settings.profile_dir)
    held: dict[str, dict] = {}
    for op in {s.op for s in sweeps}:
        held.update(table_entries(table_path(directory, device_kind, op)))
    return held


def weaker_entries(done: Sequence[PlannedSweep], settings: SweepSettings,
                   held: dict[str, dict]) -> dict[str, str]:
    """key -> why, for each sweep in `done` whose entry (in `held`) was tuned with less than `settings` ask
    (fewer candidates, fewer samples: `profiles.verdict.weaker_than`): a smoke test's entries do not count
    as done for a full campaign."""
    asked = dataclasses.asdict(settings)
    found = {}
    for s in done:
        try:
            why = weaker_than(Entry.from_json(held[s.key], s.key), asked)
        except (KeyError, ValueError):  # an entry the report and lookup skip: sweep it again
            why = "its entry cannot be read"
        if why is not None:
            found[s.key] = why
    return found


def preflight(planned: Planned) -> None:
    """What would fail the campaign late, ruled out before anything runs or is printed: MoeTuneError when the
    profile dir cannot be written or a table the sweeps write to cannot be read (one error, not one failed
    sweep each, after all its candidates ran); run here, UsageError for a sweep whose backend cannot run here
    or whose problem cannot fit in memory (`tuner.preflight`)."""
    directory = write_dir(planned.settings.profile_dir)
    writable_dir(directory)
    check_tables(planned)
    if planned.accelerator is None:
        from moe_tune.tuner import preflight as sweep_preflight

        for sweep in planned.todo:
            sweep_preflight(sweep.request(planned.settings))


def check_tables(planned: Planned) -> None:
    """TableError (naming the file) for a table the sweeps of `planned.todo` would write to that cannot be
    read or belongs to another op or device kind: the write at the end of each sweep would refuse it."""
    directory = write_dir(planned.settings.profile_dir)
    for op in dict.fromkeys(s.op for s in planned.todo):
        path = table_path(directory, planned.device_kind, op)
        if not (path.exists() or path.is_symlink()):
            continue
        table = read_table(path)
        for name, expected in (("op", op), ("device_kind", planned.device_kind)):
            if table.get(name, expected) != expected:
                raise TableError(f"{path}: table is for {name} {table[name]!r}, not {expected!r}")


def refusals(planned: Planned, *, here: bool) -> dict[str, str]:
    """key -> why the run would refuse that sweep, for a dry run: the checks of `preflight` that write
    nothing (its backend runs here, its problem fits in memory; `here`: the sweeps run in this process, not
    on a Ray cluster's devices)."""
    if not here:
        return {}
    from moe_tune.tuner.compiling import uses_workers
    from moe_tune.tuner.request import SweepPlan, check_fits

    found = {}
    workers = planned.settings.workers
    for sweep in planned.todo:
        try:
            resolved = SweepPlan(sweep.request(planned.settings))
            resolved.check_runs_here()
            check_fits(resolved.op, sweep.problem, workers if uses_workers(workers) else 1)
        except UsageError as e:
            found[sweep.key] = str(e)
    return found


def run_sweeps(planned: Planned, *, reporter: Any = None, on_sweep: OnSweep | None = None) -> list[SweepOutcome]:
    """Run the plan's `todo`: on Ray when it has an accelerator (`reporter`: a
    `ray_runner.CampaignReporter`), else here (`on_sweep`: see `run_here`)."""
    if planned.accelerator is None:
        return run_here(planned.todo, planned.settings, on_sweep=on_sweep)
    from moe_tune.campaign import ray_runner

    return ray_runner.run_on_ray(planned.todo, planned.settings, planned.accelerator, reporter=reporter)


def run_here(sweeps: Sequence[PlannedSweep], settings: SweepSettings, *,
             on_sweep: OnSweep | None = None) -> list[SweepOutcome]:
    """Run `sweeps` one after another in this process (`tuner.run_sweep`), in order. A KeyboardInterrupt
    stops the run (what finished is in the tables and sweep logs). `on_sweep(i, sweep)` is called before each
    sweep and may return its progress reporter."""
    device, outcomes = local_device(), []
    for i, sweep in enumerate(sweeps):
        reporter = on_sweep(i, sweep) if on_sweep is not None else None
        try:
            outcomes.append(SweepOutcome.of(sweep, run_sweep(sweep.request(settings), reporter), device))
        except Exception as e:  # noqa: BLE001 - a failing sweep ends itself, not the campaign
            outcomes.append(SweepOutcome(sweep, error=error_text(e), device=device))
    return outcomes


class View:
    """What a campaign shows while it runs (`commands.render.CampaignView` draws it); this one shows nothing."""

    def plan(self, planned: Planned, campaign: Campaign, *, listed: bool) -> None:
        """The plan, before its sweeps run; `listed` (a dry run): every sweep."""

    @contextlib.contextmanager
    def progress(self, planned: Planned, campaign: Campaign) -> Iterator[dict[str, Any]]:
        """The progress hooks of `run_sweeps` (`reporter`, `on_sweep`) while the plan's sweeps run."""
        yield {}

    def outcomes(self, outcomes: Sequence[SweepOutcome], planned: Planned, campaign: Campaign) -> None:
        """How the sweeps ended."""

    def line(self, text: str) -> None:
        """One line of what a pass does (the ladder's, the robust choice's, the compiles')."""


def run(campaign: Campaign, view: View | None = None) -> bool:
    """Run `campaign`'s passes in order; whether a sweep failed. Where it runs is checked once
    (`Campaign.placed`): a pass left out there is said where it would have run. A dry run prints each
    distribution's plan, with the sweeps the run would refuse (`refusals`) marked and said in one line."""
    view = view or View()
    left = campaign.placed()
    if campaign.passes.target is not None:
        from moe_tune.campaign import target

        for why in left.values():
            view.line(f"note: {why}")
        target.compile_pass(campaign, print_line=view.line)
        return False
    plans, failed = {}, False
    for distribution in campaign.passes.distributions:
        settings = dataclasses.replace(campaign.settings, distribution=distribution)
        plans[distribution], failed_here = _sweep_pass(campaign, settings, view, left)
        failed = failed or failed_here
    if campaign.passes.robust and not campaign.where.dry_run:  # the config robust across the distributions
        if "robust" in left:
            view.line(f"note: {left['robust']}")
        else:
            from moe_tune.campaign import robust

            robust.measure_campaigns(plans, print_line=view.line)
    return failed


def _sweep_pass(campaign: Campaign, settings: SweepSettings, view: View, left: dict[str, str]
                ) -> tuple[Planned, bool]:
    """Plan, check and run one distribution's sweeps, then its ladders; (the plan, whether a sweep failed)."""
    where = campaign.where
    # --dry-run shows the plan the same command runs: it changes nothing else (not the skip rule, not the order)
    planned = prepare(campaign.cases, settings, backend=campaign.backend, ray_address=where.ray_address,
                      share=where.share, notes=campaign.notes, skip_done=not campaign.one_shape,
                      dry_run=where.dry_run)
    if where.dry_run:
        check_tables(planned)
        planned.refused = refusals(planned, here=where.ray_address is None)
        view.plan(planned, campaign, listed=True)
        if planned.refused:
            first = next(iter(planned.refused.values()))
            count = f"{len(planned.refused)} of its {len(planned.todo)} sweeps" if len(planned.todo) > 1 else "it"
            view.line(f"warning: the run would refuse {count} before anything runs; the first: {first}")
        return planned, False
    preflight(planned)  # every sweep's backend, memory, tables and profile dir, before anything is printed
    if not campaign.one_shape:
        view.plan(planned, campaign, listed=False)
    if not (planned.todo or campaign.passes.ladder):
        return planned, False
    from moe_tune.tuner import compiling

    compiling.enable_cache()
    outcomes: list[SweepOutcome] = []
    if planned.todo:
        with view.progress(planned, campaign) as hooks:
            outcomes = run_sweeps(planned, **hooks)
        view.outcomes(outcomes, planned, campaign)
    if campaign.passes.ladder:  # the boundaries between the ladder's counts, from the entries just written
        if "ladder" in left:
            view.line(f"note: {left['ladder']}")
        else:
            from moe_tune.campaign import ladder

            ladder.measure_campaign(planned, print_line=view.line)
    return planned, any(o.error for o in outcomes)
