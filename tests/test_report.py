"""Reports: filters, sorting, the plot file, and `bench_case` (what `moe-tune bench` prints), on tables
written by real (tiny) sweeps."""

from __future__ import annotations

import matplotlib.image
import pytest
from plot_checks import check_plot, drawn  # noqa: F401 (a fixture)

from moe_tune.commands import bench, report
from moe_tune.commands.plots import plot_entries
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.tuner import SweepRequest, run_sweep

FAST = {"samples": 1, "max_candidates": 3, "workers": 1}


@pytest.fixture
def tables(isolated_profiles):
    """Three entries that differ in every filtered column but the device: ragged_dot fwd (tiled, float32),
    ragged_dot drhs (xla, bfloat16) and ragged_gather (tiled, float32)."""
    dot = get_op("ragged_dot").problem(m=256, k=128, n=128, groups=4)
    run_sweep(SweepRequest.make("ragged_dot", dot, **FAST))
    drhs = get_op("ragged_dot").problem(m=256, k=128, n=128, groups=4, dtype="bfloat16", direction="drhs")
    run_sweep(SweepRequest.make("ragged_dot", drhs, backend="xla", **FAST))
    gather = get_op("ragged_gather").problem(tokens=32, hidden=128, top_k=4, experts=8, ep=2)
    run_sweep(SweepRequest.make("ragged_gather", gather, **FAST))
    return isolated_profiles


def rows(frame) -> set[tuple[str, str, str, str]]:
    return {(r.op, r.direction, r.backend, r.dtype) for r in frame.itertuples()}


DOT_FWD = ("ragged_dot", "fwd", "tiled", "float32")
DOT_DRHS = ("ragged_dot", "drhs", "xla", "bfloat16")


def test_filters_and_sorting(tables):
    frame = report.entries_frame()
    assert len(frame) == 3 and set(frame["op"]) == {"ragged_dot", "ragged_gather"}
    (gather,) = rows(frame) - {DOT_FWD, DOT_DRHS}
    assert gather[0] == "ragged_gather" and gather[2:] == ("tiled", "float32")
    # each filter keeps exactly the rows it names
    assert rows(report.select(frame, op="ragged_dot")) == {DOT_FWD, DOT_DRHS}
    assert rows(report.select(frame, op="ragged_gather")) == {gather}
    assert rows(report.select(frame, op="ragged_dot", direction="drhs")) == {DOT_DRHS}
    assert rows(report.select(frame, direction="drhs")) == {DOT_DRHS}
    assert rows(report.select(frame, backend="xla")) == {DOT_DRHS}
    assert rows(report.select(frame, backend="tiled")) == {DOT_FWD, gather}
    assert rows(report.select(frame, dtype="bfloat16")) == {DOT_DRHS}
    assert rows(report.select(frame, dtype="float32", device="cpu", backend="tiled")) == {DOT_FWD, gather}
    assert len(report.select(frame, device="cpu")) == 3 and report.select(frame, device="tpu_v5_lite").empty
    assert report.select(frame, dtype="float16").empty and report.select(frame, op="dense_gather_reduce").empty
    # sorting: by a number either way, by a string
    by_time = report.select(frame, sort="time_ms", descending=True)["time_ms"].tolist()
    assert by_time == sorted(frame["time_ms"].tolist(), reverse=True)
    assert report.select(frame, sort="time_ms")["time_ms"].tolist() == sorted(by_time)
    assert report.select(frame, sort="backend")["backend"].tolist() == ["tiled", "tiled", "xla"]
    assert report.select(frame, sort="backend", descending=True)["backend"].tolist()[0] == "xla"
    with pytest.raises(UsageError, match="cannot sort"):
        report.select(frame, sort="colour")
    with pytest.raises(UsageError, match="unknown filter"):
        report.select(frame, flavour="x")


def test_plot_draws_candidates_and_speedups(tables, tmp_path, drawn):
    entries = [entry for _, _, entry in report.effective_entries()]
    path = plot_entries(entries, tmp_path / "plots" / "report.png", title="test")
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    (fig,) = drawn
    assert fig.get_suptitle() == "test"
    check_plot(fig, entries)
    with pytest.raises(UsageError, match="nothing to plot"):
        plot_entries([], tmp_path / "empty.png")


def test_bench_case_uses_the_tuned_entry(tables):
    problem = get_op("ragged_dot").problem(m=256, k=128, n=128, groups=4)
    result = bench.bench_case("ragged_dot", problem, samples=1)
    assert result.lookup_source == "exact"
    t = result.times_s
    assert set(t) == {"tuned", "default", "xla", "dense", "skewed", "copy"} and result.ratios["xla_vs_dense"] > 0
    # the roofline is the larger of the compute roof (the dense matmul) and the memory roof
    memory_roof = problem.min_bytes / (result.copy_gbps * 1e9)
    assert result.roofline_s == pytest.approx(max(t["dense"], memory_roof))
    assert result.roofline_bound == ("compute" if t["dense"] >= memory_roof else "memory")
    assert result.ratios["tuned_vs_roofline"] == pytest.approx(t["tuned"] / result.roofline_s)
    assert result.ratios["skewed_vs_balanced"] == pytest.approx(t["skewed"] / t["tuned"])
    gather = get_op("ragged_gather").problem(tokens=32, hidden=128, top_k=4, experts=8, ep=2)
    result = bench.bench_case("ragged_gather", gather, samples=1)
    assert result.lookup_source == "exact"
    assert set(result.times_s) == {"tuned", "default", "fallback", "copy", "output_write"}


def test_bench_case_times_and_looks_up_the_distribution_it_is_given(tables, monkeypatch):
    """`bench --distribution skewed`: the lookup asks for the skewed entry (the table holds a balanced one
    only, so it is not an exact hit) and the kernels run on group sizes drawn from that distribution."""
    kernel_op = get_op("ragged_dot")
    drawn, make_inputs = [], kernel_op.make_inputs
    monkeypatch.setattr(kernel_op, "make_inputs", lambda problem, distribution, seed: (
        drawn.append(distribution), make_inputs(problem, distribution, seed))[1])
    result = bench.bench_case("ragged_dot", kernel_op.problem(m=256, k=128, n=128, groups=4), samples=1,
                              distribution="skewed")
    assert drawn == ["skewed"] and result.lookup_source != "exact"


def test_sweep_log_shows_every_candidate_with_reasons(isolated_profiles, monkeypatch):
    """A sweep with a wrong and a failing candidate: the log report lists all of them, reasons included."""
    from faulty_backend import FaultyRaggedDot

    from moe_tune.kernels.ragged_dot import BACKENDS

    BACKENDS.register(FaultyRaggedDot())
    try:
        problem = get_op("ragged_dot").problem(m=128, k=64, n=64, groups=4)
        run_sweep(SweepRequest.make("ragged_dot", problem, backend="faulty_test", samples=1, workers=1))
    finally:
        BACKENDS.unregister("faulty_test")
    (log,) = isolated_profiles.glob("cpu/sweeps/ragged_dot/*.jsonl")
    header, frame, finals = report.sweep_log_frame(log)
    assert header["type"] == "header" and len(finals) == 1
    assert list(frame["status"][:2]) == ["ok", "ok"] and set(frame["status"]) == {"ok", "wrong", "failed"}
    assert frame["reason"][frame["status"] == "wrong"].str.contains("relative error").all()
    failed = frame[frame["status"] == "failed"]
    assert set(failed["stage"]) == {"compile", "run"} and (failed["reason"].str.len() > 0).all()
    with pytest.raises(UsageError, match="no sweep log"):
        report.sweep_log_frame(isolated_profiles / "missing.jsonl")
