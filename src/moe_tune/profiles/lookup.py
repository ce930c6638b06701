"""Which config the runtime uses for a call, and why: an exact entry, the nearest entry (same everything
but the token counts, e.g. ragged_dot's m, nearest in log space), or the backend's heuristic default."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path
from typing import Any

from moe_tune import devices, distributions
from moe_tune.errors import MoeTuneError, TableError
from moe_tune.profiles import dirs
from moe_tune.profiles.key import key_fields, key_from_fields
from moe_tune.profiles.table import read_table_cached

ENV_DISTRIBUTION = "MOE_TUNE_DISTRIBUTION"


@dataclasses.dataclass(frozen=True)
class LookupResult:
    config: Any
    source: str  # "exact" | "nearest" | "default"
    key: str
    backend: str
    device_kind: str
    path: Path | None = None
    entry: dict[str, Any] | None = None
    reason: str = ""


def runtime_distribution() -> str:
    """The group-size distribution the runtime assumes when it looks entries up (default `balanced`)."""
    return distributions.check_name(os.environ.get(ENV_DISTRIBUTION, distributions.DEFAULT))


_warned: set[str] = set()


def _tables(op: str, device_kind: str, strict: bool) -> list[tuple[Path, tuple, dict[str, Any]]]:
    """(path, stamp, table) of every readable table for (op, device_kind), highest priority first."""
    found = []
    for _, directory in dirs.search_dirs():
        path = dirs.table_path(directory, device_kind, op)
        try:
            cached = read_table_cached(path)
        except TableError as e:
            if strict:
                raise
            if str(path) not in _warned:  # a broken table must never break a model: skip it, say so once
                _warned.add(str(path))
                warnings.warn(f"moe-tune: ignoring unreadable table: {e}", RuntimeWarning, stacklevel=4)
            continue
        if cached is not None:
            found.append((path, *cached))
    return found


_memo: dict[tuple, LookupResult] = {}


def lookup(
    op: str,
    problem: Any,
    *,
    backend: str | None = None,
    distribution: str | None = None,
    device_kind: str | None = None,
    strict: bool = False,
) -> LookupResult:
    """The config `moe_tune.<op>` would use for `problem` on `device_kind` (default: this machine).

    `strict=True` raises TableError for an unreadable table instead of warning and skipping it.
    """
    from moe_tune.kernels import get_op  # kernels import this module; import lazily to avoid a cycle

    spec = get_op(op)
    impl = spec.backends.resolve(backend, devices.platform())
    distribution = distributions.check_name(distribution or runtime_distribution())
    device_kind = device_kind or devices.device_kind()
    fields = key_fields(problem, impl.name, distribution)
    key = key_from_fields(op, fields)
    tables = _tables(op, device_kind, strict)
    # Same question, same tables (by stamp): same answer, without rescanning entries.
    memo_key = (op, problem, impl.name, distribution, device_kind, tuple((p, stamp) for p, stamp, _ in tables))
    if memo_key not in _memo:
        if len(_memo) > 4096:  # stale stamps accumulate when tables are rewritten in-process
            _memo.clear()
        _memo[memo_key] = _resolve(problem, impl, fields, key, device_kind, [(p, t) for p, _, t in tables])
    return _memo[memo_key]


def _resolve(problem, impl, fields: dict[str, Any], key: str, device_kind: str,
             tables: list[tuple[Path, dict[str, Any]]]) -> LookupResult:
    distribution = fields["distribution"]
    for path, table in tables:
        entry = table["entries"].get(key)
        if entry is not None:
            try:
                config = impl.coerce_config(entry["config"], problem)
            except MoeTuneError as e:
                reason = f"exact entry in {path} has an unusable config ({e})"
                break
            return LookupResult(config, "exact", key, impl.name, device_kind, path, entry, f"tuned entry in {path}")
    else:
        reason = "no entry for this shape"

    # Nearest: every key field equal but the problem's size fields (token counts), which may differ, and the
    # distribution, which should not; closest in log space.
    sizes = type(problem).SIZE_FIELDS
    best: tuple[tuple[int, float, int], Path, dict[str, Any], Any] | None = None
    for rank, (path, table) in enumerate(tables):
        for entry in table["entries"].values():
            other = entry["fields"]
            if any(other.get(f) != v for f, v in fields.items() if f not in (*sizes, "distribution")):
                continue
            if not all(isinstance(other.get(f), int) and other[f] > 0 for f in sizes):
                continue
            try:
                config = impl.coerce_config(entry["config"], problem)
            except MoeTuneError:
                continue
            distance = sum(abs(math.log(other[f] / fields[f])) for f in sizes)
            score = (int(other.get("distribution") != distribution), distance, rank)
            if best is None or score < best[0]:
                best = (score, path, entry, config)
    if best is not None:
        _, path, entry, config = best
        tuned = " ".join(f"{f}={entry['fields'][f]}" for f in sizes)
        why = f"{reason}; nearest tuned {tuned} ({entry['fields'].get('distribution')}) in {path}"
        return LookupResult(config, "nearest", key, impl.name, device_kind, path, entry, why)
    return LookupResult(impl.default_config(problem), "default", key, impl.name, device_kind, None, None,
                        f"{reason}; heuristic default")
