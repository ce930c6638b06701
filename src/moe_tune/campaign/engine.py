"""A campaign from start to end: where it runs (a Ray cluster, or this process), its plan for that platform and
device kind, the share of it this process takes (`--shard`), what the target table already holds, the checks
made before anything runs, and the run (`runner.run`).

Ray is imported only when a campaign runs on Ray (`ray_address`): importing this module does not import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from moe_tune.campaign.plan import Case, PlannedSweep, plan, shard, split_done
from moe_tune.core.errors import UsageError
from moe_tune.profiles import dirs
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.verdict import weaker_than
from moe_tune.profiles.table import table_entries
from moe_tune.tuner.request import SweepSettings


@dataclasses.dataclass
class Campaign:
    """A campaign ready to run. planned: every sweep of the plan (duplicates removed, largest first); share:
    (index, count) of the `--shard` this process takes, or None; todo / done: this share's sweeps to run and
    those the target table already holds; platform, device_kind: what it is planned for (the accelerator's,
    probed through a Ray task on Ray); settings: how every sweep runs; accelerator: the Ray accelerator, or
    None (this process runs it)."""

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


def prepare(cases: Sequence[Case], settings: SweepSettings, *, backend: str | None = None,
            ray_address: str | None = None, share: tuple[int, int] | None = None, notes: Sequence[str] = (),
            skip_done: bool = True, dry_run: bool = False) -> Campaign:
    """The one planning function: `--dry-run` prints what it returns, and the run runs its `todo`, in order.

    Connect to Ray (when `ray_address`) and find its accelerator, then plan `cases` for it and take the
    share. `skip_done`: leave out the sweeps whose complete entry the target table holds (unless
    `settings.fresh`), except those tuned with less than `settings` ask (`weaker_entries`); without it (one
    shape) every sweep runs, resuming its log."""
    accelerator = None
    if ray_address is not None and dry_run:  # --dry-run never connects: planned for this machine, and said so
        notes = [*notes, "--dry-run does not connect to Ray: this plan is for this machine's device kind; on the "
                         "cluster it is made for the cluster's accelerators"]
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
    mine = planned if share is None else shard(planned, *share)
    todo, done = split_done(mine, profile_dir=settings.profile_dir, device_kind=device_kind,
                            fresh=settings.fresh or not skip_done)
    again = weaker_entries(done, settings, device_kind)
    run = {s.key for s in todo} | again.keys()
    todo = [s for s in mine if s.key in run]  # plan order: largest first
    done = [s for s in done if s.key not in again]
    return Campaign(planned, share, todo, done, len(cases), platform, device_kind, settings, accelerator,
                    list(notes), again, skip_done)


def weaker_entries(done: Sequence[PlannedSweep], settings: SweepSettings, device_kind: str) -> dict[str, str]:
    """key -> why, for each sweep in `done` whose entry was tuned with less than `settings` ask (fewer
    candidates, fewer samples: `profiles.verdict.weaker_than`): a smoke test's entries do not count as done
    for a full campaign."""
    asked = dataclasses.asdict(settings)
    tables = {op: table_entries(dirs.table_path(dirs.write_dir(settings.profile_dir), device_kind, op))
              for op in {s.op for s in done}}
    found = {}
    for s in done:
        try:
            why = weaker_than(Entry.from_json(tables[s.op][s.key], s.key), asked)
        except ValueError:  # an entry the report and lookup skip: sweep it again
            why = "its entry cannot be read"
        if why is not None:
            found[s.key] = why
    return found


def preflight(campaign: Campaign) -> None:
    """What would fail the campaign late, ruled out before anything runs or is printed: MoeTuneError when the
    profile dir cannot be written (one error, not one failed sweep each); run here, UsageError for a sweep
    whose backend cannot run here or whose problem cannot fit in memory (`tuner.preflight`)."""
    dirs.writable_dir(dirs.write_dir(campaign.settings.profile_dir))
    if campaign.accelerator is None:
        from moe_tune.tuner import preflight as sweep_preflight

        for sweep in campaign.todo:
            sweep_preflight(sweep.request(campaign.settings))
