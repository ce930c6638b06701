"""The sweep log: every finished candidate is appended at once, a re-run resumes, Ctrl-C keeps what finished,
a SIGKILLed real sweep resumes. Real sweeps at tiny sizes; no timing is asserted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from moe_tune.cli import cli
from moe_tune.core.errors import MoeTuneError
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.profiles import read_table
from moe_tune.tuner import Reporter, SweepInterrupted, SweepRequest, log_path_for, run_sweep
from moe_tune.tuner.compiling import backend_compiles
from moe_tune.tuner.request import SweepLog, read_log
from moe_tune.tuner.search import spread

SMALL = RaggedDotProblem(m=256, k=128, n=128, groups=4)  # swept with its first 4 candidates
# the first 16 candidates: two chunks of 8
MEDIUM = ["--m", "256", "--k", "640", "--n", "640", "--groups", "4", "--max-candidates", "16"]
SMALL_CLI = ["sweep", "--m", "256", "--k", "128", "--n", "128", "--groups", "4", "--max-candidates", "4"]


def _request(**kw):
    # no racing: a raced-out candidate has fewer samples, and these tests count them (racing: test_tuner)
    return SweepRequest.make("ragged_dot", SMALL, **{"backend": "tiled", "samples": 2, "workers": 1, "batch_size": 2,
                                             "max_candidates": 4, "race": None, **kw})


def _lines(path, kind=None):
    lines, _ = read_log(path)
    return [x for x in lines if kind is None or x["type"] == kind]


def _raw_lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]  # every line parses: nothing torn


class InterruptAt(Reporter):
    """Raises KeyboardInterrupt once `stage` has advanced past `after` (timing: candidates' worth of rounds)."""

    def __init__(self, stage: str, after: float):
        self.stage_name, self.after, self.count = stage, after, 0.0

    def advance(self, name, amount=1):
        if name == self.stage_name:
            self.count += amount
            if self.count > self.after:
                raise KeyboardInterrupt


def test_every_finished_candidate_is_logged_and_a_rerun_resumes(tmp_path):
    space = spread(BACKENDS.get("tiled").search_space(SMALL), 4, seed=0)  # --max-candidates 4, seed 0
    first = run_sweep(_request(profile_dir=tmp_path))
    log = first.log_path
    assert log.parent == tmp_path / "cpu" / "sweeps" / "ragged_dot"
    assert log == log_path_for(_request(profile_dir=tmp_path))
    lines = _raw_lines(log)
    assert [x["type"] for x in lines] == ["header"] + ["candidate"] * len(space) + ["final"]
    assert lines[0]["key"] == first.key and lines[0]["versions"]["jax"]
    candidates = lines[1:-1]
    assert [c["config"] for c in candidates] == [c.to_dict() for c in space]
    assert [c["batch"] for c in candidates] == [i // 2 for i in range(len(space))]  # batches of 2, in order
    for c in candidates:
        assert c["status"] == "ok" and c["compiles"] == 1 and c["error"] is not None
        assert len(c["timing"]["samples_s"]) == 2 and c["timing"]["median_s"] > 0
    assert lines[-1]["winner"] == first.entry.config and lines[-1]["interrupted"] is False
    assert first.resumed == 0 and first.entry.search["resumed"] == 0 and first.entry.interrupted is False

    before = backend_compiles()
    again = run_sweep(_request(profile_dir=tmp_path))
    compiled = backend_compiles() - before
    search = again.entry.search
    assert again.resumed == search["resumed"] == len(space) and again.log_path == log
    # only the finalists came back to be compiled: the fastest 4 and the default, at most
    assert compiled == search["recompiled_finalists"] and 1 <= compiled <= min(len(space), 5)
    assert again.entry.candidates["tried"] == len(space) and again.entry.config in [c.to_dict() for c in space]
    assert [c.index for c in again.candidates] == list(range(len(space))) and again.candidates[0].is_default
    assert [c.batch for c in again.candidates] == [i // 2 for i in range(len(space))]  # restored rounds pair as logged
    assert [x["type"] for x in _raw_lines(log)].count("candidate") == len(space)  # nothing was run again
    kinds = [x["type"] for x in _raw_lines(log)]
    assert kinds.count("header") == 1 and kinds.count("run") == 1 and kinds.count("final") == 2

    fresh = run_sweep(_request(profile_dir=tmp_path, fresh=True))
    assert fresh.resumed == 0 and fresh.entry.search["recompiled_finalists"] == 0
    kinds = [x["type"] for x in _raw_lines(log)]
    assert kinds == ["header"] + ["candidate"] * len(space) + ["final"]


def test_keyboard_interrupt_keeps_finished_candidates_and_writes_an_interrupted_entry(tmp_path):
    with pytest.raises(SweepInterrupted) as caught:  # during the second batch's timing rounds
        run_sweep(_request(profile_dir=tmp_path), InterruptAt("time", 2))
    e = caught.value
    assert isinstance(e, KeyboardInterrupt) and e.kept == 2
    assert "2 finished candidate(s) kept" in str(e) and "resume" in str(e) and str(e.log_path) in str(e)
    entry = read_table(tmp_path / "cpu" / "ragged_dot.json")["entries"][e.result.key]
    assert entry["interrupted"] is True and entry["candidates"]["tried"] == 2
    assert entry["search"]["stopped"] == "interrupted" and entry["default"]["median_s"] > 0
    log = _lines(e.log_path)
    assert [x["type"] for x in log] == ["header", "candidate", "candidate", "final"] and log[-1]["interrupted"]

    result = run_sweep(_request(profile_dir=tmp_path))  # resumes the two, measures the other two
    assert result.resumed == 2 and result.entry.interrupted is False and result.entry.candidates["tried"] == 4
    configs = [x["config"] for x in _lines(e.log_path, "candidate")]
    assert len(configs) == 4 and len({json.dumps(c) for c in configs}) == 4
    entry = read_table(tmp_path / "cpu" / "ragged_dot.json")["entries"][result.key]
    assert entry["interrupted"] is False


def test_interrupt_before_the_default_finished_writes_no_entry(tmp_path):
    with pytest.raises(SweepInterrupted) as caught:
        run_sweep(_request(profile_dir=tmp_path), InterruptAt("time", 0))
    assert caught.value.result is None and caught.value.kept == 0 and "no table entry" in str(caught.value)
    assert not (tmp_path / "cpu" / "ragged_dot.json").exists()


def test_an_interrupted_sweep_does_not_replace_a_complete_entry(tmp_path):
    complete = run_sweep(_request(profile_dir=tmp_path, max_candidates=2))
    with pytest.raises(SweepInterrupted) as caught:  # another sweep (strategy) of the same key, interrupted
        run_sweep(_request(profile_dir=tmp_path, strategy="random", budget=4), InterruptAt("time", 2))
    assert "complete entry already in" in str(caught.value)
    entry = read_table(tmp_path / "cpu" / "ragged_dot.json")["entries"][complete.key]
    assert entry["interrupted"] is False and entry["tuned_at"] == complete.entry.tuned_at


def test_torn_last_line_is_ignored_and_cut_before_appending(tmp_path):
    first = run_sweep(_request(profile_dir=tmp_path, max_candidates=3))
    log = first.log_path
    with open(log, "a") as f:  # a kill in the middle of writing a line
        f.write('{"type": "candidate", "index": 3, "config": {"tm": 256, "tk"')
    lines, _ = read_log(log)
    assert len([x for x in lines if x["type"] == "candidate"]) == 3
    again = run_sweep(_request(profile_dir=tmp_path, max_candidates=3))
    assert again.resumed == 3
    assert [x["type"] for x in _raw_lines(log)].count("candidate") == 3  # the torn tail is gone


def test_log_of_other_versions_is_set_aside(tmp_path):
    first = run_sweep(_request(profile_dir=tmp_path, max_candidates=2))
    lines = first.log_path.read_text().splitlines()
    header = json.loads(lines[0])
    header["versions"]["jax"] = "0.0.1"
    first.log_path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    again = run_sweep(_request(profile_dir=tmp_path, max_candidates=2))
    assert again.resumed == 0 and "versions changed" in again.entry.search["log_restarted"]
    assert first.log_path.with_suffix(".stale.jsonl").exists()


def test_one_writer_per_log(tmp_path):
    path = tmp_path / "x.jsonl"
    with SweepLog(path, {"identity": {"a": 1}}):
        with pytest.raises(MoeTuneError, match="another sweep is writing"):
            SweepLog(path, {"identity": {"a": 1}}).__enter__()
    with SweepLog(path, {"identity": {"a": 1}}) as log:  # released on exit
        assert log.restored == {}


def test_time_budget_stops_starting_new_candidates(tmp_path):
    result = run_sweep(_request(profile_dir=tmp_path, batch_size=1, time_budget_s=1e-3))
    assert result.entry.search["stopped"] == "time budget"
    assert result.entry.candidates["tried"] == 1 and result.candidates[0].is_default  # the default always runs


@pytest.mark.slow
def test_sigkilled_cli_sweep_resumes(tmp_path, isolated_profiles):
    """A real `moe-tune sweep` process is SIGKILLed once its log has candidate lines; the same sweep run again
    restores exactly those and measures the rest."""
    args = ["sweep", *MEDIUM, "--samples", "2", "--workers", "2"]
    sweeps = isolated_profiles / "cpu" / "sweeps" / "ragged_dot"
    proc = subprocess.Popen([sys.executable, "-m", "moe_tune.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        logged = []
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list(sweeps.glob("*.jsonl")) if sweeps.exists() else []
            if logs and (logged := _lines(logs[0], "candidate")):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        assert proc.wait(30) == -signal.SIGKILL, "the sweep finished or failed before it could be killed"
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its compile workers, should any be left
        except ProcessLookupError:
            pass
    (log,) = sweeps.glob("*.jsonl")
    logged = _lines(log, "candidate")
    assert 0 < len(logged) < 16 and not any(x["type"] == "final" for x in _lines(log))

    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"{len(logged)} candidates from the sweep log" in result.output and "16 tried" in result.output
    candidates = _lines(log, "candidate")
    assert len(candidates) == 16 and len({json.dumps(x["config"]) for x in candidates}) == 16
    assert candidates[: len(logged)] == logged  # what the killed run logged was kept as it was
    entry = read_table(isolated_profiles / "cpu" / "ragged_dot.json")["entries"]
    (entry,) = entry.values()
    assert entry["search"]["resumed"] == len(logged) and entry["interrupted"] is False


def test_cli_resume_fresh_and_usage_errors(isolated_profiles):
    runner = CliRunner()
    args = [*SMALL_CLI, "--samples", "2", "--workers", "1"]
    first = runner.invoke(cli, args, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    assert "grid: 4 of 4 candidates" in first.output and "0 candidates from the sweep log" in first.output
    assert "sweep log" in first.output and "strategy grid" in first.output
    again = runner.invoke(cli, args, catch_exceptions=False)
    assert "4 candidates from the sweep log" in again.output
    fresh = runner.invoke(cli, [*args, "--fresh"], catch_exceptions=False)
    assert fresh.exit_code == 0 and "0 candidates from the sweep log" in fresh.output

    for extra, message in [(["--budget", "0"], "budget must be at least 1"),
                           (["--time-budget", "0"], "time budget must be a positive"),
                           (["--strategy", "random"], "needs a budget")]:
        bad = runner.invoke(cli, [*args, *extra], catch_exceptions=False)
        assert bad.exit_code == 2 and message in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output


def test_cli_ctrl_c_exits_130_with_what_was_kept(isolated_profiles, monkeypatch):
    from moe_tune.tuner import measure

    real = measure.time_batch

    def interrupt_after_first_batch(state, batch):
        real(state, batch)  # its candidates are logged as it returns; what it did (its Step) is lost
        raise KeyboardInterrupt

    monkeypatch.setattr(measure, "time_batch", interrupt_after_first_batch)
    args = [*SMALL_CLI, "--samples", "2", "--workers", "1"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 130
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("interrupted: 4 finished candidate(s) kept in ") and "run the same sweep again" in last
    assert "an interrupted entry" in last
    (entry,) = read_table(isolated_profiles / "cpu" / "ragged_dot.json")["entries"].values()
    assert entry["interrupted"] is True and entry["candidates"]["tried"] == 4


def test_the_sweeps_settings_are_one_record_in_header_identity_and_entry(tmp_path):
    """The log's header, the identity its name hashes and the entry's `search` take the same settings."""
    result = run_sweep(_request(profile_dir=tmp_path, max_candidates=2, strategy="random", budget=2,
                             time_budget_s=600.0))
    header = _lines(result.log_path)[0]
    for name in ("strategy", "budget", "time_budget_s", "max_candidates", "space", "batch_size"):
        assert header["spec"][name] == result.entry.search[name], name
    for name in ("seed", "samples", "race", "strategy", "budget", "max_candidates"):
        assert header["identity"][name] == header["spec"][name], name
    assert header["identity"]["key"] == header["key"] == result.key == result.entry.key
    assert result.entry.search["strategy"] == "random" and result.entry.search["space"] == 2


DATA = os.path.join(os.path.dirname(__file__), "data", "sweep_log_v1")


@pytest.mark.parametrize("shape, settings", [
    ({"m": 32, "k": 32, "n": 32, "groups": 2}, {}),  # the whole space (4 candidates)
    ({"m": 64, "k": 64, "n": 64, "groups": 4}, {"max_candidates": 3}),  # its table is in DATA too
])
def test_a_log_written_before_the_tuner_was_reshaped_resumes_unchanged(tmp_path, shape, settings):
    """tests/data/sweep_log_v1: finished sweeps' logs (and one table), written by the code before the typed
    settings and request and the stages' steps. The same sweep asked now finds its log by the same name
    (the identity hashes the same), restores every candidate of the log it still has (all of them, unless
    `max_candidates` now picks others), and runs none of them again; the table reads."""
    from pathlib import Path

    from moe_tune.kernels import get_op
    from moe_tune.profiles.entry import Entry
    from moe_tune.profiles.entry import entry_versions
    from moe_tune.tuner.request import config_key
    from moe_tune.tuner.request import SweepPlan

    [(key, old_entry)] = read_table(Path(DATA) / "table_ragged_dot.json")["entries"].items()
    assert Entry.from_json(old_entry, key).config == {"tm": 32, "tk": 64, "tn": 64, "tail": 16, "batched": True,
                                                       "dequantize": False}
    problem = get_op("ragged_dot").problem(**shape)
    request = SweepRequest.make("ragged_dot", problem, backend="tiled", samples=1, workers=1, profile_dir=tmp_path,
                                **settings)
    log = log_path_for(request)
    old_log = Path(DATA) / log.name
    assert old_log.exists()  # the log's name and identity hash did not change
    lines = [json.loads(line) for line in old_log.read_text().splitlines()]
    # another installed JAX (or moe-tune) version sets a log aside by design: the versions are this
    # machine's, everything the code computes (identity, key, settings) is the old log's own
    lines[0]["versions"] = entry_versions(BACKENDS.get("tiled"))
    log.parent.mkdir(parents=True)
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    logged = {config_key(x["config"]) for x in lines if x["type"] == "candidate"}
    kept = logged & {config_key(c.to_dict()) for c in SweepPlan(request).space}
    if not settings:
        assert kept == logged and len(kept) == 4

    result = run_sweep(request)
    assert result.resumed == result.entry.search["resumed"] == len(kept) >= 1  # the default at least
    assert result.entry.key == problem_key(result) and result.entry.search["log_restarted"] is None
    after, _ = read_log(log)
    assert after[: len(lines)] == lines  # appended to, never rewritten
    new = after[len(lines):]
    assert new[0]["type"] == "run" and new[0]["restorable"] == len(logged) and new[-1]["type"] == "final"
    measured = [config_key(x["config"]) for x in new if x["type"] == "candidate" and not x.get("recompiled")]
    assert not set(measured) & logged  # nothing the log holds ran again
    if not settings:
        assert measured == [] and new[-1]["candidates"] == new[-1]["resumed"] == 4


def problem_key(result) -> str:
    """The key the old log's header names (what the sweep is tuned under)."""
    [header] = [x for x in read_log(result.log_path)[0] if x["type"] == "header"]
    return header["key"]
