"""Compile records: which configs compiled for a chip, stored with the tables, read by a later sweep there.

`compile_sweep.compile_candidates` appends one record per config it compiles for a target to
`<profile dir>/<device kind>/<op>.compile-records.jsonl` (the target's device kind: the directory its tuned
tables live in); a sweep on the chip drops the configs recorded as failing (`uncompilable`). A record is
keyed like a table entry (`profiles.entry`, less the group-size distribution, which does not change what
compiles) plus the config, and remembers the JAX version and backend revision it was made with: a record
of another one is ignored. JSON lines, appended under the table lock, so a run killed midway keeps what it
compiled and a rerun compiles only the rest.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import filelock

from moe_tune.kernels import get_op
from moe_tune.profiles.entry import key_from_fields
from moe_tune.profiles.table import lock_path
from moe_tune.targets.compile import CompileResult

SUFFIX = ".compile-records.jsonl"


def records_path(profile_dir: Path | str, device_kind: str, op: str) -> Path:
    return Path(profile_dir) / device_kind / f"{op}{SUFFIX}"


def record_key(op: str, problem: Any, backend: str) -> str:
    """The table entry's key without the distribution: `ragged_dot|direction=fwd|m=...|backend=megablox`."""
    return key_from_fields(op, {**problem.key_fields(), "backend": backend})


def record_versions(op: str, backend: str) -> dict[str, Any]:
    import jax

    return {"jax": jax.__version__, "backend_revision": get_op(op).backends.get(backend).revision}


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """One config's verdict from a target's compiler."""

    key: str
    config: dict[str, Any]
    result: CompileResult
    versions: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "config": self.config, "result": self.result.to_dict(), "versions": self.versions}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CompileRecord":
        return cls(data["key"], dict(data["config"]), CompileResult.from_dict(data["result"]), dict(data["versions"]))


def read_records(path: Path | str, op: str, backend: str) -> dict[tuple[str, str], CompileRecord]:
    """(key, config as JSON) -> the latest record for `backend` made with the installed JAX and the backend's
    revision; lines that do not parse (a write cut by a kill) are skipped."""
    path, current = Path(path), record_versions(op, backend)
    found: dict[tuple[str, str], CompileRecord] = {}
    if not path.exists():
        return found
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = CompileRecord.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError):
            continue
        if record.versions == current and record.key.endswith(f"|backend={backend}"):
            found[(record.key, json.dumps(record.config, sort_keys=True))] = record
    return found


def append_records(path: Path | str, records: Iterable[CompileRecord]) -> None:
    """Append records under the file's lock (every writer on this file system takes the same one). A last
    line cut by a kill is ended first, so it stays one line that `read_records` skips and the first new
    record is a line of its own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(record.to_json()) + "\n" for record in records).encode()
    with filelock.FileLock(str(lock_path(path))), path.open("ab+") as out:
        if out.seek(0, os.SEEK_END):
            out.seek(-1, os.SEEK_END)
            if out.read(1) != b"\n":
                data = b"\n" + data
        out.write(data)


def uncompilable(profile_dir: Path | str, device_kind: str, op: str, backend: str, problem: Any) -> dict[str, str]:
    """Config label -> the compiler's message, for each config of `problem` the store says does not compile
    on the chip of `device_kind`: what a sweep there skips."""
    key = record_key(op, problem, backend)
    path = records_path(profile_dir, device_kind, op)
    if not path.exists():
        return {}
    records = read_records(path, op, backend)
    config_cls = get_op(op).backends.get(backend).config_cls
    return {config_cls(**r.config).label(): r.result.message or r.result.status
            for (k, _), r in records.items() if k == key and not r.result.ok}
