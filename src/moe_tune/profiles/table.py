"""The JSON table format: one file per device kind and op, `<dir>/<device_kind>/<op>.json`.

    {"schema_version": 1, "op": "ragged_dot", "device_kind": "cpu", "entries": {KEY: ENTRY, ...}}

Entries are keyed by `key.entry_key`; each holds `fields` (the key's parts), `config`, `timing`, `default`,
`speedup_over_default`, `candidates`, `distribution`, `versions` and `tuned_at` (see `tuner.sweep`).
Writes hold a file lock, re-read the file, merge, and replace it atomically, so concurrent writers never
lose each other's entries and a crash never leaves a half-written table.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import filelock

from moe_tune.errors import TableError

SCHEMA_VERSION = 1


def empty_table(op: str, device_kind: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "op": op, "device_kind": device_kind, "entries": {}}


def read_table(path: Path) -> dict[str, Any]:
    """Parse and check one table; TableError names the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TableError(f"{path}: no such table") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TableError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise TableError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise TableError(f"{path}: not a moe-tune table (no 'entries' object)")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TableError(f"{path}: schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
    for key, entry in data["entries"].items():
        if not isinstance(entry, dict) or "config" not in entry or "fields" not in entry:
            raise TableError(f"{path}: entry {key!r} lacks 'config' or 'fields'")
    return data


_cache: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def read_table_cached(path: Path) -> tuple[tuple[int, int, int], dict[str, Any]] | None:
    """(stamp, table): `read_table` memoized on the stamp (inode, mtime, size); None when there is no file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # writes replace the file, so the inode changes too
    hit = _cache.get(path)
    if hit is not None and hit[0] == stamp:
        return hit
    _cache[path] = (stamp, read_table(path))
    return _cache[path]


def write_entries(path: Path, op: str, device_kind: str, entries: Iterable[dict[str, Any]]) -> Path:
    """Add or replace `entries` (each with a `key`) in the table at `path`, atomically and under a lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock"):
        table = read_table(path) if path.exists() else empty_table(op, device_kind)
        for entry in entries:
            table["entries"][entry["key"]] = entry
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(table, f, indent=1, sort_keys=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path
