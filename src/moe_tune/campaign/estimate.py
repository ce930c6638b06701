"""What a planned sweep will cost, for the plan a campaign prints before it runs (and `--dry-run` prints
instead of running): how many candidates its strategy will measure, and an estimate of its time from the
sweeps the tables have recorded (each entry holds its `sweep_wall_s` and how many candidates it tried: seconds
per candidate, taken from the recorded sweep of the same op, backend and direction nearest in size)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from moe_tune.campaign.request import PlannedSweep
from moe_tune.kernels import get_op
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.table import search_dirs, table_entries, table_path, write_dir
from moe_tune.tuner.request import SweepSettings
from moe_tune.tuner.search import CoordinateDescent, spread


@dataclasses.dataclass(frozen=True)
class Cost:
    """candidates: how many the sweep measures (`exact`: exactly, for a grid; `bound`: at most; else about as
    many, the strategy's own walk estimated: `candidates`) of `space`; seconds: the estimated wall time, None
    when no recorded sweep of its kind exists."""

    candidates: int
    exact: bool
    seconds: float | None
    bound: bool = True
    space: int | None = None

    @property
    def text(self) -> str:
        """`68 candidates, ~2.5 min` / `<= 12 candidates, time unknown` / `~11 of 68 candidates, ~30 s`."""
        if self.exact:
            count = f"{self.candidates} candidates"
        elif self.bound:
            count = f"<= {self.candidates} candidates"
        else:
            count = f"~{self.candidates} of {self.space} candidates"
        return f"{count}, time unknown" if self.seconds is None else f"{count}, ~{duration(self.seconds)}"


def duration(seconds: float) -> str:
    """`40 s`, `2.5 min`, `1.3 h`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def candidates(sweep: PlannedSweep, settings: SweepSettings) -> tuple[int, bool, bool, int]:
    """(count, exact, bound, space) of the candidates `sweep` will measure with `settings`: its backend's
    space, cut by --max-candidates and --budget: exactly that many for a grid without a time budget, at most
    that many for random or a time budget. Coordinate descent measures its first round (the default and its
    neighbours, counted here on the space) and then a step or two: estimated as the first round and one step
    as large (FINDINGS.md strategies: cold descents on a 36-candidate space measured 5, 8 and 13,
    `strategies_cpu_2core_2026-11-21.json`), never more than the space."""
    backend = get_op(sweep.op).backends.get(sweep.backend)
    full = backend.search_space(sweep.problem)
    count = min(x for x in (len(full), settings.max_candidates, settings.budget) if x is not None)
    if settings.strategy != "coordinate":
        return count, settings.strategy == "grid" and settings.time_budget_s is None, True, count
    space = full if settings.max_candidates is None else spread(full, settings.max_candidates,
                                                                           settings.seed)
    first = len(CoordinateDescent(space, backend=backend, problem=sweep.problem).next_round({}))
    return min(count, 2 * first - 1), False, False, len(space)


@dataclasses.dataclass(frozen=True)
class _Record:
    """One recorded sweep: seconds per candidate (its compile, check and time stages over the candidates it
    tried) and the rest of its wall time (inputs, reference, the final round), which does not grow with the
    candidates."""

    op: str
    backend: str | None
    direction: str | None
    size: float
    per_candidate_s: float
    fixed_s: float


def recorded(device_kind: str, ops: Iterable[str], profile_dir: Path | None = None) -> list[_Record]:
    """Seconds per candidate of every sweep the tables of `device_kind` recorded (the write dir of
    `profile_dir` and every search dir), for `ops`."""
    roots = [write_dir(profile_dir), *(root for _, root in search_dirs())]
    found = []
    for root in dict.fromkeys(roots):
        for op in ops:
            for key, data in table_entries(table_path(root, device_kind, op)).items():
                try:
                    entry = Entry.from_json(data, key)
                except ValueError:
                    continue
                tried = entry.count("tried")
                if not entry.sweep_wall_s or not tried:
                    continue
                stages = (entry.search or {}).get("stage_s") or {}
                staged = sum(v for v in stages.values() if isinstance(v, (int, float))) or entry.sweep_wall_s
                found.append(_Record(op, entry.backend, entry.direction, _size_of(entry.flops, entry.fields),
                                     staged / tried, max(0.0, entry.sweep_wall_s - staged)))
    return found


def _size_of(flops: int | None, fields) -> float:
    """A problem's size for nearness: its FLOPs, else (the gathers) rows x hidden."""
    if flops:
        return float(flops)
    return float((fields.get("rows") or fields.get("tokens") or 1) * (fields.get("hidden") or 1))


def estimate(sweep: PlannedSweep, settings: SweepSettings, history: Sequence[_Record]) -> Cost:
    """The sweep's candidates and estimated time: the recorded sweep of the same op, backend and direction
    nearest in size (in log space): its fixed time plus the candidate count times its seconds per candidate,
    scaled by the sizes' ratio to the power 1/2 (compile time, most of a small sweep, grows slower than the
    work)."""
    count, exact, bound, space = candidates(sweep, settings)
    op = get_op(sweep.op)
    fields = sweep.problem.key_fields()
    size, direction = _size_of(op.flops(sweep.problem), fields), fields.get("direction")
    same = [r for r in history if r.op == sweep.op and r.backend == sweep.backend and r.direction == direction]
    if not same:
        return Cost(count, exact, None, bound, space)
    near = min(same, key=lambda r: abs(math.log(r.size / size)))
    return Cost(count, exact, (near.fixed_s + count * near.per_candidate_s) * math.sqrt(size / near.size), bound,
                space)
