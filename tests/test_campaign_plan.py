"""A campaign's plan (no engine): duplicates removed across models, largest first, shares for job arrays,
what the table already holds; and `sweep --dry-run` / `--shard` through the CLI, the shares then merged."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from moe_tune.campaign.request import Case, model_campaign_cases, parse_shard, plan, shard, shard_from_env, split_done
from moe_tune.cli import cli
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.layer.models import ModelPreset, layer_cases
from moe_tune.profiles.entry import entry_key

# Same matmuls per shard (4 experts on one shard, or 8 on two: 4 groups of the same m, k, n); other gathers.
FOUR = ModelPreset(name="four", hidden=128, expert_intermediate=64, experts=4, top_k=2, shared_experts=0)
EIGHT = ModelPreset(name="eight", hidden=128, expert_intermediate=64, experts=8, top_k=2, shared_experts=0)


def cases_of(preset: ModelPreset, ep: int) -> list[Case]:
    return [Case(c.op, c.problem, f"{preset.name} {c.role}") for _, c in layer_cases(preset, [16], ep=ep,
                                                                                     dtype="float32")]


def test_duplicates_across_models_are_swept_once_largest_first():
    cases = cases_of(FOUR, 1) + cases_of(EIGHT, 2)
    sweeps = plan(cases, platform="cpu", distribution="balanced")
    keys = [s.key for s in sweeps]
    every = {entry_key(c.op, c.problem, "tiled", "balanced") for c in cases}
    assert len(keys) == len(set(keys)) and set(keys) == every and len(cases) == 16
    assert sum(s.op == "ragged_dot" for s in sweeps) == 6  # the same 6 matmuls in both models
    assert all(s.label.startswith("four") for s in sweeps if s.op == "ragged_dot")  # named by its first case
    sizes = [s.size for s in sweeps]
    assert sizes == sorted(sizes, reverse=True) and sweeps[0].op == "ragged_dot"


def test_a_compile_only_plan_takes_the_backend_the_chip_tunes():
    """`--target h100` checks the chip's own kernels: a GPU default with nothing to tune (plain JAX for the
    fused layer and the dense combine) gives way to triton in the compile-only plan; a default with tunables
    (triton for ragged_dot on GPU, megablox on TPU) stays; --backend still wins."""
    cases = cases_of(FOUR, 1)
    on_gpu = {(s.op, s.backend) for s in plan(cases, platform="gpu", distribution="balanced")}
    assert ("ragged_dot", "triton") in on_gpu and any(backend == "jax" for _, backend in on_gpu)
    assert {s.backend for s in plan(cases, platform="gpu", distribution="balanced", tunable=True)} == {"triton"}
    on_tpu = {(s.op, s.backend) for s in plan(cases, platform="tpu", distribution="balanced", tunable=True)}
    assert ("ragged_dot", "megablox") in on_tpu and ("ragged_gather", "pallas_tpu") in on_tpu
    chosen = plan(cases, platform="gpu", distribution="balanced", backend="tiled", tunable=True)
    assert {s.backend for s in chosen} == {"tiled"}


def test_model_campaign_leaves_out_ep_sizes_a_model_cannot_take():
    cases, notes = model_campaign_cases(["mixtral-8x7b", "qwen3-30b-a3b"], [16], [1, 16], dtype="float32")
    assert {c.label.split()[0] for c in cases if "ep=16" in c.label} == {"qwen3-30b-a3b"}
    assert notes == ["mixtral-8x7b: ep=16 left out (8 experts are not divisible by 16)"]
    # training (the default): 6 ragged_dots, dispatch, combine and their two backward gathers per layer, then the
    # fused kernels (gate/up and down, forward and backward, and the gate/up forward with the glu an evaluation
    # between training steps runs) and the fused-or-not choice, timed forward (serving) and forward+backward
    # (training)
    assert len(model_campaign_cases(["all"], [16], [1], dtype="float32")[0]) == 17 * 10
    assert len(model_campaign_cases(["all"], [16], [1], dtype="float32", direction="fwd")[0]) == 7 * 10
    with pytest.raises(UsageError, match="no sweep"):
        model_campaign_cases(["mixtral-8x7b"], [16], [16], dtype="float32")


@given(st.integers(0, 60), st.integers(1, 12))
def test_shares_are_disjoint_and_complete(size, count):
    items = list(range(size))
    shares = [shard(items, i, count) for i in range(count)]
    together = sorted(x for share in shares for x in share)
    assert together == items  # complete, and disjoint: every item exactly once
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("text", ["2/2", "-1/2", "1/0", "a/b", "1", "1/2/3"])
def test_bad_shards_are_usage_errors(text):
    with pytest.raises(UsageError, match="--shard"):
        parse_shard(text)


def test_shard_defaults_from_a_slurm_job_array():
    assert shard_from_env({}) is None
    assert shard_from_env({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}) == (3, 4)
    assert shard_from_env({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4",
                           "SLURM_ARRAY_TASK_MIN": "1"}) == (3, 4)
    with pytest.raises(UsageError):
        shard_from_env({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "4"})


def test_complete_entries_are_skipped_unless_fresh(isolated_profiles):
    from moe_tune.profiles.table import write_entries

    sweeps = plan(cases_of(FOUR, 1), platform="cpu", distribution="balanced")
    first, second, third = sweeps[0], sweeps[1], sweeps[2]
    revision = get_op("ragged_dot").backends.get(first.backend).revision
    table = isolated_profiles / "cpu" / "ragged_dot.json"
    current = {"backend_revision": revision}
    write_entries(table, "ragged_dot", "cpu", [
        {"key": first.key, "fields": {}, "config": {}, "versions": current},
        {"key": second.key, "fields": {}, "config": {}, "versions": current, "interrupted": True},
        {"key": third.key, "fields": {}, "config": {}, "versions": {"backend_revision": revision - 1}}])
    todo, done = split_done(sweeps, profile_dir=None, device_kind="cpu")
    # an interrupted entry is not complete, and one of an older kernel revision is stale: both run again
    assert done == [first] and todo == sweeps[1:]
    assert split_done(sweeps, profile_dir=None, device_kind="cpu", fresh=True) == (sweeps, [])


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(cli, list(args), catch_exceptions=False)


def test_dry_run_prints_the_plan(run, monkeypatch):
    result = run("sweep", "--model", "gpt-oss-20b,gpt-oss-120b", "--tokens", "64,512", "--ep", "1,4", "--dry-run")
    assert result.exit_code == 0, result.output
    # 2 models x 2 counts: at ep=1 the one-device layer's 17 cases (training, fused kernels and both choices
    # included); at ep=4 the layer across 4 devices: its shard layer on the device's tokens and the all_gather
    # strategy's on 4 x them, 13 each once gpt-oss's down matmuls (its gate/up ones) are counted once (the
    # all_to_all strategy's calls are among them: its gathers on the device's tokens, its matmuls on tokens x
    # top_k x 4 rows; the strategy's own lookup is left out here: one device). Sweeps: 20b at ep=1 has the
    # matmuls of 120b's shard layer at ep=4 (32 experts per shard), the gathers' keys do not hold the model's
    # experts, and the dispatch's gradient is the combine's own kernel at ep=4. The strategy's token chunks add,
    # per (model, count) at ep=4, the 26 calls again at half the device's tokens and the 13 of the shard layer
    # at a quarter (its all_gather strategy's, on 4 x a quarter, are the one-chunk shard layer's): 65 in all, so
    # 68 + 4 x 65 = 328 cases; the smaller shapes' sweeps coincide across counts (64 / 2 x 4 = 512 / 4 ...)
    assert "328 kernel cases, 210 sweeps after removing duplicates" in result.output
    assert "210 to run" in result.output and "gpt-oss-20b gate/up drhs tokens=512 ep=1" in result.output
    assert "gpt-oss-120b all_gather gate/up drhs tokens=64 ep=4" in result.output
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    shared = run("sweep", "--model", "gpt-oss-20b", "--tokens", "64", "--dry-run")
    assert "14 sweeps after removing duplicates; share 1/3: 5 sweeps" in shared.output


def test_a_list_of_shapes_is_a_campaign_of_every_combination(run):
    result = run("sweep", "--op", "ragged_dot", "--m", "256,512", "--k", "128", "--n", "128,256", "--groups", "4",
                 "--direction", "all", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "12 kernel cases, 12 sweeps after removing duplicates" in result.output  # 2 m x 2 n x 3 directions
    for m in (256, 512):
        for n in (128, 256):
            assert f"ragged_dot dlhs m={m} k=128 n={n} g=4" in result.output
    gathers = run("sweep", "--op", "ragged_gather", "--tokens", "64,128,64", "--hidden", "128", "--dry-run")
    assert "3 kernel cases, 2 sweeps after removing duplicates" in gathers.output  # the repeated 64 once
    for command in ("lookup", "bench"):  # one shape each: several values are a one-line error
        single = run(command, "--op", "ragged_dot", "--m", "256,512")
        assert single.exit_code == 2 and "several --m values make a campaign" in single.output, single.output


def test_bad_campaign_flags_are_one_line(run):
    for args, message in ((["--shard", "3/2"], "I must be 0 to 1"),
                          (["--model", "gpt-oss-20b,nope"], "unknown model 'nope'"),
                          (["--model", "gpt-oss-20b", "--ep", "0"], "positive integers")):
        result = run("sweep", *args, "--dry-run")
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


def test_shards_run_their_share_and_merge_into_the_whole(run, tmp_path):
    shape = ["--m", "64", "--k", "64", "--n", "64", "--groups", "4", "--direction", "all", "--samples", "1",
             "--max-candidates", "1", "--workers", "1"]
    tables = []
    for index in (0, 1):
        result = run("sweep", *shape, "--shard", f"{index}/2", "--profile-dir", str(tmp_path / f"shard{index}"))
        assert result.exit_code == 0, result.output
        tables.append(tmp_path / f"shard{index}" / "cpu" / "ragged_dot.json")
    keys = [set(json.loads(t.read_text())["entries"]) for t in tables]
    assert [len(k) for k in keys] == [2, 1] and not keys[0] & keys[1]
    merged = tmp_path / "all" / "cpu" / "ragged_dot.json"
    assert run("merge", str(merged), *map(str, tables)).exit_code == 0
    assert set(json.loads(merged.read_text())["entries"]) == keys[0] | keys[1]
    again = run("sweep", *shape, "--shard", "0/2", "--profile-dir", str(tmp_path / "shard0"))
    assert "2 already in the table, 0 to run" in again.output
