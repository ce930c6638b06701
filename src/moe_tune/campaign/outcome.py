"""How one sweep of a campaign ended, whichever engine ran it; and `run_here`, the engine-less runner (this
process, one sweep after another: `--shard` shares and plain multi-model sweeps)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moe_tune.campaign.plan import PlannedSweep
from moe_tune.errors import MoeTuneError
from moe_tune.profiles.entry import Entry


@dataclasses.dataclass
class SweepOutcome:
    """One planned sweep's end: its entry (as written to `table`), or the error that ended it.

    device: where it ran (`host`, `device` as JAX names it, `device_kind`, `platform`, and on Ray the
    `accelerator_ids` Ray assigned); attempts: how many times it was started (a retry after a dead process
    counts); resumed: candidates restored from its sweep log instead of run again."""

    sweep: PlannedSweep
    entry: Entry | None = None
    table: Path | None = None
    error: str | None = None
    device: dict[str, Any] | None = None
    attempts: int = 1
    resumed: int = 0
    wall_s: float = 0.0


def local_device() -> dict[str, Any]:
    """This process's device record (the first JAX device: the one a sweep here tunes)."""
    import jax

    from moe_tune import devices

    return {"host": socket.gethostname(), "device": str(jax.devices()[0]), "device_kind": devices.device_kind(),
            "platform": devices.platform()}


def run_here(sweeps: Sequence[PlannedSweep], options: dict[str, Any], *,
             on_sweep: Callable[[int, PlannedSweep], Any] | None = None) -> list[SweepOutcome]:
    """Run `sweeps` one after another in this process with `SweepSpec(op, problem, backend, **options)`; each
    writes its own entry (`run_sweep`). A sweep that fails is recorded and the next one runs; a
    KeyboardInterrupt stops the run (what finished is in the tables and sweep logs). `on_sweep(i, sweep)` is
    called before each sweep and may return its progress reporter."""
    from moe_tune.tuner import SweepSpec, run_sweep

    device, outcomes = local_device(), []
    for i, sweep in enumerate(sweeps):
        reporter = on_sweep(i, sweep) if on_sweep is not None else None
        outcome = SweepOutcome(sweep, device=device)
        try:
            result = run_sweep(SweepSpec(sweep.op, sweep.problem, **{**options, "backend": sweep.backend}), reporter)
            outcome.entry, outcome.table, outcome.resumed, outcome.wall_s = (result.entry, result.table_path,
                                                                            result.resumed, result.wall_s)
        except MoeTuneError as e:
            outcome.error = str(e)
        except Exception as e:  # noqa: BLE001 - a kernel or runtime failure ends this sweep, not the campaign
            outcome.error = f"{type(e).__name__}: {e}"
        outcomes.append(outcome)
    return outcomes
