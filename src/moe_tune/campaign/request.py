"""A tuning campaign as one typed request, and what each of its sweeps comes back as.

`Campaign`: the kernel cases to tune, how every sweep runs (`SweepSettings`), the backend asked for, where it
runs (`Where`: here, on a Ray cluster, as share I of N, or as a dry run that only prints the plan) and its
passes (`Passes`: the sweeps, once per routing distribution; then a ladder's boundaries, the config robust
across distributions; or, instead of sweeping, compiling every candidate for a chip this machine does not
have). `runner.run` plans it once (`plan`, below) and runs its passes in order.

`Campaign.placed()` is the one check of where it runs: which passes can run there. Compiling for a chip runs
on this machine (not on Ray); the ladder's boundaries and the robust choice time the whole plan's winners side
by side in this process, so a campaign on Ray or a share of one leaves them out, and says how to measure them.

`SweepOutcome`: how one sweep ended, wherever it ran (this process or a Ray task).

The plan (`plan`): every sweep (one table key each) across models, token counts, ep values and
directions, duplicates removed, largest first; its shares (`shard`) for job arrays; and which of its sweeps a
target table already holds (`split_done`). One shape is a campaign of one sweep; a `--model` layer, a list of
shapes and several models are campaigns of many: all are planned here, and removing duplicates (one sweep per
table key) happens here only.

A sweep is the unit of work: its candidates are never split across devices (timings from two devices are not
comparable, and the final round re-times the finalists side by side on one device). The order is
deterministic, so every shard of a job array computes the same plan and takes a disjoint share of it.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tune.core.errors import MoeTuneError, UsageError
from moe_tune.kernels import get_op
from moe_tune.layer.models import KernelCase, get_preset, layer_cases, presets
from moe_tune.profiles.entry import Entry, entry_key
from moe_tune.profiles.table import is_complete, table_entries, table_path, write_dir
from moe_tune.tuner.request import SweepRequest, SweepSettings
from moe_tune.tuner.state import SweepResult


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call to tune: op, problem, and a label saying where it came from."""

    op: str
    problem: Any
    label: str


@dataclasses.dataclass(frozen=True)
class PlannedSweep:
    """One sweep of a campaign. `problem`: the op's problem object (`RaggedDotProblem` / `GatherProblem`);
    `backend`: the backend's name on the campaign's platform; `key`: its table key (`profiles.entry`);
    `label`: where it first came from (`deepseek-v3 gate/up fwd tokens=4096 ep=8`), for people."""

    op: str
    problem: Any
    backend: str
    key: str
    label: str
    # the other cases of the key whose problems differ in what the key does not hold (`represented`)
    also: tuple[Case, ...] = ()

    @property
    def size(self) -> tuple[int, int]:
        """(FLOPs, bytes of memory it needs): what `largest first` sorts by (the gathers have no FLOPs)."""
        op = get_op(self.op)
        return op.flops(self.problem), op.memory_estimate(self.problem)

    def request(self, settings: SweepSettings) -> SweepRequest:
        """This sweep, run with `settings`."""
        return SweepRequest(self.op, self.problem, self.backend, settings)


def model_campaign_cases(models: Sequence[str], tokens: Sequence[int], eps: Sequence[int], *, dtype: str,
                         quant: Mapping[str, Any] | None = None, direction: str = "all",
                         tp: int | None = None) -> tuple[list[Case], list[str]]:
    """(every kernel case one layer of each model runs at each token count and ep, notes): for training
    (`direction` all) or serving (fwd), `models.layer_cases`: at ep 1 (and `tp` None or 1) the one-device
    layer (`models.layer_runs`), else the layer across an ep x tp mesh (`tp` None: 1), `tokens` per device of
    the expert axis (`models.sharded_runs`). `models`: preset names, or `["all"]` for every preset. A (model,
    ep) whose ep does not divide the model's experts is left out with a note (a campaign over several models
    and ep values usually has some); an unknown model or a bad token count is a UsageError."""
    names = list(presets()) if list(models) == ["all"] else list(models)
    cases, notes = [], []
    for name in names:
        preset = get_preset(name)
        for ep in eps:
            if preset.experts % ep:
                notes.append(f"{name}: ep={ep} left out ({preset.experts} experts are not divisible by {ep})")
                continue
            for count, case in layer_cases(preset, list(tokens), ep=ep, dtype=dtype, quant=quant,
                                           direction=direction, tp=tp):
                cases.append(Case(case.op, case.problem, f"{name} {_role(case)} tokens={count} ep={ep}"))
    if not cases:
        raise UsageError("the campaign has no sweep: " + "; ".join(notes))
    return cases, notes


def _role(case: KernelCase) -> str:
    """`gate/up drhs`: the case's role in the layer, and its direction when its op has several."""
    several = len(get_op(case.op).directions) > 1
    return f"{case.role} {case.problem.key_fields()['direction']}" if several else case.role


def op_cases(op: str, problems: Iterable[Any]) -> list[Case]:
    """`sweep --op`: one case per problem (one per direction asked for)."""
    kernel_op = get_op(op)
    return [Case(op, problem, kernel_op.describe(problem)) for problem in problems]


def plan(cases: Iterable[Case], *, platform: str, distribution: str, backend: str | None = None,
         tunable: bool = False) -> list[PlannedSweep]:
    """The campaign's sweeps on `platform`: one per table key (the first case of a key names it; cases of
    the key with another problem are its `also`), largest first, ties in the order given. `backend`: None takes each op's default backend on `platform`, or with
    `tunable` the backend a chip of `platform` tunes (`BackendRegistry.tunable_for`: compile-only checks)."""
    by_key: dict[str, PlannedSweep] = {}
    for case in cases:
        registry = get_op(case.op).backends
        chosen = registry.tunable_for(platform) if backend is None and tunable else registry.resolve(backend, platform)
        name = chosen.name
        key = entry_key(case.op, case.problem, name, distribution)
        first = by_key.setdefault(key, PlannedSweep(case.op, case.problem, name, key, case.label))
        if case.problem != first.problem and all(case.problem != c.problem for c in first.also):
            by_key[key] = dataclasses.replace(first, also=(*first.also, case))
    sweeps = list(by_key.values())
    sizes = [s.size for s in sweeps]
    order = sorted(range(len(sweeps)), key=lambda i: (-sizes[i][0], -sizes[i][1], i))
    return [sweeps[i] for i in order]


def shard(sweeps: Sequence[PlannedSweep], index: int, count: int) -> list[PlannedSweep]:
    """The `index`-th (0-based) of `count` disjoint shares whose union is `sweeps`: every count-th sweep
    from the index-th. The plan is largest first, so the shares get about equal work."""
    if not 0 <= index < count:
        raise UsageError(f"share {index} of {count}: the index must be 0 to {count - 1}")
    return list(sweeps[index::count])


def parse_shard(text: str) -> tuple[int, int]:
    """`"2/8"` -> (2, 8); UsageError (one line) for anything else."""
    parts = text.split("/")
    try:
        index, count = (int(part) for part in parts)
    except ValueError:
        raise UsageError(f"--shard {text!r}: expected I/N, e.g. 0/4 (the I-th of N shares, 0-based)") from None
    if count < 1:
        raise UsageError(f"--shard {text!r}: N must be at least 1")
    if not 0 <= index < count:
        raise UsageError(f"--shard {text!r}: I must be 0 to {count - 1} (the shares are counted from 0)")
    return index, count


def shard_from_env(environ: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(index, count) of this task of a SLURM job array (`SLURM_ARRAY_TASK_ID` counted from
    `SLURM_ARRAY_TASK_MIN`, `SLURM_ARRAY_TASK_COUNT`), or None outside one."""
    task, count = environ.get("SLURM_ARRAY_TASK_ID"), environ.get("SLURM_ARRAY_TASK_COUNT")
    if task is None or count is None:
        return None
    first = environ.get("SLURM_ARRAY_TASK_MIN", "0")
    try:
        index, total = int(task) - int(first), int(count)
    except ValueError:
        raise UsageError(f"SLURM_ARRAY_TASK_ID={task!r}, SLURM_ARRAY_TASK_MIN={first!r} and "
                         f"SLURM_ARRAY_TASK_COUNT={count!r} must be integers") from None
    if total < 1 or not 0 <= index < total:  # parse_shard would blame a --shard the user never gave
        raise UsageError(f"SLURM_ARRAY_TASK_ID={task} is outside the job array of SLURM_ARRAY_TASK_COUNT={count} "
                         f"tasks from SLURM_ARRAY_TASK_MIN={first}; pass --shard I/N to choose the share")
    return index, total


def split_done(sweeps: Sequence[PlannedSweep], *, profile_dir: Path | None, device_kind: str,
               fresh: bool = False) -> tuple[list[PlannedSweep], list[PlannedSweep]]:
    """(to run, already done): a sweep is done when the target table (the write dir of `profile_dir`, this
    device kind) holds a complete (not interrupted) entry for its key, tuned with the backend's current
    revision (a revision bump makes the old entries stale: they are swept again); with `fresh` nothing is
    done."""
    if fresh:
        return list(sweeps), []
    directory = write_dir(profile_dir)
    tables = {op: table_entries(table_path(directory, device_kind, op)) for op in {s.op for s in sweeps}}

    def is_done(s: PlannedSweep) -> bool:
        revision = get_op(s.op).backends.get(s.backend).revision
        return is_complete(tables[s.op].get(s.key), revision=revision)

    done = {s.key for s in sweeps if is_done(s)}
    return [s for s in sweeps if s.key not in done], [s for s in sweeps if s.key in done]


def represented(sweeps: Sequence[PlannedSweep], held: Mapping[str, Mapping[str, Any]]
                ) -> tuple[list[PlannedSweep], list[str]]:
    """(`sweeps`, notes) with each sweep that stands for cases its key cannot tell apart (their problems differ
    in fields the key does not hold: the gathers' ep, which the runtime cannot see, so one entry serves every
    ep) swept as the case the table's entry (`held`, by key) records it was tuned for, else as its first: a
    campaign over several such values keeps tuning the entry it holds, and a note says which cases share."""
    found, shared = [], []
    for sweep in sweeps:
        if not sweep.also:
            found.append(sweep)
            continue
        cases = [Case(sweep.op, sweep.problem, sweep.label), *sweep.also]
        chosen = next((c for c in cases if _tuned_for(held.get(sweep.key), c.problem)), cases[0])
        others = tuple(c for c in cases if c is not chosen)
        found.append(dataclasses.replace(sweep, problem=chosen.problem, label=chosen.label, also=others))
        shared.append((chosen, others))
    if not shared:
        return found, []
    fields = sorted({name for chosen, others in shared for c in others for name in _unkeyed(chosen.problem)
                     if getattr(c.problem, name) != getattr(chosen.problem, name)})
    chosen, others = shared[0]
    return found, [f"{len(shared)} sweep(s) each serve cases that differ only in {', '.join(fields)}, which the "
                   f"key does not hold (the runtime cannot see it): one entry serves them all, tuned as the case "
                   f"the table's entry was tuned for, else the first given (e.g. {chosen.label}, also serving "
                   f"{'; '.join(c.label for c in others)})"]


def _unkeyed(problem: Any) -> list[str]:
    """The fields of `problem` (a dataclass) that its table key does not hold."""
    keyed = problem.key_fields()
    return [f.name for f in dataclasses.fields(problem) if f.name not in keyed]


def _tuned_for(entry: Mapping[str, Any] | None, problem: Any) -> bool:
    """Whether `entry` (JSON) records being tuned for `problem`'s values of the fields its key does not hold
    (as its `distribution` record states them)."""
    record = (entry or {}).get("distribution")
    if not isinstance(record, Mapping):
        return False
    named = [name for name in _unkeyed(problem) if name in record]
    return bool(named) and all(record[name] == getattr(problem, name) for name in named)


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a campaign runs: here (`ray_address` None) or on the Ray cluster at `ray_address` (`local`: a
    private Ray started here); `share`: (index, count) of the `--shard` this process takes, or None (the whole
    plan); `dry_run`: print the plan the same request runs, and run nothing."""

    ray_address: str | None = None
    share: tuple[int, int] | None = None
    dry_run: bool = False

    @property
    def elsewhere(self) -> bool:
        """Whether the campaign's tables end up elsewhere than in this process's (Ray's driver writes them
        here, but its sweeps ran on other devices; a share's are merged later)."""
        return self.ray_address is not None or self.share is not None


@dataclasses.dataclass(frozen=True)
class Passes:
    """What a campaign does, in order. distributions: the routing distributions the sweeps run under (one
    sweep pass each; two or more: then the config robust across them, `robust`); ladder: then the boundaries
    between neighbouring token counts' winners (`ladder`); target: instead of sweeping, compile every
    candidate for this chip (`targets`)."""

    distributions: tuple[str, ...]
    ladder: bool = False
    target: str | None = None

    @property
    def robust(self) -> bool:
        return len(self.distributions) > 1


ELSEWHERE_NOTE = ("{what} measured in this process after the sweeps: rerun the command without --ray / --shard "
                  "once the tables are merged")


@dataclasses.dataclass(frozen=True)
class Campaign:
    """One `moe-tune sweep`: the kernel cases (`plan.Case`), the settings of every sweep (its distribution
    is the first pass's), the backend asked for (None: each op's default), where it runs, its passes, notes
    on what the cases left out. one_shape: one shape asked for, not run elsewhere: every sweep runs (resuming
    its log, not skipped when the table holds it) and shows its own summary; layer: (model, its ep and dtype)
    for one model's layer (its summary is titled so), else None."""

    cases: tuple[Case, ...]
    settings: SweepSettings
    passes: Passes
    where: Where = Where()
    backend: str | None = None
    notes: tuple[str, ...] = ()
    one_shape: bool = False
    layer: tuple[str, str] | None = None

    def placed(self) -> dict[str, str]:
        """The one check of where the campaign runs: UsageError for a pass that cannot run there at all;
        else {pass: why it is left out there} for the passes that run only here, on the whole plan."""
        passes, where = self.passes, self.where
        if passes.target is not None:
            if where.ray_address is not None:
                raise UsageError("--target compiles on this machine; it does not take --ray")
            left = {}
            if passes.ladder:
                left["ladder"] = "--target compiles only: a sweep on the chip measures the ladder's boundaries"
            if passes.robust:
                left["robust"] = "--target compiles only: a sweep on the chip measures the robust choice"
            return left
        if not where.elsewhere:
            return {}
        left = {}
        if passes.ladder:
            left["ladder"] = ELSEWHERE_NOTE.format(what="ladder boundaries are")
        if passes.robust:
            left["robust"] = ELSEWHERE_NOTE.format(what="the robust choice is")
        return left


@dataclasses.dataclass
class SweepOutcome:
    """One planned sweep's end: its entry (as written to `table`), or the error that ended it.

    device: where it ran (`host`, `device` as JAX names it, `device_kind`, `platform`, and on Ray the
    `accelerator_ids` Ray assigned); attempts: how many times it was started (a retry after a dead process
    counts); resumed: candidates restored from its sweep log instead of run again; result: the tuner's whole
    result (every candidate) when the sweep ran in this process (None on Ray, where only the entry comes back)."""

    sweep: PlannedSweep
    entry: Entry | None = None
    table: Path | None = None
    error: str | None = None
    device: dict[str, Any] | None = None
    attempts: int = 1
    resumed: int = 0
    wall_s: float = 0.0
    result: SweepResult | None = None

    @classmethod
    def of(cls, sweep: PlannedSweep, result: SweepResult, device: dict[str, Any]) -> SweepOutcome:
        """The outcome of a sweep run in this process."""
        return cls(sweep, entry=result.entry, table=result.table_path, device=device, resumed=result.resumed,
                   wall_s=result.wall_s, result=result)


def local_device() -> dict[str, Any]:
    """This process's device record (the first JAX device: the one a sweep here tunes)."""
    import jax

    from moe_tune.core import devices

    return {"host": socket.gethostname(), "device": str(jax.devices()[0]), "device_kind": devices.device_kind(),
            "platform": devices.platform()}


def error_text(error: BaseException) -> str:
    """How a sweep's error is recorded: a moe-tune error's message, else the exception's type and message (a
    kernel or runtime failure ends its sweep, not the campaign)."""
    return str(error) if isinstance(error, MoeTuneError) else f"{type(error).__name__}: {error}"
