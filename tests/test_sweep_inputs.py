"""A sweep's inputs made while its first compiles run (FINDINGS.md: warm start): the compile workers get requests
before the payload (inputs, reference) exists and ask for it once they need it; the inputs and reference are
the op's, with one host copy (views of the device copy); the reference runs on one BLAS thread."""

from __future__ import annotations

import threading
import time
import uuid

import jax
import numpy as np
import pytest

from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import RaggedDotProblem
from moe_tune.tuner import candidate as inputs, compiling as workers
from moe_tune.tuner.candidate import SweepInputs
from moe_tune.workers import protocol
from moe_tune.workers.pool import Deferred

TINY = RaggedDotProblem(m=128, k=64, n=64, groups=4)


def _requests_sent(monkeypatch, on_request=None) -> list:
    """What the pool writes to its workers: requests (fn, args, share) and deferred payloads."""
    sent, pack = [], protocol.pack

    def spy(obj):
        sent.append(obj)
        if on_request is not None and isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], str):
            on_request(obj)
        return pack(obj)

    monkeypatch.setattr(protocol, "pack", spy)
    return sent


def test_a_deferred_payload_reaches_workers_that_started_before_it_was_made(monkeypatch):
    """The requests go out with `DEFERRED` before the payload is made; each worker asks once, the payload is
    written to its file once, and the wait (longer than the timeout) does not count against the request."""
    payload = np.arange(250_000, dtype=np.float32)
    made = threading.Event()

    def first_request(request):  # made only after a worker holds a request without it
        if request[2] is not None and request[2][1] == protocol.DEFERRED and not made.is_set():
            threading.Timer(1.5, made.set).start()

    pool, token, answers = workers.pool(2), uuid.uuid4().hex, {}
    pool.map("moe_tune.tuner.compiling:progress", [(i, (None,)) for i in range(2)], lambda *a: None)  # started
    sent = _requests_sent(monkeypatch, first_request)
    deferred = Deferred(lambda: (made.wait(60), payload)[1], made.is_set)
    pool.map("moe_tune.tuner.compiling:shared", [(i, (token,)) for i in range(4)],
             lambda tag, status, value: answers.__setitem__(tag, (status, value)), timeout=1.0,
             shared=(token, deferred))
    assert sorted(answers) == [0, 1, 2, 3]
    assert all(status == "ok" and np.array_equal(value, payload) for status, value in answers.values())
    requests = [s for s in sent if isinstance(s, tuple) and len(s) == 3 and isinstance(s[0], str)]
    assert requests[0][2] == (token, protocol.DEFERRED)
    stored = [s for s in sent if isinstance(s, inputs.Stored)]
    assert 1 <= len(stored) <= 2 and len(set(stored)) == 1  # once per worker that asked; one file


def test_a_payload_that_cannot_be_made_fails_the_request_and_keeps_the_worker(monkeypatch):
    def fail():
        raise MemoryError("no room for the inputs")

    token, answers = uuid.uuid4().hex, {}
    pool = workers.pool(2)
    pool.map("moe_tune.tuner.compiling:shared", [(0, (token,))],
             lambda tag, status, value: answers.__setitem__(tag, (status, value)), timeout=30,
             shared=(token, Deferred(fail, lambda: False)))
    status, failure = answers[0]
    assert status == "failed" and failure.kind == "error" and "could not be made" in failure.message
    pids = {w.proc.pid for w in pool._idle.queue}
    pool.map("moe_tune.tuner.compiling:shared", [(1, (token,))],
             lambda tag, status, value: answers.__setitem__(tag, (status, value)), timeout=30, shared=(token, 5))
    assert answers[1] == ("ok", 5) and {w.proc.pid for w in pool._idle.queue} == pids


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16"}, {"rhs_quant": "int8", "direction": "fwd"}])
def test_prepared_inputs_are_the_ops_with_one_host_copy(options):
    op = get_op("ragged_dot")
    problem = op.problem(m=64, k=128, n=64, groups=4, **options)
    prepared = SweepInputs.prepare(op, problem, "balanced", 3)
    host = op.make_inputs(problem, "balanced", 3)
    device = jax.device_put(host)
    assert prepared.shapes == jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), device)
    np.testing.assert_array_equal(prepared.reference.expected, op.reference(problem, host))
    for mine, theirs, on_device in zip(jax.tree.leaves(prepared.host), jax.tree.leaves(host),
                                       jax.tree.leaves(prepared.device)):
        np.testing.assert_array_equal(mine, theirs)
        assert np.shares_memory(mine, np.asarray(on_device))  # the host inputs are views of the device copy
    payload = prepared.payload()
    assert payload[0] is prepared.host and payload[1] is prepared.reference


def test_an_error_making_the_reference_is_raised_where_it_is_needed():
    class Broken:
        def make_inputs(self, problem, distribution, seed):
            return {"x": np.ones((4, 4), np.float32)}

        def reference(self, problem, inputs):
            raise ValueError("no reference here")

    prepared = SweepInputs.prepare(Broken(), None, "balanced", 0)
    assert prepared.shapes == {"x": jax.ShapeDtypeStruct((4, 4), np.float32)}
    with pytest.raises(ValueError, match="no reference here"):
        prepared.device
    assert prepared.ready()


def test_the_reference_runs_on_one_blas_thread_and_the_count_is_restored(monkeypatch):
    from threadpoolctl import threadpool_info

    def blas_threads() -> list[int]:
        return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]

    before = blas_threads()
    if not before:
        pytest.skip("no BLAS threadpoolctl can see in this process")
    op, seen = get_op("ragged_dot"), []
    reference = op.reference
    monkeypatch.setattr(op, "reference", lambda *a: (seen.append(blas_threads()), reference(*a))[1])
    made = SweepInputs.prepare(op, TINY, "balanced", 0)
    made.reference  # waits for the thread
    assert seen == [[1] * len(before)] and blas_threads() == before


def test_inputs_that_cannot_be_made_fail_the_sweep_not_its_candidates(monkeypatch, tmp_path):
    """The reference fails on its thread after the compiles went out: the sweep raises that error, and no
    candidate is logged as failed for it (a resumed sweep would not retry them)."""
    from moe_tune.tuner import SweepRequest, run_sweep
    from moe_tune.tuner.sweep import log_path_for

    op = get_op("ragged_dot")

    def broken(problem, inputs):
        time.sleep(1.0)  # the first compiles went out meanwhile
        raise MemoryError("no room for the reference")

    monkeypatch.setattr(op, "reference", broken)
    request = SweepRequest.make("ragged_dot", TINY, backend="tiled", max_candidates=2, samples=1, workers=2,
                                profile_dir=tmp_path, cold=True)
    with pytest.raises(MemoryError, match="no room for the reference"):
        run_sweep(request)
    log = log_path_for(request).read_text()
    assert '"header"' in log and '"failed"' not in log


def _problems():
    ragged = get_op("ragged_dot")
    for direction in ("fwd", "dlhs", "drhs"):
        for options in ({}, {"dtype": "bfloat16"}, {"rhs_quant": "int8"}, {"rhs_quant": "int4"},
                        {"rhs_quant": "float4_e2m1fn"}):
            yield ragged, ragged.problem(m=64, k=128, n=64, groups=4, direction=direction, **options)
    yield ragged, ragged.problem(m=64, k=128, n=64, groups=4, lhs_quant="int8", rhs_quant="int8", lhs_dynamic=True)
    for name in ("ragged_gather", "ragged_gather_reduce", "dense_gather_reduce"):
        yield get_op(name), get_op(name).problem(tokens=64, hidden=128, top_k=2)
    for stage in ("dispatch", "combine"):
        yield get_op("fused_moe"), get_op("fused_moe").problem(tokens=64, top_k=2, k=128, n=64, groups=4, stage=stage)


def test_the_shapes_compiled_before_the_inputs_exist_are_the_made_inputs():
    """For the ops whose shapes come first (`targets.calls.DESCRIBED_OPS`), `targets.calls.abstract_inputs` is
    what `make_inputs` makes; it refuses another op (it once fell through to a gather's inputs)."""
    from moe_tune.targets.calls import DESCRIBED_OPS, abstract_inputs
    from moe_tune.tuner.candidate import _shapes

    covered = set()
    for op, problem in _problems():
        covered.add(op.name)
        assert _shapes(abstract_inputs(op.name, problem)) == _shapes(op.make_inputs(problem, "balanced", 1)), problem
    assert covered == set(DESCRIBED_OPS)
    with pytest.raises(ValueError, match="no abstract inputs for op 'moe_fusion'"):
        abstract_inputs("moe_fusion", None)


def test_made_inputs_that_are_not_the_shapes_compiled_for_are_an_error(monkeypatch):
    from moe_tune.tuner import candidate as inputs_module

    monkeypatch.setattr(inputs_module, "abstract_inputs", lambda op, problem: {"a": np.zeros((1,), np.float32)})
    prepared = SweepInputs.prepare(get_op("ragged_dot"), TINY, "balanced", 0)
    with pytest.raises(RuntimeError, match="moe-tune bug"):
        prepared.reference
