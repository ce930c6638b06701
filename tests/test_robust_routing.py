"""The config robust across routing distributions: `campaign.robust` picks the winner with the
lowest worst-case slowdown against each distribution's own winner, `sweep --distribution all` plans every
distribution, lookup answers with the record when the distribution asked for has no entry."""

from __future__ import annotations

import dataclasses

from click.testing import CliRunner

from moe_tune import cli
from moe_tune.campaign import robust
from moe_tune.core import distributions
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.profiles.entry import entry_key
from moe_tune.profiles.table import update_table, write_entries

PROBLEM = RaggedDotProblem(m=64, k=64, n=128, groups=4)
A = {"tm": 8, "tk": 64, "tn": 128, "tail": 4}
B = {"tm": 16, "tk": 64, "tn": 128, "tail": 8}
C = {"tm": 32, "tk": 64, "tn": 128, "tail": 16}
# time of each config under each distribution: A wins balanced, B skewed, C uniform. Worst-case slowdowns
# against each distribution's winner: A 3.0 (uniform), B 1.2, C 1.5 -> B is robust though it wins once only.
TIMES = {"balanced": {"A": 1.0, "B": 1.1, "C": 1.5}, "skewed": {"A": 2.0, "B": 1.0, "C": 1.2},
         "uniform": {"A": 3.0, "B": 1.2, "C": 1.0}}


def _entry(config, distribution):
    fields = {**PROBLEM.key_fields(), "backend": "tiled", "distribution": distribution}
    return {"key": entry_key("ragged_dot", PROBLEM, "tiled", distribution), "op": "ragged_dot", "fields": fields,
            "config": config, "versions": {"backend_revision": get_op("ragged_dot").backends.get("tiled").revision}}


@dataclasses.dataclass
class _Timed:
    median_s: dict


def _timer(calls):
    names = {repr(A): "A", repr(B): "B", repr(C): "C"}

    def timer(op, backend, problem, configs, *, distribution, seed):
        calls.append(distribution)
        return _Timed({label: TIMES[distribution][names[repr(c)]] for label, c in configs.items()})

    return timer


def test_robust_record_minimizes_the_worst_case_slowdown_and_lookup_uses_it(isolated_profiles):
    entries = {"balanced": _entry(A, "balanced"), "skewed": _entry(B, "skewed"), "uniform": _entry(C, "uniform")}
    calls: list[str] = []
    record = robust.robust_record("ragged_dot", "tiled", PROBLEM, entries, seed=0, timer=_timer(calls))
    assert calls == ["balanced", "skewed", "uniform"]  # every winner timed under every distribution
    assert record["config"] == B and record["distribution"] == "skewed" and record["worst_slowdown"] == 1.2
    assert record["slowdowns"]["winner of balanced"]["uniform"] == 3.0 and "distribution" not in record["fields"]
    assert robust.robust_record("ragged_dot", "tiled", PROBLEM, {"balanced": entries["balanced"]}, seed=0,
                                timer=_timer([])) is None

    path = isolated_profiles / "cpu" / "ragged_dot.json"
    write_entries(path, "ragged_dot", "cpu", entries.values())
    update_table(path, "ragged_dot", "cpu", lambda t: t["robust"].__setitem__(record["key"], record))
    found = get_op("ragged_dot").lookup(PROBLEM, backend="tiled", distribution="single")
    assert found.source == "robust" and found.config.to_dict() | B == found.config.to_dict()
    assert "no entry for this shape for distribution single" in found.reason
    assert get_op("ragged_dot").lookup(PROBLEM, backend="tiled", distribution="uniform").source == "exact"


def test_sweep_distribution_all_plans_every_distribution_and_lookup_refuses_all():
    runner = CliRunner()
    result = runner.invoke(cli.cli, ["sweep", "--m", "64", "--k", "64", "--n", "128", "--groups", "4",
                                     "--distribution", "all", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.count("1 sweeps after removing duplicates") == len(distributions.DISTRIBUTIONS)
    looked = runner.invoke(cli.cli, ["lookup", "--distribution", "all"])
    assert looked.exit_code == 2 and "unknown distribution 'all'" in looked.output


def test_a_count_between_tuned_ones_gets_the_nearest_shapes_robust_choice(isolated_profiles):
    entries = {"balanced": _entry(A, "balanced"), "skewed": _entry(B, "skewed"), "uniform": _entry(C, "uniform")}
    record = robust.robust_record("ragged_dot", "tiled", PROBLEM, entries, seed=0, timer=_timer([]))
    path = isolated_profiles / "cpu" / "ragged_dot.json"
    write_entries(path, "ragged_dot", "cpu", entries.values())
    update_table(path, "ragged_dot", "cpu", lambda t: t["robust"].__setitem__(record["key"], record))
    found = get_op("ragged_dot").lookup(dataclasses.replace(PROBLEM, m=80), backend="tiled", distribution="single")
    assert found.source == "robust" and "nearest tuned m=64: no entry there" in found.reason
    assert found.config.to_dict() | B == found.config.to_dict()
