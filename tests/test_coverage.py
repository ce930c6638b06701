"""`moe-tune coverage`: every kernel call of a model's layer with lookup's own answer, the entry's age and
staleness, and the cost of tuning what is not covered, estimated from the sweep times the tables recorded."""

from __future__ import annotations

import datetime
import json

from click.testing import CliRunner

from moe_tune.campaign.request import model_campaign_cases
from moe_tune.cli import cli
from moe_tune.kernels import get_op
from moe_tune.profiles import key_fields, write_entries
from moe_tune.profiles.entry import key_from_fields
from moe_tune.profiles.entry import entry_versions

ARGS = ["coverage", "--model", "qwen3-30b-a3b", "--tokens", "16", "--ep", "8", "--dtype", "float32",
        "--direction", "fwd"]


def _entry(case, *, days_old: float, fresh: bool = True) -> dict:
    op = get_op(case.op)
    impl = op.backend(None)
    fields = key_fields(case.problem, impl.name, "balanced")
    tuned = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=days_old)
    return {"key": key_from_fields(case.op, fields), "fields": fields,
            "config": impl.default_config(case.problem).to_dict(), "timing": {"median_s": 1e-3},
            "versions": entry_versions(impl) if fresh else {"backend_revision": 0},
            "tuned_at": tuned.isoformat(timespec="seconds"), "sweep_wall_s": 30.0,
            "candidates": {"tried": 10, "ok": 10, "failed": 0, "wrong": 0},
            "search": {"stage_s": {"compile": 10.0, "check": 0.0, "time": 10.0}}, "flops": op.flops(case.problem)}


def test_coverage_lists_every_call_with_lookups_answer_and_estimates_the_rest(isolated_profiles):
    cases, _ = model_campaign_cases(["qwen3-30b-a3b"], [16], [8], dtype="float32", direction="fwd")
    dot, other = [c for c in cases if c.op == "ragged_dot"][:2]
    write_entries(isolated_profiles / "cpu" / "ragged_dot.json", "ragged_dot", "cpu",
                  [_entry(dot, days_old=3), _entry(other, days_old=0.5, fresh=False)])
    result = CliRunner().invoke(cli, [*ARGS, "--format", "json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)  # the stale entry warns on stderr
    calls = {c["call"]: c for c in found["calls"]}
    assert list(calls) == [c.label for c in cases]  # every call of the layer, in the layer's order
    tuned, stale = calls[dot.label], calls[other.label]
    assert tuned["source"] == "exact" and not tuned["to_tune"] and tuned["estimate"] is None
    assert 2.9 < tuned["age_days"] < 3.1 and tuned["stale"] == ""
    assert stale["source"] == "exact" and stale["stale"] and stale["to_tune"]  # a stale entry is to tune again
    assert "candidates" in stale["estimate"] and stale["estimate_s"] > 0  # from the recorded 2 s per candidate
    rest = [c for c in calls.values() if c["call"] not in (dot.label, other.label)]
    assert rest and all(c["source"] in ("nearest", "default") and c["to_tune"] for c in rest)
    assert all(c["reason"] for c in calls.values())  # lookup's own why
    assert found["summary"].startswith(f"{len(cases) - 1} of {len(cases)} kernel calls to tune")

    table = CliRunner().invoke(cli, ARGS)
    assert table.exit_code == 0 and "exact" in table.output and "3 d" in table.output
    assert f"{len(cases) - 1} of {len(cases)} kernel calls to tune" in table.output


def test_coverage_bad_input_is_one_line():
    result = CliRunner().invoke(cli, ["coverage", "--model", "no-such-model"])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "no-such-model" in result.output
