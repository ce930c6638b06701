"""The dry run is the run: `sweep ... --dry-run` prints the plan that the same command without
it runs, the same sweeps in the same order, with the same skip rules: a complete entry tuned with at least
the budget asked is skipped, one tuned with less is swept again (and the plan says why)."""

from __future__ import annotations

import re

from click.testing import CliRunner

from moe_tune.campaign import runner
from moe_tune.cli import cli

TINY = ["--op", "ragged_dot", "--m", "32,64", "--k", "32", "--n", "32", "--groups", "2", "--direction", "all",
        "--max-candidates", "2", "--samples", "1", "--workers", "1"]
ROW = re.compile(r"^│\s*(\d+|-)\s*│\s*(ragged_dot \w+ m=\d+ k=\d+ n=\d+ g=\d+ \w+)\s*│.*│"
                 r"\s*(to run|again: .*?|done .*?)\s*│$")


def planned_rows(output: str) -> list[tuple[str, str, str]]:
    """(number, sweep, state) of each row of the printed plan."""
    return [m.groups() for m in map(ROW.match, output.splitlines()) if m]


def test_a_campaign_runs_exactly_the_sweeps_its_dry_run_planned(isolated_profiles, monkeypatch):
    invoke = CliRunner().invoke
    # the table before: m=64 fwd complete with the budget asked (skipped), m=32 fwd from a smoke test with
    # less (--max-candidates 1: swept again)
    one = ["--op", "ragged_dot", "--k", "32", "--n", "32", "--groups", "2", "--samples", "1", "--workers", "1"]
    for m, most in (("64", "2"), ("32", "1")):
        done = invoke(cli, ["sweep", *one, "--m", m, "--max-candidates", most], catch_exceptions=False)
        assert done.exit_code == 0, done.output

    dry = invoke(cli, ["sweep", *TINY, "--dry-run"], catch_exceptions=False)
    assert dry.exit_code == 0, dry.output
    rows = planned_rows(dry.output)
    to_run = [sweep for number, sweep, state in rows if number != "-"]
    assert len(rows) == 6 and len(to_run) == 5, dry.output
    assert [state for _, sweep, state in rows if sweep.startswith("ragged_dot fwd m=64")] == [
        "done (--fresh sweeps it again)"]
    again = [state for _, sweep, state in rows if sweep.startswith("ragged_dot fwd m=32")]
    assert len(again) == 1 and re.fullmatch(r"again: tuned with grid, 1 of \d+ candidates \(--max-candidates 1\)",
                                            again[0]), again
    assert "5 to run (1 swept again: tuned with less than asked)" in dry.output
    planned_lines = [line for line in dry.output.splitlines()
                     if ("to run" in line or "again:" in line) and "│" in line]
    assert len(planned_lines) == 5 and all("2 candidates" in line for line in planned_lines)
    # the fwd sweeps have recorded sweeps of their kind (the two above): a time estimated from them
    assert all(re.search(r"2 candidates, ~\d+ s", line) for line in planned_lines if "ragged_dot fwd" in line)

    ran = []
    real = runner.run_sweep
    monkeypatch.setattr(runner, "run_sweep", lambda request, *a, **k: ran.append(request.op + " " + _describe(
        request)) or real(request, *a, **k))
    result = invoke(cli, ["sweep", *TINY], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert ran == to_run  # the same sweeps, in the same order

    again_dry = invoke(cli, ["sweep", *TINY, "--dry-run"], catch_exceptions=False)
    assert "6 already in the table, 0 to run" in again_dry.output  # and what ran now counts as done


def _describe(request) -> str:
    from moe_tune.kernels import get_op

    return get_op(request.op).describe(request.problem).removeprefix(request.op + " ")


def test_the_dry_run_estimates_what_the_strategy_measures(isolated_profiles):
    """A grid measures its whole space; coordinate descent its first round (the default and its neighbours)
    and about one step more: fewer, and said as an estimate of the space."""
    invoke = CliRunner().invoke
    shape = ["--op", "ragged_dot", "--m", "256", "--k", "128", "--n", "128", "--groups", "4", "--dry-run"]
    grid = invoke(cli, ["sweep", *shape], catch_exceptions=False)
    walk = invoke(cli, ["sweep", *shape, "--strategy", "coordinate"], catch_exceptions=False)
    assert grid.exit_code == walk.exit_code == 0, grid.output + walk.output
    [space] = re.findall(r"│ (\d+) candidates", grid.output)
    [(about, of)] = re.findall(r"│ ~(\d+) of (\d+) candidates", walk.output)
    assert of == space and 1 < int(about) < int(space)
