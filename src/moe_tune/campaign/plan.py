"""The plan of a tuning campaign: every sweep (one table key each) across models, token counts, ep values and
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
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.layer.models import KernelCase, get_preset, layer_cases, presets
from moe_tune.profiles.table import table_path, write_dir
from moe_tune.profiles.entry import entry_key
from moe_tune.profiles.table import is_complete, table_entries
from moe_tune.tuner.request import SweepRequest, SweepSettings


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
