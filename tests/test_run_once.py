"""`run_once.gather`, the sharing of a module fixture's subprocess result between xdist workers: another
worker is a thread here holding a part's lock, as a worker making that part holds it."""

from __future__ import annotations

import threading
import time

import pytest
import run_once


def _other_worker(root, name, part, parts, *, then, after=None):
    """A thread that holds part's lock (as a worker making it) until `after` exists, then writes `then` as
    the part's record (None: writes nothing, as a worker that died) and lets go."""
    held = threading.Event()

    def work():
        lock = run_once._lock(root, name, part, parts)
        with lock:
            held.set()
            deadline = time.monotonic() + 30
            while after is not None and not after.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if then is not None:
                run_once._write(run_once._path(root, name, part, parts), then)

    thread = threading.Thread(target=work)
    thread.start()
    assert held.wait(30)
    return thread


def test_each_part_is_made_once_and_every_worker_gets_the_union(tmp_path):
    made = []

    def make(part, parts):
        made.append((part, parts))
        return {f"case{part}": {"by": "this worker"}, "shared": part}

    # the other worker makes part 0 while this one makes part 1 (free), then waits for part 0
    other = _other_worker(tmp_path, "checks", 0, 2, then={"value": {"case0": {"by": "other"}, "shared": 0}},
                          after=run_once._path(tmp_path, "checks", 1, 2))
    got = run_once.gather(tmp_path, "checks", make, 2, wait_s=30)
    other.join()
    assert made == [(1, 2)]
    assert got == {"case0": {"by": "other"}, "case1": {"by": "this worker"}, "shared": 1}  # later parts win
    # a worker arriving after both reads them and makes nothing
    assert run_once.gather(tmp_path, "checks", lambda *_: pytest.fail("made again"), 2) == got
    # one part (no xdist) is its own file: it does not read the split run's parts
    assert run_once.gather(tmp_path, "checks", make, 1) == {"case0": {"by": "this worker"}, "shared": 0}
    assert made == [(1, 2), (0, 1)]


def test_a_failed_part_fails_every_worker_with_its_error_and_nobody_hangs(tmp_path):
    def failing(part, parts):
        raise AssertionError("the subprocess's stderr: Barrier remains allocated")

    with pytest.raises(AssertionError, match="Barrier remains allocated"):  # its maker: the exception itself
        run_once.gather(tmp_path, "broken", failing, 1)
    with pytest.raises(pytest.fail.Exception, match="made by another worker.*Barrier remains allocated"):
        run_once.gather(tmp_path, "broken", lambda *_: pytest.fail("made again"), 1)  # the others: its text

    # a maker that died (its lock released, no result): the waiter makes the part itself
    dead = _other_worker(tmp_path, "orphan", 0, 1, then=None)
    dead.join()
    assert run_once.gather(tmp_path, "orphan", lambda part, parts: {"made": "here"}, 1) == {"made": "here"}

    # a maker that holds on past the wait: one clear failure, not a hang
    stop = tmp_path / "stop"
    slow = _other_worker(tmp_path, "stuck", 0, 1, then=None, after=stop)
    with pytest.raises(pytest.fail.Exception, match="waited 0 s for part 1 of 1"):
        run_once.gather(tmp_path, "stuck", lambda *_: pytest.fail("made again"), 1, wait_s=0.2)
    stop.touch()
    slow.join()


def test_a_skipped_part_skips_every_worker(tmp_path):
    def skipping(part, parts):
        pytest.skip("needs 8 devices")

    with pytest.raises(pytest.skip.Exception):
        run_once.gather(tmp_path, "skipped", skipping, 1)
    with pytest.raises(pytest.skip.Exception, match="needs 8 devices"):
        run_once.gather(tmp_path, "skipped", lambda *_: pytest.fail("made again"), 1)
