"""The report a person reads: a compact default table that fits 160 columns for the demo's
entries (the shipped ragged_dot tables and the demo's own sweep), one line per row; dtypes as people name
them (int8 weights as `int8`, not `rhs_dtype=float32`); the source of each entry and a filter for the user's
own; `--columns` and `--all` for the rest."""

from __future__ import annotations

import copy
import io
import json

import pytest
from click.testing import CliRunner
from rich.console import Console

from moe_tune.cli import cli
from moe_tune.commands import render as cli_render
from moe_tune.commands import report
from moe_tune.kernels import get_op
from moe_tune.profiles import table as dirs
from moe_tune.profiles.entry import key_fields, key_from_fields
from moe_tune.profiles.table import write_entries

SHIPPED = dirs.shipped_dir()


def _demo_entry() -> dict:
    """The entry `make demo` writes (its default ragged_dot shape), as long as it can get: the longest config
    label of the space, an unverified low-budget verdict (the longest verdict words)."""
    op = get_op("ragged_dot")
    problem = op.problem(**op.default_problem_options())
    space = op.backends.get("tiled").search_space(problem)
    config = max(space, key=lambda c: len(c.label())).to_dict()
    shipped = json.loads((SHIPPED / "cpu" / "ragged_dot.json").read_text())["entries"]
    entry = copy.deepcopy(next(iter(shipped.values())))
    fields = key_fields(problem, "tiled", "balanced")
    entry.update(key=key_from_fields("ragged_dot", fields), fields=fields, config=config,
                 search={**entry["search"], "max_candidates": 3, "space": 3, "full_space": len(space)},
                 verdict={**entry["verdict"], "rule": "unverified", "reason": "interrupted before the final round"})
    return entry


@pytest.fixture
def demo_tables(isolated_profiles, monkeypatch, tmp_path):
    """The shipped tables and the demo's entry in the user cache dir."""
    monkeypatch.setattr("moe_tune.profiles.table.shipped_dir", lambda: SHIPPED)
    entry = _demo_entry()
    write_entries(dirs.user_dir() / "cpu" / "ragged_dot.json", "ragged_dot", "cpu", [entry])
    return entry


def test_the_default_table_fits_160_columns_one_line_per_row(demo_tables):
    frame = report.select(report.entries_frame(None, "ragged_dot"), op="ragged_dot")
    assert len(frame) > 30 and "user cache" in set(frame["source"]) and "shipped" in set(frame["source"])
    console = Console(width=160, file=io.StringIO(), record=True)
    cli_render.frame(frame, "table", title="Tuned configs", empty="", shown=report.table_columns(frame),
                     compact=True, console=console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 160
    rows = [line for line in lines if line.lstrip().startswith("ragged_dot")]
    assert len(rows) == len(frame)  # no row wraps onto a second line
    assert not any("…" in line for line in lines)  # and none is cut short
    mine = next(line for line in rows if "user cache" in line)
    assert "unverified, low budget" in mine and "float32" in mine


def test_dtype_labels_name_quantization():
    fields = {"lhs_dtype": "bfloat16", "rhs_dtype": "float32", "out_dtype": "bfloat16", "rhs_qdtype": "int8",
              "rhs_qblock": 2048, "k": 2048}
    assert report.dtype_label(fields) == "bfloat16 x int8"
    assert report.dtype_label({**fields, "rhs_qblock": 128}) == "bfloat16 x int8/128"
    w8a8 = {**fields, "lhs_dtype": "float32", "lhs_qdtype": "int8", "lhs_qblock": 2048, "out_dtype": "float32"}
    assert report.dtype_label(w8a8) == "int8 -> float32"
    assert report.dtype_label({"dtype": "bfloat16"}) == "bfloat16"


def test_mine_columns_and_all(demo_tables):
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(cli, ["report", *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    mine = json.loads(run("--mine", "--format", "json"))
    assert [r["key"] for r in mine] == [demo_tables["key"]] and mine[0]["source"] == "user cache"
    assert json.loads(run("--source", "user", "--format", "json")) == mine
    assert all(r["source"] == "shipped" for r in json.loads(run("--source", "shipped", "--format", "json")))
    chosen = run("--mine", "--columns", "kernel,time_ms,budget")
    assert "time_ms" in chosen and "--max-candidates 3" in chosen and "speedup" not in chosen
    assert "tuned_at" in run("--mine", "--all") and "tuned_at" not in run("--mine")
    wrong = runner.invoke(cli, ["report", "--columns", "colour"])
    assert wrong.exit_code == 2 and "no column 'colour'" in wrong.output


def test_other_devices_shipped_tables_show_only_when_asked(demo_tables):
    """The H100's shipped entries are not this CPU's: hidden by default, shown by --device or --source shipped."""
    frame = report.entries_frame(None, "ragged_dot")
    h100 = "nvidia_h100_80gb_hbm3"
    assert (frame["device_kind"] == h100).sum() >= 10
    assert h100 not in set(report.select(frame, op="ragged_dot")["device_kind"])
    for asked in ({"device": h100}, {"source": "shipped"}):
        shown = report.select(frame, op="ragged_dot", **asked)
        assert (shown["device_kind"] == h100).sum() == (frame["device_kind"] == h100).sum(), asked
