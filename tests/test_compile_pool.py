"""The compile pool's worker assignment, with fake workers (no compiler starts): one GPU target per process."""

from __future__ import annotations

import pytest

from moe_tune.targets import pool as pool_module
from moe_tune.targets.compile import CompileResult
from moe_tune.targets.pool import CompileJob, CompilePool


class _FakeWorker:
    """Records the targets it compiled for; `run` answers at once."""

    started: list["_FakeWorker"] = []

    def __init__(self) -> None:
        self.gpu_target = None
        self.targets: list[str] = []
        self.closed = False
        _FakeWorker.started.append(self)

    alive = property(lambda self: not self.closed)
    serves = pool_module._Worker.serves

    def run(self, job_id, job, timeout):
        self.targets.append(job.target)
        return CompileResult(job.target, "compiled", "", "compile")

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_workers(monkeypatch):
    _FakeWorker.started = []
    monkeypatch.setattr(pool_module, "_Worker", _FakeWorker)
    monkeypatch.setattr(pool_module.wheels, "require", lambda platform: None)
    return _FakeWorker.started


def test_each_gpu_target_gets_its_own_process_and_tpu_targets_share_one(fake_workers):
    jobs = [CompileJob(target, "ragged_dot", "xla", None, None)
            for target in ("h100", "v5e", "b200", "h100", "v6e", "b200")]
    with CompilePool(workers=1) as pool:
        results = pool.compile(jobs)
    assert [r.target for r in results] == [job.target for job in jobs]  # answers stay in the jobs' order
    gpu_sets = [{t for t in w.targets if t in ("h100", "b200")} for w in fake_workers]
    assert all(len(targets) <= 1 for targets in gpu_sets)
    assert sorted(t for w in fake_workers for t in w.targets) == sorted(job.target for job in jobs)
    assert len(fake_workers) == 2  # one target's jobs run together: b200's worker, then h100's (with the TPUs)
