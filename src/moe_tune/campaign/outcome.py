"""How one sweep of a campaign ended, wherever it ran (this process or a Ray task): the one result type that
the campaign runner returns and the CLI's summary shows."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

from moe_tune.campaign.plan import PlannedSweep
from moe_tune.core.errors import MoeTuneError
from moe_tune.profiles.entry import Entry
from moe_tune.tuner.state import SweepResult


@dataclasses.dataclass
class SweepOutcome:
    """One planned sweep's end: its entry (as written to `table`), or the error that ended it.

    device: where it ran (`host`, `device` as JAX names it, `device_kind`, `platform`, and on Ray the
    `accelerator_ids` Ray assigned); attempts: how many times it was started (a retry after a dead process
    counts); resumed: candidates restored from its sweep log instead of run again; result: the tuner's whole
    result (every candidate) when the sweep ran in this process (None on Ray, where only the entry comes back)."""

    sweep: PlannedSweep
    entry: Entry | None = None
    table: Path | None = None
    error: str | None = None
    device: dict[str, Any] | None = None
    attempts: int = 1
    resumed: int = 0
    wall_s: float = 0.0
    result: SweepResult | None = None

    @classmethod
    def of(cls, sweep: PlannedSweep, result: SweepResult, device: dict[str, Any]) -> SweepOutcome:
        """The outcome of a sweep run in this process."""
        return cls(sweep, entry=result.entry, table=result.table_path, device=device, resumed=result.resumed,
                   wall_s=result.wall_s, result=result)


def local_device() -> dict[str, Any]:
    """This process's device record (the first JAX device: the one a sweep here tunes)."""
    import jax

    from moe_tune.core import devices

    return {"host": socket.gethostname(), "device": str(jax.devices()[0]), "device_kind": devices.device_kind(),
            "platform": devices.platform()}


def error_text(error: BaseException) -> str:
    """How a sweep's error is recorded: a moe-tune error's message, else the exception's type and message (a
    kernel or runtime failure ends its sweep, not the campaign)."""
    return str(error) if isinstance(error, MoeTuneError) else f"{type(error).__name__}: {error}"
