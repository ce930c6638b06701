"""Token-count ladders: table schema 3 (intervals, robust records), lookup order exact, interval,
robust, nearest, default, the ladder's boundary bisection and intervals, the CLI's `--m A:B`, the report's
interval column. Most tests write tables by hand or time with a stand-in; one times two real configs."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from moe_tune import cli
from moe_tune.campaign import ladder as ladders
from moe_tune.campaign.request import PlannedSweep
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.profiles import intervals as iv
from moe_tune.profiles.entry import entry_key
from moe_tune.profiles.table import SCHEMA_VERSION, migrate, read_table, write_entries
from moe_tune.tuner import SweepSettings

DATA = Path(__file__).parent / "data"
SMALL = RaggedDotProblem(m=8, k=64, n=128, groups=2)
A = {"tm": 8, "tk": 64, "tn": 128, "tail": 4}
B = {"tm": 16, "tk": 64, "tn": 128, "tail": 8}
C = {"tm": 32, "tk": 64, "tn": 128, "tail": 16}


def _entry(problem, config, *, distribution="balanced", op="ragged_dot", median=1e-3, results=None):
    fields = {**problem.key_fields(), "backend": "tiled", "distribution": distribution}
    return {"key": entry_key(op, problem, "tiled", distribution), "op": op, "fields": fields, "config": config,
            "timing": {"median_s": median}, "versions": {"backend_revision": get_op(op).backends.get("tiled").revision},
            **({"results": results} if results is not None else {})}


def _table_path(directory: Path, op: str = "ragged_dot") -> Path:
    return directory / "cpu" / f"{op}.json"


def _ladder(counts, distribution="balanced"):
    sweeps = [PlannedSweep("ragged_dot", dataclasses.replace(SMALL, m=m), "tiled",
                           entry_key("ragged_dot", dataclasses.replace(SMALL, m=m), "tiled", distribution), f"m={m}")
              for m in counts]
    return sweeps, ladders.ladders(sweeps, distribution)


@dataclasses.dataclass
class _Timed:
    median_s: dict
    unusable: dict = dataclasses.field(default_factory=dict)

    def fastest(self):
        return min(self.median_s, key=self.median_s.get) if self.median_s else None

    def to_json(self):
        return {"median_s": self.median_s, "unusable": self.unusable}

    def ratio(self, name, over):
        return self.median_s[name] / self.median_s[over] if {name, over} <= self.median_s.keys() else None


def _fake_timer(crossover: int, calls: list):
    """A stand-in for `crossover.time_side_by_side`: the upper winner is faster from `crossover` on."""

    def timer(op, backend, problem, configs, *, distribution, seed, time_s=0.0):
        calls.append(problem.m)
        upper_faster = problem.m >= crossover
        return _Timed({"lower": 2.0 if upper_faster else 1.0, "upper": 1.0 if upper_faster else 2.0})

    return timer


def test_schema2_fixture_migrates_purely_and_loads(tmp_path):
    raw = json.loads((DATA / "table_schema2_ragged_dot.json").read_text())
    migrated = migrate(raw)
    assert raw["schema_version"] == 2 and "intervals" not in raw  # pure
    assert migrated["schema_version"] == SCHEMA_VERSION == 3 and migrated["intervals"] == {} == migrated["robust"]
    assert migrated["entries"] == raw["entries"]
    path = _table_path(tmp_path)
    path.parent.mkdir(parents=True)
    shutil.copy(DATA / "table_schema2_ragged_dot.json", path)
    assert read_table(path)["intervals"] == {}
    write_entries(path, "ragged_dot", "cpu", [_entry(dataclasses.replace(SMALL, m=64), C)])
    on_disk = json.loads(path.read_text())
    assert on_disk["schema_version"] == 3 and len(on_disk["entries"]) == 3 and on_disk["robust"] == {}


def test_ladder_counts_are_powers_of_two_with_both_ends():
    assert ladders.ladder_counts(1, 16) == [1, 2, 4, 8, 16]
    assert ladders.ladder_counts(12, 100) == [12, 16, 32, 64, 100]
    with pytest.raises(Exception, match="first < last"):
        ladders.ladder_counts(16, 16)


def test_ladder_bisects_each_boundary_writes_intervals_and_reuses_them(isolated_profiles):
    counts = [8, 16, 32, 64]
    configs = {8: A, 16: B, 32: B, 64: C}  # 16 and 32 share a winner: one interval, no boundary between them
    write_entries(_table_path(isolated_profiles), "ragged_dot", "cpu",
                  [_entry(dataclasses.replace(SMALL, m=m), configs[m]) for m in counts])
    _, (ladder,) = _ladder(counts)
    calls: list[int] = []
    outcome = ladders.measure(ladder, SweepSettings(), "cpu", timer=_fake_timer(11, calls))
    assert outcome.measured == 2 and outcome.reused == 0
    # 8..16: timed at 11 (upper faster), then at 9 (lower faster): bracket [9, 11], crossover round(sqrt(99))=10
    # 32..64: crossover 11 is below 32, so the upper winner is faster at 45 and 38: bracket [32, 38]
    assert calls == [11, 9, 45, 38]
    spans = [(r["lo"], r["hi"], r["config"]) for r in outcome.intervals]
    assert spans == [(8, 10, A), (10, 35, B), (35, 65, C)]
    middle = outcome.intervals[1]
    assert middle["evidence"]["won_at"] == [16, 32] and middle["evidence"]["below"]["bracket"] == [9, 11]
    assert [t["faster"] for t in middle["evidence"]["below"]["timed"]] == ["upper", "lower"]

    again: list[int] = []
    outcome = ladders.measure(ladder, SweepSettings(), "cpu", timer=_fake_timer(11, again))
    assert again == [] and outcome.reused == 2  # a rerun measures nothing twice
    table = read_table(_table_path(isolated_profiles))
    assert len(table["intervals"]) == 3  # the rerun replaced the intervals it re-measured


def _results(times):
    """A sweep's first-round results: (config, median seconds) pairs."""
    return [{"config": config, "status": "ok", "median_s": median} for config, median in times]


def _physical_timer(time_of, calls: list):
    """A stand-in for `crossover.time_side_by_side` whose configs take `time_of(config, m)` seconds."""

    def timer(op, backend, problem, configs, *, distribution, seed, time_s=0.0):
        calls.append(problem.m)
        return _Timed({name: time_of(config, problem.m) for name, config in configs.items()})

    return timer


@pytest.mark.parametrize("wins", [True, False])
def test_neighbours_sharing_a_winner_are_challenged_at_their_middle(isolated_profiles, wins):
    # C won at 8 and 32; A was faster than C in both sweeps' first rounds (short of a finals win), B only at 8
    results = _results([(C, 1.0), (A, 0.9), (B, 0.5)]), _results([(C, 1.0), (A, 0.95), (B, 1.5)])
    write_entries(_table_path(isolated_profiles), "ragged_dot", "cpu",
                  [_entry(dataclasses.replace(SMALL, m=m), C, results=r) for m, r in zip((8, 32), results)])
    _, (ladder,) = _ladder([8, 32])
    assert ladders.challenger(C, *(_entry(SMALL, C, results=r) for r in results)) == A

    def time_of(config, m):  # A is faster than C for 12 <= m < 21 (when it wins at all)
        return 0.5 if config == A and wins and 12 <= m < 21 else 2.0 if config == A else 1.0

    calls: list[int] = []
    said: list[str] = []
    outcome = ladders.measure(ladder, SweepSettings(), "cpu", timer=_physical_timer(time_of, calls),
                              on_boundary=said.append)
    assert said[0] == f"m 8..32: challenged at 16 ({0.5 if wins else 2.0:.3f}x the shared winner's time), " + (
        "won: a point of the ladder" if wins else "lost")
    spans = [(r["lo"], r["hi"], r["config"]) for r in outcome.intervals]
    challenges = [c for r in outcome.intervals for c in r["evidence"]["challenges"]]
    assert [(c["at"], c["challenger"], c["won"]) for c in challenges] == [(16, A, wins)]
    if wins:
        # 8..16: C at 11, A at 13 -> crossover 12; 16..32 (A below C): C at 23, A at 19 -> crossover 21
        assert calls == [16, 11, 13, 23, 19] and outcome.challenged == 1 and outcome.measured == 2
        assert spans == [(8, 12, C), (12, 21, A), (21, 33, C)]
        assert outcome.intervals[1]["entries"] == [] and outcome.intervals[1]["evidence"]["won_at"] == [16]
    else:
        assert calls == [16] and spans == [(8, 33, C)] and outcome.intervals[0]["entries"] == [
            entry_key("ragged_dot", dataclasses.replace(SMALL, m=m), "tiled", "balanced") for m in (8, 32)]
    again: list[int] = []
    outcome = ladders.measure(ladder, SweepSettings(), "cpu", timer=_physical_timer(time_of, again))
    assert again == [] and outcome.challenged == 0  # the challenge and the boundaries are reused
    assert [(r["lo"], r["hi"], r["config"]) for r in outcome.intervals] == spans


def test_a_boundary_is_decided_by_the_per_round_ratios(isolated_profiles):
    from moe_tune.tuner.crossover import SideBySide

    # `upper` won two rounds of three, by half; its one slow round (load) makes its median the larger
    timed = SideBySide({"lower": 2.0, "upper": 3.0}, {}, 3, "trace", None, {},
                       {"lower": (2.0, 2.0, 4.0), "upper": (1.0, 3.0, 3.0)})
    assert timed.fastest() == "lower" and timed.ratio("upper", "lower") == 0.75
    assert timed.ratio("upper", "gone") is None
    write_entries(_table_path(isolated_profiles), "ragged_dot", "cpu",
                  [_entry(dataclasses.replace(SMALL, m=m), cfg) for m, cfg in ((8, A), (32, B))])
    _, (ladder,) = _ladder([8, 32])
    outcome = ladders.measure(ladder, SweepSettings(), "cpu", timer=lambda *a, **k: timed, steps=1)
    below = outcome.intervals[1]["evidence"]["below"]
    assert below["timed"][0]["faster"] == "upper" and below["bracket"] == [8, 16]  # upper holds 16


@pytest.mark.parametrize("m,source,config", [(16, "exact", B), (13, "interval", B), (9, "interval", A),
                                             (40, "interval", C), (200, "nearest", C), (4, "nearest", A)])
def test_lookup_order_exact_interval_nearest(isolated_profiles, m, source, config):
    counts = [8, 16, 64]
    write_entries(_table_path(isolated_profiles), "ragged_dot", "cpu",
                  [_entry(dataclasses.replace(SMALL, m=c), cfg) for c, cfg in zip(counts, (A, B, C))])
    _, (ladder,) = _ladder(counts)
    ladders.measure(ladder, SweepSettings(), "cpu", timer=_fake_timer(12, []))  # [8,12) A, [12,19) B, [19,65) C
    found = get_op("ragged_dot").lookup(dataclasses.replace(SMALL, m=m), backend="tiled")
    assert found.source == source and found.config.to_dict() | config == found.config.to_dict()
    if source == "interval":
        field, lo, hi = found.interval
        assert field == "m" and lo <= m < hi and "interval m in [" in found.reason
    else:
        assert found.interval is None


def test_interval_of_a_gather_matches_only_its_rows_per_token(isolated_profiles):
    op = get_op("ragged_gather")
    problem = op.problem(tokens=64, hidden=128, top_k=4, experts=8, ep=1)
    family = iv.family_fields({**problem.key_fields(), "backend": "tiled", "distribution": "balanced"},
                              problem.SIZE_FIELDS)
    config = op.backends.get("tiled").default_config(problem).to_dict()
    record = iv.make_interval("ragged_gather", family, "tokens", 32, 128, config=config, scale={"rows": 4.0},
                              entries=[], evidence={}, versions={"backend_revision": op.backends.get("tiled").revision},
                              tuned_at="2026-11-25T00:00:00+00:00")
    path = _table_path(isolated_profiles, "ragged_gather")
    from moe_tune.profiles.table import update_table

    update_table(path, "ragged_gather", "cpu", lambda t: iv.replace_intervals(t, [record]))
    assert op.lookup(op.problem(tokens=100, hidden=128, top_k=4, experts=8, ep=1)).source == "interval"
    assert op.lookup(op.problem(tokens=100, hidden=128, top_k=2, experts=8, ep=1)).source == "default"
    assert op.lookup(op.problem(tokens=128, hidden=128, top_k=4, experts=8, ep=1)).source == "default"  # [32, 128)


def test_robust_record_answers_a_distribution_the_shape_was_not_tuned_for(isolated_profiles):
    problem = dataclasses.replace(SMALL, m=64)
    path = _table_path(isolated_profiles)
    balanced, skewed = _entry(problem, A), _entry(problem, C, distribution="skewed")
    write_entries(path, "ragged_dot", "cpu", [balanced, skewed])
    op = get_op("ragged_dot")
    found = op.lookup(problem, backend="tiled", distribution="uniform")
    assert found.source == "nearest" and "no entry for distribution uniform" in found.reason  # no robust record yet
    from moe_tune.profiles.table import update_table

    record = {"key": iv.robust_key("ragged_dot", balanced["fields"]), "fields": {}, "config": C,
              "distribution": "skewed", "entry": skewed["key"], "worst_slowdown": 1.07,
              "versions": balanced["versions"]}
    update_table(path, "ragged_dot", "cpu", lambda t: t["robust"].__setitem__(record["key"], record))
    found = op.lookup(problem, backend="tiled", distribution="uniform")
    assert found.source == "robust" and found.config.to_dict() | C == found.config.to_dict()
    assert "for distribution uniform (tuned for balanced, skewed)" in found.reason and "1.07x" in found.reason
    assert op.lookup(problem, backend="tiled", distribution="balanced").source == "exact"


def test_cli_range_is_a_ladder_and_report_shows_intervals(isolated_profiles):
    runner = CliRunner()
    result = runner.invoke(cli.cli, ["sweep", "--m", "8:64", "--k", "64", "--n", "128", "--groups", "2", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "4 sweeps" in result.output and "m=64" in result.output and "m=8 " in result.output
    bad = runner.invoke(cli.cli, ["sweep", "--m", "64:8", "--dry-run"])
    assert bad.exit_code == 2 and "first < last" in bad.output

    counts = [8, 16]
    write_entries(_table_path(isolated_profiles), "ragged_dot", "cpu",
                  [_entry(dataclasses.replace(SMALL, m=c), cfg) for c, cfg in zip(counts, (A, B))])
    _, (ladder,) = _ladder(counts)
    ladders.measure(ladder, SweepSettings(), "cpu", timer=_fake_timer(12, []))
    report = runner.invoke(cli.cli, ["report", "--format", "csv", "--columns", "shape,interval"])
    assert "m in [8, 12)" in report.output and "m in [12, 17)" in report.output
    looked = runner.invoke(cli.cli, ["lookup", "--m", "13", "--k", "64", "--n", "128", "--groups", "2"])
    assert looked.exit_code == 0 and "interval: m in [12, 17)" in looked.output


def test_crossover_times_two_real_configs_and_rejects_an_unusable_one():
    from moe_tune.tuner.crossover import time_side_by_side

    problem = dataclasses.replace(SMALL, m=24)
    result = time_side_by_side("ragged_dot", "tiled", problem, {"a": A, "b": B, "bad": {"tm": 0}},
                               distribution="balanced", samples=2)
    assert set(result.median_s) == {"a", "b"} and all(t > 0 for t in result.median_s.values())
    assert "bad" in result.unusable and result.fastest() in ("a", "b") and result.samples == 2


def test_validate_names_a_broken_interval_and_merge_keeps_intervals(isolated_profiles, tmp_path):
    from moe_tune.profiles import merge_tables, validate_table
    from moe_tune.profiles.table import update_table

    counts = [8, 16]
    path = _table_path(isolated_profiles)
    write_entries(path, "ragged_dot", "cpu", [_entry(dataclasses.replace(SMALL, m=c), cfg)
                                              for c, cfg in zip(counts, (A, B))])
    _, (ladder,) = _ladder(counts)
    intervals = ladders.measure(ladder, SweepSettings(), "cpu", timer=_fake_timer(12, [])).intervals
    out = tmp_path / "merged" / "cpu" / "ragged_dot.json"
    merge_tables(out, [path])
    assert set(read_table(out)["intervals"]) == {r["key"] for r in intervals}
    assert validate_table(path, get_op=get_op) == []
    update_table(path, "ragged_dot", "cpu", lambda t: t["intervals"].__setitem__("bad", {"lo": 9, "hi": 3}))
    problems = [str(p) for p in validate_table(path, get_op=get_op)]
    assert any("intervals: lo=9, hi=3 is not an interval" in p for p in problems)
    assert get_op("ragged_dot").lookup(dataclasses.replace(SMALL, m=13), backend="tiled").source == "interval"
