"""`report --breakdown`: where a tuned kernel's time goes. The CPU readers (the xplane's per-op events, xprof's
trace_viewer) agree on one trace; an entry's winner and default are profiled and kept for xprof; the GPU/TPU
readers of xprof's hlo_stats / kernel_stats tables are tested on fixtures (tests/data/xprof_*_stats.json:
the column lists xprof 2.24 emits, captured from a real conversion, with rows as a GPU profile gives them)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from click.testing import CliRunner

from moe_tune.cli import cli
from moe_tune.commands.breakdown import profile_entry
from moe_tune.commands.breakdown.ops import OpEvent, self_times
from moe_tune.commands.breakdown.run import program, read_ops
from moe_tune.commands.breakdown.xprof_tools import datatable_rows, hlo_stats_ops, kernel_stats_ops
from moe_tune.kernels import get_op
from moe_tune.tuner import SweepRequest, run_sweep
from moe_tune.tuner.timing import traceable

DATA = Path(__file__).parent / "data"
# A shape whose time is mostly its dots (ynn fusions on CPU), so that one op dominates.
PROBLEM = dict(m=256, k=512, n=512, groups=4)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(profile dir, its tuned entry of PROBLEM): a tiny sweep, the default and two more candidates."""
    problem = get_op("ragged_dot").problem(**PROBLEM)
    profile_dir = tmp_path_factory.mktemp("profiles")
    result = run_sweep(SweepRequest.make("ragged_dot", problem, samples=1, max_candidates=3, workers=1,
                                         profile_dir=profile_dir))
    return profile_dir, result.entry


def test_self_times_subtract_nested_ops():
    """A loop's own time is its duration less its body's ops; lines (threads) are summed separately."""
    events = [OpEvent("a", "while", 0, 100), OpEvent("a", "dot", 10, 60), OpEvent("a", "copy", 75, 5),
              OpEvent("a", "dot", 200, 40), OpEvent("b", "dot", 20, 30)]
    totals, counts = self_times(events)
    assert totals == pytest.approx({"while": 35e-9, "dot": 130e-9, "copy": 5e-9})
    assert counts == {"while": 1, "dot": 3, "copy": 1}


def test_the_wall_time_no_op_event_covers_is_shown(capsys):
    """A breakdown whose ops cover 60% of its wall time says that 40% is in no op's event; one whose ops cover
    it all (or whose wall time was not measured) says nothing of it."""
    from moe_tune.commands.breakdown import Breakdown
    from moe_tune.commands.breakdown.ops import OpTime
    from moe_tune.commands.render import breakdowns

    ops = (OpTime("dot", 0.006, 1.0, 1.0),)
    found = [Breakdown("winner", {"tm": 8}, "trace", 3, ops, wall_s=0.010),
             Breakdown("default", {"tm": 16}, "trace", 3, ops, wall_s=0.005), Breakdown("x", {}, "trace", 3, ops)]
    assert [b.untraced_share for b in found] == [pytest.approx(0.4), 0.0, 0.0]
    assert found[0].to_json()["untraced_share"] == pytest.approx(0.4)
    breakdowns(found, "table", top=5)
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("in no op's event") == 1 and "40% of its 10.000 ms of wall time" in out


def test_cpu_readers_agree_on_one_trace(tmp_path):
    """The xplane reader and xprof's trace_viewer read the same per-op events of one trace: same ops, same
    calls, the same dominant op, the same shares."""
    pytest.importorskip("xprof")
    kernel_op = get_op("ragged_dot")
    problem = kernel_op.problem(**PROBLEM)
    backend = kernel_op.backend("tiled")
    inputs = jax.device_put(kernel_op.make_inputs(problem, "balanced", 0))
    config = backend.default_config(problem)
    compiled = traceable(lambda x: kernel_op.run(backend, config, problem, x), 7).lower(inputs).compile()
    jax.block_until_ready(compiled(inputs))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            jax.block_until_ready(compiled(inputs))
    ((_, by_trace),) = read_ops(tmp_path, "cpu", "trace", program(7), 2)
    ((reader, by_xprof),) = read_ops(tmp_path, "cpu", "xprof", program(7), 2)
    assert reader == "xprof trace_viewer"
    assert {o.name for o in by_trace} == {o.name for o in by_xprof}
    assert {o.name: o.count for o in by_trace} == {o.name: o.count for o in by_xprof}
    assert by_trace[0].name == by_xprof[0].name and by_trace[0].share > 0.3
    xprof_share = {o.name: o.share for o in by_xprof}
    for op in by_trace:  # trace_viewer rounds times to ns in microseconds: equal up to that
        assert op.share == pytest.approx(xprof_share[op.name], abs=1e-3)
    assert sum(o.share for o in by_trace) == pytest.approx(1.0)
    assert [o.seconds for o in by_trace] == sorted((o.seconds for o in by_trace), reverse=True)


def test_entry_breakdown_both_readers_and_kept_traces(tuned, tmp_path):
    """Winner and default are profiled (separate runs per reader: the same ops and calls, whatever the times),
    and the kept traces are where `xprof --logdir` finds them."""
    pytest.importorskip("xprof")
    _, entry = tuned
    kept = tmp_path / "traces"
    by_trace = profile_entry(entry, source="trace", runs=2, keep_trace=kept)
    by_xprof = profile_entry(entry, source="xprof", runs=1)
    labels = ["winner"] + (["default"] if entry.config != entry.default_config else [])
    assert [b.label for b in by_trace] == [b.label for b in by_xprof] == labels
    assert by_trace[0].config == entry.config and by_trace[0].source == "trace" and by_trace[0].runs == 2
    for a, b in zip(by_trace, by_xprof):
        assert {(o.name, o.count) for o in a.ops} == {(o.name, o.count) for o in b.ops}
        assert a.total_s > 0 and sum(o.share for o in a.ops) == pytest.approx(1.0)
        assert a.wall_s > 0 and 0 <= a.untraced_share < 1
    assert by_trace[0].trace_dir == str(kept)
    sessions = sorted(p.name.split("_")[0] for p in (kept / "plugins" / "profile").iterdir())
    assert sessions == sorted(labels)
    assert all(list(p.glob("*.xplane.pb")) for p in (kept / "plugins" / "profile").iterdir())


def test_report_breakdown_cli(tuned, tmp_path):
    """`report --breakdown --key K --keep-trace DIR`: the verdict, a table per config, how to open the traces;
    an unknown key is one line and exit 2."""
    profile_dir, entry = tuned
    runner = CliRunner()
    result = runner.invoke(cli, ["report", "--profile-dir", str(profile_dir), "--key", entry.key, "--breakdown",
                                 "--runs", "1", "--keep-trace", str(tmp_path / "kept"), "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert f"breakdown of {entry.key}" in result.output and "verdict: " in result.output
    assert f"xprof --logdir {tmp_path / 'kept'}" in result.output
    assert "label,config,source,rank,op,group,ms_per_run,share,cumulative,calls_per_run" in result.output
    assert "\nwinner,tm=" in result.output
    missing = runner.invoke(cli, ["report", "--profile-dir", str(profile_dir), "--key", "nope", "--breakdown"])
    assert missing.exit_code == 2 and "nothing to break down" in missing.output
    stray = runner.invoke(cli, ["report", "--profile-dir", str(profile_dir), "--keep-trace", str(tmp_path)])
    assert stray.exit_code == 2 and "apply to --breakdown" in stray.output


def test_hlo_stats_fixture():
    """GPU/TPU: self time per HLO op from hlo_stats, per run, summed over programs, largest first."""
    table = json.loads((DATA / "xprof_hlo_stats.json").read_text())
    assert len(datatable_rows(table)) == 4 and datatable_rows([table]) == datatable_rows(table)
    ops = hlo_stats_ops(table, runs=10)
    assert [o.name for o in ops] == ["custom-call.2", "loop_convert_fusion", "copy.1"]
    assert [o.seconds for o in ops] == pytest.approx([800e-6, 150e-6, 50e-6])  # 1200 + 300 us over 10 runs
    assert [o.count for o in ops] == [1, 2, 2]
    assert [o.share for o in ops] == pytest.approx([0.8, 0.15, 0.05])
    assert [o.group for o in ops] == ["custom-call", "loop fusion", "data formatting"]


def test_kernel_stats_fixture():
    """GPU: time per kernel from kernel_stats (a kernel's launch shapes summed), with the HLO op it runs."""
    ops = kernel_stats_ops(json.loads((DATA / "xprof_kernel_stats.json").read_text()), runs=10)
    assert [(o.name, o.group) for o in ops] == [("ragged_dot_kernel", "custom-call.2"),
                                                ("loop_convert_fusion", "loop_convert_fusion")]
    assert [o.seconds for o in ops] == pytest.approx([800e-6, 115e-6])
    assert [o.count for o in ops] == [2, 1]
    assert sum(o.share for o in ops) == pytest.approx(1.0)


def test_a_gpu_program_without_hlo_stats_rows_is_read_from_its_kernels(tmp_path, monkeypatch):
    """A command buffer (Triton's fwd on an H100) leaves hlo_stats empty: the breakdown is the kernel table."""
    from moe_tune.commands.breakdown import run, xprof_tools

    kernels = json.loads((DATA / "xprof_kernel_stats.json").read_text())
    empty = {**json.loads((DATA / "xprof_hlo_stats.json").read_text()), "rows": []}
    monkeypatch.setattr(run, "xplane_file", lambda trace_dir: tmp_path / "vm.xplane.pb")
    tables = {"hlo_stats": empty, "kernel_stats": kernels}
    monkeypatch.setattr(xprof_tools, "tool_data", lambda xplane, tool: tables[tool])
    ((reader, ops),) = read_ops(tmp_path, "gpu", "xprof", program(0), 10)
    assert reader == run.KERNEL_STATS and ops[0].name == "ragged_dot_kernel"
    tables["kernel_stats"] = empty
    with pytest.raises(run.MoeTuneError, match="no per-op events"):
        read_ops(tmp_path, "gpu", "xprof", program(0), 10)
