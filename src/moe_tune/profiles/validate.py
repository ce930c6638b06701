"""`moe-tune validate`: check tables the way the runtime will use them, and say precisely what is wrong.

Errors (the table or entry cannot be used as intended): unreadable file, invalid JSON, not a table, a schema
this moe-tune does not know, missing `op` / `device_kind`, a table whose directory or file name does not match
its device kind or op (lookup would never find it), an unknown op, and per entry: structural problems, a key
that is not `key_from_fields(op, fields)`, fields that do not build a problem, non-canonical fields (lookup
computes another key for the same problem), an unknown backend or distribution, a config the backend cannot
run for the problem, a bad timing or revision record.

Warnings (usable, but worth knowing): a stale entry (another kernel revision or JAX minor version), an older
schema (migrated on read, rewritten at the current schema on the next write), a directory without tables.

The op objects come from the caller (`get_op`, e.g. `kernels.get_op`): profiles know nothing of
kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moe_tune.core import devices, distributions, settings
from moe_tune.core.errors import TableError
from moe_tune.profiles.table import search_dirs
from moe_tune.profiles.entry import record_problems
from moe_tune.profiles.intervals import INTERVALS, ROBUST, interval_problems, robust_problems
from moe_tune.profiles.entry import key_fields, key_from_fields
from moe_tune.profiles.protocols import OpLike
from moe_tune.profiles.table import SCHEMA_VERSION, entry_problems, parse_table
from moe_tune.profiles.entry import staleness

ERROR = "error"
WARNING = "warning"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a table: the file, the entry's key (None for the whole file), what is wrong."""

    path: Path
    message: str
    key: str | None = None
    severity: str = ERROR  # "error" | "warning"

    def __str__(self) -> str:
        where = f"{self.path}" + (f": entry {self.key!r}" if self.key is not None else "")
        return f"{where}: {'warning: ' if self.severity == WARNING else ''}{self.message}"


@dataclasses.dataclass
class ValidationReport:
    files: list[Path]  # every table file checked
    problems: list[Problem]

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    @property
    def ok(self) -> bool:
        """No errors (warnings allowed): the CLI exits 0 when ok, else 1."""
        return not self.errors

    def lines(self) -> list[str]:
        """One line per problem, then a summary line."""
        summary = (f"{len(self.files)} table{'s' if len(self.files) != 1 else ''} checked: "
                   f"{len(self.errors)} error{'s' if len(self.errors) != 1 else ''}, "
                   f"{len(self.warnings)} warning{'s' if len(self.warnings) != 1 else ''}")
        return [str(p) for p in self.problems] + [summary]


def _without_path(path: Path, message: str) -> str:
    prefix = f"{path}: "
    return message[len(prefix):] if message.startswith(prefix) else message


GetOp = Callable[[str], OpLike]  # op name -> op object; raises (naming the choices) for an unknown op


def validate_table(path: str | os.PathLike, *, get_op: GetOp, on_its_device: bool = False) -> list[Problem]:
    """Every problem with the table at `path` (empty when it is fine). `get_op`: `kernels.get_op`;
    `on_its_device`: judge configs as on the table's device kind (`devices.judging_kind`), else as on this
    machine."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        what = ("is a directory, not a table file" if isinstance(e, IsADirectoryError)
                else "no such file" if isinstance(e, FileNotFoundError)
                else f"cannot read: {e.strerror or e}")
        return [Problem(path, what)]
    try:
        table = parse_table(raw, path)
    except TableError as e:
        return [Problem(path, _without_path(path, str(e)))]

    problems: list[Problem] = []
    original = json.loads(raw)["schema_version"]  # parse_table accepted it, so this parses
    if original != SCHEMA_VERSION:
        problems.append(Problem(path, f"schema_version {original} (migrated to {SCHEMA_VERSION} on read; rewritten "
                                      f"at {SCHEMA_VERSION} on the next write or merge)", severity=WARNING))
    op, device_kind = table.get("op"), table.get("device_kind")
    for name, value in (("op", op), ("device_kind", device_kind)):
        if value is None:
            problems.append(Problem(path, f"no '{name}' at the top level"))
    if device_kind is not None and path.parent.name != device_kind:
        problems.append(Problem(path, f"table is for device_kind {device_kind!r} but lies in directory "
                                      f"{path.parent.name!r}: lookup reads <profile dir>/<device_kind>/<op>.json"))
    if op is not None and path.name != f"{op}.json":
        problems.append(Problem(path, f"table is for op {op!r} but is named {path.name!r}: lookup reads "
                                      f"<profile dir>/<device_kind>/<op>.json"))
    kernel_op = None
    if op is not None:
        try:
            kernel_op = get_op(op)
        except Exception as e:
            problems.append(Problem(path, str(e)))
    judged_as = devices.judging_kind(device_kind) if on_its_device and device_kind else contextlib.nullcontext()
    with judged_as:
        for key, entry in table["entries"].items():
            problems += _entry_problems_stale(path, key, entry, op, device_kind, kernel_op)
    for section, check in ((INTERVALS, interval_problems), (ROBUST, robust_problems)):
        for key, record in (table.get(section) or {}).items():  # lookup skips a broken one; say it here
            problems += [Problem(path, f"{section}: {message}", key) for message in check(record)]
    return problems


def _entry_problems_stale(path: Path, key: str, entry: Any, op: str | None, device_kind: str | None,
                          kernel_op: OpLike | None) -> list[Problem]:
    """An entry's problems, else whether it is stale (warnings)."""
    wrong = _entry_problems(key, entry, op, device_kind, kernel_op)
    if wrong or kernel_op is None:
        return [Problem(path, message, key) for message in wrong]
    backend = kernel_op.backends.get(entry["fields"]["backend"])
    return [Problem(path, f"stale: tuned with {d}", key, WARNING) for d in staleness(entry, backend)]


def _entry_problems(key: str, entry: Any, op: str | None, device_kind: str | None,
                    kernel_op: OpLike | None) -> list[str]:
    structural = entry_problems(entry)
    if structural:
        return structural
    found = []
    if entry.get("key", key) != key:
        found.append(f"its 'key' field {entry['key']!r} differs from the key it is stored under")
    for name, expected in (("op", op), ("device_kind", device_kind)):
        if expected is not None and entry.get(name, expected) != expected:
            found.append(f"entry is for {name} {entry[name]!r}, the table for {expected!r}")
    found += record_problems(entry)
    if kernel_op is None:
        return found

    fields = entry["fields"]
    expected_key = key_from_fields(op, fields)
    if key != expected_key:
        found.append(f"key does not match its fields, which give {expected_key!r}")
    names = list(kernel_op.key_field_names)
    missing = [n for n in names if n not in fields]
    unknown = [n for n in fields if n not in names and n not in kernel_op.optional_key_field_names]
    if missing:
        found.append(f"fields lack {', '.join(missing)}")
    if unknown:
        found.append(f"fields has unknown name(s) {', '.join(unknown)} (an {op} key has {', '.join(names)})")
    if missing or unknown:
        return found
    backend = None
    try:
        backend = kernel_op.backends.get(fields["backend"])
    except Exception as e:
        found.append(str(e))
    try:
        distributions.check_name(fields["distribution"])
    except Exception as e:
        found.append(str(e))
    try:
        problem = kernel_op.problem_class.from_key_fields(fields)
    except Exception as e:
        found.append(f"fields do not describe a valid {op} problem: {e}")
        return found
    if backend is None:
        return found
    canonical = key_from_fields(op, key_fields(problem, backend.name, fields["distribution"]))
    if canonical != expected_key:
        found.append(f"fields are not canonical: lookup computes the key {canonical!r} for this problem, so the "
                     "entry would never be found")
    try:
        backend.coerce_config(entry["config"], problem)
    except Exception as e:
        found.append(f"config {entry['config']} is not valid for backend {backend.name!r} and this problem: {e}")
    return found


def table_files(directory: Path) -> list[Path]:
    """Table files under a profile dir (`*/*.json`) or a device-kind dir (`*.json`)."""
    return sorted({*directory.glob("*/*.json"), *directory.glob("*.json")})


def _not_a_dir(path: Path) -> str:
    """Why `path`, which exists (at least as a link), is no directory: a file, a symlink loop, ..."""
    try:
        path.stat()
    except OSError as e:
        return e.strerror or str(e)
    return "a file"


def validate_paths(paths: Iterable[str | os.PathLike] | None = None, *, get_op: GetOp,
                   on_its_device: bool = False) -> ValidationReport:
    """Validate table files and every table under directories; no paths: every profile dir that exists
    (`search_dirs()`: overlays, `$MOE_TUNE_PROFILE_DIR`, the user cache dir, the shipped tables).
    `get_op`: `kernels.get_op`."""
    paths = list(paths or [])
    files: list[Path] = []
    problems: list[Problem] = []
    if not paths:
        for origin, directory in search_dirs():
            if directory.is_dir():
                files += table_files(directory)
            elif os.path.lexists(directory):  # lookup fails on it (exit 1), so validate must too
                source = f" (${settings.PROFILE_DIR})" if origin == "env" else ""
                problems.append(Problem(directory, f"the profile dir{source} is not a directory "
                                                   f"({_not_a_dir(directory)}): no table under it can be read"))
    for given in map(Path, paths):
        if given.is_dir() and not given.name.endswith(".json"):
            found = table_files(given)
            if not found:
                problems.append(Problem(given, "no tables here (expected <device_kind>/<op>.json files)",
                                        severity=WARNING))
            files += found
        elif given.exists() or given.is_symlink():
            files.append(given)
        else:
            problems.append(Problem(given, "no such file or directory"))
    seen: set[str] = set()
    unique = []
    for path in files:
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            unique.append(path)
    for path in unique:
        problems += validate_table(path, get_op=get_op, on_its_device=on_its_device)
    return ValidationReport(unique, problems)
