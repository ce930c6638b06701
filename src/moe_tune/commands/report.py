"""Tables as a pandas DataFrame: one row per tuned entry (the effective one when several dirs hold a key),
filters and sorting for `moe-tune report`, and its plots."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from moe_tune.commands.breakdown.ops import Breakdown
from moe_tune.core.errors import UsageError, warn_caller
from moe_tune.core.quant_format import QuantFormat
from moe_tune.kernels import get_op
from moe_tune.profiles.table import search_dirs
from moe_tune.profiles.entry import Entry, record_problems, seconds
from moe_tune.profiles.intervals import describe_interval, interval_of_entry
from moe_tune.profiles.table import read_table
from moe_tune.profiles.verdict import BEAT_DEFAULT, budget_text, verdict_of, verdict_words

# (newer columns come last: scripts that read the csv by position keep working)
COLUMNS = [
    "device_kind", "op", "direction", "backend", "shape", "dtype", "quant", "quant_error", "distribution", "config",
    "time_ms", "default_ms", "speedup", "verdict", "tried", "failed", "wrong", "timing", "source", "tuned_at", "key",
    "kernel", "verdict_detail", "budget", "config_short", "interval",
]
# The default rich table: what a person reads first, one line per entry where it fits (the shipped tables' rows
# need about 230 columns: fused shapes and GPU configs are the longest); on a narrower terminal the
# WRAP_COLUMNS wrap, nothing is cut. `--all` shows ALL_TABLE_COLUMNS, `--columns` any of COLUMNS.
COMPACT_COLUMNS = ["kernel", "shape", "interval", "dtype", "backend", "config_short", "speedup", "verdict",
                   "source"]
WRAP_COLUMNS = ("shape", "config", "config_short", "verdict", "verdict_detail", "budget", "quant")
# Column headers that differ from the frame's column names.
HEADERS = {"config_short": "config"}
ALL_TABLE_COLUMNS = ["device_kind", "kernel", "backend", "shape", "interval", "dtype", "quant", "quant_error", "distribution",
                     "config", "time_ms", "default_ms", "speedup", "verdict", "verdict_detail", "budget", "tried",
                     "failed", "wrong", "timing", "source", "tuned_at"]
_QUANT_COLUMNS = ("quant", "quant_error")
# `moe-tune report` filters: option name -> column it matches.
FILTERS = {"op": "op", "direction": "direction", "device": "device_kind", "backend": "backend", "dtype": "dtype",
           "key": "key", "source": "source"}
_NOT_SHAPE = ("direction", "backend", "distribution")
# Where an entry comes from (`search_dirs` origins), in the words of the `source` column.
SOURCES = {"shipped": "shipped", "user": "user cache", "env": "profile dir", "dir": "profile dir",
           "use_profiles": "use_profiles"}
MINE = ("user cache", "profile dir", "use_profiles")  # `report --mine`: every source but the shipped tables


def table_files(profile_dir: Path | None = None, op: str | None = None) -> list[tuple[str, Path]]:
    """(origin, path) of every table in `profile_dir`, or in every search dir, highest priority first."""
    roots = [("dir", Path(profile_dir))] if profile_dir is not None else search_dirs()
    found = []
    for origin, root in roots:
        pattern = f"*/{op}.json" if op else "*/*.json"
        found += [(origin, path) for path in sorted(Path(root).glob(pattern))]
    return found


def effective_entries(profile_dir: Path | None = None, op: str | None = None
                      ) -> Iterator[tuple[str, dict[str, Any], Entry]]:
    """(origin, table, entry) of every entry the runtime could use (a key shadowed by a higher-priority dir
    is skipped); raises TableError (naming the file) for an unreadable table."""
    seen = set()
    for origin, path in table_files(profile_dir, op):
        table = read_table(path)
        for key, entry in table["entries"].items():
            ident = (table.get("device_kind"), key)
            if ident in seen:
                continue
            seen.add(ident)
            broken = record_problems(entry)
            if broken:  # the runtime uses its config; the report cannot compute with its records
                warn_caller(f"moe-tune: skipping {path}: entry {key!r}: {broken[0]} (`moe-tune validate` lists "
                            "what is wrong)")
                continue
            yield origin, table, Entry.from_json(entry, key)


def selected_entries(frame: pd.DataFrame, profile_dir: Path | None = None, op: str | None = None) -> list[Entry]:
    """The entries behind the rows of `frame` (from `entries_frame` and `select`), in its row order."""
    entries = {entry.key: entry for _, _, entry in effective_entries(profile_dir, op)}
    return [entries[key] for key in frame["key"]]


def shape_label(fields: dict[str, Any]) -> str:
    """`m=4096 k=1024 n=1024 groups=8`: the key fields that are sizes (not direction, dtypes, backend,
    quantization...)."""
    return " ".join(f"{k}={v}" for k, v in fields.items()
                    if k not in _NOT_SHAPE and not k.endswith(("dtype", "qblock", "qdynamic", "qlayout")))


def _quantized(fields: dict[str, Any], side: str) -> str | None:
    """`int8/128`: a quantized operand's stored dtype, with its scale block when it is not all of k (`mxfp4`
    for float4_e2m1fn in its blocks of 32); ` dynamic` after activations the kernel quantizes, ` nk` after
    weights stored in that layout; None for a float operand."""
    qdtype, block = fields.get(f"{side}_qdtype"), fields.get(f"{side}_qblock")
    if qdtype is None:
        return None
    dynamic = " dynamic" if fields.get(f"{side}_qdynamic") else ""
    dynamic += f" {fields[f'{side}_qlayout']}" if fields.get(f"{side}_qlayout") else ""
    try:
        return QuantFormat(qdtype, block).label(fields.get("k")) + dynamic
    except UsageError:  # a table's entry no problem produces (validate says so): shown as stored
        return f"{qdtype}/{block}{dynamic}"


def quant_label(fields: dict[str, Any]) -> str:
    """`rhs int8/128` (per side: quantized dtype, and the scale block when it is not all of k), or `-`."""
    return " ".join(f"{side} {_quantized(fields, side)}" for side in ("lhs", "rhs")
                    if _quantized(fields, side) is not None) or "-"


def dtype_label(fields: dict[str, Any]) -> str:
    """The operands' dtypes as a person names them: `bfloat16`; `bfloat16 x int8` (int8 weights, float
    activations: the quantized side shows its stored dtype, not the float32 it counts as in the key);
    `int8 x int8/128 -> float32`; the output only when it differs from the lhs."""
    if "lhs_dtype" not in fields:  # one dtype for the op's floats; quantized weights show their own
        weights = _quantized(fields, "rhs")
        return str(fields.get("dtype", "-")) + (f" x {weights}" if weights else "")
    lhs, rhs = (_quantized(fields, side) or str(fields.get(f"{side}_dtype")) for side in ("lhs", "rhs"))
    out = str(fields.get("out_dtype", lhs))
    text = lhs if lhs == rhs else f"{lhs} x {rhs}"
    return text if out == lhs.split("/")[0] else f"{text} -> {out}"


def table_columns(frame: pd.DataFrame, *, columns: Sequence[str] | None = None, everything: bool = False) -> list[str]:
    """The rich table's columns: `columns` as given (UsageError naming the known ones for another), else
    ALL_TABLE_COLUMNS with `everything`, else COMPACT_COLUMNS; the quantization ones only when a row is
    quantized."""
    if columns:
        unknown = [c for c in columns if c not in COLUMNS]
        if unknown:
            raise UsageError(f"no column {unknown[0]!r}; columns are {', '.join(COLUMNS)}")
        return list(columns)
    quantized = bool((frame["quant"] != "-").any()) if len(frame) else False
    # the token-count interval a ladder sweep measured around an entry, when one has one
    laddered = bool((frame["interval"] != "-").any()) if len(frame) else False
    return [c for c in (ALL_TABLE_COLUMNS if everything else COMPACT_COLUMNS)
            if (quantized or c not in _QUANT_COLUMNS) and (laddered or c != "interval")]


DIRECTION_WORDS = {"fwd": "forward", "dlhs": "gradient of lhs", "drhs": "gradient of rhs"}


def entry_words(entry: Entry) -> str:
    """The entry's shape in words, for titles: `ragged_dot, gradient of lhs: m=1024 k=2880 n=2880 groups=8,
    bfloat16 x int8, tiled backend, balanced routing`."""
    fields, direction = entry.fields, entry.fields.get("direction")
    op = entry.op or "kernel"
    what = f"{op}, {DIRECTION_WORDS.get(direction, direction)}" if direction else op
    return (f"{what}: {shape_label(dict(fields))}, {dtype_label(dict(fields))}, {fields.get('backend')} backend, "
            f"{fields.get('distribution')} routing")


def config_short(config: Mapping[str, Any]) -> str:
    """`tm=1024 tk=2048 tn=512 tail=16 batched`: a config with its true flags named and its false ones left
    out (the compact table's `config`; the `config` column spells every value)."""
    return " ".join(k if v is True else f"{k}={v}" for k, v in config.items() if v is not False) or "-"


def _row(entry: Entry, table: dict[str, Any], origin: str) -> dict[str, Any]:
    fields = entry.fields
    median = entry.median_s
    verdict = verdict_of(entry)  # derived for an entry written before verdicts were recorded
    op, direction = table.get("op"), fields.get("direction")
    return {
        "device_kind": table.get("device_kind"),
        "op": op,
        "direction": direction,
        "kernel": _kernel_label(op, direction),
        "backend": fields.get("backend"),
        "shape": shape_label(fields),
        "dtype": dtype_label(fields),
        "quant": quant_label(fields),
        "quant_error": float("nan") if entry.quantization_error is None else entry.quantization_error,
        "distribution": fields.get("distribution"),
        "config": " ".join(f"{k}={v}" for k, v in entry.config.items()) or "-",
        "config_short": config_short(entry.config),
        "time_ms": _ms(median),
        "default_ms": _ms(entry.default_median_s),
        "speedup": entry.speedup or float("nan"),
        "verdict": verdict_words(entry),
        "verdict_detail": verdict.label,
        "budget": budget_text(entry.search, entry.count("tried")) if isinstance(entry.search, dict) else "-",
        "tried": entry.count("tried"), "failed": entry.count("failed"), "wrong": entry.count("wrong"),
        "timing": entry.timing_method,
        "source": SOURCES.get(origin, origin),
        "tuned_at": entry.tuned_at,
        "key": entry.key,
        "interval": _interval_text(table, entry.key),
    }


def _kernel_label(op: str | None, direction: str | None) -> str:
    """The `kernel` column: the op's own label (`KernelOp.kernel_label`); for a table of an op this package
    does not know, its name and any direction but fwd."""
    try:
        return get_op(op).kernel_label(direction)
    except UsageError:
        return f"{op} {direction}" if direction and direction != "fwd" else str(op)


def _interval_text(table: dict[str, Any], key: str) -> str:
    """`m in [64, 181)`: the interval of token counts whose config this entry won (a ladder sweep's), or `-`."""
    record = interval_of_entry(table, key)
    return describe_interval(record) if record is not None else "-"


def _ms(value: Any) -> float:
    """Seconds as milliseconds; NaN for anything that is not a positive number of seconds."""
    value = seconds(value)
    return float("nan") if value is None else value * 1e3


def entries_frame(profile_dir: Path | None = None, op: str | None = None) -> pd.DataFrame:
    """Every effective entry as a row of COLUMNS; raises TableError (naming the file) for an unreadable table."""
    rows = [_row(entry, table, origin) for origin, table, entry in effective_entries(profile_dir, op)]
    frame = pd.DataFrame(rows, columns=COLUMNS)
    return frame.sort_values(["device_kind", "op", "direction", "shape"], ignore_index=True)


def select(frame: pd.DataFrame, *, sort: str | None = None, descending: bool = False,
           **filters: str | None) -> pd.DataFrame:
    """Rows matching every given filter (FILTERS names; a dtype matches any of a row's dtypes), sorted by a
    column of COLUMNS if asked. Without a device or source filter, the shipped tables of other device kinds
    (what a lent H100 tuned, on a CPU) are left out: this machine never uses them."""
    if filters.get("device") is None and filters.get("source") is None:
        from moe_tune.core import devices  # here: the report's other paths never touch JAX's backends

        frame = frame[(frame["source"] != SOURCES["shipped"]) | (frame["device_kind"] == devices.device_kind())]
    for name, value in filters.items():
        if value is None:
            continue
        if name not in FILTERS:
            raise UsageError(f"unknown filter {name!r}; filters are {', '.join(FILTERS)}")
        column = frame[FILTERS[name]].astype(str)
        if name == "dtype":  # any operand's dtype: `bfloat16 x int8/128 -> float32` matches each of them
            keep = column.str.findall(r"[A-Za-z]\w*").apply(lambda parts: value in parts)
        elif name == "source" and value == "mine":  # the user's own entries: every source but the shipped
            keep = column.isin(MINE)
        else:
            keep = column == (SOURCES.get(value, value) if name == "source" else value)
        frame = frame[keep]
    if sort is not None:
        if sort not in COLUMNS:
            raise UsageError(f"cannot sort by {sort!r}; columns are {', '.join(COLUMNS)}")
        frame = frame.sort_values(sort, ascending=not descending, kind="stable")
    return frame.reset_index(drop=True)


LOG_COLUMNS = ["index", "status", "config", "median_ms", "spread", "final_ms", "final_spread", "winner", "error",
               "stage", "reason", "compile_s", "default"]


def sweep_log_frame(path: str | Path) -> tuple[dict[str, Any], pd.DataFrame, list[dict[str, Any]]]:
    """(header, one row per candidate of LOG_COLUMNS, the `final` lines) of a sweep log (tuner/request.py):
    every candidate a sweep finished, failed and wrong ones with their reasons, fastest correct first.

    median_ms / spread: the candidate's sweep round; final_ms / final_spread: a finalist's final round (from
    the last `final` line; NaN for the others, and the spread for logs written before it was recorded);
    winner: the config that last `final` line chose."""
    from moe_tune.core.errors import MoeTuneError
    from moe_tune.tuner.request import read_log

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no sweep log at {path} (sweep logs live under <profile dir>/<device>/sweeps/<op>/)")
    lines, _ = read_log(path)
    if not lines or lines[0].get("type") != "header":
        raise MoeTuneError(f"{path}: not a moe-tune sweep log (no header line)")
    finals = [line for line in lines if line.get("type") == "final"]
    last = finals[-1] if finals else {}
    final_round = {f.get("index"): f for f in last.get("finalists") or () if isinstance(f, dict)}
    candidates = [line for line in lines if line.get("type") == "candidate"]
    usable = [line for line in candidates if isinstance(line.get("config"), dict)]
    if len(usable) < len(candidates):  # as the sweep's resume does: such a line is no candidate
        warn_caller(f"moe-tune: {path}: skipping {len(candidates) - len(usable)} candidate line(s) whose config "
                    "is not an object")
    rows = [_log_row(line, final_round.get(line.get("index"), {}), last.get("winner")) for line in usable]
    frame = pd.DataFrame(rows, columns=LOG_COLUMNS)
    order = {"ok": 0, "wrong": 1, "failed": 2}
    frame = frame.assign(_rank=frame["status"].map(order).fillna(3)).sort_values(
        ["_rank", "median_ms", "index"], kind="stable").drop(columns="_rank").reset_index(drop=True)
    return lines[0], frame, finals


def _log_row(line: dict[str, Any], final: dict[str, Any], winner: Any) -> dict[str, Any]:
    """One candidate line of a sweep log as a row of LOG_COLUMNS (`final`: its record in the last final round)."""
    timing = line.get("timing") if isinstance(line.get("timing"), dict) else {}
    return {
        "index": line.get("index"),
        "status": line.get("status"),
        "config": " ".join(f"{k}={v}" for k, v in line["config"].items()) or "-",
        "median_ms": _ms(timing.get("median_s")),
        "spread": timing.get("spread", float("nan")),
        "final_ms": _ms(final.get("median_s")),
        "final_spread": final.get("spread") if final.get("spread") is not None else float("nan"),
        "winner": line["config"] == winner,
        "error": line.get("error") if line.get("error") is not None else float("nan"),
        "stage": line.get("stage") or "",
        "reason": line.get("reason") or "",
        "compile_s": line.get("compile_s") if line.get("compile_s") is not None else float("nan"),
        "default": bool(line.get("is_default")),
    }


BREAKDOWN_COLUMNS = ["label", "config", "source", "rank", "op", "group", "ms_per_run", "share", "cumulative",
                     "calls_per_run"]


def breakdown_frame(breakdowns: Sequence[Breakdown], top: int | None = None) -> pd.DataFrame:
    """One row per op of each breakdown (`moe_tune.commands.breakdown`), largest first, with its share and the
    cumulative share; `top`: only each one's first `top` ops, the rest summed into one `other (N ops)` row."""
    rows = []
    for breakdown in breakdowns:
        ops = list(breakdown.ops)
        shown, rest = (ops, []) if top is None else (ops[:top], ops[top:])
        config = " ".join(f"{k}={v}" for k, v in breakdown.config.items())
        common = {"label": breakdown.label, "config": config, "source": breakdown.source}
        cumulative = 0.0
        for rank, op in enumerate(shown, 1):
            cumulative += op.share
            rows.append({**common, "rank": rank, "op": op.name, "group": op.group, "ms_per_run": op.seconds * 1e3,
                         "share": op.share, "cumulative": cumulative, "calls_per_run": _per_run(op.count)})
        if rest:
            rows.append({**common, "rank": "-", "op": f"other ({len(rest)} ops)", "group": "",
                         "ms_per_run": sum(o.seconds for o in rest) * 1e3, "share": sum(o.share for o in rest),
                         "cumulative": 1.0, "calls_per_run": _per_run(sum(o.count for o in rest))})
    return pd.DataFrame(rows, columns=BREAKDOWN_COLUMNS)


def _per_run(count: float) -> int | float:
    """Calls per run as a count: an integer when it is one (`79`, not `79.000`)."""
    return round(count) if abs(count - round(count)) < 1e-6 else round(count, 2)


def breakdown_check(entry: Entry, breakdowns: Sequence[Breakdown]) -> list[str]:
    """Lines saying what the breakdown says of the entry's claim: the winner/default ratio of op time, and a
    warning when it contradicts the verdict (a claimed win whose winner spends more op time than its
    default). Empty when the winner is the default (one breakdown: nothing to compare)."""
    totals = {b.label: b.total_s for b in breakdowns}
    if "winner" not in totals or "default" not in totals or not totals["default"]:
        return []
    ratio = totals["winner"] / totals["default"]
    lines = [f"winner/default op time: {ratio:.2f} ({totals['winner'] * 1e3:.3f} ms vs {totals['default'] * 1e3:.3f} "
             "ms per run)"]
    verdict = verdict_of(entry)
    if verdict.rule == BEAT_DEFAULT and ratio > 1:
        lines.append(f"warning: the entry's verdict ({verdict.text}) claims the winner is {entry.speedup or 0:.2f}x "
                     f"faster, but here it spends {ratio:.2f}x the default's op time: the claim does not hold up. "
                     "Check with `moe-tune bench` and sweep it again with --fresh (the final round re-times the "
                     "finalists side by side).")
    return lines
