"""Token-count ladders: a shape tuned at a ladder of token counts (`--m 1:16384`: powers of two), and the
intervals between them measured, not guessed (DESIGN.md "Token counts").

After the ladder's sweeps (an ordinary campaign: one sweep per count, resumed and skipped as any), each pair
of neighbouring counts a < b whose winners A and B differ gets a boundary: A and B are checked and timed side
by side (`tuner.crossover`) at counts between them, bisecting in log space (`STEPS` times) towards where B
starts to win; the crossover is the geometric middle of the last bracket (A faster at its low end, B at its
high end). The table then holds intervals `[lo, hi)`: the first starts at the ladder's first count, each
boundary starts the next, the last ends after the ladder's last count; neighbours with the same winner share
one interval. Beyond the ladder lookup falls back to the nearest entry.

A rerun measures nothing twice: a boundary the table's intervals already record for the same two counts and
winners is reused.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tune.campaign.plan import PlannedSweep
from moe_tune.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.profiles import dirs
from moe_tune.profiles import intervals as iv
from moe_tune.profiles.table import is_complete, table_entries, update_table
from moe_tune.tuner.sweep_settings import SweepSettings

STEPS = 2  # bisection steps per boundary: each times both winners at one count between the brackets' ends


def ladder_counts(lo: int, hi: int) -> list[int]:
    """`lo`, the powers of two strictly between, and `hi` (`1:16384` -> 1, 2, 4, ..., 16384)."""
    if not 1 <= lo < hi:
        raise UsageError(f"a ladder {lo}:{hi} needs 1 <= first < last")
    return sorted({lo, hi, *(2**i for i in range(hi.bit_length()) if lo < 2**i < hi)})


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The sweeps of one family (same op, backend, distribution and every key field but the token counts)
    sorted by `field` (the problem's first size field); `scale`: the other size fields per unit of it."""

    op: str
    backend: str
    distribution: str
    family: dict[str, Any]
    field: str
    scale: dict[str, float]
    rungs: tuple[PlannedSweep, ...]

    def count(self, sweep: PlannedSweep) -> int:
        return sweep.problem.key_fields()[self.field]

    def problem_at(self, count: int) -> Any:
        """The family's problem at token count `count` (the other size fields scaled with it)."""
        sizes = {self.field: count, **{f: round(count * r) for f, r in self.scale.items()}}
        return dataclasses.replace(self.rungs[0].problem, **sizes)

    def label(self) -> str:
        counts = [self.count(s) for s in self.rungs]
        return f"{get_op(self.op).describe(self.rungs[0].problem)} ({self.field} ladder {counts[0]}..{counts[-1]})"


def ladders(planned: Sequence[PlannedSweep], distribution: str) -> list[Ladder]:
    """The ladders among a campaign's sweeps: families of two or more token counts, in plan order."""
    groups: dict[tuple, list[PlannedSweep]] = {}
    for sweep in planned:
        fields = {**sweep.problem.key_fields(), "backend": sweep.backend, "distribution": distribution}
        sizes = type(sweep.problem).SIZE_FIELDS
        scale = iv.scale_of(fields, sizes)
        family = iv.family_fields(fields, sizes)
        groups.setdefault((sweep.op, iv.interval_key(sweep.op, family, sizes[0], 1, 2), repr(scale)), []).append(sweep)
    found = []
    for (op, _, _), sweeps in groups.items():
        sizes = type(sweeps[0].problem).SIZE_FIELDS
        fields = {**sweeps[0].problem.key_fields(), "backend": sweeps[0].backend, "distribution": distribution}
        rungs = tuple(sorted(sweeps, key=lambda s: s.problem.key_fields()[sizes[0]]))
        if len(rungs) >= 2:
            found.append(Ladder(op, sweeps[0].backend, distribution, iv.family_fields(fields, sizes), sizes[0],
                                iv.scale_of(fields, sizes) or {}, rungs))
    return found


@dataclasses.dataclass
class LadderOutcome:
    """What one ladder's boundaries came to: the intervals written (JSON), the boundaries measured now and
    those reused from the table, and notes (a count without a complete entry is left out)."""

    ladder: Ladder
    intervals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    measured: int = 0
    reused: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    table: Path | None = None


Timer = Callable[..., Any]  # tuner.crossover.time_side_by_side, or a stand-in in tests


def measure(ladder: Ladder, settings: SweepSettings, device_kind: str, *, timer: Timer | None = None,
            steps: int = STEPS, on_boundary: Callable[[str], None] | None = None) -> LadderOutcome:
    """Measure `ladder`'s boundaries from its entries in the write table and write its intervals there."""
    if timer is None:
        from moe_tune.tuner.crossover import time_side_by_side as timer
    table = dirs.table_path(dirs.write_dir(settings.profile_dir), device_kind, ladder.op)
    entries = table_entries(table)
    known = _known_boundaries(table, ladder)
    outcome = LadderOutcome(ladder, table=table)
    points = []
    for sweep in ladder.rungs:
        entry = entries.get(sweep.key)
        if is_complete(entry):
            points.append((ladder.count(sweep), sweep.key, entry))
        else:
            outcome.notes.append(f"{ladder.field}={ladder.count(sweep)}: no complete entry; left out of the intervals")
    if len(points) < 2:
        outcome.notes.append("fewer than two tuned counts: no interval written")
        return outcome
    segments: list[tuple[int, list[tuple[int, str, dict]], dict | None]] = [(points[0][0], [points[0]], None)]
    for below, above in zip(points, points[1:]):
        if _config(below[2]) == _config(above[2]):
            segments[-1][1].append(above)
            continue
        ident = _boundary_ident(below, above)
        boundary = known.get(ident)
        if boundary is not None:
            outcome.reused += 1
        else:
            boundary = _bisect(ladder, below, above, settings, timer, steps)
            outcome.measured += 1
        if on_boundary is not None:
            on_boundary(f"{ladder.field} {below[0]}..{above[0]}: crossover at {boundary['crossover']}")
        segments.append((boundary["crossover"], [above], boundary))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ends = [start for start, _, _ in segments[1:]] + [points[-1][0] + 1]
    counts = [p[0] for p in points]
    for (start, won, below), end in zip(segments, ends):
        outcome.intervals.append(iv.make_interval(
            ladder.op, ladder.family, ladder.field, start, end, config=_config(won[0][2]), scale=ladder.scale,
            entries=[key for _, key, _ in won], versions=won[0][2].get("versions") or {}, tuned_at=now,
            evidence={"ladder": counts, "won_at": [c for c, _, _ in won], "below": below}))
    update_table(table, ladder.op, device_kind, lambda t: iv.replace_intervals(t, outcome.intervals))
    return outcome


def _config(entry: Mapping[str, Any]) -> dict[str, Any]:
    return dict(entry["config"])


def _boundary_ident(below: tuple, above: tuple) -> tuple:
    return (below[0], above[0], repr(sorted(_config(below[2]).items())), repr(sorted(_config(above[2]).items())))


def _known_boundaries(table: Path, ladder: Ladder) -> dict[tuple, dict[str, Any]]:
    """Boundaries the table's intervals of this family already record, by (counts, winners)."""
    from moe_tune.profiles.table import read_table
    from moe_tune.errors import TableError

    try:
        held = read_table(table).get(iv.INTERVALS, {}) if table.exists() else {}
    except TableError:
        return {}
    found = {}
    for record in held.values():
        if record.get("fields") != ladder.family or record.get("field") != ladder.field:
            continue
        boundary = (record.get("evidence") or {}).get("below")
        if isinstance(boundary, Mapping) and "crossover" in boundary:
            lower, upper = boundary["lower"], boundary["upper"]
            ident = (lower["count"], upper["count"], repr(sorted(dict(lower["config"]).items())),
                     repr(sorted(dict(upper["config"]).items())))
            found[ident] = dict(boundary)
    return found


def _bisect(ladder: Ladder, below: tuple, above: tuple, settings: SweepSettings, timer: Timer,
            steps: int) -> dict[str, Any]:
    """Where the upper winner starts to beat the lower one between two tuned counts: `steps` side-by-side
    timings of both winners, each at the geometric middle of the bracket left."""
    lo, hi = below[0], above[0]
    configs = {"lower": _config(below[2]), "upper": _config(above[2])}
    timed = []
    for _ in range(steps):
        mid = round(math.sqrt(lo * hi))
        if not lo < mid < hi:
            break
        result = timer(ladder.op, ladder.backend, ladder.problem_at(mid), configs,
                       distribution=ladder.distribution, seed=settings.seed, time_s=settings.final_time_s)
        faster = result.fastest()
        timed.append({"at": mid, "faster": faster, **result.to_json()})
        if faster == "upper":
            hi = mid
        else:  # the lower winner faster, or neither usable: the lower one keeps the count
            lo = mid
    crossover = hi if hi - lo <= 1 else min(hi, max(lo + 1, round(math.sqrt(lo * hi))))
    return {"lower": {"count": below[0], "config": configs["lower"], "entry": below[1]},
            "upper": {"count": above[0], "config": configs["upper"], "entry": above[1]},
            "timed": timed, "bracket": [lo, hi], "crossover": crossover,
            "rule": "bisection in log space; the crossover is the geometric middle of the last bracket"}


def measure_campaign(campaign: Any, *, print_line: Callable[[str], None] = print) -> list[LadderOutcome]:
    """Measure the boundaries of every ladder of a prepared campaign (`engine.Campaign`), here, once its
    sweeps have run: the whole plan's ladders, so that a rerun whose sweeps were all done still measures
    what is missing. A share of a plan (`--shard`) or a campaign on Ray measures nothing (the ladder's
    entries are in other tables until they are merged): run the same command here afterwards."""
    if campaign.share is not None or campaign.accelerator is not None:
        print_line("note: ladder boundaries are measured in this process after the sweeps: rerun the command "
                   "without --ray / --shard once the tables are merged")
        return []
    found = []
    for ladder in ladders(campaign.planned, campaign.settings.distribution):
        print_line(f"ladder {ladder.label()}: measuring the boundaries between neighbouring winners")
        outcome = measure(ladder, campaign.settings, campaign.device_kind,
                          on_boundary=lambda text: print_line(f"  {text}"))
        for note in outcome.notes:
            print_line(f"  note: {note}")
        for record in outcome.intervals:
            config = ", ".join(f"{k}={v}" for k, v in record["config"].items())
            print_line(f"  {iv.describe_interval(record)}: {config}")
        print_line(f"  {outcome.measured} boundaries measured, {outcome.reused} reused; intervals in {outcome.table}")
        found.append(outcome)
    return found
