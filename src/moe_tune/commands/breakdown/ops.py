"""A breakdown's types, and per-op trace events summed into self times.

On CPU every HLO op that runs is one event (a thunk) with `hlo_op`, `hlo_module` and `run_id` stats; ops
nest (a `while` loop's event holds its body's events), so an op's own time is its events' durations less
those of the op events nested directly inside them: a loop's own time is its overhead, its body's ops
are counted as themselves. Both CPU readers (the xplane here, xprof's `trace_viewer` events) feed the
same `OpEvent`s to `self_times`, so they can only differ in what they read.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One execution of one op. line: the trace line (thread) it ran on; start_ns, duration_ns."""

    line: Hashable
    op: str
    start_ns: float
    duration_ns: float


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One op's (or kernel's) share of a breakdown. seconds and count: per run of the program; share: of
    the breakdown's total (0..1); group: xprof's HLO op category (hlo_stats), the HLO op a GPU kernel runs
    (kernel_stats), "" on CPU."""

    name: str
    seconds: float
    count: float
    share: float
    group: str = ""


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Time per op of one config of one entry, largest first.

    label: "winner" / "default" (and for GPU kernel tables "winner kernels"...); config: the config as JSON;
    source: which reader made it ("trace": the xplane's per-op events; "xprof trace_viewer", "xprof
    hlo_stats", "xprof kernel_stats"); runs: how many runs were profiled (times are per run); total_s: the
    sum of the ops' times per run (on CPU: op time on all threads, which can exceed the wall time when ops
    run in parallel); trace_dir: where the trace was kept (None: deleted); wall_s: the wall time per run of the
    traced runs, by the host's clock (None: not measured)."""

    label: str
    config: Mapping[str, Any]
    source: str
    runs: int
    ops: tuple[OpTime, ...]
    trace_dir: str | None = None
    wall_s: float | None = None

    @property
    def total_s(self) -> float:
        return sum(op.seconds for op in self.ops)

    @property
    def untraced_share(self) -> float:
        """The share of the wall time per run that no op event covers (0 when the ops cover it all or the wall
        time was not measured). On CPU it is not noise: XLA runs its large dots on its own threads, and the
        dot's event covers only handing the work over (a tgmm whose bf16 windows XLA ran on float32 copies
        spent most of its time there: FINDINGS.md: bf16 drhs transposed lhs), so read an op table whose share is
        large with care."""
        if not self.wall_s:
            return 0.0
        return max(0.0, 1.0 - self.total_s / self.wall_s)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "config": dict(self.config), "source": self.source, "runs": self.runs,
                "total_s": self.total_s, "wall_s": self.wall_s, "untraced_share": self.untraced_share,
                "trace_dir": self.trace_dir, "ops": [dataclasses.asdict(op) for op in self.ops]}


def ranked(totals: Mapping[str, float], counts: Mapping[str, float], runs: int,
           groups: Mapping[str, str] | None = None) -> tuple[OpTime, ...]:
    """OpTimes from per-op totals over `runs` runs (seconds, executions), largest first."""
    whole = sum(totals.values()) or 1.0
    ops = [OpTime(name, seconds / runs, counts.get(name, 0) / runs, seconds / whole,
                  (groups or {}).get(name, "")) for name, seconds in totals.items()]
    return tuple(sorted(ops, key=lambda op: (-op.seconds, op.name)))


def self_times(events: Iterable[OpEvent]) -> tuple[dict[str, float], dict[str, int]]:
    """(op -> summed self time in seconds, op -> executions) of `events`: on each line, an event's time
    less that of the events nested directly inside it."""
    by_line: dict[Hashable, list[OpEvent]] = defaultdict(list)
    for event in events:
        by_line[event.line].append(event)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for line in by_line.values():
        line.sort(key=lambda e: (e.start_ns, -e.duration_ns))  # a parent before the children it holds
        open_events: list[tuple[float, str]] = []  # (end, op) of the events enclosing the current one
        for event in line:
            while open_events and open_events[-1][0] <= event.start_ns:
                open_events.pop()
            if open_events:
                totals[open_events[-1][1]] -= event.duration_ns * 1e-9
            totals[event.op] += event.duration_ns * 1e-9
            counts[event.op] += 1
            open_events.append((event.start_ns + event.duration_ns, event.op))
    return dict(totals), dict(counts)
