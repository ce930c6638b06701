"""Token-count ladders: a shape tuned at a ladder of token counts (`--m 1:16384`: powers of two), and the
intervals between them measured, not guessed (docs/ARCHITECTURE.md, "Tables and the shared key"; FINDINGS.md:
held-out token counts).

After the ladder's sweeps (an ordinary campaign: one sweep per count, resumed and skipped as any), each pair
of neighbouring counts a < b whose winners A and B differ gets a boundary: A and B are checked and timed side
by side (`tuner.crossover`) at counts between them, bisecting in log space (`STEPS` times) towards where B
starts to win; the crossover is the geometric middle of the last bracket (A faster at its low end, B at its
high end). The table then holds intervals `[lo, hi)`: the first starts at the ladder's first count, each
boundary starts the next, the last ends after the ladder's last count; neighbours with the same winner share
one interval. Beyond the ladder lookup falls back to the nearest entry.

Neighbours with the same winner are challenged first: a rung's sweep finds its winner at that count only,
and the counts in between are not the rungs' (a power of two splits evenly into balanced groups, so no row tile
leaves a tail there; in between every group has one). When another config ran faster than the shared winner in
both rungs' sweeps (their first rounds, where a winner short of the finals' 10% gain over the default is left
unchosen), it is timed side by side with the winner at the geometric middle; if it is faster there too (the
median of the per-round ratios), the middle becomes a point of the ladder with that config as its winner, and
its boundaries with both rungs are bisected as any. Three measurements agreeing is the evidence; the interval
records the challenge (`evidence.challenges`), won or lost.

A rerun measures nothing twice: a boundary or a challenge the table's intervals already record for the same
counts and configs is reused.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tune.campaign.request import PlannedSweep
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.profiles.table import table_path, write_dir
from moe_tune.profiles import intervals as iv
from moe_tune.profiles.table import is_complete, table_entries, update_table
from moe_tune.tuner.request import SweepSettings

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
    challenged: int = 0  # challenges timed now (reused ones count in `reused`)
    notes: list[str] = dataclasses.field(default_factory=list)
    table: Path | None = None


Timer = Callable[..., Any]  # tuner.crossover.time_side_by_side, or a stand-in in tests


def measure(ladder: Ladder, settings: SweepSettings, device_kind: str, *, timer: Timer | None = None,
            steps: int = STEPS, on_boundary: Callable[[str], None] | None = None) -> LadderOutcome:
    """Measure `ladder`'s boundaries from its entries in the write table and write its intervals there."""
    if timer is None:
        from moe_tune.tuner.crossover import time_side_by_side as timer
    table = table_path(write_dir(settings.profile_dir), device_kind, ladder.op)
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
    rungs = [p[0] for p in points]
    points, challenges = _challenged(ladder, points, settings, timer, _known_challenges(table, ladder), outcome)
    for c in challenges:
        if on_boundary is not None:
            ratio = "unusable" if c["ratio"] is None else f"{c['ratio']:.3f}x the shared winner's time"
            verdict = "won: a point of the ladder" if c["won"] else "lost"
            on_boundary(f"{ladder.field} {c['lower']}..{c['upper']}: challenged at {c['at']} ({ratio}), {verdict}")
    segments: list[tuple[int, list[tuple[int, str | None, dict]], dict | None]] = [(points[0][0], [points[0]], None)]
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
    for (start, won, below), end in zip(segments, ends):
        outcome.intervals.append(iv.make_interval(
            ladder.op, ladder.family, ladder.field, start, end, config=_config(won[0][2]), scale=ladder.scale,
            entries=[key for _, key, _ in won if key is not None], versions=won[0][2].get("versions") or {},
            tuned_at=now, evidence={"ladder": rungs, "won_at": [c for c, _, _ in won], "below": below,
                                    "challenges": [c for c in challenges if start <= c["at"] < end]}))
    update_table(table, ladder.op, device_kind, lambda t: iv.replace_intervals(t, outcome.intervals))
    return outcome


def _config(entry: Mapping[str, Any]) -> dict[str, Any]:
    return dict(entry["config"])


def _ident(config: Mapping[str, Any]) -> str:
    """A config as a comparable text (its items sorted)."""
    return repr(sorted(dict(config).items()))


def _boundary_ident(below: tuple, above: tuple) -> tuple:
    return (below[0], above[0], _ident(below[2]["config"]), _ident(above[2]["config"]))


def _known_boundaries(table: Path, ladder: Ladder) -> dict[tuple, dict[str, Any]]:
    """Boundaries the table's intervals of this family already record, by (counts, winners)."""
    found = {}
    for record in _family_intervals(table, ladder):
        boundary = (record.get("evidence") or {}).get("below")
        if isinstance(boundary, Mapping) and "crossover" in boundary:
            lower, upper = boundary["lower"], boundary["upper"]
            ident = (lower["count"], upper["count"], _ident(lower["config"]), _ident(upper["config"]))
            found[ident] = dict(boundary)
    return found


def _family_intervals(table: Path, ladder: Ladder) -> list[dict[str, Any]]:
    """The intervals `table` holds for this ladder's family (none when it is missing or unreadable)."""
    from moe_tune.core.errors import TableError
    from moe_tune.profiles.table import read_table

    try:
        held = read_table(table).get(iv.INTERVALS, {}) if table.exists() else {}
    except TableError:
        return []
    return [r for r in held.values() if isinstance(r, Mapping) and r.get("fields") == ladder.family
            and r.get("field") == ladder.field]


def _bisect(ladder: Ladder, below: tuple, above: tuple, settings: SweepSettings, timer: Timer,
            steps: int) -> dict[str, Any]:
    """Where the upper winner starts to beat the lower one between two tuned counts: `steps` side-by-side
    timings of both winners, each at the geometric middle of the bracket left (the faster: by the median of
    the per-round ratios)."""
    lo, hi = below[0], above[0]
    configs = {"lower": _config(below[2]), "upper": _config(above[2])}
    timed = []
    for _ in range(steps):
        mid = round(math.sqrt(lo * hi))
        if not lo < mid < hi:
            break
        result = timer(ladder.op, ladder.backend, ladder.problem_at(mid), configs,
                       distribution=ladder.distribution, seed=settings.seed, time_s=settings.final_time_s)
        ratio = result.ratio("upper", "lower")
        faster = result.fastest() if ratio is None else "upper" if ratio < 1 else "lower"
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


def challenger(shared: Mapping[str, Any], below: Mapping[str, Any], above: Mapping[str, Any]) -> dict | None:
    """The config that ran faster than `shared` (the winner of both entries) in both sweeps (each entry's
    `results`: the first round's medians), by the widest margin at the entry where its margin was narrower;
    None when no config did."""

    def medians(entry: Mapping[str, Any]) -> dict[str, tuple[dict, float]]:
        return {_ident(r["config"]): (dict(r["config"]), r["median_s"]) for r in entry.get("results") or []
                if r.get("status") == "ok" and isinstance(r.get("median_s"), (int, float)) and r["median_s"] > 0}

    low, high, mine = medians(below), medians(above), _ident(shared)
    if mine not in low or mine not in high:
        return None
    ratios = {ident: max(low[ident][1] / low[mine][1], high[ident][1] / high[mine][1])
              for ident in low.keys() & high.keys() if ident != mine}
    best = min(ratios, key=ratios.__getitem__, default=None)
    return low[best][0] if best is not None and ratios[best] < 1 else None


def _challenged(ladder: Ladder, points: list[tuple], settings: SweepSettings, timer: Timer,
                known: dict[tuple, dict[str, Any]], outcome: LadderOutcome) -> tuple[list[tuple], list[dict]]:
    """`points` with the middle of each pair of neighbours that share a winner added where a challenger
    (`challenger`) beat it there too (as `(count, None, {"config": ..., "versions": ...})`), and every
    challenge's record, timed now or reused from `known`."""
    found, records = [points[0]], []
    for below, above in zip(points, points[1:]):
        shared = _config(below[2])
        rival = challenger(shared, below[2], above[2]) if shared == _config(above[2]) else None
        mid = round(math.sqrt(below[0] * above[0]))
        if rival is not None and below[0] < mid < above[0]:
            ident = (below[0], above[0], _ident(shared), _ident(rival))
            record = known.get(ident)
            if record is not None:
                outcome.reused += 1
            else:
                result = timer(ladder.op, ladder.backend, ladder.problem_at(mid),
                               {"shared": shared, "challenger": rival}, distribution=ladder.distribution,
                               seed=settings.seed, time_s=settings.final_time_s)
                ratio = result.ratio("challenger", "shared")
                record = {"lower": below[0], "upper": above[0], "at": mid, "config": shared, "challenger": rival,
                          "ratio": ratio, "won": ratio is not None and ratio < 1, **result.to_json()}
                outcome.challenged += 1
            records.append(record)
            if record["won"]:
                found.append((mid, None, {"config": rival, "versions": below[2].get("versions") or {}}))
        found.append(above)
    return found, records


def _known_challenges(table: Path, ladder: Ladder) -> dict[tuple, dict[str, Any]]:
    """Challenges the table's intervals of this family already record, by (counts, shared winner, challenger)."""
    return {(c["lower"], c["upper"], _ident(c["config"]), _ident(c["challenger"])): dict(c)
            for record in _family_intervals(table, ladder)
            for c in (record.get("evidence") or {}).get("challenges") or [] if isinstance(c, Mapping)}


def measure_campaign(campaign: Any, *, print_line: Callable[[str], None] = print) -> list[LadderOutcome]:
    """Measure the boundaries of every ladder of a planned campaign (`runner.Planned`), here, once its
    sweeps have run: the whole plan's ladders, so that a rerun whose sweeps were all done still measures
    what is missing. Only for a whole plan run here (`request.Campaign.placed`: on Ray or as a share, the
    ladder's entries are in other tables until they are merged)."""
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
        print_line(f"  {outcome.measured} boundaries and {outcome.challenged} challenges measured, {outcome.reused} "
                   f"reused; intervals in {outcome.table}")
        found.append(outcome)
    return found
