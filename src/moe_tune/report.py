"""Tables as a pandas DataFrame: one row per tuned entry, the effective one when several dirs hold a key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from moe_tune.profiles import dirs
from moe_tune.profiles.table import read_table

COLUMNS = [
    "device_kind", "op", "direction", "backend", "shape", "dtype", "distribution", "config",
    "time_ms", "default_ms", "speedup", "tried", "failed", "wrong", "timing", "source", "tuned_at",
]


_NOT_SHAPE = ("direction", "backend", "distribution")


def table_files(profile_dir: Path | None = None, op: str | None = None) -> list[tuple[str, Path]]:
    """(origin, path) of every table in `profile_dir`, or in every search dir, highest priority first."""
    roots = [("dir", Path(profile_dir))] if profile_dir is not None else dirs.search_dirs()
    found = []
    for origin, root in roots:
        pattern = f"*/{op}.json" if op else "*/*.json"
        found += [(origin, path) for path in sorted(Path(root).glob(pattern))]
    return found


def _row(entry: dict[str, Any], table: dict[str, Any], origin: str) -> dict[str, Any]:
    fields = entry["fields"]
    dtypes = {str(v) for k, v in fields.items() if k.endswith("dtype")}
    default = entry.get("default") or {}
    timing = entry.get("timing") or {}
    counts = entry.get("candidates") or {}
    config = entry["config"]
    return {
        "device_kind": table.get("device_kind"),
        "op": table.get("op"),
        "direction": fields.get("direction"),
        "backend": fields.get("backend"),
        "shape": " ".join(f"{k}={v}" for k, v in fields.items() if k not in _NOT_SHAPE and not k.endswith("dtype")),
        "dtype": "/".join(sorted(dtypes)),
        "distribution": fields.get("distribution"),
        "config": " ".join(f"{k}={v}" for k, v in config.items()) or "-",
        "time_ms": timing.get("median_s", float("nan")) * 1e3,
        "default_ms": (default.get("median_s") or float("nan")) * 1e3,
        "speedup": entry.get("speedup_over_default") or float("nan"),
        "tried": counts.get("tried"), "failed": counts.get("failed"), "wrong": counts.get("wrong"),
        "timing": timing.get("method"),
        "source": origin,
        "tuned_at": entry.get("tuned_at"),
    }


def entries_frame(profile_dir: Path | None = None, op: str | None = None) -> pd.DataFrame:
    """Every effective entry; raises TableError (naming the file) for an unreadable table."""
    rows, seen = [], set()
    for origin, path in table_files(profile_dir, op):
        table = read_table(path)
        for key, entry in table["entries"].items():
            ident = (table.get("device_kind"), key)
            if ident in seen:  # shadowed by a higher-priority dir
                continue
            seen.add(ident)
            rows.append(_row(entry, table, origin))
    frame = pd.DataFrame(rows, columns=COLUMNS)
    return frame.sort_values(["device_kind", "op", "direction", "shape"], ignore_index=True)
