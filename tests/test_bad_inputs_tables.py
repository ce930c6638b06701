"""Bad inputs and misleading answers of the table commands (lookup, coverage, merge, report), the compile
records, the final round and the warm start: each a user mistake refused with one line (exit 2), or an
answer that must say the truth, with nothing lost on the way.

CLI rows use `test_bad_inputs.Case` and its runner (in-process through click, an escaping exception fails).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bad_inputs import Case, _fill, _run

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
    from moe_tune.tuner.request import read_log

    relay = LogRelay.__ray_actor_class__(str(tmp_path))
    header = json.dumps({"type": "header", "key": "k"}) + "\n"
    (tmp_path / "s.jsonl").write_text(header + '{"type": "candidate", "ind')  # a write cut by a kill
    relay.append("s.jsonl", (json.dumps({"type": "candidate", "index": 1}) + "\n").encode())
    lines, _ = read_log(tmp_path / "s.jsonl")
    assert [line.get("index") for line in lines] == [None, 1]


# -- merge: an interval standing on an entry another table replaced ----------------------------------------

def test_merge_drops_the_intervals_that_stand_on_a_replaced_entry(isolated_profiles, tmp_path):
    import dataclasses

    from test_ladder import SMALL, A, B, C, _entry, _fake_timer, _ladder

    from moe_tune.campaign import ladder as ladders
    from moe_tune.profiles import merge_tables
    from moe_tune.profiles.table import read_table, write_entries
    from moe_tune.tuner import SweepSettings

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


# -- the final round after the trace failed the wall-clock cross-check -------------------------------------

def _finalist(index: int, samples: list[float], *, default: bool = False):
    from test_evidence import CONFIGS

    from moe_tune.tuner.candidate import Candidate
    from moe_tune.tuner.timing import summarize

    return Candidate(index, CONFIGS[index], is_default=default, timing=summarize(samples, "trace", samples))


@pytest.mark.parametrize("refused", [1, 2, 4], ids=lambda n: f"refused from chunk {n}")
def test_a_final_round_that_falls_back_to_the_wall_clock_keeps_the_minimum_samples(monkeypatch, refused):
    """A faked timer: its trace passes the cross-check until chunk `refused`, then fails it (a 1-round chunk
    on a loaded machine): the rest of the round is timed by the wall clock, and every finalist ends with at
    least the rounds the round stops after, never 1."""
    from moe_tune.profiles.verdict import BEAT_DEFAULT, MIN_FINAL_SAMPLES
    from moe_tune.tuner import Reporter, measure
    from moe_tune.tuner.request import SweepSettings
    from moe_tune.tuner.timing import summarize

    asked = []

    def fake(calls, *, samples, wall_only=False, **kw):
        asked.append((samples, wall_only))
        method = "wall" if wall_only or len(asked) >= refused else "trace"
        why = None if wall_only or method == "trace" else "trace time exceeds wall time"
        return {i: summarize([t] * samples, method, [t]) for i, t in ((0, 1.2), (1, 1.0)) if i in calls}, why

    monkeypatch.setattr(measure, "time_candidates", fake)
    settings = SweepSettings(samples=3, workers=1, finalists=1, final_time_s=0.3)
    default, seed = _finalist(0, [0.012] * 3, default=True), _finalist(1, [0.010] * 3)
    default.batch = seed.batch = 0  # timed in one batch: its rounds are the first final rounds
    winner, verdict, fallback = measure.final_round(settings, [default, seed], default, {}, "cpu", Reporter())
    assert fallback == "trace time exceeds wall time"
    assert all(wall for _, wall in asked[refused:])  # after the refusal, the wall clock only
    assert default.timing.method == seed.timing.method == "wall"
    assert min(default.timing.samples, seed.timing.samples) >= measure.earliest_stop(measure.final_samples(
        settings, 0.012)) >= MIN_FINAL_SAMPLES
    assert winner is seed and verdict.rule == BEAT_DEFAULT


def test_wall_only_timing_runs_no_profiler(monkeypatch):
    import jax.numpy as jnp

    from moe_tune.tuner import timing

    def no_profiler(*args, **kwargs):
        raise AssertionError("the profiler ran")

    monkeypatch.setattr(timing, "collect", no_profiler)
    x = jnp.ones(8)
    timings, why = timing.time_candidates({0: lambda: x + 1, 1: lambda: x * 2}, samples=5, platform="cpu",
                                          wall_only=True)
    assert why is None and {t.method for t in timings.values()} == {"wall"}
    assert {t.samples for t in timings.values()} == {5}


# -- lookup and coverage: another device kind, --backend, --profile-dir -------------------------------------

H100_CALL = ("--m", "4096", "--k", "7168", "--n", "2048", "--groups", "32", "--dtype", "bfloat16")
LAYER = ("coverage", "--model", "qwen3-30b-a3b", "--tokens", "512", "--ep", "8", "--dtype", "bfloat16",
         "--direction", "fwd")


def user_gpu_table(tmp: Path) -> None:
    """A table of a GPU moe-tune has no chip facts for, in the profile dir."""
    from test_bad_inputs import entry, write_table

    path = write_table(tmp / "p", entry())
    path.parent.rename(tmp / "p" / "nvidia_rtx_4090")


def h100_table(tmp: Path) -> None:
    """The shipped H100 ragged_dot table (the tests' shipped dir is empty), in the profile dir."""
    import shutil

    import moe_tune.profiles

    kind = "nvidia_h100_80gb_hbm3"
    (tmp / "p" / kind).mkdir(parents=True)
    shutil.copy(Path(moe_tune.profiles.__file__).parent / "data" / kind / "ragged_dot.json", tmp / "p" / kind)


LOOKUP_CASES = [
    Case("lookup of another device kind asks its platform's default backend",
         ("lookup", *H100_CALL, "--device-kind", "nvidia_h100_80gb_hbm3"), 0, "source: exact", setup=h100_table),
    Case("... and names it", ("lookup", *H100_CALL, "--device-kind", "nvidia_h100_80gb_hbm3"), 0,
         "on nvidia_h100_80gb_hbm3, backend triton"),
    Case("lookup of a device kind with tables only", ("lookup", *H100_CALL, "--device-kind", "nvidia_rtx_4090"), 0,
         "on nvidia_rtx_4090, backend triton", setup=user_gpu_table),
    Case("lookup of an unknown device kind", ("lookup", *H100_CALL, "--device-kind", "tpu_v9"), 2,
         "unknown device kind 'tpu_v9'; known: cpu,"),
    Case("lookup of a path as device kind", ("lookup", *H100_CALL, "--device-kind", "../../etc"), 2,
         "device kind '../../etc' is not a device kind"),
    Case("lookup of an absolute path as device kind", ("lookup", *H100_CALL, "--device-kind", "/tmp"), 2,
         "device kind '/tmp' is not a device kind"),
    Case("coverage of another device kind asks its platform's default backend",
         (*LAYER, "--device-kind", "nvidia_h100_80gb_hbm3", "--format", "json"), 0, '"backend": "triton"'),
    Case("coverage --backend applies to the ops that have it",
         (*LAYER, "--device-kind", "nvidia_h100_80gb_hbm3", "--backend", "triton"), 0,
         "note: --backend triton applies to fused_moe, ragged_dot, ragged_gather, ragged_gather_reduce; moe_fusion, "
         "moe_sharding ask about their default backend"),
    Case("... on one device", (*LAYER, "--ep", "1", "--device-kind", "nvidia_h100_80gb_hbm3", "--backend", "triton"), 0,
         "note: --backend triton applies to dense_gather_reduce, fused_moe, ragged_dot, ragged_gather; moe_fusion "
         "asks about its default backend"),
    Case("coverage --backend no op has", (*LAYER, "--backend", "nope"), 2,
         "--backend 'nope' is no backend of any op of the layer"),
    Case("coverage of an unknown device kind", (*LAYER, "--device-kind", "tpu_v9"), 2, "unknown device kind 'tpu_v9'"),
    Case("coverage of a path as device kind", (*LAYER, "--device-kind", "../../etc"), 2,
         "device kind '../../etc' is not a device kind"),
    Case("coverage --profile-dir that does not exist", (*LAYER, "--profile-dir", "{tmp}/nonexistent/dir"), 2,
         "--profile-dir {tmp}/nonexistent/dir is not a directory"),
]


@pytest.mark.parametrize("case", LOOKUP_CASES, ids=lambda c: c.item)
def test_lookup_and_coverage_answer_for_the_device_kind_asked(case: Case, tmp_path: Path):
    if case.setup is not None:
        case.setup(tmp_path)
    code, output = _run(case, tmp_path)
    assert "Traceback" not in output, output
    assert code == case.code, output
    assert any(_fill(case.message, tmp_path) in line for line in output.splitlines()), output
    if code:
        assert len([line for line in output.splitlines() if line.startswith(("error:", "Error:"))]) == 1, output


def test_the_api_refuses_a_path_as_device_kind():
    from moe_tune.core.errors import UsageError
    from moe_tune.kernels import get_op

    op = get_op("ragged_dot")
    with pytest.raises(UsageError, match="is not a device kind"):
        op.lookup(op.problem(m=64, k=64, n=64, groups=4), device_kind="../cpu")


# -- warm start: only from entries of the same dtypes and quantization -------------------------------------

def test_a_float32_sweep_is_not_seeded_by_bfloat16_or_quantized_entries(isolated_profiles):
    from moe_tune.kernels import get_op
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
    from moe_tune.profiles.entry import key_fields, key_from_fields
    from moe_tune.profiles.table import write_entries
    from moe_tune.tuner import search as warm_start

    tiled = get_op("ragged_dot").backends.get("tiled")
    here = RaggedDotProblem(m=4096, k=1024, n=1024, groups=8)
    space = tiled.search_space(here)
    winner = space[-1].to_dict()

    def tuned(problem):
        fields = key_fields(problem, "tiled", "balanced")
        return {"key": key_from_fields("ragged_dot", fields), "fields": fields, "config": winner,
                "timing": {"median_s": 1e-3}}

    bf16 = {"lhs_dtype": "bfloat16", "rhs_dtype": "bfloat16", "out_dtype": "bfloat16"}
    int8 = {"rhs_qdtype": "int8", "rhs_qblock": None}
    neighbours = [RaggedDotProblem(m=m, k=1024, n=1024, groups=8, **bf16) for m in (2048, 4096, 8192)]
    neighbours.append(RaggedDotProblem(m=4096, k=1024, n=1024, groups=8, **int8))
    table = isolated_profiles / "cpu" / "ragged_dot.json"
    write_entries(table, "ragged_dot", "cpu", [tuned(p) for p in neighbours])
    fields = key_fields(here, "tiled", "balanced")
    found = warm_start.find("ragged_dot", "cpu", fields, key_from_fields("ragged_dot", fields), space)
    assert found.sources == () and found.describe().startswith("cold start")

    write_entries(table, "ragged_dot", "cpu", [tuned(RaggedDotProblem(m=2048, k=1024, n=1024, groups=8))])
    found = warm_start.find("ragged_dot", "cpu", fields, key_from_fields("ragged_dot", fields), space)
    assert [s["key"].split("|")[2] for s in found.sources] == ["m=2048"]  # the float32 one only


# -- report: width, the plot's labels and entry, quantized fused entries ------------------------------------

def _shipped(monkeypatch) -> None:
    import moe_tune.profiles

    monkeypatch.setattr("moe_tune.profiles.table.shipped_dir", lambda: Path(moe_tune.profiles.__file__).parent / "data")


def test_the_default_report_cuts_no_cell_short(monkeypatch):
    """Piped (not a terminal), every row is one line however wide; on a 160-column terminal the long cells
    wrap instead; neither cuts a cell short (rich's `…`)."""
    import io

    from click.testing import CliRunner
    from rich.console import Console

    from moe_tune.cli import cli
    from moe_tune.commands import render

    _shipped(monkeypatch)
    result = CliRunner().invoke(cli, ["report", "--source", "shipped"], catch_exceptions=False)
    assert result.exit_code == 0 and "…" not in result.stdout, result.stdout
    rows = [line for line in result.stdout.splitlines() if line.lstrip().startswith(("ragged_dot", "fused_moe"))]
    assert rows and all(line.rstrip().endswith("shipped") for line in rows)  # one line each: the source last

    terminal = Console(file=io.StringIO(), width=160, force_terminal=True, color_system=None)
    monkeypatch.setattr(render, "out", terminal)
    result = CliRunner().invoke(cli, ["report", "--source", "shipped"], catch_exceptions=False)
    shown = terminal.file.getvalue()
    assert result.exit_code == 0 and "…" not in shown and shown.count("shipped") >= len(rows)
    assert max(len(line) for line in shown.splitlines()) <= 160


def test_a_quantized_fused_entry_shows_its_weights_dtype():
    from moe_tune.commands import report

    fields = {"stage": "dispatch", "tokens": 512, "m": 4096, "k": 2048, "n": 1536, "groups": 64,
              "dtype": "bfloat16", "rhs_qdtype": "int8", "rhs_qblock": None}
    assert report.dtype_label(fields) == "bfloat16 x int8"
    assert report.dtype_label({**fields, "rhs_qblock": 128}) == "bfloat16 x int8/128"
    assert report.dtype_label({"dtype": "bfloat16"}) == "bfloat16"


def _plotted(op: str, fields: dict, *, speedup: float, tried: int, rule: str, search: dict | None = None):
    from moe_tune.profiles.entry import Entry

    configs = [{"tm": 2 ** (i + 3)} for i in range(tried)]
    return Entry.from_json({
        "key": op + "|" + "|".join(f"{k}={v}" for k, v in fields.items()), "op": op, "fields": fields,
        "config": configs[-1] if rule == "beat_default" else configs[0], "timing": {"median_s": 1e-3 / speedup},
        "default": {"config": configs[0], "status": "ok", "median_s": 1e-3}, "speedup_over_default": speedup,
        "candidates": {"tried": tried, "ok": tried, "failed": 0, "wrong": 0},
        "results": [{"config": c, "status": "ok", "median_s": 1e-3 / (1 + i / 10)} for i, c in enumerate(configs)],
        "verdict": {"rule": rule, "noise": 0.05, "finalists": []},
        "search": search or {"strategy": "grid", "space": tried, "budget": None, "time_budget_s": None}})


def test_the_plot_labels_every_key_field_and_explains_the_largest_clean_win():
    from moe_tune.commands import plots

    gather = {"direction": "fwd", "tokens": 512, "rows": 4096, "hidden": 2048, "backend": "tiled",
              "distribution": "balanced"}
    fused = _plotted("moe_fusion", {"direction": "fwd", "tokens": 512, "hidden": 2048, "dtype": "float32",
                                    "backend": "layer", "distribution": "balanced"},
                     speedup=1.0, tried=2, rule="default_fastest")
    plain = _plotted("ragged_gather", {**gather, "dtype": "float32", "weighted": False}, speedup=1.0, tried=6,
                     rule="within_noise")
    weighted = _plotted("ragged_gather", {**gather, "dtype": "bfloat16", "weighted": True}, speedup=1.37,
                        tried=6, rule="beat_default")
    cut = _plotted("ragged_gather", {**gather, "dtype": "float32", "weighted": True}, speedup=1.6, tried=3,
                   rule="beat_default", search={"strategy": "grid", "space": 12, "budget": None,
                                                "time_budget_s": None, "max_candidates": 3})
    entries = [fused, plain, weighted, cut]
    labels = plots.speedup_labels(entries)
    assert len(set(labels)) == len(labels), labels
    assert "float32" in labels[1] and "weighted=False" in labels[1]
    assert "bfloat16" in labels[2] and "weighted=True" in labels[2]
    assert "low budget" in plots.marks(cut)
    assert plots.worth_explaining(entries) is weighted  # the largest win with nothing to doubt, not the first
    assert plots.worth_explaining([fused, plain]) is plain  # no clean win: the most candidates measured
    assert plots.worth_explaining([fused]) is fused
