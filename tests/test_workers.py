"""The worker pool on its own (`moe_tune.workers`), with the standard library's functions as requests: progress
reaches the caller as it comes, a request that raises keeps its worker, one that aborts or hangs costs only
its worker (replaced; what it wrote to stderr kept), and a pool's environment, setup function and affinity
keys hold in its workers. The tuner's and the compile targets' uses are tested in test_isolation.py,
test_sweep_inputs.py and test_compile_pool.py."""

from __future__ import annotations

import os
import threading

import pytest

from moe_tune.workers import WorkerPool

ENV_NAME = "MOE_TUNE_TEST_POOL_ENV"


def _env() -> dict[str, str]:
    from moe_tune.workers import inherited_env

    return {**inherited_env(), ENV_NAME: "this pool's"}


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(1, env=_env, setup="faulthandler:enable") as one:
        yield one


def _results(pool, fn, requests, **kwargs) -> dict:
    out = {}
    pool.map(fn, requests, lambda tag, status, value: out.__setitem__(tag, (status, value)), **kwargs)
    return out


def test_progress_comes_to_the_callers_thread_before_the_answer_and_an_error_keeps_the_worker(pool):
    """(What a request prints goes to the worker's stderr, not into the answers.)"""
    seen = []
    code = "from moe_tune.workers import progress\nfor step in range(3): print('stray'), progress(step)\n"
    pool.map("builtins:exec", [("a", (code, {}))],
             lambda tag, status, value: seen.append(("result", tag, status)),
             on_progress=lambda tag, obj: seen.append(("progress", tag, obj, threading.current_thread())))
    main = threading.main_thread()
    assert seen == [("progress", "a", 0, main), ("progress", "a", 1, main), ("progress", "a", 2, main),
                    ("result", "a", "ok")]

    (pid,) = pool.pids()
    status, failure = _results(pool, "builtins:int", [(0, ("not a number",))], timeout=60)[0]
    assert status == "failed" and failure.kind == "error" and failure.message.startswith("ValueError: ")
    assert pool.pids() == {pid}  # a function that raised does not cost its worker
    status, failure = _results(pool, "no_such_module_here:f", [(0, ())])[0]
    assert status == "failed" and failure.kind == "error" and "ModuleNotFoundError" in failure.message
    assert _results(pool, "os:getpid", [(0, ())])[0] == ("ok", pid)


def test_an_abort_or_a_hang_costs_only_its_worker(pool):
    crash = "import os, sys\nsys.stderr.write('about to abort\\n')\nsys.stderr.flush()\nos.abort()\n"
    status, failure = _results(pool, "builtins:exec", [(0, (crash, {}))], timeout=60)[0]
    assert status == "failed" and failure.kind == "died" and failure.started
    assert failure.describe() == "worker died (SIGABRT, signal 6)" and "about to abort" in failure.output
    status, failure = _results(pool, "time:sleep", [(0, (3600,))], timeout=1.0)[0]
    assert status == "failed" and failure.kind == "timeout" and failure.describe() == "worker hung: timed out after 1 s"
    assert _results(pool, "operator:add", [(0, (2, 3))])[0] == ("ok", 5)  # a new worker took their place


def test_the_pools_environment_setup_and_affinity_hold_in_its_workers(pool):
    assert _results(pool, "os:getenv", [(0, (ENV_NAME,))])[0] == ("ok", "this pool's")
    assert os.environ.get(ENV_NAME) is None
    assert _results(pool, "faulthandler:is_enabled", [(0, ())])[0] == ("ok", True)  # the setup ran there
    keys = {0: "x", 1: "x", 2: None, 3: "y", 4: None}
    pids = _results(pool, "os:getpid", [(i, ()) for i in keys], affinity=keys.get)
    assert pids[0] == pids[1] == pids[2] != pids[3] == pids[4]  # "y" needed a worker that never ran "x"
