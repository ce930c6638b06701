"""Bad inputs and misleading answers of the table commands (lookup, coverage, merge, report), the compile
records, the final round and the warm start: each a user mistake refused with one line (exit 2), or an
answer that must say the truth, with nothing lost on the way.

CLI rows use `test_bad_inputs.Case` and its runner (in-process through click, an escaping exception fails).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_bad_inputs import Case, _fill, _run


# -- JSONL appenders: a last line cut by a kill ------------------------------------------------------------

def _record(n: int):
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
    from moe_tune.targets.compile import CompileResult
    from moe_tune.targets.records import CompileRecord, record_key, record_versions

    problem = RaggedDotProblem(64 * n, 64, 64, 4)
    return CompileRecord(record_key("ragged_dot", problem, "tiled"), {"tm": 32}, CompileResult("here", "ok", ""),
                         record_versions("ragged_dot", "tiled"))


def test_compile_records_append_after_a_cut_line_loses_nothing(tmp_path):
    from moe_tune.targets.records import append_records, read_records, records_path

    path = records_path(tmp_path, "tpu_v5_lite", "ragged_dot")
    append_records(path, [_record(1), _record(2)])
    whole = path.read_bytes()
    path.write_bytes(whole[:-20])  # the second record's write cut by a kill
    append_records(path, [_record(3)])
    found = {key for key, _ in read_records(path, "ragged_dot", "tiled")}
    assert found == {_record(1).key, _record(3).key}
    assert path.read_bytes().endswith(b"\n")


def test_compile_records_append_to_an_empty_file(tmp_path):
    from moe_tune.targets.records import append_records, read_records

    path = tmp_path / "r.jsonl"
    path.write_bytes(b"")
    append_records(path, [_record(1)])
    assert path.read_bytes().startswith(b"{")
    assert len(read_records(path, "ragged_dot", "tiled")) == 1


def test_the_ray_drivers_sweep_log_append_after_a_cut_line_keeps_the_new_lines(tmp_path):
    pytest.importorskip("ray")
    from moe_tune.campaign.ray_runner import LogRelay
    from moe_tune.tuner.log import read_log

    relay = LogRelay.__ray_actor_class__(str(tmp_path))
    header = json.dumps({"type": "header", "key": "k"}) + "\n"
    (tmp_path / "s.jsonl").write_text(header + '{"type": "candidate", "ind')  # a write cut by a kill
    relay.append("s.jsonl", (json.dumps({"type": "candidate", "index": 1}) + "\n").encode())
    lines, _ = read_log(tmp_path / "s.jsonl")
    assert [line.get("index") for line in lines] == [None, 1]


# -- merge: an interval standing on an entry another table replaced ----------------------------------------

def test_merge_drops_the_intervals_that_stand_on_a_replaced_entry(isolated_profiles, tmp_path):
    import dataclasses

    from moe_tune.campaign import ladder as ladders
    from moe_tune.profiles import merge_tables
    from moe_tune.profiles.table import read_table, write_entries
    from moe_tune.tuner import SweepSettings
    from tests.test_ladder import A, B, C, SMALL, _entry, _fake_timer, _ladder

    laddered = isolated_profiles / "cpu" / "ragged_dot.json"  # A3: m=8 won by A, m=16 by B, a ladder between
    write_entries(laddered, "ragged_dot", "cpu", [_entry(dataclasses.replace(SMALL, m=8), A),
                                                  _entry(dataclasses.replace(SMALL, m=16), B)])
    _, (ladder,) = _ladder([8, 16])
    ladders.measure(ladder, SweepSettings(), "cpu", timer=_fake_timer(12, []))  # [8, 12) A, [12, 17) B
    other = tmp_path / "a2" / "cpu" / "ragged_dot.json"  # A2: m=16 faster with C
    write_entries(other, "ragged_dot", "cpu", [_entry(dataclasses.replace(SMALL, m=16), C, median=5e-4)])
    untouched = tmp_path / "a4" / "cpu" / "ragged_dot.json"  # A4: the same m=16 winner, also faster
    write_entries(untouched, "ragged_dot", "cpu", [_entry(dataclasses.replace(SMALL, m=16), B, median=5e-4)])

    out = tmp_path / "out" / "cpu" / "ragged_dot.json"
    report = merge_tables(out, [laddered, other])
    merged = read_table(out)
    assert merged["entries"][_entry(dataclasses.replace(SMALL, m=16), C)["key"]]["config"] == C
    assert merged["intervals"] == {}  # both ends of [8, 12) and all of [12, 17) were measured against B at m=16
    assert sum("dropped interval" in line for line in report.lines()) == 2

    same = merge_tables(tmp_path / "same" / "cpu" / "ragged_dot.json", [laddered, untouched])
    assert len(read_table(same.out)["intervals"]) == 2  # the kept entry has the config the intervals recorded
    assert not any("dropped" in line for line in same.lines())
