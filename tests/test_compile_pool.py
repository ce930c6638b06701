"""The compile pool's worker assignment, with fake workers (no compiler starts): one GPU target per process."""

from __future__ import annotations

import pytest

from moe_tune.targets import jobs as jobs_module
from moe_tune.targets.compile import CompileResult
from moe_tune.targets.jobs import CompileJob, CompilePool
from moe_tune.workers import pool as pool_module


class _FakeWorker:
    """Records the targets it compiled for; `call` answers at once."""

    started: list["_FakeWorker"] = []

    def __init__(self, command, env) -> None:
        self.key = None
        self.targets: list[str] = []
        self.closed = False
        _FakeWorker.started.append(self)

    alive = lambda self: not self.closed  # noqa: E731
    serves = pool_module.Worker.serves

    def call(self, fn, job, timeout=None, shared=None, on_progress=None):
        assert fn == "moe_tune.targets.jobs:compile_job"
        self.targets.append(job.target)
        return CompileResult(job.target, "compiled", "", "compile")

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_workers(monkeypatch):
    _FakeWorker.started = []
    monkeypatch.setattr(pool_module, "Worker", _FakeWorker)
    monkeypatch.setattr(jobs_module.wheels, "require", lambda platform: None)
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
    assert all(w.closed for w in fake_workers)  # the one replaced, and the last one by `close`


def test_a_job_that_kills_or_hangs_its_worker_is_a_crash_and_one_that_cannot_start_stops(fake_workers, monkeypatch):
    fatal = ("I1125 14:35:55.000001    8580 cuda_executor.cc:1] could not find cuda drivers\n"
             "E1125 14:35:56.083957    8580 ptx_compiler.cc:460] LLVM ERROR: fatal: cannot select\n"
             "*** SIGABRT received, stack trace ***\n@ 0x7f frame\n")
    failures = {"h100": pool_module.WorkerFailure("died", returncode=-6, output=fatal),
                "a100": pool_module.WorkerFailure("timeout", timeout=300.0)}
    monkeypatch.setattr(_FakeWorker, "call", _failing(failures, _FakeWorker.call))
    jobs = [CompileJob(target, "ragged_dot", "xla", None, None) for target in ("h100", "a100", "v5e")]
    with CompilePool(workers=1, timeout=300.0) as pool:
        died, hung, fine = pool.compile(jobs)
    assert (died.status, died.message) == ("crashed", "the compiling process died (signal SIGABRT): LLVM ERROR: "
                                                      "fatal: cannot select")
    assert (hung.status, hung.message) == ("crashed", "the compiling process died (signal SIGKILL): timed out "
                                                      "after 300 s")
    assert fine.status == "compiled"
    assert len(fake_workers) == 3  # each dead or killed worker replaced (a100 and h100 apart in any case)

    failures["v5e"] = pool_module.WorkerFailure("died", returncode=1, output="ImportError: no libtpu here\n",
                                                started=False)
    with CompilePool(workers=1) as pool, pytest.raises(RuntimeError, match="did not start: ImportError: no libtpu"):
        pool.compile(jobs[2:])


def _failing(failures, call):
    def fail_or_call(self, fn, job, **kwargs):
        if job.target in failures:
            raise failures[job.target]
        return call(self, fn, job, **kwargs)

    return fail_or_call
