"""The state one run of a sweep shares between its stages: the inputs and the reference, the finished
candidates (restored from the log or measured now), and what the run has spent.

Every stage (search, measure, finals, record) reads and updates one `SweepState`; `finished` is the one way
a candidate becomes finished: its line is appended to the sweep log first, so nothing finished is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from moe_tune.kernels.base import KernelConfig
from moe_tune.tuner import record
from moe_tune.tuner.candidates import OK, Candidate
from moe_tune.tuner.log import SweepLog
from moe_tune.tuner.spec import Reporter, SweepPlan, SweepSpec


@dataclasses.dataclass
class SweepState:
    plan: SweepPlan
    log: SweepLog
    reporter: Reporter
    started: float  # perf_counter() when the sweep started
    host_inputs: dict[str, np.ndarray] | None = None
    expected: np.ndarray | None = None  # the reference output
    inputs: Any = None  # the inputs on the device
    done: list[Candidate] = dataclasses.field(default_factory=list)  # finished: restored or measured
    measured: dict[KernelConfig, Candidate] = dataclasses.field(default_factory=dict)  # what strategies see
    next_index: int = 0
    resumed: int = 0  # candidates restored from the log
    recompiled: int = 0  # XLA compilations spent again on candidates (finalists restored from the log)
    batches: int = 0
    fallback: str | None = None  # why a batch was timed by the wall clock, if one was
    stopped: str | None = None  # why the search stopped
    stage_s: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"compile": 0.0, "check": 0.0, "time": 0.0})  # wall time per stage

    @property
    def spec(self) -> SweepSpec:
        return self.plan.spec

    def prepare_inputs(self) -> None:
        """Seeded inputs, the reference output, and the inputs on the device."""
        op, spec = self.plan.op, self.plan.spec
        self.host_inputs = op.make_inputs(spec.problem, spec.distribution, spec.seed)
        self.expected = op.reference(spec.problem, self.host_inputs)
        self.inputs = jax.device_put(self.host_inputs)

    @contextlib.contextmanager
    def clock(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_s[stage] += time.perf_counter() - start

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self) -> bool:
        budget = self.spec.time_budget_s
        return bool(self.measured) and budget is not None and self.elapsed_s() > budget

    def add(self, cand: Candidate) -> None:
        self.done.append(cand)
        self.measured[cand.config] = cand

    def finished(self, cands: list[Candidate], batch: int | None = None) -> None:
        """Log finished candidates (one write and fsync), then count them as measured."""
        if not cands:
            return
        self.log.append([record.candidate_line(c, batch) for c in cands])
        for c in cands:
            self.add(c)

    def default(self) -> Candidate | None:
        return next((c for c in self.done if c.is_default), None)

    def best_median(self) -> float | None:
        """The fastest median among the candidates timed so far (restored ones included), or None."""
        return min((c.timing.median_s for c in self.done if c.status == OK and c.timing is not None), default=None)
