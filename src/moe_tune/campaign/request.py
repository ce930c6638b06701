"""A tuning campaign as one typed request, and what each of its sweeps comes back as.

`Campaign`: the kernel cases to tune, how every sweep runs (`SweepSettings`), the backend asked for, where it
runs (`Where`: here, on a Ray cluster, as share I of N, or as a dry run that only prints the plan) and its
passes (`Passes`: the sweeps, once per routing distribution; then a ladder's boundaries, the config robust
across distributions; or, instead of sweeping, compiling every candidate for a chip this machine does not
have). `runner.run` plans it once and runs its passes in order.

`Campaign.placed()` is the one check of where it runs: which passes can run there. Compiling for a chip runs
on this machine (not on Ray); the ladder's boundaries and the robust choice time the whole plan's winners side
by side in this process, so a campaign on Ray or a share of one leaves them out, and says how to measure them.

`SweepOutcome`: how one sweep ended, wherever it ran (this process or a Ray task).
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

from moe_tune.campaign.plan import Case, PlannedSweep
from moe_tune.core.errors import MoeTuneError, UsageError
from moe_tune.profiles.entry import Entry
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.state import SweepResult


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a campaign runs: here (`ray_address` None) or on the Ray cluster at `ray_address` (`local`: a
    private Ray started here); `share`: (index, count) of the `--shard` this process takes, or None (the whole
    plan); `dry_run`: print the plan the same request runs, and run nothing."""

    ray_address: str | None = None
    share: tuple[int, int] | None = None
    dry_run: bool = False

    @property
    def elsewhere(self) -> bool:
        """Whether the campaign's tables end up elsewhere than in this process's (Ray's driver writes them
        here, but its sweeps ran on other devices; a share's are merged later)."""
        return self.ray_address is not None or self.share is not None


@dataclasses.dataclass(frozen=True)
class Passes:
    """What a campaign does, in order. distributions: the routing distributions the sweeps run under (one
    sweep pass each; two or more: then the config robust across them, `robust`); ladder: then the boundaries
    between neighbouring token counts' winners (`ladder`); target: instead of sweeping, compile every
    candidate for this chip (`targets`)."""

    distributions: tuple[str, ...]
    ladder: bool = False
    target: str | None = None

    @property
    def robust(self) -> bool:
        return len(self.distributions) > 1


ELSEWHERE_NOTE = ("{what} measured in this process after the sweeps: rerun the command without --ray / --shard "
                  "once the tables are merged")


@dataclasses.dataclass(frozen=True)
class Campaign:
    """One `moe-tune sweep`: the kernel cases (`plan.Case`), the settings of every sweep (its distribution
    is the first pass's), the backend asked for (None: each op's default), where it runs, its passes, notes
    on what the cases left out. one_shape: one shape asked for, not run elsewhere: every sweep runs (resuming
    its log, not skipped when the table holds it) and shows its own summary; layer: (model, its ep and dtype)
    for one model's layer (its summary is titled so), else None."""

    cases: tuple[Case, ...]
    settings: SweepSettings
    passes: Passes
    where: Where = Where()
    backend: str | None = None
    notes: tuple[str, ...] = ()
    one_shape: bool = False
    layer: tuple[str, str] | None = None

    def placed(self) -> dict[str, str]:
        """The one check of where the campaign runs: UsageError for a pass that cannot run there at all;
        else {pass: why it is left out there} for the passes that run only here, on the whole plan."""
        passes, where = self.passes, self.where
        if passes.target is not None:
            if where.ray_address is not None:
                raise UsageError("--target compiles on this machine; it does not take --ray")
            left = {}
            if passes.ladder:
                left["ladder"] = "--target compiles only: a sweep on the chip measures the ladder's boundaries"
            if passes.robust:
                left["robust"] = "--target compiles only: a sweep on the chip measures the robust choice"
            return left
        if not where.elsewhere:
            return {}
        left = {}
        if passes.ladder:
            left["ladder"] = ELSEWHERE_NOTE.format(what="ladder boundaries are")
        if passes.robust:
            left["robust"] = ELSEWHERE_NOTE.format(what="the robust choice is")
        return left


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
