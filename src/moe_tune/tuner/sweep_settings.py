"""How to sweep: one typed, frozen record of every setting that is not the op, the problem or the backend.

The CLI builds one `SweepSettings` from its flags; every sweep of a campaign (one shape, a `--model` layer, a
list of shapes, on Ray or here) runs with it. A Ray task overrides what differs there (its scratch profile
dir) with `dataclasses.replace`, which validates again.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from moe_tune.core import distributions
from moe_tune.core.errors import UsageError
from moe_tune.tuner import strategies


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    """Validated on construction: UsageError (one line) for a bad value."""

    distribution: str = distributions.DEFAULT  # of the rows (tokens) over groups (experts)
    seed: int = 0  # of the inputs, the group sizes and the random strategy
    # first-round samples per candidate: enough to rank them roughly; the finalists are re-timed side by side
    # with twice as many (at least profiles.verdict.MIN_FINAL_SAMPLES), which is where the winner is decided
    samples: int = 3
    # racing: after the first round, a candidate slower than this factor times the best known gets no more
    # samples, nor does one whose median can no longer make it a finalist (see timing.time_candidates);
    # None times every candidate `samples` times
    race: float | None = 1.5
    strategy: str = "grid"  # see tuner.strategies
    budget: int | None = None  # at most this many candidates
    time_budget_s: float | None = None  # start no new chunk of candidates after this many seconds
    max_candidates: int | None = None  # the default and a seeded sample spread across the space (tuner.sampling)
    workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    profile_dir: Path | None = None  # None: $MOE_TUNE_PROFILE_DIR, else the user cache dir
    keep_trace_dir: Path | None = None  # keep the profiler traces (xplane) here
    fresh: bool = False  # delete the sweep log first (no resume)
    finalists: int = 4  # the fastest N (and the default) are re-timed together before the winner is chosen
    # the final round gives each finalist about this many seconds of calls (short calls get more than the
    # samples above, up to tuner.finals.MAX_FINAL_SAMPLES); 0 for the samples alone
    final_time_s: float = 0.3
    batch_size: int = 8  # candidates timed together (interleaved); a kill loses at most one batch
    compile_timeout_s: float = 600.0  # per candidate, compile + first run in a worker (not its start-up)
    cold: bool = False  # no warm start: do not seed the search with the nearest tuned shapes' winners

    def __post_init__(self) -> None:
        distributions.check_name(self.distribution)
        for name in ("samples", "workers", "finalists", "batch_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:  # NumPy's seeds are unsigned 32-bit
            raise UsageError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if not self.final_time_s >= 0:
            raise UsageError(f"final_time_s must be >= 0, got {self.final_time_s}")
        if self.race is not None and not self.race > 1:
            raise UsageError(f"race must be > 1 (or None, no racing), got {self.race}")
        strategies.check(self.strategy, self.budget, self.time_budget_s)
