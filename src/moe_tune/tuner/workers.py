"""Compile workers: long-lived `python -m moe_tune.tuner.workers` subprocesses that compile candidates and
send the executables back serialized.

One JAX process does not run two XLA compilations at once, so parallel compiles need processes. Plain
subprocesses (not `multiprocessing`) keep this usable from any script, with or without a `__main__`
guard, and let a crashing compile take down only its worker: the pool notices the dead worker, records
the candidate as failed with the exit status, and starts a new worker.

Protocol: length-prefixed pickles over the worker's stdin/stdout. The worker moves its own stdout to
stderr first, so stray prints cannot corrupt the stream.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("worker closed its output")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("worker closed its output mid-message")
    return pickle.loads(data)


class Worker:
    """One subprocess that runs `fn(*args)` for each request (fn given as "module:function")."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # same modules as this process
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several processes may share one GPU
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_tune.tuner.workers"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env,
        )

    def call(self, fn: str, *args: Any, timeout: float | None = None) -> Any:
        """Run one request; EOFError when the worker died doing it, TimeoutError (worker killed) when it
        did not answer within `timeout` seconds."""
        _send(self.proc.stdin, (fn, args))
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.close()
            raise TimeoutError(f"no answer within {timeout:g} s")
        return _receive(self.proc.stdout)

    def died_with(self) -> str:
        code = self.proc.wait(timeout=10)
        return f"signal {-code}" if code < 0 else f"exit code {code}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class WorkerPool:
    """A fixed number of workers, restarted when they die; `map` runs requests across them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: queue.Queue[Worker] = queue.Queue()
        for _ in range(size):
            self._idle.put(Worker())

    def map(self, fn: str, requests: Iterable[tuple[Any, tuple]],
            on_result: Callable[[Any, str, Any], None], timeout: float | None = None) -> None:
        """For each (tag, args): on_result(tag, "ok", value) or on_result(tag, "died", reason); a request
        that takes longer than `timeout` seconds has its worker killed and counts as died."""
        todo: queue.Queue = queue.Queue()
        for item in requests:
            todo.put(item)
        lock = threading.Lock()

        def drain() -> None:
            while True:
                try:
                    tag, args = todo.get_nowait()
                except queue.Empty:
                    return
                worker = self._idle.get()
                try:
                    status, value = "ok", worker.call(fn, *args, timeout=timeout)
                except TimeoutError as e:
                    status, value = "died", f"compile worker hung: {e}"
                    worker = Worker()
                except (EOFError, BrokenPipeError, OSError):
                    status, value = "died", f"compile worker died ({worker.died_with()})"
                    worker.close()
                    worker = Worker()
                self._idle.put(worker)
                with lock:
                    on_result(tag, status, value)

        threads = [threading.Thread(target=drain, daemon=True) for _ in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().close()


_pools: dict[int, WorkerPool] = {}


def pool(size: int) -> WorkerPool:
    """The process-wide pool of `size` workers (started once: each start costs a JAX import)."""
    if size not in _pools:
        _pools[size] = WorkerPool(size)
    return _pools[size]


@atexit.register
def _close_pools() -> None:
    for p in _pools.values():
        p.close()


def _serve() -> None:
    import importlib

    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    protocol_in = sys.stdin.buffer
    while True:
        try:
            fn, args = _receive(protocol_in)
        except EOFError:
            return
        module, name = fn.split(":")
        _send(protocol_out, getattr(importlib.import_module(module), name)(*args))


if __name__ == "__main__":
    _serve()
