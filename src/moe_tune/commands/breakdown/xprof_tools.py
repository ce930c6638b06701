"""xprof's converters (`xprof.convert.raw_to_tool_data.xspace_to_tool_data`), behind the `xprof` extra and
imported only when used, and the readers of what they emit.

- `trace_viewer`: the trace as Chrome trace-event JSON ({"traceEvents": [{"ph": "X", "ts", "dur" (us),
  "pid", "tid", "name", "args": {"hlo_op", "hlo_module", "run_id", ...}}, ...]}): on CPU the same per-op
  events as the xplane;
- `hlo_stats` (GPU and TPU; empty on CPU) and `kernel_stats` (GPU): a Google Charts DataTable,
  {"cols": [{"id", "label", "type"}, ...], "rows": [{"c": [{"v": value}, ...]}, ...]}, one row per HLO op
  (`hlo_op_name`, `category`, `occurrences`, `total_self_time` in us, ...) or per kernel (`kernel_name`,
  `op_name`, `occurrences`, `total_duration_us`, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from moe_tune.commands.breakdown.ops import OpEvent, OpTime, ranked
from moe_tune.core.errors import MoeTuneError


def tool_data(xplane: Path, tool: str) -> Any:
    """The JSON xprof's `tool` makes of one xplane file. MoeTuneError when xprof is missing or fails."""
    try:
        from xprof.convert.raw_to_tool_data import xspace_to_tool_data
    except ImportError:
        raise MoeTuneError("the xprof breakdown needs xprof: pip install 'moe-tune[xprof]'") from None
    with _native_stderr_silenced():  # xprof's C++ logs a dozen INFO lines per call to fd 2
        data, _content_type = xspace_to_tool_data([str(xplane)], tool, {})
    if data is None:
        raise MoeTuneError(f"xprof's {tool} tool gave nothing for {xplane}")
    return json.loads(data)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def trace_viewer_events(trace: Mapping[str, Any], module: str) -> list[OpEvent]:
    """The per-op events of program `module` in `trace_viewer` JSON (times in us become ns)."""
    events = []
    for event in trace.get("traceEvents", ()):
        args = event.get("args") or {}
        if event.get("ph") == "X" and args.get("hlo_module") == module and "hlo_op" in args:
            events.append(OpEvent((event.get("pid"), event.get("tid")), args["hlo_op"], event["ts"] * 1e3,
                                  event["dur"] * 1e3))
    return events


def datatable_rows(table: Any) -> list[dict[str, Any]]:
    """The rows of a DataTable (or of the first of a list of them) as {column id: value}."""
    if isinstance(table, list):
        table = table[0] if table else {}
    ids = [column["id"] for column in table.get("cols", ())]
    return [{name: (cell or {}).get("v") for name, cell in zip(ids, row.get("c", ()))}
            for row in table.get("rows", ())]


def hlo_stats_ops(table: Any, runs: int) -> tuple[OpTime, ...]:
    """Per-run self time of each HLO op in `hlo_stats` data (a profile of `runs` runs), largest first."""
    return _summed(datatable_rows(table), "hlo_op_name", "total_self_time", "category", runs)


def kernel_stats_ops(table: Any, runs: int) -> tuple[OpTime, ...]:
    """Per-run time of each GPU kernel in `kernel_stats` data, largest first; group: the HLO op it runs."""
    return _summed(datatable_rows(table), "kernel_name", "total_duration_us", "op_name", runs)


def _summed(rows: list[dict[str, Any]], name: str, time_us: str, group: str, runs: int) -> tuple[OpTime, ...]:
    """Rows summed by `name` (one op may have a row per program, one kernel a row per launch shape)."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    groups: dict[str, str] = {}
    for row in rows:
        key = str(row.get(name))
        totals[key] += float(row.get(time_us) or 0.0) * 1e-6
        counts[key] += float(row.get("occurrences") or 0)
        groups.setdefault(key, str(row.get(group) or ""))
    return ranked(totals, counts, runs, groups)
