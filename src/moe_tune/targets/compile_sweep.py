"""`moe-tune sweep --target CHIP`: compile every candidate of the planned sweeps for a chip this machine does
not have, in worker processes, and store which compile (`records.py`) where the chip's tables live; a sweep
on the chip then skips the configs that cannot compile there."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moe_tune.kernels.base import KernelConfig
from moe_tune.targets import wheels
from moe_tune.core.chips import Target
from moe_tune.targets.compile import REJECTED, CompileResult
from moe_tune.targets.jobs import CompileJob, CompilePool, config_error, search_space
from moe_tune.targets.records import (CompileRecord, append_records, read_records, record_key, record_versions,
                                      records_path)


@dataclasses.dataclass
class TargetSweep:
    """What compiling one sweep's candidates for a target gave: counts by status, and the first failure."""

    op: str
    backend: str
    problem: Any
    candidates: int
    ok: int = 0
    failed: int = 0
    stored: int = 0  # verdicts read from the store (compiled by an earlier run)
    compile_s: float = 0.0
    first_failure: str = ""


def compile_candidates(target: Target, op: str, backend: str, problem: Any, configs: list[KernelConfig], *,
                       profile_dir: Path | str, pool: CompilePool | None = None, workers: int = 2,
                       on_record: Callable[[CompileRecord, bool], None] | None = None) -> list[CompileRecord]:
    """A record for each config, in order: read from the store when there is one (`on_record(record, False)`),
    else compiled now in worker processes and appended as it arrives (`on_record(record, True)`)."""
    path, key = records_path(profile_dir, target.device_kind, op), record_key(op, problem, backend)
    known = read_records(path, op, backend)
    versions = record_versions(op, backend)
    out: dict[int, CompileRecord] = {}
    todo: list[tuple[int, KernelConfig]] = []
    for index, config in enumerate(configs):
        record = known.get((key, json.dumps(config.to_dict(), sort_keys=True)))
        if record is None:
            todo.append((index, config))
        else:
            out[index] = record
            if on_record:
                on_record(record, False)

    def arrived(position: int, job: CompileJob, result: CompileResult) -> None:
        record = CompileRecord(key, job.config.to_dict(), result, versions)
        append_records(path, [record])
        out[todo[position][0]] = record
        if on_record:
            on_record(record, True)

    if todo:
        jobs = [CompileJob(target.name, op, backend, problem, config) for _, config in todo]
        own = pool is None
        pool = pool or CompilePool(workers=workers)
        try:
            pool.compile(jobs, on_result=arrived)
        finally:
            if own:
                pool.close()
    return [out[i] for i in range(len(configs))]



def compile_sweeps(sweeps: Sequence[Any], target: Target, *, profile_dir: Path | str, workers: int = 2,
                   max_candidates: int | None = None,
                   on_record: Callable[[TargetSweep, CompileRecord, bool], None] | None = None) -> list[TargetSweep]:
    """Compile the search space (as the target's rules prune it, cut to `max_candidates`) of each planned
    sweep (`op`, `problem`, `backend` attributes: `campaign.request.PlannedSweep`) for `target`, in one pool
    of `workers` processes; records go to `profile_dir`. MissingCompilerError (one line) without the wheels."""
    wheels.require(target.platform)
    summaries = []
    with CompilePool(workers=workers) as pool:
        for sweep in sweeps:
            space = search_space(target, sweep.op, sweep.backend, sweep.problem)
            space = space if max_candidates is None else space[: max(1, max_candidates)]
            summary = TargetSweep(sweep.op, sweep.backend, sweep.problem, len(space))

            def count(record: CompileRecord, compiled: bool, summary=summary) -> None:
                summary.ok += record.result.ok
                summary.failed += not record.result.ok
                summary.stored += not compiled
                summary.compile_s += record.result.compile_s if compiled else 0.0
                if not record.result.ok and not summary.first_failure:
                    summary.first_failure = f"{record.result.status}: {record.result.message}"
                if on_record:
                    on_record(summary, record, compiled)

            # The default leads the space even where the rules refuse every config (a dtype the backend does not
            # serve): that sweep is refused with the rules' reason, not compiled (nor stored).
            refusal = config_error(target, sweep.op, sweep.backend, space[0], sweep.problem)
            if refusal is not None:
                result = CompileResult(target.name, REJECTED, f"refused: {refusal}", "rules")
                count(CompileRecord(record_key(sweep.op, sweep.problem, sweep.backend), space[0].to_dict(), result,
                                    record_versions(sweep.op, sweep.backend)), True)
            else:
                compile_candidates(target, sweep.op, sweep.backend, sweep.problem, space, profile_dir=profile_dir,
                                   pool=pool, on_record=count)
            summaries.append(summary)
    return summaries
