"""One sweep: every candidate of one backend for one problem, compiled in parallel, checked against the
reference, timed from the profiler trace; the winner (and everything about how it won) becomes a table
entry.

Rules (DESIGN.md): a wrong candidate never wins; the default config is always a candidate, so the speedup
over it is always measured; a failing candidate is recorded with its reason and the sweep goes on. The
fastest few are re-timed together with the default before a winner is chosen (`_final_round`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from moe_tune import devices, distributions
from moe_tune.errors import MoeTuneError, UsageError
from moe_tune.kernels import get_op
from moe_tune.profiles import dirs
from moe_tune.profiles.key import key_fields, key_from_fields
from moe_tune.profiles.table import write_entries
from moe_tune.tuner.candidates import FAILED, OK, WRONG, Candidate, check_all, compile_all
from moe_tune.tuner.timing import Timing, time_candidates


class SweepError(MoeTuneError):
    """The sweep could not produce a winner (every candidate failed or was wrong)."""


class Reporter:
    """Progress callbacks; the CLI draws them with rich, the library default ignores them."""

    def stage(self, name: str, total: int) -> None:
        pass

    def advance(self, name: str, amount: int = 1) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    op: str
    problem: Any
    backend: str | None = None  # None: the platform's default backend
    distribution: str = distributions.DEFAULT
    seed: int = 0
    samples: int = 5
    workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    profile_dir: Path | None = None  # None: $MOE_TUNE_PROFILE_DIR, else the user cache dir
    max_candidates: int | None = None  # keep the first N of the search space (default first)
    finalists: int = 4  # the fastest N (and the default) are re-timed together before the winner is chosen
    compile_timeout_s: float = 600.0  # per candidate, in compile workers
    keep_trace_dir: Path | None = None

    def __post_init__(self) -> None:
        distributions.check_name(self.distribution)
        if self.samples < 1:
            raise UsageError(f"samples must be >= 1, got {self.samples}")
        if self.workers < 1:
            raise UsageError(f"workers must be >= 1, got {self.workers}")
        if self.finalists < 1:
            raise UsageError(f"finalists must be >= 1, got {self.finalists}")


@dataclasses.dataclass
class SweepResult:
    spec: SweepSpec
    key: str
    entry: dict[str, Any]
    candidates: list[Candidate]
    table_path: Path
    wall_s: float

    @property
    def best(self) -> Candidate:
        return next(c for c in self.candidates if c.config.to_dict() == self.entry["config"] and c.status == OK)

    @property
    def default(self) -> Candidate:
        return next(c for c in self.candidates if c.is_default)


def versions() -> dict[str, str]:
    found = {}
    for dist in ("jax", "jaxlib", "moe-tune", "tune-jax"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "unknown"
    return found


def run_sweep(spec: SweepSpec, reporter: Reporter | None = None) -> SweepResult:
    """Tune one (op, backend, problem, distribution) and write the winning entry; returns everything."""
    reporter = reporter or Reporter()
    started = time.perf_counter()
    op = get_op(spec.op)
    platform = devices.platform()
    backend = op.backends.resolve(spec.backend, platform)
    if not backend.runs_on(platform):
        raise UsageError(f"backend {backend.name!r} does not run on {platform}")
    problem = spec.problem
    configs = backend.search_space(problem)
    if spec.max_candidates is not None:
        configs = configs[: max(1, spec.max_candidates)]
    candidates = [Candidate(i, cfg, is_default=(i == 0)) for i, cfg in enumerate(configs)]

    host_inputs = op.make_inputs(problem, spec.distribution, spec.seed)
    expected = op.reference(problem, host_inputs)
    inputs = jax.device_put(host_inputs)

    reporter.stage("compile", len(candidates))
    compile_all(op, backend, problem, candidates, inputs, workers=spec.workers,
                on_done=lambda c: reporter.advance("compile"), timeout=spec.compile_timeout_s)
    reporter.stage("check", len(candidates))
    check_all(candidates, inputs, expected, op.tolerance(problem), on_done=lambda c: reporter.advance("check"))
    survivors = [c for c in candidates if c.status == OK]
    if not survivors:
        reasons = "; ".join(f"{c.config.label()}: {c.reason}" for c in candidates[:3])
        raise SweepError(f"no candidate of {backend.name} compiled and passed the check ({reasons})")

    reporter.stage("time", spec.samples)
    timings, fallback = time_candidates(
        {c.index: (lambda c=c: c.executable(inputs)) for c in survivors},
        samples=spec.samples, platform=platform, seed=spec.seed, keep_trace_dir=spec.keep_trace_dir,
        on_round=lambda r: reporter.advance("time"),
    )
    for c in survivors:
        c.timing = timings[c.index]
    default = candidates[0]
    best, within_noise, final_fallback = _final_round(spec, survivors, default, inputs, platform, reporter)
    fallback = fallback or final_fallback

    fields = key_fields(problem, backend.name, spec.distribution)
    key = key_from_fields(spec.op, fields)
    entry = _entry(spec, key, fields, problem, best, default, candidates, fallback, host_inputs)
    entry["within_noise_of_default"] = within_noise
    entry["sweep_wall_s"] = round(time.perf_counter() - started, 3)
    directory = dirs.write_dir(spec.profile_dir)
    path = write_entries(dirs.table_path(directory, devices.device_kind(), spec.op), spec.op,
                         devices.device_kind(), [entry])
    return SweepResult(spec, key, entry, candidates, path, time.perf_counter() - started)


def relative_noise(timing: Timing) -> float:
    """Median absolute deviation of the samples over their median: a spread that ignores outliers."""
    med = timing.median_s
    return statistics.median(abs(x - med) for x in timing.samples_s) / med if med > 0 else 0.0


def _final_round(spec: SweepSpec, survivors: list[Candidate], default: Candidate, inputs, platform, reporter):
    """Re-time the fastest few and the default together, with twice the samples, and pick the winner there.

    One sweep round's medians of near-equal candidates are mostly noise on a shared machine; the finalists
    are compared like for like. A winner that beats the default by less than the noise (twice the larger
    relative MAD of the two) is not a win: the default is kept and the entry says so.
    Returns (winner, whether the default was kept for being within noise, timing fallback reason).
    """
    ranked = sorted(survivors, key=lambda c: c.timing.median_s)
    finalists = ranked[: spec.finalists]
    if default.status == OK and default not in finalists:
        finalists.append(default)
    if len(finalists) < 2:
        return ranked[0], False, None
    reporter.stage("finalists", 2 * spec.samples)
    final, fallback = time_candidates(
        {c.index: (lambda c=c: c.executable(inputs)) for c in finalists},
        samples=2 * spec.samples, platform=platform, seed=spec.seed + 1,
        on_round=lambda r: reporter.advance("finalists"),
    )
    for c in finalists:
        c.timing = final[c.index]
    best = min(finalists, key=lambda c: c.timing.median_s)
    if best is default or default.status != OK:
        return best, False, fallback
    noise = 2 * max(relative_noise(best.timing), relative_noise(default.timing))
    if default.timing.median_s / best.timing.median_s - 1 <= noise:
        return default, True, fallback
    return best, False, fallback


def _entry(spec, key, fields, problem, best, default, candidates, fallback, host_inputs) -> dict[str, Any]:
    counts = {s: sum(c.status == s for c in candidates) for s in (OK, FAILED, WRONG)}
    default_ok = default.status == OK
    return {
        "key": key,
        "op": spec.op,
        "fields": fields,
        "config": best.config.to_dict(),
        "timing": best.timing.to_dict(),
        "timing_fallback": fallback,
        "default": {
            "config": default.config.to_dict(),
            "status": default.status,
            "median_s": default.timing.median_s if default_ok else None,
            "reason": default.reason or None,
        },
        "speedup_over_default": default.timing.median_s / best.timing.median_s if default_ok else None,
        "candidates": {"tried": len(candidates), "ok": counts[OK], "failed": counts[FAILED], "wrong": counts[WRONG],
                       "compiles": sum(c.compiles for c in candidates)},
        "failures": [c.record() for c in candidates if c.status != OK],
        "results": [c.record() for c in candidates if c.status == OK],
        "distribution": {
            "name": spec.distribution,
            "seed": spec.seed,
            **get_op(spec.op).distribution_record(problem, spec.distribution, spec.seed, host_inputs),
        },
        "flops": get_op(spec.op).flops(problem),
        "versions": versions(),
        "platform": devices.platform(),
        "device_kind": devices.device_kind(),
        "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
