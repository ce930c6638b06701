"""Candidates that crash, hang or run out of memory when RUN take down only their worker: real sweeps record
them as failed at stage "run" with the reason, restart the worker and go on; a good candidate wins, and the
pool keeps serving the next sweep. Nothing of a bad candidate runs, or even compiles, in this process."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from faulty_backend import FaultyConfig, FaultyRaggedDot

from moe_tune.core import devices
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.tuner import SweepRequest, run_sweep
from moe_tune.tuner import candidate as inputs, compiling as workers
from moe_tune.tuner.compiling import backend_compiles
from moe_tune.workers import protocol

TINY = RaggedDotProblem(m=128, k=64, n=64, groups=4)
# Per-candidate deadline (compile + first run). A tiny good candidate takes about a second (several on a loaded
# 2-core machine, with a worker restarting beside it); hang_run sleeps for an hour, so only a real hang
# reaches the deadline, and only the hung candidate pays for its length.
TIMEOUT_S = 20.0
MEMORY_LIMIT = 8 << 30  # RLIMIT_AS of the workers here: far above what they use, far below oom_run's 1e13 bytes


@pytest.fixture(scope="module", autouse=True)
def limited_workers():
    """On CPU, fresh workers whose address space is capped, so that oom_run's allocation fails cleanly
    whatever the machine's overcommit policy; the next module gets fresh uncapped ones. (A GPU refuses
    the allocation by itself, and its runtime reserves more address space than any such cap allows.)"""
    patch = pytest.MonkeyPatch()
    if devices.platform() == "cpu":
        patch.setenv(workers.MEMORY_LIMIT_ENV, str(MEMORY_LIMIT))
    workers.close_pools()
    yield
    patch.undo()
    workers.close_pools()


@pytest.fixture
def faulty(monkeypatch):
    backend = BACKENDS.register(FaultyRaggedDot())
    monkeypatch.setattr(FaultyRaggedDot, "default_config", lambda self, p: FaultyConfig("good", 64))
    yield backend
    BACKENDS.unregister(backend.name)


def _sweep(backend, monkeypatch, tmp_path, modes):
    monkeypatch.setattr(FaultyRaggedDot, "candidate_values", lambda self, p: {"mode": list(modes), "tm": [32]})
    return run_sweep(SweepRequest.make("ragged_dot", TINY, backend=backend.name, samples=1, finalists=1, workers=2,
                                       compile_timeout_s=TIMEOUT_S, profile_dir=tmp_path))


REASONS = {
    "crash_run": ["worker died (SIGABRT, signal 6) running the candidate"],
    "hang_run": [f"worker hung: timed out after {TIMEOUT_S:g} s running the candidate"],
    "oom_run": ["out of memory: ", "RESOURCE_EXHAUSTED"],
    "sigkill_run": ["out of memory: worker died (SIGKILL, signal 9) running the candidate", "OOM killer"],
}


# hang_run pays the whole deadline: it runs once, in `test_every_kind_of_failure_in_one_sweep`, which checks
# everything this test checks of each failure.
@pytest.mark.parametrize("bad", [mode for mode in REASONS if mode != "hang_run"])
def test_run_time_failure_is_recorded_and_the_sweep_goes_on(faulty, monkeypatch, tmp_path, bad):
    before = backend_compiles()
    result = _sweep(faulty, monkeypatch, tmp_path, ["good", bad, "good"])
    assert backend_compiles() == before  # every candidate compiled (and the bad one ran) in a worker only

    modes = [c.config.mode for c in result.candidates]
    assert modes == ["good", "good", bad]  # the default (good, tm=64), then the space: good and bad at tm=32
    failed = result.candidates[2]
    assert (failed.status, failed.stage) == ("failed", "run"), failed
    assert all(part in failed.reason for part in REASONS[bad]), failed.reason
    assert failed.compiles == 1 and failed.executable is None and failed.timing is None
    assert all(c.status == "ok" and c.compiles == 1 and c.timing is not None for c in result.candidates[:2])
    assert result.entry.config["mode"] == "good"
    assert result.entry.candidates["failed"] == 1
    assert result.entry.failures == [failed.record()] and result.entry.failures[0]["stage"] == "run"

    # The pool (one worker of it restarted) serves the next sweep.
    again = _sweep(faulty, monkeypatch, tmp_path, ["good"])
    assert [c.status for c in again.candidates] == ["ok", "ok"]


def test_every_kind_of_failure_in_one_sweep(faulty, monkeypatch, tmp_path):
    """Both workers die or hang, over and over, and the good candidates (one last in line) still make it: each
    failure is recorded at stage "run" with its reason (the hang as a hang, once the deadline passed), nothing
    of them compiled or ran in this process, and the pool serves the next sweep."""
    before = backend_compiles()
    result = _sweep(faulty, monkeypatch, tmp_path, ["crash_run", "oom_run", "hang_run", "sigkill_run", "good"])
    assert backend_compiles() == before
    status = {c.config.mode: (c.status, c.stage) for c in result.candidates if c.config.tm == 32}
    assert status == {"crash_run": ("failed", "run"), "oom_run": ("failed", "run"), "hang_run": ("failed", "run"),
                      "sigkill_run": ("failed", "run"), "good": ("ok", "")}
    assert result.entry.config["mode"] == "good" and result.entry.candidates["ok"] == 2
    for failed in result.candidates:
        if failed.status == "failed":
            assert all(part in failed.reason for part in REASONS[failed.config.mode]), failed.reason
            assert failed.compiles == 1 and failed.executable is None and failed.timing is None
    assert sorted(f["reason"] for f in result.entry.failures) == sorted(
        c.reason for c in result.candidates if c.status == "failed")
    again = _sweep(faulty, monkeypatch, tmp_path, ["good"])
    assert [c.status for c in again.candidates] == ["ok", "ok"]


def _shares_sent(monkeypatch) -> list:
    """The shared payloads the requests sent from now on carry (a `inputs.Stored`, or None)."""
    sent = []
    pack = protocol.pack
    monkeypatch.setattr(protocol, "pack", lambda obj: (sent.append(obj[2]), pack(obj))[1])
    return sent


def test_shared_payload_goes_to_each_worker_once_and_errors_keep_the_worker(monkeypatch):
    sent = _shares_sent(monkeypatch)
    payload = np.arange(250_000, dtype=np.float32)  # 1 MB
    token = uuid.uuid4().hex
    answers = {}
    pool = workers.pool(2)
    pool.map("moe_tune.tuner.compiling:shared", [(i, (token,)) for i in range(6)],
             lambda tag, status, value: answers.__setitem__(tag, (status, value)), timeout=60, shared=(token, payload))
    assert all(status == "ok" and np.array_equal(value, payload) for status, value in answers.values())
    shares = [s for s in sent if s is not None]
    assert 1 <= len(shares) <= 2  # once per worker, not once per request; written to one file, once
    assert len({s[1] for s in shares}) == 1 and all(isinstance(s[1], inputs.Stored) for s in shares)

    pids = pool.pids()
    pool.map("moe_tune.tuner.compiling:shared", [(0, ("no such token",))],
             lambda tag, status, value: answers.__setitem__(tag, (status, value)), timeout=60)
    status, failure = answers[0]
    assert status == "failed" and failure.kind == "error" and "KeyError" in failure.message
    assert pool.pids() == pids  # a function that raised does not cost its worker


def test_a_sweep_in_chunks_sends_its_inputs_to_each_worker_once(monkeypatch):
    """compile_all called chunk by chunk with the same inputs: each worker gets them with its first request,
    later requests carry only a token; each candidate's error against the reference comes back for check_all."""
    import jax

    from moe_tune.kernels import get_op
    from moe_tune.tuner.candidate import Candidate, Reference, check_all
    from moe_tune.tuner.compiling import Kernel, compile_all

    sent = _shares_sent(monkeypatch)
    op, backend = get_op("ragged_dot"), BACKENDS.get("tiled")
    host = op.make_inputs(TINY, "balanced", 0)
    inputs = jax.device_put(host)
    cands = [Candidate(i, cfg) for i, cfg in enumerate(backend.search_space(TINY)[:4])]
    reference = Reference.of(op.reference(TINY, host))
    for chunk in (cands[:2], cands[2:]):
        compile_all(Kernel(op, backend, TINY), chunk, inputs, reference, workers=2, timeout=60)
    assert all(c.status == "ok" and c.worker_error is not None for c in cands)
    assert 1 <= sum(s is not None for s in sent) <= 2
    check_all(cands, inputs, reference, op.tolerance(TINY))
    assert all(c.status == "ok" and c.worker_error is None and c.error is not None for c in cands)


def test_with_a_reference_the_worker_compares_and_only_the_error_comes_back():
    """Given the sweep's reference (sent once per worker with the inputs), a worker compares each output with
    it: the error comes back instead of the output, check_all judges by it without running the candidate
    here, and a wrong output is caught all the same."""
    import jax

    from moe_tune.kernels import get_op
    from moe_tune.kernels.kernel_op import relative_error
    from moe_tune.tuner.candidate import Candidate, Reference, check_all
    from moe_tune.tuner.compiling import Kernel, compile_all

    op, backend = get_op("ragged_dot"), BACKENDS.get("tiled")
    host = op.make_inputs(TINY, "balanced", 0)
    inputs, expected = jax.device_put(host), op.reference(TINY, host)
    cands = [Candidate(i, cfg) for i, cfg in enumerate(backend.search_space(TINY)[:2])]
    compile_all(Kernel(op, backend, TINY), cands, inputs, workers=2, timeout=60, reference=Reference.of(expected))
    assert all(c.status == "ok" and c.worker_error is not None for c in cands)
    errors = [c.worker_error for c in cands]
    assert errors == pytest.approx([relative_error(np.asarray(c.executable(inputs)), expected) for c in cands])
    for c in cands:
        c.executable = None  # judged by the worker's error: nothing runs here
    check_all(cands[:1], inputs, Reference.of(expected), op.tolerance(TINY))
    check_all(cands[1:], inputs, Reference.of(expected + 1.0), op.tolerance(TINY))  # ignored: judged in the worker
    assert cands[0].status == "ok" and cands[0].error == errors[0] and cands[0].worker_error is None
    assert cands[1].status == "ok"
    wrong = [Candidate(9, backend.search_space(TINY)[0])]
    compile_all(Kernel(op, backend, TINY), wrong, inputs, workers=2, timeout=60, reference=Reference.of(expected + 1.0))
    check_all(wrong, inputs, Reference.of(expected + 1.0), op.tolerance(TINY))
    assert wrong[0].status == "wrong" and wrong[0].stage == "check" and "relative error" in wrong[0].reason


def test_map_calls_back_on_the_callers_thread_and_an_error_there_stops_the_rest():
    """The callbacks run on the caller's thread (the workers go on meanwhile); one that raises stops the
    requests not yet started, and the error reaches the caller."""
    import threading
    import time

    token = uuid.uuid4().hex
    pool = workers.pool(2)
    seen = []
    pool.map("moe_tune.tuner.compiling:shared", [(i, (token,)) for i in range(4)],
             lambda tag, status, value: seen.append((tag, status, value, threading.current_thread())),
             timeout=60, shared=(token, 7))
    assert sorted(tag for tag, *_ in seen) == [0, 1, 2, 3]
    assert all(status == "ok" and value == 7 and thread is threading.main_thread() for _, status, value, thread in seen)

    called = []

    def fail(tag, status, value):
        called.append(tag)
        raise ValueError("stop here")

    with pytest.raises(ValueError, match="stop here"):
        pool.map("moe_tune.tuner.compiling:shared", [(i, (token,)) for i in range(50)], fail, timeout=60,
                 shared=(token, 7))
    assert len(called) == 1
    deadline = time.monotonic() + 30
    while pool._idle.qsize() < 2 and time.monotonic() < deadline:  # the requests in flight finish
        time.sleep(0.05)
    assert pool._idle.qsize() == 2
