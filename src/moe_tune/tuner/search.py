"""The search policy: which configs of a backend's search space a sweep measures, round by round, and the warm
start that seeds them from the nearest shapes already tuned.

A strategy proposes rounds of configs (the default always first, then the warm start's seeds); the sweep measures
each round and passes everything measured so far to `next_round`. A strategy never proposes a config twice,
never one outside the space, never more than `budget` in all; proposals depend only on the space, the budget,
the seed and the results, so a resumed sweep (results from its log) replays the same proposals.

- `grid` (`Grid`): the whole space in order, `budget` keeps its first N; `--cold` asks for it whole.
- `random` (`RandomSearch`): the default, the seeds, then a seeded sample of the rest.
- `coordinate` (`CoordinateDescent`): from the default, each round the unmeasured neighbours of the best config
  so far (along each tunable, the nearest smaller and larger value among configs differing in it alone); it
  stops when a round finds nothing faster or the budget is spent.
- The warm local search (`grid` and `coordinate` with seeds; `Strategy.local`): the default, the seeds and the
  configs `bracket`ed by them (seeds differing in one tunable: m/2 won tm=32 and 2m tm=128, so tm=64 is tried),
  side by side; then a descent from the best along the `open_tunables` only (those the default and the seeds do
  not all agree on), moving only past `NOISE` (`speedup`, paired round by round where it can). With one seed the
  descent starts only when the seed beat the default in its first round by `verdict.PAIRED_MIN_NOISE`; else the
  search stops at two candidates (FINDINGS.md: warm start, for why both rules).
- `--max-candidates N` (`spread(space, n, seed)`, pure): the default and a seeded sample spread across the space,
  not its first N configs (the smallest tiles); a resumed sweep gets the same ones again. `make` builds a
  strategy by name.

Warm start (`find`, `WarmStart`): the tables (every profile dir in lookup order, and the sweep's own) are read
for entries of the same op, backend, device kind, dtypes and quantization (`same_numerics`) whose key differs
only in sizes, direction or distribution; the nearest `limit` by `distance` give their winners, mapped onto this
space (`project`: the nearest config of the space, so a seed is always valid). When every source kept its own
default (`WarmStart.defaults_held`) the winners are evidence for the heuristic: the seeds are cut to the nearest
one. The seeds depend on the tables when the sweep starts; `--cold` (`SweepSettings.cold`) turns it off.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from moe_tune.core.errors import TableError, UsageError
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.profiles import read_table, search_dirs, table_path
from moe_tune.profiles.verdict import PAIRED_MIN_NOISE, paired_ratios
from moe_tune.tuner.candidate import Candidate, same_rounds
from moe_tune.tuner.compiling import OK

NOISE = 0.03  # the warm local search moves to a neighbour only when it is this much faster than the best


BRACKET = 8  # at most this many configs between the seeds are tried in the warm first round


def bracket(space: Sequence[KernelConfig], seeds: Sequence[KernelConfig], limit: int = BRACKET
            ) -> list[KernelConfig]:
    """The configs of `space` (not the default, `space[0]`, nor the seeds) that lie strictly between two seeds
    which differ in one ordered tunable only (the line a ladder draws: m/2 won tm=32 and 2m won tm=128, so
    tm=64 for m), nearest the middle of their pair first, at most `limit`. Seeds that differ in several
    tunables bracket nothing: the box between them grows with every tunable and costs more than it finds."""
    found: list[tuple[float, int, KernelConfig]] = []
    for i, a in enumerate(seeds):
        for b in seeds[i + 1:]:
            differ = [f for f, v in a.to_dict().items() if getattr(b, f) != v]
            if len(differ) != 1 or not all(_positive(getattr(c, differ[0])) for c in (a, b)):
                continue
            (field,), low, high = differ, *sorted((getattr(a, differ[0]), getattr(b, differ[0])))
            middle = math.sqrt(low * high)  # the geometric middle: tiles double
            for index, c in enumerate(space[1:]):
                value = getattr(c, field)
                if c not in seeds and low < value < high and all(
                        getattr(c, f) == v for f, v in a.to_dict().items() if f != field):
                    found.append((abs(math.log2(value / middle)), index, c))
    return list(dict.fromkeys(c for _, _, c in sorted(found, key=lambda item: item[:2])))[:limit]


def open_tunables(default: KernelConfig, seeds: Sequence[KernelConfig]) -> set[str]:
    """The tunables a warm descent walks: those on which `default` and `seeds` do not all agree."""
    here = default.to_dict()
    return {f for f, v in here.items() if any(getattr(c, f) != v for c in seeds)}


def speedup(here: Candidate, other: Candidate) -> float:
    """`here`'s time over `other`'s: the median per-round ratio when both were timed in the same rounds
    (`candidate.same_rounds`: load both calls of a round share cancels), else the ratio of their medians."""
    if same_rounds([here, other]):
        return statistics.median(paired_ratios(here.timing.samples_s, other.timing.samples_s))
    return here.timing.median_s / other.timing.median_s


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


class Strategy:
    """Base: `space` is the backend's search space for the problem (valid configs, default first)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # one phrase for `moe-tune sweep --help`
    needs_budget: ClassVar[bool] = False  # without a budget (count or time) the strategy is just a grid
    local: bool = False  # a warm local search around the seeds (module docstring), not the strategy's own walk

    def __init__(self, space: Sequence[KernelConfig], *, backend: Backend | None = None, problem: Any = None,
                 budget: int | None = None, seed: int = 0, seeds: Sequence[KernelConfig] = ()):
        if not space:
            raise UsageError("the search space is empty")
        self.space, self.backend, self.problem = list(space), backend, problem
        # the warm start's configs (of the space, not the default), measured right after the default
        self.seeds = [c for c in dict.fromkeys(seeds) if c in set(self.space) and c != self.space[0]]
        self.budget, self.seed = budget, seed
        self.stopped: str | None = None  # why the strategy has no more rounds (once next_round returns [])

    @property
    def default(self) -> KernelConfig:
        return self.space[0]

    def _first(self, rest: Sequence[KernelConfig]) -> list[KernelConfig]:
        """The default, the seeds, then `rest` (without repeats)."""
        return list(dict.fromkeys([self.default, *self.seeds, *rest]))

    def planned(self) -> int:
        """An upper bound on the number of configs it will propose (for progress bars)."""
        return min(len(self.space), self.budget or len(self.space))

    def next_round(self, measured: Mapping[KernelConfig, Candidate]) -> list[KernelConfig]:
        """The next configs to measure (none of them in `measured`); [] when done (`stopped` says why)."""
        raise NotImplementedError

    def _left(self, measured: Mapping[KernelConfig, Candidate]) -> int | None:
        return None if self.budget is None else self.budget - len(measured)

    def _cap(self, proposal: list[KernelConfig], measured: Mapping[KernelConfig, Candidate],
             done_reason: str) -> list[KernelConfig]:
        proposal = [c for c in dict.fromkeys(proposal) if c not in measured]
        left = self._left(measured)
        if left is not None and left <= 0 and proposal:
            self.stopped = "budget"
            return []
        if left is not None:
            proposal = proposal[:left]
        if not proposal:
            self.stopped = done_reason
        return proposal


class Grid(Strategy):
    name = "grid"
    summary = "every candidate (with a warm start: a local search around the seeds; --cold: every candidate)"

    def __init__(self, space, **kwargs):
        super().__init__(space, **kwargs)
        self.local = bool(self.seeds)
        self._descent = CoordinateDescent(space, **kwargs) if self.local else None

    def next_round(self, measured):
        if self._descent is not None:  # warm: the local search (module docstring)
            proposal = self._descent.next_round(measured)
            self.stopped = self._descent.stopped
            return proposal
        return self._cap(self._first(self.space), measured, "exhausted" if self.budget is None or self.budget >= len(
            self.space) else "budget")


class RandomSearch(Strategy):
    name = "random"
    summary = "a seeded sample (needs --budget or --time-budget)"
    needs_budget = True

    def __init__(self, space, **kwargs):
        super().__init__(space, **kwargs)
        rest = self.space[1:]
        random.Random(self.seed).shuffle(rest)
        self.order = self._first(rest)  # with no count budget, a seeded shuffle of the whole space

    def next_round(self, measured):
        return self._cap(self.order, measured, "exhausted" if self.budget is None or self.budget >= len(
            self.space) else "budget")


def _sort_key(value: Any) -> tuple:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


class CoordinateDescent(Strategy):
    name = "coordinate"
    summary = "coordinate descent from the default config (with a warm start: from the best seed)"

    def __init__(self, space, **kwargs):
        super().__init__(space, **kwargs)
        self.in_space = set(self.space)
        self.current: KernelConfig | None = None  # the config whose neighbours were proposed last
        self.path: list[KernelConfig] = []  # the best config after each round (non-increasing time)
        self.local = bool(self.seeds)  # the warm local search (module docstring)
        # the tunables the warm descent walks (None: every one, the cold walk)
        self.open = open_tunables(self.default, self.seeds) if self.local else None

    def neighbours(self, config: KernelConfig, fields: set[str] | None = None) -> list[KernelConfig]:
        """Along each tunable (of `fields`; None: every one), the configs of the space that differ from
        `config` in that tunable only and have the nearest smaller and the nearest larger value."""
        here = config.to_dict()
        found = []
        for field, value in here.items():
            if fields is not None and field not in fields:
                continue
            line = [c for c in self.space if c != config and all(
                v == here[f] for f, v in c.to_dict().items() if f != field)]
            below = [c for c in line if _sort_key(getattr(c, field)) < _sort_key(value)]
            above = [c for c in line if _sort_key(getattr(c, field)) > _sort_key(value)]
            if below:
                found.append(max(below, key=lambda c: _sort_key(getattr(c, field))))
            if above:
                found.append(min(above, key=lambda c: _sort_key(getattr(c, field))))
        return [c for c in found if self._valid(c)]

    def _valid(self, config: KernelConfig) -> bool:
        if config not in self.in_space:
            return False
        return self.backend is None or self.backend.config_error(config, self.problem) is None

    def next_round(self, measured):
        if not measured:  # the first round: the default and its neighbours, timed side by side
            if self.local:  # warm: the default, the seeds and what they bracket; descend from the best of them
                return self._cap(self._first(bracket(self.space, self.seeds)), measured, "converged")
            self.current = self.default
            return self._cap([self.default, *self.neighbours(self.default)], measured, "converged")
        ok = [c for c in measured.values() if c.status == OK and c.timing is not None]
        if not ok:  # nothing ran yet (the default failed, and its neighbours): go on in space order
            self.current = None
            return self._cap([c for c in self.space if c not in measured][:8], measured, "exhausted")
        fastest = min(ok, key=lambda c: c.timing.median_s)
        best = fastest.config
        needed = 1 / (1 - NOISE)  # moving needs a gain beyond the noise
        if self.local and self.current is None and len(self.seeds) == 1 and any(
                c.config == self.default for c in ok):
            # one seed: descended from only when it beat the default by the least gain a final round calls a win
            self.current, needed = self.default, 1 + PAIRED_MIN_NOISE
        if self.local and self.current is not None and best != self.current:
            if speedup(measured[self.current], fastest) < needed:
                best = self.current
        self.path.append(best)
        if best == self.current:
            self.stopped = "converged"
            return []
        self.current = best
        return self._cap(self.neighbours(best, self.open), measured, "converged")


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (Grid, RandomSearch, CoordinateDescent)}


def check_strategy(name: str, budget: int | None, time_budget_s: float | None) -> None:
    """UsageError for an unknown strategy, a budget below 1, or a strategy that needs a budget without one."""
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if budget is not None and budget < 1:
        raise UsageError(f"budget must be at least 1 candidate, got {budget}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise UsageError(f"time budget must be a positive number of seconds, got {time_budget_s}")
    if STRATEGIES[name].needs_budget and budget is None and time_budget_s is None:
        raise UsageError(f"strategy {name!r} needs a budget: --budget N (candidates) or --time-budget SECONDS")


def make(name: str, space: Sequence[KernelConfig], *, backend: Backend | None = None, problem: Any = None,
         budget: int | None = None, seed: int = 0, seeds: Sequence[KernelConfig] = ()) -> Strategy:
    return STRATEGIES[name](space, backend=backend, problem=problem, budget=budget, seed=seed, seeds=seeds)


def _pairs(config: KernelConfig) -> set[tuple[str, str]]:
    """(tunable, value) pairs of a config (values as text: hashable whatever their type)."""
    return {(name, repr(value)) for name, value in config.to_dict().items()}


def spread(space: Sequence[KernelConfig], n: int, seed: int = 0) -> list[KernelConfig]:
    """The default (`space[0]`) and n - 1 more configs of `space`, in space order after the default: first,
    greedily, the config that shows the most (tunable, value) pairs not yet shown (each tunable weighing the
    same; ties broken by a seeded shuffle), so that every value of every tunable appears once n allows it;
    then, with room left, a seeded random sample of the rest. The whole space when n >= len(space)."""
    if n >= len(space):
        return list(space)
    n = max(1, n)
    rest = list(range(1, len(space)))
    random.Random(seed).shuffle(rest)  # the tie-break order
    chosen = [0]
    every = set().union(*(_pairs(c) for c in space))
    # each tunable weighs the same: one of its values counts 1 / (its number of values), so that a flag's other
    # value (`single_pass=True`) comes before the seventh tile size
    weight = {pair: 1 / sum(p[0] == pair[0] for p in every) for pair in every}
    missing = every - _pairs(space[0])

    def gain(i: int) -> float:
        return sum(weight[p] for p in _pairs(space[i]) & missing)

    while len(chosen) < n and missing:
        best = max(rest, key=gain)  # max keeps the first of equals: the seeded order breaks ties
        if not gain(best):
            break
        chosen.append(best)
        rest.remove(best)
        missing -= _pairs(space[best])
    chosen += rest[: n - len(chosen)]  # seeded: `rest` was shuffled
    return [space[0], *(space[i] for i in sorted(chosen[1:]))]


LIMIT = 4  # winners of this many nearest entries are seeds
# What a difference of one non-size key field weighs, in units of |log(size ratio)| (a factor e in one size):
# a config tuned for the other direction of the same shape is a weaker guess than one tuned for 2x the tokens.
FIELD_WEIGHT = {"direction": 3.0, "distribution": 0.5}
OTHER_FIELD_WEIGHT = 1.0  # weighted, glu, ... (dtypes and quantization must match: `same_numerics`)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """The seeds (configs of the space, nearest source first, the default left out) and where they came from."""

    seeds: tuple[KernelConfig, ...] = ()
    # {"key", "distance", "config" (the winner), "seed" (its label), "kept_default" (its winner was its default)}
    sources: tuple[dict[str, Any], ...] = ()
    cold: bool = False  # turned off (`--cold`)
    local: bool = False  # the strategy searched only around the seeds (`Strategy.local`)

    @property
    def defaults_held(self) -> bool:
        """Whether every source kept its own default (the heuristic held at every tuned neighbour)."""
        return bool(self.sources) and all(s.get("kept_default") for s in self.sources)

    def describe(self) -> str:
        """One line for the sweep's output and log."""
        if self.cold:
            return "cold start (--cold)"
        if not self.sources:
            return "cold start (no tuned entry of this op and backend nearby)"
        said = (f"warm {'local search' if self.local else 'start'} from {len(self.sources)} tuned entr{'y' if len(self.sources) == 1 else 'ies'}: "
                + "; ".join(f"{s['key'].split('|', 1)[1]} -> {s['seed']}" for s in self.sources))
        if not self.seeds:
            return said + " (each the default here: no seed to add)"
        return said + (" (each kept its default: the nearest seed only)" if self.defaults_held else "")

    def to_json(self) -> dict[str, Any]:
        return {"cold": self.cold, "local": self.local, "seeds": [s.to_dict() for s in self.seeds], "sources": list(self.sources)}


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# Key fields of the numerics: the dtypes (`dtype`, `lhs_dtype`, `rhs_qdtype`, ...) and the quantization
# (`rhs_qblock`, `lhs_qdynamic`, ...). A seed comes only from an entry where all of them are the same.
_NUMERICS = re.compile(r"(^|_)(\w*dtype|q[a-z]+)$")


def same_numerics(fields: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two entries' key fields have the same dtypes and quantization (a field only one has differs)."""
    return all(fields.get(name) == other.get(name) for name in dict.fromkeys([*fields, *other])
               if _NUMERICS.search(name))


def distance(fields: Mapping[str, Any], other: Mapping[str, Any]) -> float | None:
    """How far a tuned entry's key fields are from this sweep's: the sum of |log ratio| of the positive integer
    fields (sizes, token counts), and a weight per other field that differs (`FIELD_WEIGHT`); None when the
    backend, a dtype or the quantization differs (`same_numerics`: such configs are no guess here)."""
    if other.get("backend") != fields.get("backend") or not same_numerics(fields, other):
        return None
    total = 0.0
    for name in dict.fromkeys([*fields, *other]):
        mine, theirs = fields.get(name), other.get(name)
        if mine == theirs:
            continue
        if _is_size(mine) and _is_size(theirs):
            total += abs(math.log(mine / theirs))
        else:
            total += FIELD_WEIGHT.get(name, OTHER_FIELD_WEIGHT)
    return total


def _config_distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """How far config `b` is from `a`: |log2 ratio| per positive numeric tunable, 1 per other differing one."""
    total = 0.0
    for name in dict.fromkeys([*a, *b]):
        x, y = a.get(name), b.get(name)
        if x == y:
            continue
        both = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (x, y))
        total += abs(math.log2(x / y)) if both else 1.0
    return total


def project(winner: Mapping[str, Any], space: Sequence[KernelConfig]) -> KernelConfig:
    """The config of `space` nearest to `winner` (a config's fields, possibly of another shape's space): itself
    when it is in the space; ties go to the earlier config."""
    return min(space, key=lambda c: _config_distance(winner, c.to_dict()))


def _tables(directories: Sequence[Path], device_kind: str, op: str) -> list[dict[str, Any]]:
    found, seen = [], set()
    for directory in directories:
        path = table_path(directory, device_kind, op)
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            found.append(read_table(path))
        except TableError:  # a broken table is lookup's and validate's to report; it just seeds nothing
            continue
    return found


def find(op: str, device_kind: str, fields: Mapping[str, Any], key: str, space: Sequence[KernelConfig], *,
         own_dir: Path | None = None, limit: int = LIMIT) -> WarmStart:
    """The seeds for a sweep of `key` (its key `fields`) over `space` (default first): the winners of the
    `limit` nearest tuned entries of the same op, backend and device kind (any profile dir, and `own_dir`,
    where the sweep writes), mapped onto the space. The entry of `key` itself is not used."""
    directories = ([own_dir] if own_dir is not None else []) + [d for _, d in search_dirs()]
    ranked: list[tuple[float, str, dict[str, Any]]] = []
    for table in _tables(directories, device_kind, op):
        for other_key, entry in table["entries"].items():
            if other_key == key or entry.get("interrupted") or not isinstance(entry.get("config"), dict):
                continue
            d = distance(fields, entry["fields"])
            if d is not None:
                ranked.append((d, other_key, entry))
    ranked.sort(key=lambda item: (item[0], item[1]))
    seeds: list[KernelConfig] = []
    sources: list[dict[str, Any]] = []
    for d, other_key, entry in ranked:
        if len(sources) >= limit:
            break
        if any(s["key"] == other_key for s in sources):  # the same key in two profile dirs: the first wins
            continue
        seed = project(entry["config"], space)
        sources.append({"key": other_key, "distance": round(d, 3), "config": entry["config"], "seed": seed.label(),
                        "kept_default": kept_default(entry)})
        if seed != space[0] and seed not in seeds:
            seeds.append(seed)
    start = WarmStart(tuple(seeds), tuple(sources))
    # every neighbour kept its default: the evidence is for the heuristic; one seed checks it (module doc)
    return dataclasses.replace(start, seeds=start.seeds[:1]) if start.defaults_held else start


def kept_default(entry: Mapping[str, Any]) -> bool:
    """Whether a table entry's winner is its own default config (the default was fastest, or the best did
    not beat it past the noise); False when the entry does not say what its default was."""
    default = entry.get("default")
    return isinstance(default, dict) and default.get("config") == entry.get("config")
