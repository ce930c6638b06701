"""The one runner of sweeps: a campaign's `todo` run in this process, one sweep after another, or on Ray (one
task per sweep, `ray_runner`). Either way each sweep writes its own entry and ends as one `SweepOutcome`; a
sweep that fails is recorded and the next one runs. One shape is a campaign of one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from moe_tune.campaign.engine import Campaign
from moe_tune.campaign.outcome import SweepOutcome, error_text, local_device
from moe_tune.campaign.plan import PlannedSweep
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.sweep import run_sweep

OnSweep = Callable[[int, PlannedSweep], Any]


def run(campaign: Campaign, *, reporter: Any = None, on_sweep: OnSweep | None = None) -> list[SweepOutcome]:
    """Run the campaign's `todo`: on Ray when it has an accelerator (`reporter`: a
    `ray_runner.CampaignReporter`), else here (`on_sweep`: see `run_here`)."""
    if campaign.accelerator is None:
        return run_here(campaign.todo, campaign.settings, on_sweep=on_sweep)
    from moe_tune.campaign import ray_runner

    return ray_runner.run_on_ray(campaign.todo, campaign.settings, campaign.accelerator, reporter=reporter)


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
