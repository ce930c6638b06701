"""`moe-tune sweep` and `report --breakdown` mistakes found before anything runs: one clear line and exit 2 for a
usage mistake, 1 for a file that cannot be read or written (the rows of `test_bad_inputs.CASES`, run the same
way); and a dry run says what the run would refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bad_inputs import S, Case, _fill, _run, entry, good_table, write_table


def corrupt_table(tmp: Path) -> None:
    path = tmp / "p" / "cpu" / "ragged_dot.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"schema_version": 2, "entries": ')


def trace_dir_over_a_file(tmp: Path) -> None:
    good_table(tmp)
    (tmp / "t").mkdir()
    (tmp / "t" / "plugins").write_text("")  # where the traces' sessions are copied to


FUSED = ("--op", "fused_moe", "--tokens", "32", "--top-k", "2", "--k", "64", "--n", "64", "--groups", "4")

CASES = [
    Case("a flag the stage does not take", ("sweep", *FUSED, "--stage", "combine", "--glu", "gelu", "--dry-run"), 2,
         "--glu does not apply to fused_moe with --stage combine"),
    Case("... the stage that takes it", ("sweep", *FUSED, "--stage", "dispatch", "--glu", "gelu", "--dry-run"), 0,
         "glu=gelu"),
    Case("top-k above the fused experts", ("sweep", *FUSED, "--top-k", "9", "--dry-run"), 2,
         "top_k (9) must not exceed experts (4: groups x ep)"),
    Case("... counted over the ep shards", ("sweep", *FUSED, "--top-k", "9", "--ep", "4", "--dry-run"), 0,
         "m=288"),
    Case("a ladder past memory: the run", ("sweep", "--m", "1:1000000000000", "--k", "64", "--n", "64", "--groups",
                                           "2", "--workers", "1"), 2, "TiB of memory", absent=("p/cpu",)),
    Case("... its dry run says so", ("sweep", "--m", "1:1000000000000", "--k", "64", "--n", "64", "--groups", "2",
                                     "--workers", "1", "--dry-run"), 0,
         # how many of the 41 it refuses depends on the memory available as it runs
         "of its 41 sweeps before anything runs; the first: ragged_dot fwd m=1000000000000", absent=("p/cpu",)),
    Case("a corrupt table: refused before the sweep", ("sweep", *S), 1, "{tmp}/p/cpu/ragged_dot.json",
         setup=corrupt_table, absent=("p/cpu/sweeps",)),
    Case("... and by its dry run", ("sweep", *S, "--dry-run"), 1, "not valid JSON", setup=corrupt_table),
    Case("breakdown --keep-trace where the traces cannot go",
         ("report", "--profile-dir", "{tmp}/p", "--breakdown", "--keep-trace", "{tmp}/t"), 1,
         "cannot write traces to {tmp}/t/plugins/profile: {tmp}/t/plugins is a file, not a directory",
         setup=trace_dir_over_a_file),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.item) for c in CASES])
def test_bad_campaign_input_is_one_line(case: Case, tmp_path: Path):
    if case.setup is not None:
        case.setup(tmp_path)
    code, output = _run(case, tmp_path)
    assert "Traceback" not in output, output
    assert code == case.code, output
    assert any(_fill(case.message, tmp_path) in line for line in output.splitlines()), output
    if code:
        assert len([line for line in output.splitlines() if line.startswith("error:")]) == 1, output
    for path in case.absent:
        assert not (tmp_path / path).exists(), f"{path} was written before the input was refused"


def test_a_gather_serving_several_ep_sizes_is_swept_as_the_tables_entry_was(tmp_path: Path):
    """The gathers' key holds no ep (the runtime cannot see it): one sweep serves --ep 1,8, planned as the case
    the table's entry was tuned for (here ep=8, from a smoke test: swept again, and said so as ep=8's)."""
    from moe_tune.campaign.request import model_campaign_cases, plan
    from moe_tune.kernels import get_op

    cases, _ = model_campaign_cases(["qwen3-30b-a3b"], [64], [1, 8], dtype="float32")
    [dispatch] = [s for s in plan(cases, platform="cpu", distribution="balanced")
                  if s.op == "ragged_gather" and "dispatch" in s.label and s.label.endswith("ep=1")]
    assert [c.label for c in dispatch.also] == ["qwen3-30b-a3b dispatch tokens=64 ep=8"]
    smoke = {**entry(), "key": dispatch.key, "op": "ragged_gather",
             "fields": {**dispatch.problem.key_fields(), "backend": dispatch.backend, "distribution": "balanced"},
             "distribution": {"name": "balanced", "seed": 0, "experts": 128, "ep": 8, "group_sizes": [1] * 128},
             "search": {"strategy": "grid", "space": 2, "full_space": 10, "max_candidates": 2, "samples": 1},
             "versions": {"backend_revision": get_op("ragged_gather").backends.get(dispatch.backend).revision}}
    table = write_table(tmp_path / "p", smoke).with_name("ragged_gather.json")
    (tmp_path / "p" / "cpu" / "ragged_dot.json").rename(table)
    data = json.loads(table.read_text())
    table.write_text(json.dumps({**data, "op": "ragged_gather"}))
    argv = ("sweep", "--model", "qwen3-30b-a3b", "--op", "ragged_gather", "--tokens", "64", "--ep", "1,8",
            "--direction", "fwd", "--dry-run")
    code, output = _run(Case("ep", argv, 0, ""), tmp_path)
    assert code == 0, output
    assert "again: qwen3-30b-a3b dispatch tokens=64 ep=8: tuned with" in output, output
    assert "differ only in ep, which the key does not hold" in output, output


def test_where_a_campaign_runs_decides_its_passes_once():
    """`Campaign.placed`: compiling for a chip never runs on Ray; the ladder's boundaries and the robust choice
    time the whole plan here, so on Ray or as a share they are left out, with how to measure them."""
    from moe_tune.campaign.request import Campaign, Passes, Where
    from moe_tune.core.errors import UsageError
    from moe_tune.tuner import SweepSettings

    both = Passes(("balanced", "skewed"), ladder=True)
    here = Campaign((), SweepSettings(workers=1), both)
    assert here.placed() == {}
    for where in (Where(ray_address="local"), Where(share=(0, 2))):
        left = Campaign((), SweepSettings(workers=1), both, where).placed()
        assert sorted(left) == ["ladder", "robust"] and all("without --ray / --shard" in w for w in left.values())
    chip = Passes(("balanced",), ladder=True, target="v5e")
    assert list(Campaign((), SweepSettings(workers=1), chip).placed()) == ["ladder"]
    with pytest.raises(UsageError, match="does not take --ray"):
        Campaign((), SweepSettings(workers=1), chip, Where(ray_address="local")).placed()
