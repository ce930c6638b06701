"""The record stage: what a sweep writes. The sweep log's lines (header, run, candidate, final; tuner/log),
the table entry (profiles' typed `Entry`) and its write to the table, and the message an interrupted
sweep ends with.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_tune.errors import MoeTuneError, TableError
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.table import read_table, write_entries
from moe_tune.profiles.verdict import WITHIN_NOISE, Verdict
from moe_tune.profiles.versions import entry_versions, recorded_revision
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner.candidates import FAILED, OK, WRONG, Candidate
from moe_tune.tuner.spec import SweepPlan

if TYPE_CHECKING:
    from moe_tune.tuner.state import SweepState


def writable_dir(directory: Path) -> Path:
    """`directory`, created if needed, once a file can be written in it; MoeTuneError (one line) otherwise.

    Checked before a sweep starts, so that a profile dir that cannot hold the table fails at once rather
    than after the sweep (or as a traceback from deep inside the log or the table write)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(directory) else ""
        raise MoeTuneError(f"the profile dir {directory} cannot be created or written: {why}{where}") from None
    return directory


# -- the sweep log ---------------------------------------------------------------------------------------------

def header(plan: SweepPlan) -> dict[str, Any]:
    """The log's first line (without its type and start time). A log whose identity or versions differ (a
    sweep measured another way, with other versions or another revision of the kernel) is not resumed."""
    return {"identity": plan.identity, "key": plan.key, "versions": entry_versions(plan.backend),
            "spec": plan.settings}


def run_line(state: SweepState) -> dict[str, Any]:
    """One line per later run of the same sweep (a resume)."""
    return {"type": "run", "started": sweep_log.now(), "pid": os.getpid(), "restorable": len(state.log.restored),
            "workers": state.spec.workers, "time_budget_s": state.spec.time_budget_s}


def candidate_line(c: Candidate, batch: int | None, recompiled: bool = False) -> dict[str, Any]:
    line = {"type": "candidate", "index": c.index, "config": c.config.to_dict(), "is_default": c.is_default,
            "status": c.status, "stage": c.stage, "reason": c.reason, "error": c.error, "compile_s": c.compile_s,
            "compiles": c.compiles, "batch": batch, "timing": None if c.timing is None else c.timing.to_dict(),
            "logged": sweep_log.now()}
    if recompiled:
        line["recompiled"] = True
    return line


def log_final(state: SweepState, best: Candidate | None, verdict: Verdict | None, *, interrupted: bool,
              table: Path | None, error: str | None = None) -> None:
    """The last line of a run: the winner (or why there is none), the verdict, and the finalists' timings of
    both rounds (`Candidate.finalist_record`, with their index)."""
    index = {sweep_log.config_key(c.config.to_dict()): c.index for c in state.done}
    finalists = [{"index": index.get(sweep_log.config_key(f["config"])), **f}
                 for f in (verdict.finalists if verdict else ())]
    state.log.append([{
        "type": "final", "finished": sweep_log.now(), "interrupted": interrupted,
        "winner": None if best is None else best.config.to_dict(),
        "within_noise_of_default": None if verdict is None else verdict.rule == WITHIN_NOISE,
        "verdict": None if verdict is None else verdict.text, "noise": None if verdict is None else verdict.noise,
        "error": error,
        "stopped": _stopped(state, interrupted), "candidates": len(state.done),
        "resumed": state.resumed, "recompiled_finalists": state.recompiled, "finalists": finalists,
        "table": None if table is None else str(table),
    }])


def _stopped(state: SweepState, interrupted: bool) -> str | None:
    return "interrupted" if interrupted else state.stopped


# -- the table entry -------------------------------------------------------------------------------------------

def build_entry(state: SweepState, best: Candidate, verdict: Verdict, interrupted: bool) -> Entry:
    """The table entry of a sweep: the winner, the default, every candidate's record, and how it was found."""
    plan, spec = state.plan, state.spec
    candidates, default = state.done, state.default()
    counts = {s: sum(c.status == s for c in candidates) for s in (OK, FAILED, WRONG)}
    default_ok = default.status == OK
    return Entry(
        key=plan.key,
        op=spec.op,
        fields=plan.fields,
        config=best.config.to_dict(),
        timing=best.timing.to_dict(),
        timing_fallback=state.fallback,
        default={"config": default.config.to_dict(), "status": default.status,
                 "median_s": default.timing.median_s if default_ok else None, "reason": default.reason or None},
        speedup_over_default=default.timing.median_s / best.timing.median_s if default_ok else None,
        candidates={"tried": len(candidates), "ok": counts[OK], "failed": counts[FAILED], "wrong": counts[WRONG],
                    "compiles": sum(c.compiles for c in candidates)},
        failures=[c.record() for c in candidates if c.status != OK],
        results=[c.record() for c in candidates if c.status == OK],
        distribution={"name": spec.distribution, "seed": spec.seed,
                      **plan.op.distribution_record(spec.problem, spec.distribution, spec.seed, state.host_inputs)},
        flops=plan.op.flops(spec.problem),
        versions=entry_versions(plan.backend),
        hostname=socket.gethostname(),
        platform=plan.platform,
        device_kind=plan.device_kind,
        tuned_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        within_noise_of_default=verdict.rule == WITHIN_NOISE,
        verdict=verdict.to_json(),
        interrupted=interrupted,
        search={**plan.search_settings(), "stopped": _stopped(state, interrupted), "batches": state.batches,
                "resumed": state.resumed, "recompiled_finalists": state.recompiled,
                "stage_s": {k: round(v, 3) for k, v in state.stage_s.items()}, "log_restarted": state.log.restarted},
        sweep_wall_s=round(state.elapsed_s(), 3),
    )


def write(state: SweepState, entry: Entry, interrupted: bool) -> tuple[Path, bool]:
    """Write `entry` to the table; returns (table, whether a complete entry already there was kept instead:
    an interrupted sweep never replaces a complete one)."""
    table = state.plan.table_path
    if interrupted and has_complete_entry(table, entry.key):
        return table, True
    return write_entries(table, state.spec.op, state.plan.device_kind, [entry]), False


def has_complete_entry(table: Path, key: str) -> bool:
    """Whether `table` holds a complete entry for `key` (an unreadable table holds none)."""
    return is_complete(table_entries(table).get(key))


def table_entries(table: Path) -> dict[str, Any]:
    """The entries (JSON, by key) of `table`; none when it is missing or unreadable."""
    try:
        return read_table(table)["entries"] if table.exists() else {}
    except TableError:
        return {}


def is_complete(entry: dict[str, Any] | None, revision: int | None = None) -> bool:
    """Whether a table entry (JSON) is complete: present and not written by an interrupted sweep; with
    `revision`, also tuned with that backend revision (one of an older revision is stale)."""
    if entry is None or entry.get("interrupted"):
        return False
    return revision is None or recorded_revision(entry) == revision


def interrupt_message(state: SweepState, table: Path | None, kept_complete: bool | None) -> str:
    kept = f"{len(state.done)} finished candidate(s) kept in {state.log.path}"
    if table is None:
        what = "no table entry (the default and one other candidate had not finished)"
    elif kept_complete:
        what = f"the complete entry already in {table} was kept"
    else:
        what = f"an interrupted entry (best of those finished) was written to {table}"
    return f"{kept}; {what}; run the same sweep again to resume (--fresh to start over)"
