"""Which config the runtime uses for a call, and why, in this order (docs/ARCHITECTURE.md, "Tables and the shared
key"):

1. `exact`: the entry of this key;
2. `interval`: a token-count interval a ladder sweep measured that holds this count (`intervals.py`);
3. `robust`: when this shape is tuned, but not for the routing distribution asked for, the config measured as
   robust across the tuned distributions (`sweep --distribution all` records it);
4. `nearest`: the entry of the same everything but the token counts (e.g. ragged_dot's m), nearest in log
   space, preferring the distribution asked for; when the nearest shape is tuned for other distributions only,
   its robust choice (source `robust`) if it has one, else the reason says none has the distribution;
5. `default`: the backend's heuristic default.

A broken table never breaks a model: an unreadable, corrupted or truncated table (or one whose entries lack
what lookup needs) is skipped with one warning and lookup goes on to the next profile dir, then the default;
`strict=True` (the CLI) raises TableError naming the file instead. An entry whose config does not fit its
backend and problem is not used.

Stale entries (tuned with another kernel revision or JAX minor version, `entry.py`) are used, skipped or
refused by the stale policy; `LookupResult.stale` says what differs when the config came from one.

This module knows nothing of the kernels package: the caller passes the backend (`protocols.BackendLike`) and
the problem (`protocols.ProblemLike`). `kernels.get_op(op).lookup(problem, backend=None | name)` is
the convenience that picks the backend as the runtime does.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from moe_tune.core.errors import TableError, UsageError, warn_caller
from moe_tune.profiles.table import search_dirs, table_path
from moe_tune.profiles import intervals as _intervals
from moe_tune.profiles import entry as _versions
from moe_tune.profiles.entry import Entry, record_problems
from moe_tune.profiles.entry import key_fields, key_from_fields
from moe_tune.profiles.protocols import BackendLike, ProblemLike
from moe_tune.profiles.table import read_table_cached
from moe_tune.profiles.entry import StaleEntryError
from moe_tune.core import chips, contexts, devices, distributions, settings


@dataclasses.dataclass(frozen=True)
class LookupResult:
    config: Any
    source: str  # "exact" | "interval" | "robust" | "nearest" | "default"
    key: str
    backend: str
    device_kind: str
    path: Path | None = None
    entry: Entry | None = None
    reason: str = ""
    stale: str = ""  # what differs, when the config came from a stale entry (policy `use`); "" when fresh
    stale_policy: str = _versions.DEFAULT_STALE_POLICY
    # source `interval`: (token-count field, lo, hi) of the interval [lo, hi) the config came from
    interval: tuple[str, int, int] | None = None


def runtime_distribution() -> str:
    """The group-size distribution the runtime assumes when it looks entries up and no call says one: the
    innermost `moe_tune.use_distribution` block's, else $MOE_TUNE_DISTRIBUTION's, else `balanced`."""
    return distributions.check_name(contexts.current_distribution() or settings.distribution() or distributions.DEFAULT)


_warned: set[Any] = set()


def _warn_once(ident: Any, message: str) -> None:
    if ident not in _warned:
        _warned.add(ident)
        warn_caller(message)


def _tables(op: str, device_kind: str, strict: bool) -> list[tuple[Path, tuple, dict[str, Any]]]:
    """(path, stamp, table) of every readable table for (op, device_kind), highest priority first."""
    found = []
    for _, directory in search_dirs():
        path = table_path(directory, device_kind, op)
        try:
            cached = read_table_cached(path)
        except TableError as e:
            if strict:
                raise
            # a broken table must never break a model: skip it, say so once
            _warn_once(str(path), f"moe-tune: ignoring unreadable table: {e}")
            continue
        if cached is not None:
            found.append((path, *cached))
    return found


_KIND = re.compile(r"[a-z0-9]+(_[a-z0-9]+)*")


def known_device_kinds() -> list[str]:
    """The device kinds lookup answers for: this machine's, `cpu`, the chips moe-tune knows (`core.chips`), and
    every directory of tables in a profile dir (shipped, user, environment, overlays)."""
    kinds = {devices.device_kind(), "cpu", *(t.device_kind for t in chips.TARGETS.values())}
    for _, directory in search_dirs():
        try:
            kinds.update(p.name for p in Path(directory).iterdir() if _KIND.fullmatch(p.name) and p.is_dir())
        except OSError:  # a profile dir that does not exist (yet)
            continue
    return sorted(kinds)


def device_of_kind(kind: str | None) -> devices.Device:
    """The device whose platform and rules lookups for device kind `kind` answer with (None, or the judged
    device's own kind: the judged device): a chip of `core.chips` is itself; `cpu` is the CPU; another kind
    with tables (a GPU moe-tune has no facts for) takes the platform its name says, else this machine's.
    UsageError, one line, for a kind with characters a normalized device kind never has (a path) or one that
    is neither a known chip nor a directory of tables."""
    if kind is None or kind == devices.device_kind():
        return devices.current()
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise UsageError(f"device kind {kind!r} is not a device kind: lowercase letters, digits and single '_' "
                         "only, as `jax.devices()[0].device_kind` normalizes (cpu, nvidia_h100_80gb_hbm3, tpu_v5_lite)")
    known = known_device_kinds()
    if kind not in known:
        raise UsageError(f"unknown device kind {kind!r}; known: {', '.join(known)} (the chips moe-tune knows and "
                         "the device kinds of the tables found)")
    target = chips.for_device_kind(kind)
    if target is not None:
        return devices.Device(target.platform, kind)
    platform = ("cpu" if kind == "cpu" else "tpu" if kind.startswith("tpu") else
                "gpu" if kind.startswith(("nvidia", "amd")) else devices.platform())
    return devices.Device(platform, kind)


_memo: dict[tuple, LookupResult] = {}


def lookup(
    op: str,
    problem: ProblemLike,
    *,
    backend: BackendLike,
    distribution: str | None = None,
    device_kind: str | None = None,
    strict: bool = False,
    stale_policy: str | None = None,
) -> LookupResult:
    """The config `moe_tune.<op>` would use for `problem` with `backend` (a backend instance, e.g.
    `kernels.get_op(op).backends.get("tiled")`) on `device_kind` (default: this machine; another kind must be
    one `device_of_kind` knows, else UsageError).

    `strict=True` raises TableError for an unreadable table instead of warning and skipping it.
    `stale_policy` (`use`, `skip`, `error`; default: `use_stale_policy` blocks, then `$MOE_TUNE_STALE_POLICY`,
    then `use`) says what to do with an entry tuned with another kernel revision or JAX minor version;
    `error` raises `StaleEntryError` (a TableError) naming the file, the key and what differs.
    """
    if isinstance(backend, str) or backend is None:
        raise TypeError(f"lookup needs the backend instance, got {backend!r}; "
                        f"kernels.get_op({op!r}).lookup(problem, backend=NAME) picks it by name")
    impl = backend
    distribution = distributions.check_name(distribution or runtime_distribution())
    device_kind = device_of_kind(device_kind).kind
    policy = _versions.stale_policy(stale_policy)
    jax_version = _versions.installed_jax()
    fields = key_fields(problem, impl.name, distribution)
    key = key_from_fields(op, fields)
    tables = _tables(op, device_kind, strict)
    # Same question, same tables (by stamp), same policy and versions: same answer, without rescanning entries.
    memo_key = (op, problem, impl.name, getattr(impl, "revision", None), jax_version, distribution, device_kind,
                policy, tuple((p, stamp) for p, stamp, _ in tables))
    if memo_key not in _memo:
        if len(_memo) > 4096:  # stale stamps accumulate when tables are rewritten in-process
            _memo.clear()
        result = _resolve(problem, impl, fields, key, device_kind, [(p, t) for p, _, t in tables], policy,
                          jax_version)
        _memo[memo_key] = result
    return _memo[memo_key]


def _stale_check(path: Path, key: str, entry: dict[str, Any], impl: BackendLike, policy: str,
                 jax_version: str) -> list[str]:
    """What makes `entry` stale (empty when fresh); raises under `error`, warns once per table and difference."""
    differs = _versions.staleness(entry, impl, jax_version)
    if not differs:
        return differs
    what = "; ".join(differs)
    if policy == "error":
        raise StaleEntryError(f"{path}: entry {key!r} is stale: tuned with {what}; the stale policy 'error' "
                              f"refuses it: re-tune it with `moe-tune sweep`, or set ${_versions.ENV_STALE_POLICY} "
                              "to 'use' or 'skip'")
    action = "using" if policy == "use" else "skipping"
    _warn_once(("stale", str(path), policy, what),
               f"moe-tune: {path} has entries tuned with {what}; {action} them (stale policy '{policy}', "
               f"see ${_versions.ENV_STALE_POLICY}); re-tune with `moe-tune sweep`")
    return differs


def _resolve(problem: ProblemLike, impl: BackendLike, fields: dict[str, Any], key: str, device_kind: str,
             tables: list[tuple[Path, dict[str, Any]]], policy: str, jax_version: str) -> LookupResult:
    distribution = fields["distribution"]
    skipped: list[str] = []
    for path, table in tables:
        entry = table["entries"].get(key)
        if entry is None:
            continue
        stale = _stale_check(path, key, entry, impl, policy, jax_version)
        if stale and policy == "skip":
            skipped.append(f"skipped stale exact entry in {path} (tuned with {'; '.join(stale)})")
            continue
        try:
            config = impl.coerce_config(entry["config"], problem)
        except Exception as e:  # whatever a table holds, it must not break a model
            reason = f"exact entry in {path} has an unusable config ({e})"
            break
        why = "; ".join([*skipped, f"tuned entry in {path}" + (f" (stale: {'; '.join(stale)})" if stale else "")])
        return LookupResult(config, "exact", key, impl.name, device_kind, path, _read_entry(path, entry, key), why,
                            "; ".join(stale), policy)
    else:
        reason = "; ".join([*skipped, "no entry for this shape"]) if skipped else "no entry for this shape"

    found = (_from_interval(problem, impl, fields, key, device_kind, tables, policy, jax_version, reason)
             or _from_robust(problem, impl, fields, key, device_kind, tables, policy, jax_version, reason))
    if found is not None:
        return found

    # Nearest: every key field equal but the problem's size fields (token counts), which may differ, and the
    # distribution, which should not; closest in log space.
    sizes = problem.SIZE_FIELDS
    best: tuple[tuple[int, float, int], Path, dict[str, Any], Any] | None = None
    for rank, (path, table) in enumerate(tables):
        for other_key, entry in table["entries"].items():
            other = entry["fields"]
            if any(other.get(f) != v for f, v in fields.items() if f not in (*sizes, "distribution")):
                continue
            if not all(isinstance(other.get(f), int) and other[f] > 0 for f in sizes):
                continue
            if policy == "skip" and _versions.staleness(entry, impl, jax_version):
                _stale_check(path, other_key, entry, impl, policy, jax_version)  # the once-per-table warning
                continue
            try:
                config = impl.coerce_config(entry["config"], problem)
                distance = sum(abs(math.log(other[f] / fields[f])) for f in sizes)
            except Exception:  # an unusable config, or sizes no float can hold
                continue
            score = (int(other.get("distribution") != distribution), distance, rank)
            if best is None or score < best[0]:
                best = (score, path, entry, config)
    if best is not None:
        _, path, entry, config = best
        stale = _stale_check(path, entry.get("key", key), entry, impl, policy, jax_version)
        tuned = " ".join(f"{f}={entry['fields'][f]}" for f in sizes)
        if entry["fields"].get("distribution") != distribution:
            # the nearest shape is tuned for other distributions only: its robust choice, when it has one
            there = {**fields, **{f: entry["fields"][f] for f in sizes}}
            robust = _from_robust(problem, impl, there, key, device_kind, tables, policy, jax_version,
                                  f"{reason}; nearest tuned {tuned}: no entry there")
            if robust is not None:
                return robust
            reason += f"; no entry for distribution {distribution} near it"
        why = f"{reason}; nearest tuned {tuned} ({entry['fields'].get('distribution')}) in {path}"
        if stale:
            why += f" (stale: {'; '.join(stale)})"
        return LookupResult(config, "nearest", key, impl.name, device_kind, path,
                            _read_entry(path, entry, entry.get("key", key)), why, "; ".join(stale), policy)
    others = _other_dtypes(fields, tables)
    if others:  # the commonest miss: the shape is tuned, in another dtype
        reason += f" in {_dtype_of(fields)}; tuned in {', '.join(others)} (ask for that dtype: --dtype {others[0]})"
    return LookupResult(impl.default_config(problem), "default", key, impl.name, device_kind, None, None,
                        f"{reason}; heuristic default", "", policy)


def _from_interval(problem: ProblemLike, impl: BackendLike, fields: dict[str, Any], key: str, device_kind: str,
                   tables: list[tuple[Path, dict[str, Any]]], policy: str, jax_version: str,
                   reason: str) -> LookupResult | None:
    """The config of the token-count interval that holds the problem (the first table, by priority, that has
    one), or None."""
    sizes = problem.SIZE_FIELDS
    for path, table in tables:
        record = _intervals.matching_interval(table, fields, sizes)
        if record is None:
            continue
        if policy == "skip" and _versions.staleness(record, impl, jax_version):
            _stale_check(path, record["key"], record, impl, policy, jax_version)
            continue
        try:
            config = impl.coerce_config(record["config"], problem)
        except Exception:  # an unusable config: the next table, then nearest
            continue
        stale = _stale_check(path, record["key"], record, impl, policy, jax_version)
        won = [k for k in record.get("entries") or [] if k in table["entries"]]
        entry = _read_entry(path, table["entries"][won[0]], won[0]) if won else None
        why = (f"{reason}; interval {_intervals.describe_interval(record)} in {path} (its config won at "
               f"{_won_at(record, table, sizes[0])}; its ends measured between tuned counts)")
        if stale:
            why += f" (stale: {'; '.join(stale)})"
        return LookupResult(config, "interval", key, impl.name, device_kind, path, entry, why, "; ".join(stale),
                            policy, (record["field"], record["lo"], record["hi"]))
    return None


def _won_at(record: dict[str, Any], table: dict[str, Any], field: str) -> str:
    counts = [table["entries"][k]["fields"].get(field) for k in record.get("entries") or [] if k in table["entries"]]
    return f"{field}={','.join(str(c) for c in counts)}" if counts else "tuned counts no longer in the table"


def _from_robust(problem: ProblemLike, impl: BackendLike, fields: dict[str, Any], key: str, device_kind: str,
                 tables: list[tuple[Path, dict[str, Any]]], policy: str, jax_version: str,
                 reason: str) -> LookupResult | None:
    """When the shape is tuned for other routing distributions only: the config a `--distribution all` sweep
    measured as robust across them (lowest worst-case slowdown against each distribution's winner), or None
    (no such record: nearest then says the distribution asked for has no entry)."""
    asked = fields["distribution"]
    same = {f: v for f, v in fields.items() if f != "distribution"}
    tuned = sorted({str(e["fields"].get("distribution")) for _, t in tables for e in t["entries"].values()
                    if all(e["fields"].get(f) == v for f, v in same.items())} - {asked})
    if not tuned:
        return None
    rkey = _intervals.robust_key(key.split("|", 1)[0], fields)
    for path, table in tables:
        record = (table.get(_intervals.ROBUST) or {}).get(rkey)
        if record is None or _intervals.robust_problems(record):
            continue
        if policy == "skip" and _versions.staleness(record, impl, jax_version):
            _stale_check(path, rkey, record, impl, policy, jax_version)
            continue
        try:
            config = impl.coerce_config(record["config"], problem)
        except Exception:
            continue
        stale = _stale_check(path, rkey, record, impl, policy, jax_version)
        entry_key = record.get("entry")
        entry = table["entries"].get(entry_key) if isinstance(entry_key, str) else None
        worst = record.get("worst_slowdown")
        at_worst = f", at worst {worst:.2f}x each distribution's winner" if isinstance(worst, (int, float)) else ""
        why = (f"{reason} for distribution {asked} (tuned for {', '.join(tuned)}); the config robust across them "
               f"in {path}: the {record['distribution']} winner{at_worst}")
        if stale:
            why += f" (stale: {'; '.join(stale)})"
        return LookupResult(config, "robust", key, impl.name, device_kind, path,
                            _read_entry(path, entry, entry_key) if entry is not None else None, why,
                            "; ".join(stale), policy)
    return None


def _dtype_of(fields: dict[str, Any]) -> str:
    """The dtype a person asks for (`--dtype`): the lhs's for ragged_dot, else the op's `dtype`."""
    return str(fields.get("lhs_dtype", fields.get("dtype")))


def _other_dtypes(fields: dict[str, Any], tables: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """The dtypes of the entries that match `fields` in everything but the dtypes (and the distribution)."""
    same = {f: v for f, v in fields.items() if not f.endswith("dtype") and f != "distribution"}
    found = {_dtype_of(entry["fields"]) for _, table in tables for entry in table["entries"].values()
             if isinstance(entry.get("fields"), dict) and all(entry["fields"].get(f) == v for f, v in same.items())}
    return sorted(found - {_dtype_of(fields)})


def _read_entry(path: Path, entry: dict[str, Any], key: str) -> Entry:
    """The typed entry a config came from; one warning when its records are broken (a timing that is not a
    number...): its config is used all the same, only its times are unknown (`Entry.median_s` is None)."""
    broken = record_problems(entry)
    if broken:
        _warn_once(("records", str(path), key), f"moe-tune: {path}: entry {key!r}: {broken[0]}; its config is "
                                                 "used, its times are not (`moe-tune validate` lists what is wrong)")
    return Entry.from_json(entry, key)
