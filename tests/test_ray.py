"""Campaigns on Ray, on the shared local Ray of the test session (`local_ray`: 2 CPUs, 2 fake GPUs that the
tasks are scheduled on while they run on the CPU): real tiny sweeps, one per task."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FAKE_GPUS

from moe_tune.campaign.request import Case, plan, split_done
from moe_tune.layer.models import ModelPreset, layer_cases
from moe_tune.tuner import SweepSettings

# gate/up and down have the same problems (hidden == expert width): 5 sweeps for the layer's 8 kernel cases
SQUARE = ModelPreset(name="square", hidden=64, expert_intermediate=64, experts=4, top_k=2, shared_experts=0)
FAST = SweepSettings(distribution="balanced", samples=1, max_candidates=2, workers=1, finalists=1)


def fake_gpu():
    """One fake GPU per sweep; the task must see one CPU device (the platform it really runs on)."""
    from moe_tune.campaign.ray_runner import Accelerator

    return Accelerator("cpu", {"num_gpus": 1, "num_cpus": 0}, "GPU")


class Recorder:
    """A `CampaignReporter` that keeps what it was shown."""

    def __init__(self):
        self.snapshots, self.outcomes = [], []

    def running(self, sweeps):
        self.snapshots.append({key: dict(state) for key, state in sweeps.items()})

    def finished(self, outcome):
        self.outcomes.append(outcome)


def gpu_ids(device) -> list[str]:
    return device["accelerator_ids"]["GPU"]


def entries(profile_dir: Path) -> dict[str, dict]:
    """Every entry of every table under `profile_dir`, by key."""
    found = {}
    for table in profile_dir.glob("cpu/*.json"):
        found.update(json.loads(table.read_text())["entries"])
    return found


def test_a_model_sweep_on_ray_writes_what_the_sequential_sweep_writes(local_ray, tmp_path, isolated_profiles):
    from moe_tune.campaign.ray_runner import run_on_ray
    from moe_tune.campaign.runner import run_here

    sequential = tmp_path / "sequential"
    cases = [Case(c.op, c.problem, c.role) for _, c in layer_cases(SQUARE, [8], ep=2, dtype="float32")]
    sweeps = plan(cases, platform="cpu", distribution="balanced")
    run_here(sweeps, replace(FAST, profile_dir=sequential))
    shown = Recorder()
    outcomes = run_on_ray(sweeps, replace(FAST, profile_dir=isolated_profiles), fake_gpu(), reporter=shown)

    assert len(sweeps) == 5 and [o.error for o in outcomes] == [None] * 5
    on_ray, alone = entries(isolated_profiles), entries(sequential)
    assert sorted(on_ray) == sorted(alone) == sorted(s.key for s in sweeps)
    for key, entry in on_ray.items():
        tried = sorted(json.dumps(r["config"]) for r in entry["results"] + entry["failures"])
        assert tried == sorted(json.dumps(r["config"]) for r in alone[key]["results"] + alone[key]["failures"])
        assert entry["fields"] == alone[key]["fields"]
        [record] = entry["provenance"]  # where it ran: the host and the one (fake) GPU Ray gave the task
        assert record["won"] and record["hostname"] and len(record["accelerator_ids"]["GPU"]) == 1
    # the sweep logs are in the driver's profile dir, where a sequential sweep keeps them
    assert len(list(isolated_profiles.glob("cpu/sweeps/*/*.jsonl"))) == 5

    # at most one sweep per (fake) accelerator at a time, each on its own, and they did run side by side
    assert all(len(gpu_ids(o.device)) == 1 for o in outcomes)
    concurrent = [[gpu_ids(s["device"])[0] for s in snap.values() if s.get("device")] for snap in shown.snapshots]
    assert max(map(len, concurrent)) == FAKE_GPUS
    assert all(len(ids) == len(set(ids)) <= FAKE_GPUS for ids in concurrent)


def faulty_sweep(request, reporter=None, *, on_log=None, marker: str):
    """`run_sweep` with faults: ragged_gather raises; ragged_dot's process dies (os._exit) right after its
    first finished candidate reached the driver, the first time only (`marker` remembers)."""
    from moe_tune.tuner import run_sweep

    if request.op == "ragged_gather":
        raise RuntimeError("injected failure")
    if request.op == "ragged_dot" and not os.path.exists(marker):
        def dies(data: bytes) -> None:
            on_log(data)
            if b'"type": "candidate"' in data:
                Path(marker).touch()
                os._exit(3)

        return run_sweep(request, reporter, on_log=dies)
    return run_sweep(request, reporter, on_log=on_log)


def tiny_cases() -> list[Case]:
    from moe_tune.kernels import get_op

    gather = {"tokens": 16, "hidden": 64, "top_k": 2, "experts": 4}
    return [Case("ragged_dot", get_op("ragged_dot").problem(m=64, k=64, n=64, groups=4, dtype="float32"), "dot"),
            Case("ragged_gather", get_op("ragged_gather").problem(**gather, ep=2), "dispatch"),
            Case("dense_gather_reduce", get_op("dense_gather_reduce").problem(**gather), "combine")]


def test_a_task_that_raises_is_recorded_and_a_dead_one_resumes(local_ray, tmp_path, isolated_profiles):
    from moe_tune.campaign.ray_runner import run_on_ray

    sweeps = plan(tiny_cases(), platform="cpu", distribution="balanced")
    settings = replace(FAST, batch_size=1, profile_dir=isolated_profiles)
    outcomes = run_on_ray(sweeps, settings, fake_gpu(),
                          sweep_fn=functools.partial(faulty_sweep, marker=str(tmp_path / "died")))
    by_op = {o.sweep.op: o for o in outcomes}
    failed = by_op["ragged_gather"]
    assert "injected failure" in failed.error and failed.entry is None and len(gpu_ids(failed.device)) == 1
    assert by_op["dense_gather_reduce"].error is None
    dot = by_op["ragged_dot"]
    assert (tmp_path / "died").exists() and dot.error is None and dot.attempts == 2
    assert dot.resumed >= 1 and dot.entry.candidates["tried"] == 2
    [log] = isolated_profiles.glob("cpu/sweeps/ragged_dot/*.jsonl")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    measured = [json.dumps(x["config"]) for x in lines if x["type"] == "candidate" and not x.get("recompiled")]
    assert len(measured) == len(set(measured)) == 2  # nothing the first attempt finished ran again
    assert [x["restorable"] for x in lines if x["type"] == "run"] == [dot.resumed]
    assert sorted(entries(isolated_profiles)) == sorted(s.key for s in sweeps if s.op != "ragged_gather")


DRIVER = """
import sys
import ray
from moe_tune.campaign.request import plan
from dataclasses import replace
from moe_tune.campaign.ray_runner import run_on_ray
from test_ray import FAST, fake_gpu, tiny_cases

ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
settings = replace(FAST, profile_dir=sys.argv[2])
run_on_ray(plan(tiny_cases(), platform="cpu", distribution="balanced"), settings, fake_gpu())
"""


def test_a_restarted_driver_skips_what_is_done(local_ray, isolated_profiles):
    """A driver on the session's Ray is killed (SIGKILL) once it has written its first entry; a new driver
    plans the same campaign, skips what the table holds, and runs the rest."""
    from moe_tune.campaign.ray_runner import run_on_ray

    address = local_ray.get_runtime_context().gcs_address
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, address, str(isolated_profiles)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 120
        while not entries(isolated_profiles) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        driver.kill()
        driver.wait()
    written = entries(isolated_profiles)
    assert written, f"the driver wrote nothing (exit {driver.returncode})"

    sweeps = plan(tiny_cases(), platform="cpu", distribution="balanced")
    todo, done = split_done(sweeps, profile_dir=isolated_profiles, device_kind="cpu")
    assert sorted(s.key for s in done) == sorted(written) and len(todo) == 3 - len(written)
    outcomes = run_on_ray(todo, replace(FAST, profile_dir=isolated_profiles), fake_gpu())
    assert [o.error for o in outcomes] == [None] * len(todo)
    after = entries(isolated_profiles)
    assert sorted(after) == sorted(s.key for s in sweeps)
    assert all(after[key]["tuned_at"] == entry["tuned_at"] for key, entry in written.items())  # not swept again


def test_a_task_on_the_wrong_platform_fails_loudly(local_ray):
    from moe_tune.campaign.ray_runner import Accelerator, DeviceMismatch, probe

    with pytest.raises(DeviceMismatch, match="exactly one gpu device"):
        probe(Accelerator("gpu", {"num_gpus": 1, "num_cpus": 0}, "GPU"))


def test_local_never_attaches_to_another_cluster(monkeypatch):
    import ray

    from moe_tune.campaign import ray_runner

    seen = []
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setattr(ray, "init", lambda address, **_: seen.append((address, os.environ.get("RAY_ADDRESS"))))
    ray_runner.connect("local")
    ray_runner.connect("10.0.0.2:6379")
    assert seen == [("local", None), ("10.0.0.2:6379", "10.0.0.1:6379")]
    assert os.environ["RAY_ADDRESS"] == "10.0.0.1:6379"


def test_importing_the_cli_does_not_import_ray():
    code = "import sys, moe_tune, moe_tune.cli, moe_tune.campaign.runner; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.strip() == "False"


def test_progress_shows_one_line_per_running_sweep_and_the_count():
    from rich.console import Console
    from rich.progress import Progress

    from moe_tune.campaign.request import SweepOutcome
    from moe_tune.commands.render import CampaignProgress

    sweeps = plan(tiny_cases(), platform="cpu", distribution="balanced")
    bars = Progress(console=Console(file=open(os.devnull, "w")))
    shown = CampaignProgress(bars, sweeps)
    device = {"host": "node1", "device": "cpu:0", "accelerator_ids": {"GPU": ["1"]}}
    shown.running({sweeps[0].key: {"device": device, "stage": "time", "completed": 3, "total": 8},
                   sweeps[1].key: {"device": device, "stage": None}})
    lines = {t.description: (t.completed, t.total) for t in bars.tasks}
    assert lines == {"sweeps done": (0, 3), f"{sweeps[0].label} on node1 GPU 1: Timing (trace rounds)": (3, 8),
                     f"{sweeps[1].label} on node1 GPU 1: starting": (0, None)}
    shown.finished(SweepOutcome(sweeps[1], error="boom"))
    shown.running({sweeps[0].key: {"device": device, "stage": "finalists", "completed": 1, "total": 2}})
    assert {t.description: t.completed for t in bars.tasks} == {
        "sweeps done": 1, f"{sweeps[0].label} on node1 GPU 1: Re-timing finalists": 1}


def test_tasks_compile_into_the_drivers_compile_cache(local_ray, tmp_path, isolated_profiles, monkeypatch):
    """A task turns JAX's persistent compilation cache on, in the dir the driver's
    `$MOE_TUNE_COMPILE_CACHE_DIR` names (the session's Ray workers started before the test set it)."""
    from moe_tune.campaign.ray_runner import run_on_ray

    cache = tmp_path / "jax_cache"
    monkeypatch.setenv("MOE_TUNE_COMPILE_CACHE_DIR", str(cache))
    [dispatch] = [s for s in plan(tiny_cases(), platform="cpu", distribution="balanced") if s.op == "ragged_gather"]
    [outcome] = run_on_ray([dispatch], replace(FAST, profile_dir=isolated_profiles), fake_gpu())
    assert outcome.error is None and any(cache.iterdir())


@pytest.mark.parametrize("resources, workers, reserved", [
    ({"GPU": 8, "CPU": 64}, 4, ("GPU", 4)),  # the sweep's compile workers
    ({"GPU": 8, "CPU": 16}, 16, ("GPU", 2)),  # an even share of the CPUs per GPU: no GPU left idle
    ({"GPU": 8, "CPU": 4}, 16, ("GPU", 1)),  # at least one
    ({"TPU": 4, "CPU": 96}, 8, ("TPU", 8)),
    ({"CPU": 2}, 16, (None, 2)),  # CPU sweeps: at most the cluster's CPUs
])
def test_a_task_reserves_its_compile_workers_cpus(monkeypatch, resources, workers, reserved):
    import ray

    from moe_tune.campaign import ray_runner

    monkeypatch.setattr(ray, "cluster_resources", lambda: resources)
    accelerator = ray_runner.detect_accelerator(cpus_per_sweep=workers)
    assert (accelerator.assigned, accelerator.resources["num_cpus"]) == reserved
