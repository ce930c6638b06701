"""What a stage of a sweep did, returned (yielded) by the stage rather than written onto shared state.

The search, measure and finals stages are generators: each yields a `Step` when it has done something the
entry records (a batch timed, a timing fallback, compilations spent again, candidates restored from the
log, why the search stopped) and returns its result. The sweep's runner sums the steps (`Tally`), so that
what the stages did up to a KeyboardInterrupt is still known when it writes the interrupted entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Step:
    batches: int = 0  # timing batches timed
    fallback: str | None = None  # why a batch was timed by the wall clock, if one was
    recompiled: int = 0  # XLA compilations spent again (finalists restored from the log, warm-up failures)
    resumed: int = 0  # candidates restored from the sweep log
    stopped: str | None = None  # why the search stopped

    def __add__(self, other: Step) -> Step:
        """Counts add up; the first fallback and the last stop reason are kept."""
        return Step(self.batches + other.batches, self.fallback or other.fallback,
                    self.recompiled + other.recompiled, self.resumed + other.resumed,
                    other.stopped or self.stopped)


class Tally:
    """The runner's sum of the steps its stages yielded."""

    def __init__(self) -> None:
        self.total = Step()

    def run(self, stage: Generator[Step, None, T]) -> T:
        """Run a stage to its end, adding up its steps; returns what the stage returns."""
        while True:
            try:
                step = next(stage)
            except StopIteration as done:
                return done.value
            self.total += step

