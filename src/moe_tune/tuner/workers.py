"""Worker processes: long-lived `python -m moe_tune.tuner.workers` subprocesses that run requests (for the
tuner: compile one candidate, run it once, send back the serialized executable and the output) so that
whatever a request does to its process -- a segfault, an abort, a hang, running out of memory -- takes
down only that worker, never the sweep.

Why processes: one JAX process does not run two XLA compilations at once, so parallel compiles need
processes; and a candidate that crashes or hangs has to crash or hang somewhere other than the process that
records the results. Plain subprocesses (not `multiprocessing`) keep this usable from any script, with or
without a `__main__` guard.

The pool gives each request a deadline (`timeout`, seconds, for the whole request, counted from when the
worker has read it and imported its function: a fresh worker's JAX import is not charged to the request).
A worker that does not answer in time is killed (SIGKILL); one that dies is reaped and its exit status
kept. Either way the request's callback gets a `WorkerFailure` (with the progress the request had
reported, so the caller knows how far it got), a new worker takes the dead one's place, and the pool goes
on with the next request.

Protocol: length-prefixed pickles over the worker's stdin/stdout. A request is `(fn, args, shared)`; the
worker answers `("started", None)` once it has read the request and imported `fn`, then any number of
`("progress", obj)` messages (see `progress`), then one `("done", value)` or `("error", reason)` (`fn`
raised; the worker stays usable). `shared` is `None` or `(token, payload)`: data that many requests need
(the tuner's inputs) goes to each worker once, with its first request that needs it, and is read there
with `shared(token)`; a worker holds one payload at a time. `WorkerPool.map` writes the payload's arrays once
to a shared-memory file (`shared_payload`) and sends only where they are. A payload still being made (a
`inputs.Deferred`: the tuner's reference is computed while the first compiles run) goes as
`(token, DEFERRED)`: the worker's `shared(token)` then answers `("need", token)` and reads the payload from
its stdin, which the pool sends once it is made; the request's deadline stops while it waits. The worker
moves its own stdout to stderr first, so stray prints cannot corrupt the stream.

`MOE_TUNE_WORKER_MEMORY_LIMIT` (bytes; unset by default): when set in the environment that starts a worker,
the worker caps its address space at that size (RLIMIT_AS), so an allocation past it fails cleanly
(RESOURCE_EXHAUSTED / MemoryError) instead of growing until the kernel's OOM killer steps in. The tests'
out-of-memory candidate uses it, so that it fails the same way whatever the machine's overcommit policy.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

from moe_tune.core import settings
from moe_tune.tuner import inputs

_HEADER = struct.Struct("<Q")
_CRASHED = "crashed"  # a `map` thread's own failure (not a request's), raised in the caller
MEMORY_LIMIT_ENV = settings.WORKER_MEMORY_LIMIT
START_LIMIT_S = 300.0  # for a worker to read a request and import its function (not part of `timeout`)
DEFERRED = "moe_tune.workers.deferred"  # a request's shared payload follows when the worker asks for it


def _pack(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _send(stream: BinaryIO, obj: Any) -> None:
    stream.write(_pack(obj))
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("closed")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("closed mid-message")
    return pickle.loads(data)


class _Timeout(Exception):
    pass


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    """`size` bytes from the raw pipe `fd`; EOFError when it closes first, _Timeout past `deadline`."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise _Timeout
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclasses.dataclass(eq=False)
class WorkerFailure(Exception):
    """A request that did not come back: its worker died ("died"), ran past the deadline and was killed
    ("timeout"), or the function raised in the worker ("error")."""

    kind: str
    progress: list = dataclasses.field(default_factory=list)  # what the request reported before it failed
    returncode: int | None = None  # "died": the worker's exit status (negative: killed by that signal)
    timeout: float | None = None  # "timeout": the deadline, in seconds
    message: str = ""  # "error": the exception, in one line

    @property
    def signal_name(self) -> str | None:
        if self.returncode is None or self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def describe(self) -> str:
        """e.g. "worker died (SIGABRT, signal 6)", "worker hung: timed out after 5 s"."""
        if self.kind == "died":
            if self.returncode is None:
                how = "unknown exit status"
            elif self.returncode < 0:
                how = f"{self.signal_name}, signal {-self.returncode}"
            else:
                how = f"exit code {self.returncode}"
            return f"worker died ({how})"
        if self.kind == "timeout":
            return f"worker hung: timed out after {self.timeout:g} s"
        return f"worker raised {self.message}"

    def __str__(self) -> str:
        return self.describe()


class Worker:
    """One subprocess that runs `fn(*args)` for each request (fn given as "module:function")."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # same modules as this process
        settings.no_gpu_preallocation(env)  # several processes may share one GPU
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_tune.tuner.workers"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, bufsize=0,
        )
        self.shared_token: str | None = None  # the shared payload this worker holds

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, fn: str, *args: Any, timeout: float | None = None, shared: tuple[str, Any] | None = None,
             on_progress: Callable[[Any], None] | None = None) -> Any:
        """Run one request and return its value; raise WorkerFailure when the worker died doing it, raised,
        or did not answer within `timeout` seconds (it is then killed). `shared` (token, payload) is sent
        only if this worker does not hold that token yet; a `inputs.Deferred` not ready yet is sent
        when the worker asks for it (the deadline stops while the payload is made)."""
        progress: list = []
        send = shared if shared is not None and shared[0] != self.shared_token else None
        if send is not None and isinstance(send[1], inputs.Deferred):
            send = (send[0], DEFERRED) if not send[1].ready() else (send[0], send[1].get())
        try:
            _write_all(self.proc.stdin.fileno(), _pack((fn, args, send)))
            if send is not None and send[1] is not DEFERRED:
                self.shared_token = send[0]
            # Until the worker has read the request and imported `fn` (a fresh worker imports JAX first),
            # a generous start-up limit; from then on, `timeout`.
            deadline = None if timeout is None else time.monotonic() + max(timeout, START_LIMIT_S)
            fd = self.proc.stdout.fileno()
            while True:
                (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
                kind, value = pickle.loads(_read_exact(fd, size, deadline))
                if kind == "started":
                    deadline = None if timeout is None else time.monotonic() + timeout
                elif kind == "progress":
                    progress.append(value)
                    if on_progress is not None:
                        on_progress(value)
                elif kind == "need":  # the deferred payload (`shared`): made, then sent
                    left = None if deadline is None else deadline - time.monotonic()
                    self.shared_token = self._send_deferred(*shared)
                    deadline = None if left is None else time.monotonic() + left
                elif kind == "done":
                    return value
                else:
                    raise WorkerFailure("error", progress, message=value)
        except _Timeout:
            self.close()
            raise WorkerFailure("timeout", progress, timeout=timeout) from None
        except (EOFError, OSError):  # BrokenPipeError included
            raise WorkerFailure("died", progress, returncode=self._reap()) from None

    def _send_deferred(self, token: str, payload: inputs.Deferred) -> str | None:
        """Send the payload a worker asked for; the token it now holds (None: the payload could not be made,
        and the worker's `shared` raises)."""
        try:
            value = payload.get()
        except Exception:  # noqa: BLE001 - whoever made it raises it where it is needed
            value, token = None, None
        _write_all(self.proc.stdin.fileno(), _pack(value))
        return token

    def _reap(self) -> int | None:
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # closed its output but still running: not usable either way
            self.close()
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class WorkerPool:
    """A fixed number of workers, restarted when they die; `map` runs requests across them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: queue.Queue[Worker] = queue.Queue()
        for _ in range(size):
            self._idle.put(Worker())
        self._stored: tuple[str, inputs.Stored] | None = None  # the shared payload's file, by token
        self._storing = threading.Lock()  # a deferred payload is stored on a thread of its own (`map`)

    def map(self, fn: str, requests: Iterable[tuple[Any, tuple]],
            on_result: Callable[[Any, str, Any], None], timeout: float | None = None,
            shared: tuple[str, Any] | None = None) -> None:
        """For each (tag, args): on_result(tag, "ok", value) or on_result(tag, "failed", WorkerFailure).

        A request that takes longer than `timeout` seconds has its worker killed. A worker that died or was
        killed is replaced before its next request. `shared` is (token, payload): see `Worker.call`; a
        `inputs.Deferred` is written to its file as soon as it is made, while the workers compile.
        Callbacks run one at a time, on the caller's thread, while the workers go on with the next requests
        (the tuner's callback loads the executable and checks the output: had it run on the thread that
        feeds a worker, that worker would idle meanwhile). An exception from `on_result` (or an interrupt)
        stops the requests not yet started and is raised; those in flight finish in the background.
        """
        deferred = shared is not None and isinstance(shared[1], inputs.Deferred)
        if deferred and not shared[1].ready():
            token, made = shared  # stored once made, on a thread, while the workers compile
            shared = (token, inputs.Deferred(lambda: self._store(token, made.get()), made.ready))
            threading.Thread(target=_quietly, args=(shared[1].get,), daemon=True).start()
        elif shared is not None:
            shared = (shared[0], self._store(shared[0], shared[1].get() if deferred else shared[1]))
        todo: queue.Queue = queue.Queue()
        count = 0
        for item in requests:
            todo.put(item)
            count += 1
        results: queue.Queue = queue.Queue()
        stop = threading.Event()

        def drain() -> None:
            try:
                while not stop.is_set():
                    try:
                        tag, args = todo.get_nowait()
                    except queue.Empty:
                        return
                    results.put((tag, *self._run(fn, args, timeout, shared)))
            except BaseException as e:  # noqa: BLE001 - a bug here must reach the caller, not hang it
                results.put((None, _CRASHED, e))

        threads = [threading.Thread(target=drain, daemon=True) for _ in range(min(self.size, count))]
        for t in threads:
            t.start()
        try:
            for _ in range(count):
                tag, status, value = results.get()
                if status == _CRASHED:
                    raise value
                on_result(tag, status, value)
        except BaseException:
            stop.set()
            raise
        for t in threads:
            t.join()

    def _run(self, fn: str, args: tuple, timeout: float | None, shared: tuple[str, Any] | None) -> tuple[str, Any]:
        """One request on an idle worker: ("ok", value) or ("failed", WorkerFailure); the worker (or the new
        one that replaced it, when it died or was killed) is idle again before this returns."""
        worker = self._idle.get()
        if not worker.alive():  # died while idle: not this request's fault
            worker.close()
            worker = Worker()
        try:
            status, value = "ok", worker.call(fn, *args, timeout=timeout, shared=shared)
        except WorkerFailure as failure:
            status, value = "failed", failure
            if failure.kind != "error":
                worker.close()
                worker = Worker()
        self._idle.put(worker)
        return status, value

    def _store(self, token: str, payload: Any) -> Any:
        """The file holding the payload of `token`, written once (the previous token's file is removed); the
        payload itself (sent through the pipes) when no file can be written."""
        with self._storing:
            if self._stored is None or self._stored[0] != token:
                if self._stored is not None:
                    inputs.remove(self._stored[1])
                    self._stored = None
                try:
                    self._stored = (token, inputs.store(payload))
                except OSError:  # e.g. a full /dev/shm
                    return payload
            return self._stored[1]

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().close()
        if self._stored is not None:
            inputs.remove(self._stored[1])
            self._stored = None


def _quietly(get: Callable[[], Any]) -> None:
    """`get()`, its error left to whoever needs the value (`Worker._send_deferred`)."""
    try:
        get()
    except Exception:  # noqa: BLE001
        pass


_pools: dict[int, WorkerPool] = {}


def pool(size: int) -> WorkerPool:
    """The process-wide pool of `size` workers (started once: each start costs a JAX import)."""
    if size not in _pools:
        _pools[size] = WorkerPool(size)
    return _pools[size]


@atexit.register
def close_pools() -> None:
    """Stop every worker; the next `pool(...)` starts fresh ones (e.g. after changing their environment)."""
    while _pools:
        _pools.popitem()[1].close()


# Worker side.

_out: BinaryIO | None = None
_in: BinaryIO | None = None
_shared: dict[str, Any] = {}
_deferred: str | None = None  # the token of a payload this worker gets when it asks (`DEFERRED`)


def progress(obj: Any) -> None:
    """From a request running in a worker: tell the caller how far it got (kept if the worker then dies or
    hangs). A no-op outside a worker."""
    if _out is not None:
        _send(_out, ("progress", obj))


def shared(token: str) -> Any:
    """In a worker: the shared payload sent with token `token` (KeyError if this worker does not hold it).
    A payload the request deferred is asked for now, and waited for (`DEFERRED`)."""
    global _deferred
    if token not in _shared and token == _deferred and _out is not None and _in is not None:
        _send(_out, ("need", token))
        payload = _receive(_in)
        if payload is None:
            raise RuntimeError("the sweep's shared payload could not be made")
        _hold(token, payload)
        _deferred = None
    return _shared[token]


def _hold(token: str, payload: Any) -> None:
    _shared.clear()  # one payload at a time: a new token means the previous one is done with
    if isinstance(payload, inputs.Stored):  # written to a file by `WorkerPool.map`
        payload = inputs.load(payload)
    _shared[token] = payload


def _limit_memory() -> None:
    limit = settings.worker_memory_limit()
    if limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _serve() -> None:
    import importlib

    global _out, _in, _deferred
    _limit_memory()
    if settings.compile_cache_dir_set():  # the sweep turned the persistent cache on: share it
        from moe_tune.tuner import compile_cache

        compile_cache.enable(trim_to_size=False)  # the sweep's process trimmed it
    _out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _in = sys.stdin.buffer
    while True:
        try:
            fn, args, share = _receive(_in)
        except EOFError:
            return
        module, name = fn.split(":")
        try:
            if share is not None and isinstance(share[1], str) and share[1] == DEFERRED:
                _deferred = share[0]
            elif share is not None:
                _hold(*share)
            function = getattr(importlib.import_module(module), name)
            _send(_out, ("started", None))
            answer = ("done", function(*args))
        except Exception as e:  # noqa: BLE001 - reported to the caller; the worker stays usable
            lines = str(e).strip().splitlines()
            answer = ("error", f"{type(e).__name__}: {lines[0] if lines else ''}"[:300])
        try:
            data = _pack(answer)
        except Exception as e:  # noqa: BLE001
            data = _pack(("error", f"the answer could not be pickled: {type(e).__name__}: {e}"[:300]))
        _out.write(data)
        _out.flush()


if __name__ == "__main__":
    # Serve from the module as imported (not `__main__`), so that `progress` and `shared`, called by the
    # requests' functions through `moe_tune.tuner.workers`, see this worker's stream and payload.
    from moe_tune.tuner.workers import _serve as serve

    serve()
