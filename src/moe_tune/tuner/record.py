"""The record stage: what a sweep writes. The sweep log's header, run and final lines (tuner/log; candidate
lines are written as candidates finish, `SweepState.finished`), the table entry (profiles' typed `Entry`)
and its write to the table, and the message an interrupted sweep ends with.
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any

from moe_tune.profiles.entry import Entry
from moe_tune.profiles.table import has_complete_entry, write_entries
from moe_tune.profiles.verdict import WITHIN_NOISE, Verdict
from moe_tune.profiles.versions import entry_versions
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner.candidate import FAILED, OK, WRONG, Candidate
from moe_tune.tuner.request import SweepPlan
from moe_tune.tuner.state import Step, SweepState

# -- the sweep log ---------------------------------------------------------------------------------------------


def header(plan: SweepPlan) -> dict[str, Any]:
    """The log's first line (without its type and start time). A log whose identity or versions differ (a
    sweep measured another way, with other versions or another revision of the kernel) is not resumed."""
    return {"identity": plan.identity, "key": plan.key, "versions": entry_versions(plan.backend),
            sweep_log.HEADER_SETTINGS: plan.settings_json}


def run_line(state: SweepState) -> dict[str, Any]:
    """One line per later run of the same sweep (a resume)."""
    return {"type": "run", "started": sweep_log.now(), "pid": os.getpid(), "restorable": len(state.log.restored),
            "workers": state.settings.workers, "time_budget_s": state.settings.time_budget_s}


def log_final(state: SweepState, done: Step, best: Candidate | None, verdict: Verdict | None, *,
              interrupted: bool, table: Path | None, error: str | None = None) -> None:
    """The last line of a run: the winner (or why there is none), the verdict, and the finalists' timings of
    both rounds (`Candidate.finalist_record`, with their index). `done`: what the stages did."""
    index = {sweep_log.config_key(c.config.to_dict()): c.index for c in state.done}
    finalists = [{"index": index.get(sweep_log.config_key(f["config"])), **f}
                 for f in (verdict.finalists if verdict else ())]
    state.log.append([{
        "type": "final", "finished": sweep_log.now(), "interrupted": interrupted,
        "winner": None if best is None else best.config.to_dict(),
        "within_noise_of_default": None if verdict is None else verdict.rule == WITHIN_NOISE,
        "verdict": None if verdict is None else verdict.text, "noise": None if verdict is None else verdict.noise,
        "error": error,
        "stopped": _stopped(done, interrupted), "candidates": len(state.done),
        "resumed": done.resumed, "recompiled_finalists": done.recompiled, "finalists": finalists,
        "table": None if table is None else str(table),
        # where this run's search started (`warm_start`): the seeds and the tuned entries they came from
        "start": state.start.describe(), **state.start.to_json(),
    }])


def _stopped(done: Step, interrupted: bool) -> str | None:
    return "interrupted" if interrupted else done.stopped


# -- the table entry -------------------------------------------------------------------------------------------

def build_entry(state: SweepState, done: Step, best: Candidate, verdict: Verdict, interrupted: bool) -> Entry:
    """The table entry of a sweep: the winner, the default, every candidate's record, and how it was found."""
    plan, settings, problem = state.plan, state.settings, state.plan.request.problem
    candidates, default = state.done, state.default()
    counts = {s: sum(c.status == s for c in candidates) for s in (OK, FAILED, WRONG)}
    default_ok = default.status == OK
    return Entry(
        key=plan.key,
        op=plan.request.op,
        fields=plan.fields,
        config=best.config.to_dict(),
        timing=best.timing.to_dict(),
        timing_fallback=done.fallback,
        default={"config": default.config.to_dict(), "status": default.status,
                 "median_s": default.timing.median_s if default_ok else None, "reason": default.reason or None},
        speedup_over_default=default.timing.median_s / best.timing.median_s if default_ok else None,
        candidates={"tried": len(candidates), "ok": counts[OK], "failed": counts[FAILED], "wrong": counts[WRONG],
                    "compiles": sum(c.compiles for c in candidates)},
        failures=[c.record() for c in candidates if c.status != OK],
        results=[c.record() for c in candidates if c.status == OK],
        distribution={"name": settings.distribution, "seed": settings.seed,
                      **plan.op.distribution_record(problem, settings.distribution, settings.seed, state.host_inputs)},
        flops=plan.op.flops(problem),
        versions=entry_versions(plan.backend),
        hostname=socket.gethostname(),
        platform=plan.platform,
        device_kind=plan.device_kind,
        tuned_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        within_noise_of_default=verdict.rule == WITHIN_NOISE,
        verdict=verdict.to_json(),
        interrupted=interrupted,
        search={**plan.search_settings(), "stopped": _stopped(done, interrupted), "batches": done.batches,
                "resumed": done.resumed, "recompiled_finalists": done.recompiled,
                "stage_s": {k: round(v, 3) for k, v in state.stage_s.items()}, "log_restarted": state.log.restarted,
                "start": state.start.describe(), "seeds": [c.to_dict() for c in state.start.seeds],
                "local": state.start.local},
        sweep_wall_s=round(state.elapsed_s(), 3),
    )


def write(state: SweepState, entry: Entry, interrupted: bool) -> tuple[Path, bool]:
    """Write `entry` to the table; returns (table, whether a complete entry already there was kept instead:
    an interrupted sweep never replaces a complete one)."""
    table = state.plan.table_path
    if interrupted and has_complete_entry(table, entry.key):
        return table, True
    return write_entries(table, state.plan.request.op, state.plan.device_kind, [entry]), False


def interrupt_message(state: SweepState, table: Path | None, kept_complete: bool | None) -> str:
    kept = f"{len(state.done)} finished candidate(s) kept in {state.log.path}"
    if table is None:
        what = "no table entry (the default and one other candidate had not finished)"
    elif kept_complete:
        what = f"the complete entry already in {table} was kept"
    else:
        what = f"an interrupted entry (best of those finished) was written to {table}"
    return f"{kept}; {what}; run the same sweep again to resume (--fresh to start over)"
