"""What one sweep is asked to do (`SweepRequest`: op, problem, backend, settings) and the plan resolved from
it once (`SweepPlan`: the op object, the backend, the kernel bound from them, the key, the search space,
the settings as they are recorded, the sweep's identity, the log's and the table's paths).

The settings are serialized in one place (`SweepPlan.settings_json`): the sweep log's header, the log's name
(through `identity`) and the entry's `search` record all take their fields from it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from moe_tune.core import devices
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.profiles import dirs
from moe_tune.profiles.key import key_fields, key_from_fields
from moe_tune.targets.records import uncompilable
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner import sampling
from moe_tune.tuner.kernel import Kernel
from moe_tune.tuner.sweep_settings import SweepSettings

# The settings that decide which candidates a sweep has and how they are measured: two sweeps that differ in
# one of them are different sweeps (another log file; never resumed from each other's log).
IDENTITY_FIELDS = ("seed", "samples", "race", "strategy", "budget", "max_candidates")
# The settings an entry's `search` record repeats (with how the search went).
# (`space`: the candidates the strategy chose from, after --max-candidates; `full_space`: the backend's whole
# search space; `samples`: of the sweep round. `profiles.evidence` reads them as the entry's budget.)
SEARCH_FIELDS = ("strategy", "budget", "time_budget_s", "max_candidates", "space", "full_space", "samples",
                 "batch_size")


@dataclasses.dataclass(frozen=True)
class SweepRequest:
    """One sweep: `op` (its name), `problem` (the op's problem object), `backend` (its name; None: the
    platform's default backend for the op) and how to sweep (`settings`)."""

    op: str
    problem: Any
    backend: str | None = None
    settings: SweepSettings = dataclasses.field(default_factory=SweepSettings)

    @classmethod
    def make(cls, op: str, problem: Any, *, backend: str | None = None, **settings: Any) -> SweepRequest:
        """`SweepRequest(op, problem, backend, SweepSettings(**settings))`: for scripts and tests."""
        return cls(op, problem, backend, SweepSettings(**settings))


def as_json(value: Any) -> Any:
    """`value` as it reads back from JSON (so that a header compares equal to the one in the log)."""
    return json.loads(json.dumps(value, default=str))


class SweepPlan:
    """A `SweepRequest` resolved once on this machine: the op, backend, kernel, key and search space."""

    def __init__(self, request: SweepRequest):
        self.request = request
        self.op: KernelOp = get_op(request.op)
        self.platform = devices.platform()
        self.device_kind = devices.device_kind()
        self.backend: Backend = self.op.backends.resolve(request.backend, self.platform)
        self.kernel = Kernel(self.op, self.backend, request.problem)
        self.fields = key_fields(request.problem, self.backend.name, request.settings.distribution)
        self.key = key_from_fields(request.op, self.fields)
        self.directory = dirs.write_dir(request.settings.profile_dir)

    def check_runs_here(self) -> None:
        if not self.backend.runs_on(self.platform):
            raise UsageError(f"backend {self.backend.name!r} does not run on {self.platform}")

    @functools.cached_property
    def full_space(self) -> list[KernelConfig]:
        """The backend's search space for the problem (valid configs, default first), less the configs that
        compile records (`moe-tune sweep --target`, `targets/records.py`) say fail on this chip (the default
        stays: the sweep measures it whatever happens)."""
        space = self.backend.search_space(self.request.problem)
        failing = uncompilable(self.directory, self.device_kind, self.request.op, self.backend.name,
                               self.request.problem)
        if failing:
            space = space[:1] + [c for c in space[1:] if c.label() not in failing]
        return space

    @functools.cached_property
    def space(self) -> list[KernelConfig]:
        """`full_space`, or with max_candidates the default and a seeded sample spread across it
        (`sampling.spread`: the same candidates for the same seed, so a resumed sweep gets them again)."""
        limit = self.request.settings.max_candidates
        return self.full_space if limit is None else sampling.spread(self.full_space, limit,
                                                                     self.request.settings.seed)

    @functools.cached_property
    def settings_json(self) -> dict[str, Any]:
        """The sweep's settings as JSON reads them back: the one serialization of them (the log header's
        `spec`, the identity, the entry's `search`)."""
        s = self.request.settings
        return as_json({"op": self.request.op, "backend": self.backend.name, "distribution": s.distribution,
                        "seed": s.seed, "samples": s.samples, "race": s.race, "strategy": s.strategy,
                        "budget": s.budget, "time_budget_s": s.time_budget_s, "max_candidates": s.max_candidates,
                        "finalists": s.finalists, "batch_size": s.batch_size, "space": len(self.space),
                        "full_space": len(self.full_space)})

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """What makes two sweeps the same sweep: the same candidates, measured the same way."""
        problem = self.request.problem
        optional = getattr(type(problem), "OPTIONAL_KEY_FIELDS", ())
        # an optional key field that is off (False: ragged_dot's lhs_qdynamic) is left out, as the key leaves it,
        # so that the identity of every problem without it hashes as it did before the field existed
        problem = ({k: v for k, v in dataclasses.asdict(problem).items() if not (k in optional and v is False)}
                   if dataclasses.is_dataclass(problem) else repr(problem))
        return as_json({"key": self.key, "problem": problem, **{k: self.settings_json[k] for k in IDENTITY_FIELDS}})

    def search_settings(self) -> dict[str, Any]:
        return {k: self.settings_json[k] for k in SEARCH_FIELDS}

    @property
    def log_path(self) -> Path:
        return sweep_log.log_path(self.directory, self.device_kind, self.request.op,
                                  sweep_log.log_name(self.fields, self.identity))

    @property
    def table_path(self) -> Path:
        return dirs.table_path(self.directory, self.device_kind, self.request.op)
