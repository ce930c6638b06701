"""Two (or more) configs of one backend timed side by side on one problem: what a ladder sweep
(`campaign.ladder`) measures between two tuned token counts whose winners differ, and what a
`--distribution all` sweep measures to find the config robust across routing distributions.

The tuning rules hold here too: every config's output is checked against the op's reference first (a wrong
or unusable config is recorded with its reason and never counts as faster), and the configs are timed
interleaved in the same profiler-trace rounds (`timing.time_candidates`), so that their ratio is not
run-to-run noise.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any

import jax

from moe_tune.core import devices
from moe_tune.kernels import get_op
from moe_tune.kernels.kernel_op import relative_error
from moe_tune.profiles.verdict import paired_ratios
from moe_tune.tuner.compiling import Kernel
from moe_tune.tuner.measure import samples_for_time
from moe_tune.tuner.timing import time_candidates

# Samples per config: the finalists' floor (`profiles.verdict.MIN_FINAL_SAMPLES` is 5) and a little more,
# since a boundary is decided by one comparison.
SAMPLES = 7


@dataclasses.dataclass(frozen=True)
class SideBySide:
    """The times of `configs` (name -> config JSON) on one problem. `median_s` / `spread`: per name, of the
    configs that ran and were correct; `unusable`: name -> why not (invalid for this problem, failed to
    compile or run, wrong output); `method`: how it was timed (`trace`, or `wall` with `fallback` saying why)."""

    median_s: dict[str, float]
    spread: dict[str, float]
    samples: int
    method: str
    fallback: str | None
    unusable: dict[str, str]
    # per name, every sample (s), in round order: for a caller's own statistics; not part of `to_json`
    samples_s: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)

    def fastest(self) -> str | None:
        """The name of the fastest usable config (None when none is usable)."""
        return min(self.median_s, key=self.median_s.__getitem__) if self.median_s else None

    def ratio(self, name: str, over: str) -> float | None:
        """`name`'s time over `over`'s: the median of their per-round ratios when both have the same number of
        samples (they ran in the same rounds, so a round slowed by load slows both), else the ratio of their
        medians; None when either is unusable."""
        if name not in self.median_s or over not in self.median_s:
            return None
        mine, theirs = self.samples_s.get(name, ()), self.samples_s.get(over, ())
        if mine and len(mine) == len(theirs):
            return statistics.median(paired_ratios(mine, theirs))
        return self.median_s[name] / self.median_s[over]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["samples_s"]  # a table's interval evidence keeps medians and spreads, not every sample
        return out


def time_side_by_side(op: str, backend: str, problem: Any, configs: Mapping[str, Mapping[str, Any]], *,
                      distribution: str, seed: int = 0, samples: int = SAMPLES, time_s: float = 0.0) -> SideBySide:
    """Check and time `configs` (name -> a config's JSON, as a table holds it) of `backend` on `problem`, with
    seeded inputs routed by `distribution`, in this process (each config compiles once). `time_s`: short calls
    get more than `samples`, about this many seconds of calls each (from the slowest check call's wall time,
    `finals.samples_for_time`), as the finals give short finalists."""
    kernel_op = get_op(op)
    impl = kernel_op.backends.get(backend)
    kernel = Kernel(kernel_op, impl, problem)
    host = kernel_op.make_inputs(problem, distribution, seed)
    expected = kernel_op.reference(problem, host)
    inputs = jax.device_put(host)
    unusable: dict[str, str] = {}
    calls: dict[int, Any] = {}
    names = list(configs)
    slowest_s = 0.0
    for index, name in enumerate(names):
        try:
            config = impl.coerce_config(dict(configs[name]), problem)
            compiled, _ = kernel.compile(config, index, inputs)
            start = time.perf_counter()
            out = jax.block_until_ready(compiled(inputs))
            slowest_s = max(slowest_s, time.perf_counter() - start)
            error = relative_error(jax.device_get(out), expected)
        except Exception as e:  # noqa: BLE001 - a config that cannot run here loses, with its reason
            unusable[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        tolerance = kernel_op.tolerance(problem, config)
        if not error <= tolerance:
            unusable[name] = f"wrong: relative error {error:.3g} > tolerance {tolerance:.3g}"
            continue
        calls[index] = lambda compiled=compiled: compiled(inputs)
    if not calls:
        return SideBySide({}, {}, 0, "none", None, unusable)
    # the check above was each executable's first call (on CPU, a warm one: `timing.first_call_is_warm`)
    samples = samples_for_time(samples, time_s, slowest_s)
    timings, fallback = time_candidates(calls, samples=samples, platform=devices.platform(), seed=seed, warmup=0)
    return SideBySide({names[i]: t.median_s for i, t in timings.items()},
                      {names[i]: t.spread for i, t in timings.items()}, samples,
                      next(iter(timings.values())).method, fallback, unusable,
                      {names[i]: t.samples_s for i, t in timings.items()})
