"""One dtype default: `lookup`, `sweep --op` and `sweep --model` (and `models`) ask for the same
dtype when none is given, and `lookup` says when the shape is tuned in another dtype only."""

from __future__ import annotations

from click.testing import CliRunner

from moe_tune.cli import cli
from moe_tune.kernels import get_op
from moe_tune.layer.models import LAYER_DEFAULTS, layer_settings
from moe_tune.profiles import table as dirs
from moe_tune.profiles.table import write_entries


def test_every_command_defaults_to_one_dtype():
    ragged_dot = get_op("ragged_dot").default_problem_options()["dtype"]
    gathers = {get_op(op).default_problem_options()["dtype"] for op in ("ragged_gather", "ragged_gather_reduce")}
    assert {ragged_dot, *gathers, LAYER_DEFAULTS["dtype"], layer_settings()[2]} == {"float32"}


def test_lookup_says_when_only_another_dtype_is_tuned(isolated_profiles):
    problem = get_op("ragged_dot").problem(m=64, k=32, n=32, groups=2, dtype="bfloat16")
    fields = {**problem.key_fields(), "backend": "tiled", "distribution": "balanced"}
    key = get_op("ragged_dot").lookup(problem).key
    write_entries(dirs.user_dir() / "cpu" / "ragged_dot.json", "ragged_dot", "cpu",
                  [{"key": key, "fields": fields, "config": {"tm": 64, "tk": 32, "tn": 32, "tail": 16}}])
    shape = ["lookup", "--m", "64", "--k", "32", "--n", "32", "--groups", "2"]
    missed = CliRunner().invoke(cli, shape)
    assert missed.exit_code == 0 and "source: default" in missed.output, missed.output
    assert "tuned in bfloat16 (ask for that dtype: --dtype bfloat16)" in missed.output.replace("\n", " ")
    found = CliRunner().invoke(cli, [*shape, "--dtype", "bfloat16"])
    assert "source: exact" in found.output and "tuned in" not in found.output
