"""A campaign from start to end: where it runs (a Ray cluster, or this process), its plan for that platform and
device kind, the share of it this process takes (`--shard`), what the target table already holds, and the run.

Ray is imported only when a campaign runs on Ray (`ray_address`): importing this module does not import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from moe_tune.campaign.outcome import SweepOutcome, run_here
from moe_tune.campaign.plan import Case, PlannedSweep, plan, shard, split_done
from moe_tune.errors import UsageError


@dataclasses.dataclass
class Campaign:
    """A campaign ready to run. planned: every sweep of the plan (duplicates removed, largest first); share:
    (index, count) of the `--shard` this process takes, or None; todo / done: this share's sweeps to run and
    those the target table already holds; platform, device_kind: what it is planned for (the accelerator's,
    probed through a Ray task on Ray); accelerator: the Ray accelerator, or None (this process runs it)."""

    planned: list[PlannedSweep]
    share: tuple[int, int] | None
    todo: list[PlannedSweep]
    done: list[PlannedSweep]
    cases: int  # kernel cases before duplicates were removed
    platform: str
    device_kind: str
    accelerator: Any = None
    notes: list[str] = dataclasses.field(default_factory=list)


def prepare(cases: Sequence[Case], options: dict[str, Any], *, backend: str | None = None,
            ray_address: str | None = None, share: tuple[int, int] | None = None,
            notes: Sequence[str] = ()) -> Campaign:
    """Connect to Ray (when `ray_address`) and find its accelerator, then plan `cases` for it and take the
    share. `options`: the sweeps' `SweepSpec` options (distribution, profile_dir and fresh are read here)."""
    accelerator = None
    if ray_address is not None:
        try:
            from moe_tune.campaign import ray_runner
        except ImportError:
            raise UsageError("--ray needs Ray: pip install 'moe-tune[ray]'") from None
        ray_runner.connect(ray_address)
        accelerator = ray_runner.detect_accelerator(cpus_per_sweep=options.get("workers") or 1)
        device = ray_runner.probe(accelerator)
        platform, device_kind = device["platform"], device["device_kind"]
    else:
        from moe_tune import devices

        platform, device_kind = devices.platform(), devices.device_kind()
    planned = plan(cases, platform=platform, distribution=options["distribution"], backend=backend)
    mine = planned if share is None else shard(planned, *share)
    todo, done = split_done(mine, profile_dir=options.get("profile_dir"), device_kind=device_kind,
                            fresh=bool(options.get("fresh")))
    return Campaign(planned, share, todo, done, len(cases), platform, device_kind, accelerator, list(notes))


def execute(campaign: Campaign, options: dict[str, Any], *, reporter: Any = None,
            on_sweep: Callable[[int, PlannedSweep], Any] | None = None) -> list[SweepOutcome]:
    """Run the campaign's `todo`: on Ray (`reporter`: a `ray_runner.CampaignReporter`), or here one after
    another (`on_sweep`: see `run_here`). MoeTuneError first when the profile dir cannot be written (one error,
    not one failed sweep each)."""
    from moe_tune.profiles import dirs
    from moe_tune.tuner.record import writable_dir

    writable_dir(dirs.write_dir(options.get("profile_dir")))
    if campaign.accelerator is None:
        return run_here(campaign.todo, options, on_sweep=on_sweep)
    from moe_tune.campaign import ray_runner

    return ray_runner.run_on_ray(campaign.todo, options, campaign.accelerator, reporter=reporter)
