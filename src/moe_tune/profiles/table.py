"""The JSON table format: one file per device kind and op, `<dir>/<device_kind>/<op>.json`.

    {"schema_version": 3, "op": "ragged_dot", "device_kind": "cpu", "entries": {KEY: ENTRY, ...},
     "intervals": {KEY: INTERVAL, ...}, "robust": {KEY: ROBUST, ...}}

Entries are keyed by `entry.entry_key`; each holds `key`, `fields` (the key's parts), `config`, `timing`, `default`,
`speedup_over_default`, `candidates`, `distribution`, `versions` (jax, jaxlib, moe-tune, tune-jax and the
kernel's `backend_revision`, see `entry.entry_versions`) and `tuned_at` (see `tuner.sweep`); an entry kept
by `moe-tune merge` also holds `provenance` (see `merge`). `intervals` (token-count intervals a ladder sweep
measured) and `robust` (a shape's config robust across routing distributions) are described in `intervals.py`.

Schema history (`MIGRATIONS` turns each into the next on read; writes always write `SCHEMA_VERSION`):

- 1: as above, without `backend_revision` or `provenance`.
- 2: `versions.backend_revision`, `provenance`; every entry holds its `key` and a `versions` object.
- 3: the `intervals` and `robust` objects (empty in a table migrated from 2: it has neither).

Writes hold a file lock (`lock_path`: `.locks/<op>.json.lock` beside the table), re-read the file, merge,
and replace it atomically, so concurrent writers never lose each other's entries and a crash never leaves a
half-written table. Tables are written with the mode a new file gets (0644 under the usual umask), readable
by whoever the directory is shared with.

Locks sit in one hidden folder beside the files they guard, `<dir>/.locks/<name>.lock`, so that a table
directory a user shares or copies holds only tables; every writer of a file takes its lock through
`lock_path`, so they all agree on it.

Where tables live. Read order, highest first: `use_profiles(...)` overlays (innermost first),
`$MOE_TUNE_PROFILE_DIR`, the user cache dir, the tables shipped in the package. Sweeps write to
`--profile-dir`, else `$MOE_TUNE_PROFILE_DIR`, else the user cache dir.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import filelock
import platformdirs

from moe_tune.core import contexts, settings
from moe_tune.core import settings as paths
from moe_tune.core.contexts import use_profiles  # noqa: F401  (the public name's home for `profiles`)
from moe_tune.core.errors import TableError
from moe_tune.profiles.entry import Entry, recorded_revision
from moe_tune.profiles.intervals import INTERVALS, ROBUST

LOCK_DIR = ".locks"


def lock_path(path: Path | str) -> Path:
    """The lock file of `path` (its folder is created): `<path's dir>/.locks/<path's name>.lock`."""
    path = Path(path)
    folder = path.parent / LOCK_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{path.name}.lock"


def shared_mode() -> int:
    """The mode a new file gets from `open()`: 0666 less the process umask (0644 under the usual 022).

    `tempfile.mkstemp`, which atomic writes use, creates files 0600 whatever the umask; a table written
    that way could not be read by the people it is shared with."""
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read from /proc where it can be (setting it to read it is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


SCHEMA_VERSION = 3


def empty_table(op: str, device_kind: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "op": op, "device_kind": device_kind, "entries": {},
            INTERVALS: {}, ROBUST: {}}


def migrate_v1_to_v2(table: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 -> 2 (pure: returns a new table). Entries gain their `key` and a `versions` object where they
    lacked them. Schema 1 recorded no kernel revision: such entries count as revision 1 (`entry.recorded_revision`)."""
    out = copy.deepcopy(table)
    out["schema_version"] = 2
    for key, entry in out["entries"].items():
        if isinstance(entry, dict):
            entry.setdefault("key", key)
            if entry.get("versions") is None:
                entry["versions"] = {}
    return out


def migrate_v2_to_v3(table: dict[str, Any]) -> dict[str, Any]:
    """Schema 2 -> 3 (pure: returns a new table). The table gains empty `intervals` and `robust` objects: a
    schema-2 table holds points only, so lookup answers it as before (exact, nearest, default)."""
    out = copy.deepcopy(table)
    out["schema_version"] = 3
    out.setdefault(INTERVALS, {})
    out.setdefault(ROBUST, {})
    return out


# schema version -> function turning a table of that version into one of the next version.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: migrate_v1_to_v2, 2: migrate_v2_to_v3}


def migrate(table: dict[str, Any]) -> dict[str, Any]:
    """`table` (with an `entries` object and an integer `schema_version` <= SCHEMA_VERSION) as a table of the
    current schema. Pure: the argument is not modified."""
    version = table["schema_version"]
    while version < SCHEMA_VERSION:
        table = MIGRATIONS[version](table)
        version = table["schema_version"]
    return table


def parse_table(text: bytes | str, path: Path | str) -> dict[str, Any]:
    """Parse a table's bytes, check its top level and schema, migrate it to the current schema.

    Entries are not checked here (`entry_problems`); TableError names `path` and what is wrong."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TableError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                             "the file is corrupted") from None
    if not text.strip():
        raise TableError(f"{path}: empty file (a truncated write?)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TableError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise TableError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise TableError(f"{path}: not a moe-tune table (no 'entries' object)")
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TableError(f"{path}: schema_version {version!r} is not supported (expected 1 to {SCHEMA_VERSION})")
    if version > SCHEMA_VERSION:
        raise TableError(f"{path}: schema_version {version} was written by a newer moe-tune (this one reads "
                         f"schema 1 to {SCHEMA_VERSION}); upgrade moe-tune to use this table")
    for name in ("op", "device_kind"):
        if name in data and not isinstance(data[name], str):
            raise TableError(f"{path}: '{name}' is {data[name]!r}, not a string")
    for name in (INTERVALS, ROBUST):
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise TableError(f"{path}: '{name}' is {type(data[name]).__name__}, not an object")
    return migrate(data)


def load_table(path: Path | str) -> dict[str, Any]:
    """Read and parse one table without checking its entries; TableError names the file and the problem."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise TableError(f"{path}: no such table") from None
    except IsADirectoryError:
        raise TableError(f"{path}: is a directory, not a table file") from None
    except PermissionError:
        raise TableError(f"{path}: cannot read: permission denied") from None
    except OSError as e:
        raise TableError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_table(raw, path)


def entry_problems(entry: Any) -> list[str]:
    """What is structurally wrong with one entry (what lookup and merge rely on); empty when nothing."""
    if not isinstance(entry, dict):
        return [f"is {type(entry).__name__}, not an object"]
    found = []
    for name in ("fields", "config"):
        if not isinstance(entry.get(name), dict):
            found.append(f"lacks a '{name}' object" if name not in entry
                         else f"'{name}' is {type(entry[name]).__name__}, not an object")
    for name, kind in (("versions", dict), ("timing", dict), ("provenance", list)):
        if entry.get(name) is not None and not isinstance(entry[name], kind):
            found.append(f"'{name}' is {type(entry[name]).__name__}, not {'an object' if kind is dict else 'a list'}")
    return found


def read_table(path: Path | str) -> dict[str, Any]:
    """Parse, check and migrate one table; TableError names the file (and entry) and what is wrong with it."""
    table = load_table(path)
    for key, entry in table["entries"].items():
        problems = entry_problems(entry)
        if problems:
            raise TableError(f"{path}: entry {key!r}: {problems[0]}")
    return table


_cache: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def read_table_cached(path: Path) -> tuple[tuple[int, int, int], dict[str, Any]] | None:
    """(stamp, table): `read_table` memoized on the stamp (inode, mtime, size); None when there is no file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # e.g. a path component that is a file, not a directory
        raise TableError(f"{path}: cannot read: {e.strerror or e}") from None
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # writes replace the file, so the inode changes too
    hit = _cache.get(path)
    if hit is not None and hit[0] == stamp:
        return hit
    _cache[path] = (stamp, read_table(path))
    return _cache[path]


@contextlib.contextmanager
def locked(path: Path | str) -> Iterator[Path]:
    """Hold the table's write lock (`locks.lock_path`, shared by every writer on this file system)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(lock_path(path))):
        yield path


def write_table_atomic(path: Path | str, table: dict[str, Any]) -> Path:
    """Replace the file at `path` with `table` (at the current schema) in one rename. Callers hold `locked`."""
    path = Path(path)
    table = {**table, "schema_version": SCHEMA_VERSION}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, shared_mode())  # mkstemp's 0600 would keep the table from the people it is shared with
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


T = TypeVar("T")


def update_table(path: Path | str, op: str, device_kind: str, update: Callable[[dict[str, Any]], T]) -> T:
    """Under the lock: read the table at `path` (an empty one if there is none), let `update` change it in
    place, write it back atomically; returns what `update` returned. Raises TableError, naming the file, when
    the existing table is unreadable or belongs to another op or device kind (nothing is written then)."""
    with locked(path) as path:
        if path.exists() or path.is_symlink():
            table = read_table(path)
            for name, expected in (("op", op), ("device_kind", device_kind)):
                if table.setdefault(name, expected) != expected:
                    raise TableError(f"{path}: table is for {name} {table[name]!r}, not {expected!r}")
        else:
            table = empty_table(op, device_kind)
        result = update(table)
        write_table_atomic(path, table)
    _cache.pop(path, None)
    return result


def write_entries(path: Path | str, op: str, device_kind: str, entries: Iterable[Entry | dict[str, Any]]) -> Path:
    """Add or replace `entries` (`Entry`s, or their JSON) in the table at `path`, atomically and under a lock."""
    entries = [e.to_json() if isinstance(e, Entry) else e for e in entries]

    def add(table: dict[str, Any]) -> None:
        for entry in entries:
            table["entries"][entry["key"]] = entry

    update_table(path, op, device_kind, add)
    return Path(path)


def table_entries(table: Path) -> dict[str, Any]:
    """The entries (JSON, by key) of `table`; none when it is missing or unreadable."""
    try:
        return read_table(table)["entries"] if table.exists() else {}
    except TableError:
        return {}


def is_complete(entry: dict[str, Any] | None, revision: int | None = None) -> bool:
    """Whether a table entry (JSON) is complete: present and not written by an interrupted sweep; with
    `revision`, also tuned with that backend revision (one of an older revision is stale). The tuner keeps a
    complete entry over an interrupted sweep's; a campaign skips a sweep whose entry is complete."""
    if entry is None or entry.get("interrupted"):
        return False
    return revision is None or recorded_revision(entry) == revision


def has_complete_entry(table: Path, key: str) -> bool:
    """Whether `table` holds a complete entry for `key` (an unreadable table holds none)."""
    return is_complete(table_entries(table).get(key))


ENV_PROFILE_DIR = settings.PROFILE_DIR


def user_dir() -> Path:
    return platformdirs.user_cache_path("moe-tune") / "profiles"


def shipped_dir() -> Path:
    return Path(__file__).parent / "data"


def search_dirs() -> list[tuple[str, Path]]:
    """(origin, dir) pairs in lookup order: overlay, env, user, shipped."""
    found = [("use_profiles", p) for p in contexts.profile_overlays()]
    env = settings.profile_dir()
    if env is not None:
        found.append(("env", env))
    found += [("user", user_dir()), ("shipped", shipped_dir())]
    return found


def write_dir(explicit: str | os.PathLike | None = None) -> Path:
    if explicit is not None:
        return Path(explicit).expanduser()
    return settings.profile_dir() or user_dir()


def table_path(directory: Path, device_kind: str, op: str) -> Path:
    return Path(directory) / device_kind / f"{op}.json"


def writable_dir(directory: str | os.PathLike) -> Path:
    """`directory`, created if needed, once a file can be written in it; MoeTuneError (one line naming it and
    what stands in the way: a file, a symlink loop, a permission) otherwise.

    Checked before a sweep or a campaign starts, so that a profile dir that cannot hold the table fails at
    once rather than after the sweep (or as a traceback from deep inside the log or the table write)."""
    return paths.writable_dir(directory, "cannot create or write the profile dir")
