"""The CLI through click's CliRunner: real sweeps on tiny spaces, reports, lookups, and user mistakes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moe_tune.cli import cli

TINY = ["--m", "256", "--k", "128", "--n", "128", "--groups", "4", "--samples", "2", "--max-candidates", "3"]


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, list(args), catch_exceptions=False)

    return invoke


def test_ops_lists_backends_and_tunables(run):
    result = run("ops")
    assert result.exit_code == 0
    for name in ("xla", "tiled", "megablox", "tm, tk, tn", "ragged_gather_reduce", "pallas_tpu", "rows_per_chunk",
                 "dmas_in_flight"):
        assert name in result.output


def test_sweep_report_lookup_round_trip(run, tmp_path, isolated_profiles):
    result = run("sweep", *TINY)
    assert result.exit_code == 0, result.output
    assert "winner" in result.output and "speedup" in result.output and "3 tried" in result.output
    table = isolated_profiles / "cpu" / "ragged_dot.json"
    assert table.exists()

    csv = run("report", "--format", "csv")
    assert csv.exit_code == 0
    header, row = csv.output.strip().splitlines()[:2]
    assert header.startswith("device_kind,op,direction,backend,shape,dtype")
    assert row.startswith("cpu,ragged_dot,fwd,tiled,m=256 k=128 n=128 groups=4,float32")

    records = json.loads(run("report", "--format", "json").output)
    assert len(records) == 1 and records[0]["tried"] == 3 and records[0]["time_ms"] > 0

    markdown = run("report", "--format", "markdown").output
    assert markdown.splitlines()[0].startswith("| device_kind") and "ragged_dot" in markdown

    assert "ragged_dot" in run("report").output

    found = run("lookup", "--m", "256", "--k", "128", "--n", "128", "--groups", "4")
    assert found.exit_code == 0 and "source: exact" in found.output
    near = run("lookup", "--m", "300", "--k", "128", "--n", "128", "--groups", "4")
    assert "source: nearest" in near.output
    none = run("lookup", "--m", "300", "--k", "64", "--n", "128", "--groups", "4")
    assert "source: default" in none.output


@pytest.mark.parametrize("op", ["ragged_gather", "ragged_gather_reduce", "dense_gather_reduce"])
def test_gather_op_sweep_then_lookup_is_exact(run, op, isolated_profiles):
    shape = ["--tokens", "64", "--hidden", "128", "--top-k", "4", "--experts", "8"]
    if op != "dense_gather_reduce":
        shape += ["--ep", "2"]
    result = run("sweep", "--op", op, *shape, "--samples", "2", "--max-candidates", "2", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert f"{op} tokens=64 top_k=4 hidden=128" in result.output and "2 tried" in result.output
    assert (isolated_profiles / "cpu" / f"{op}.json").exists()
    found = run("lookup", "--op", op, *shape)
    assert found.exit_code == 0 and "source: exact" in found.output, found.output
    near = run("lookup", "--op", op, "--tokens", "80", "--hidden", "128", "--top-k", "4")
    assert "source: nearest" in near.output and "tokens=64 rows=256" in near.output
    assert "tokens=64 rows=256 hidden=128" in run("report", "--op", op, "--format", "csv").output


def test_models_lists_presets_and_one_layers_kernels(run):
    listing = run("models")
    assert listing.exit_code == 0 and "deepseek-v3" in listing.output and "mixtral-8x7b" in listing.output
    layer = run("models", "qwen3-30b-a3b", "--tokens", "512", "--ep", "4")
    assert layer.exit_code == 0, layer.output
    assert "ragged_dot drhs m=4096 k=2048 n=768 g=32 bfloat16" in layer.output
    assert "ragged_gather_reduce tokens=512 top_k=8 hidden=2048 bfloat16 (ep=4)" in layer.output
    typo = run("models", "qwen3-30b")
    assert typo.exit_code == 2 and "did you mean" in typo.output and "Traceback" not in typo.output


def test_sweep_to_explicit_profile_dir(run, tmp_path):
    result = run("sweep", *TINY, "--backend", "xla", "--profile-dir", str(tmp_path / "p"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "p" / "cpu" / "ragged_dot.json").exists()
    assert "xla" in run("report", "--profile-dir", str(tmp_path / "p"), "--format", "csv").output


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["sweep", "--op", "nope"], 2, "nope"),
        (["sweep", "--m", "0"], 2, "0"),
        (["sweep", "--k", "-5"], 2, "-5"),
        (["sweep", "--dtype", "float7"], 2, "float7"),
        (["sweep", "--backend", "cuda_magic", *TINY], 2, "unknown backend 'cuda_magic'"),
        (["sweep", "--distribution", "lopsided"], 2, "lopsided"),
        (["lookup", "--backend", "nope"], 2, "unknown backend"),
        (["sweep", "--samples", "0"], 2, "0"),
        (["sweep", "--op", "ragged_gather", "--m", "64"], 2, "--m does not apply to ragged_gather"),
        (["lookup", "--tokens", "64"], 2, "--tokens does not apply to ragged_dot"),
        (["sweep", "--op", "dense_gather_reduce", "--ep", "2"], 2, "--ep does not apply"),
        (["sweep", "--op", "ragged_gather", "--experts", "6", "--ep", "4"], 2, "multiple of the expert-parallel"),
        (["sweep", "--op", "ragged_gather", "--direction", "dlhs"], 2, "has no direction 'dlhs'"),
    ],
)
def test_user_mistakes_get_one_line_and_exit_code(run, args, code, message):
    result = run(*args)
    assert result.exit_code == code
    assert message in result.output
    assert "Traceback" not in result.output


def test_unreadable_table_names_the_file_and_exits_1(run, isolated_profiles):
    path = isolated_profiles / "cpu" / "ragged_dot.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"schema_version": 1, "entries": ')
    for args in (["report"], ["lookup"]):
        result = run(*args)
        assert result.exit_code == 1
        assert str(path) in result.output and "not valid JSON" in result.output
        assert "Traceback" not in result.output


def test_empty_report_says_how_to_start(run):
    result = run("report")
    assert result.exit_code == 0 and "moe-tune sweep" in result.output
