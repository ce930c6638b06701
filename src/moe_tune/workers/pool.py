"""The process pool: `size` long-lived `python -m moe_tune.workers` subprocesses that run requests, so that
whatever a request does to its process -- a segfault, an abort, a hang, running out of memory -- takes down
only that worker, never the process that records the results.

Why processes: one JAX process does not run two XLA compilations at once, so parallel compiles need
processes; and a request that crashes or hangs has to do it somewhere else than the caller. Plain
subprocesses (not `multiprocessing`) keep this usable from any script, with or without a `__main__` guard.

Each pool sets its workers' environment (`env`: by default this process's, with its import path) and the
function each worker runs once before serving (`setup`). Each request gets a deadline (`timeout`, seconds,
counted from when the worker has read it and imported its function: a fresh worker's imports are not charged
to it). A worker that does not answer in time is killed (SIGKILL); one that dies is reaped and its exit status
kept. Either way the request ends as a `WorkerFailure` (with the progress it had reported and what the worker
wrote to stderr meanwhile), a new worker takes the dead one's place, and the pool goes on.

A request may name an affinity (a key, e.g. the one GPU target a process may compile for): a worker that ran a
request with a key serves only requests with that key or none; another key gets a fresh worker in its place.

Shared payloads: data that many requests need goes to each worker once, with its first request that needs it
(`shared=(token, payload)`), written first by the pool's `store` (e.g. to a shared-memory file; `unstore`
removes it) when there is one. A payload still being made (`Pending`: `ready()`, `get()`) goes as
`protocol.DEFERRED`; the worker asks for it when a request first needs it, and the request's deadline stops
while it is made.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from moe_tune.core import settings
from moe_tune.workers import protocol

START_LIMIT_S = 300.0  # for a worker to read a request and import its function (not part of `timeout`)
OUTPUT_CHARS = 64 << 10  # of what a worker wrote to stderr during a request, the end kept with a failure
_CRASHED = "crashed"  # a `map` thread's own failure (not a request's), raised in the caller
_PROGRESS = "progress"


@runtime_checkable
class Pending(Protocol):
    """A shared payload still being made: `get()` waits for it; `ready()` says whether `get` would not wait."""

    def ready(self) -> bool: ...

    def get(self) -> Any: ...


def inherited_env() -> dict[str, str]:
    """This process's environment with its import path (the workers import the same modules), and JAX kept
    from taking most of a GPU's memory unless the user chose (several processes may share one GPU)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    settings.no_gpu_preallocation(env)
    return env


@dataclasses.dataclass(eq=False)
class WorkerFailure(Exception):
    """A request that did not come back: its worker died ("died"), ran past the deadline and was killed
    ("timeout"), or the function raised in the worker ("error")."""

    kind: str
    progress: list = dataclasses.field(default_factory=list)  # what the request reported before it failed
    returncode: int | None = None  # "died": the worker's exit status (negative: killed by that signal)
    timeout: float | None = None  # "timeout": the deadline, in seconds
    message: str = ""  # "error": the exception, in one line
    output: str = ""  # the end of what the worker wrote to stderr during the request
    started: bool = True  # False: the worker ended before it had read the request and imported its function

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
    """One subprocess that runs `fn(*args)` for each request; its stderr goes to a file of its own."""

    def __init__(self, command: list[str], env: Mapping[str, str]) -> None:
        self._stderr = tempfile.TemporaryFile()
        fd = self._stderr.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)  # emptied per request
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env=dict(env), bufsize=0)
        self.shared_token: str | None = None  # the shared payload this worker holds
        self.key: str | None = None  # the affinity of the requests it ran (None: any)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serves(self, key: str | None) -> bool:
        """Whether this worker may run a request of affinity `key`."""
        return key is None or self.key in (None, key)

    def output(self) -> str:
        """The end of what the worker wrote to stderr since its current request was sent."""
        if self._stderr.closed:
            return ""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        data = os.pread(fd, min(size, OUTPUT_CHARS), max(0, size - OUTPUT_CHARS))
        return data.decode("utf-8", "replace")

    def call(self, fn: str, *args: Any, timeout: float | None = None, shared: tuple[str, Any] | None = None,
             on_progress: Callable[[Any], None] | None = None) -> Any:
        """Run one request and return its value; raise WorkerFailure when the worker died doing it, raised,
        or did not answer within `timeout` seconds (it is then killed). `shared` (token, payload) is sent
        only if this worker does not hold that token yet; a `Pending` payload not ready yet is sent when the
        worker asks for it (the deadline stops while it is made)."""
        progress: list = []
        started = False
        send = shared if shared is not None and shared[0] != self.shared_token else None
        if send is not None and isinstance(send[1], Pending):
            send = (send[0], protocol.DEFERRED) if not send[1].ready() else (send[0], send[1].get())
        try:
            os.ftruncate(self._stderr.fileno(), 0)
            protocol.write_all(self.proc.stdin.fileno(), protocol.pack((fn, args, send)))
            if send is not None and send[1] is not protocol.DEFERRED:
                self.shared_token = send[0]
            # Until the worker has read the request and imported `fn` (a fresh worker imports JAX first),
            # a generous start-up limit; from then on, `timeout`.
            deadline = None if timeout is None else time.monotonic() + max(timeout, START_LIMIT_S)
            fd = self.proc.stdout.fileno()
            while True:
                kind, value = protocol.read_message(fd, deadline)
                if kind == "started":
                    started = True
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
                    raise WorkerFailure("error", progress, message=value, output=self.output())
        except protocol.Timeout:
            self._kill()
            output = self.output()
            self.close()
            raise WorkerFailure("timeout", progress, timeout=timeout, output=output, started=started) from None
        except (EOFError, OSError):  # BrokenPipeError included
            code = self._reap()
            raise WorkerFailure("died", progress, returncode=code, output=self.output(), started=started) from None

    def _send_deferred(self, token: str, payload: Pending) -> str | None:
        """Send the payload a worker asked for; the token it now holds (None: the payload could not be made,
        and the worker's `shared` raises)."""
        try:
            value = payload.get()
        except Exception:  # noqa: BLE001 - whoever made it raises it where it is needed
            value, token = None, None
        protocol.write_all(self.proc.stdin.fileno(), protocol.pack(value))
        return token

    def _reap(self) -> int | None:
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # closed its output but still running: not usable either way
            self._kill()
            return None

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Kill the process (if it still runs) and close its pipes and its stderr file."""
        self._kill()
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            try:
                stream.close()
            except OSError:
                pass


class WorkerPool:
    """`size` workers, restarted when they die; `map` runs requests across them.

    `env`: the workers' environment, or a function giving it when each starts (default `inherited_env`).
    `setup`: "module:function" each worker runs once before serving. `store(payload)` -> what is sent of a
    shared payload (e.g. where a file holds it), `unstore(stored)` removes it. `start`: start the workers
    now (and a replacement as soon as one dies), so that their start-up overlaps what the caller does next;
    otherwise each starts when a request first needs it.
    """

    def __init__(self, size: int, *, env: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
                 setup: str | None = None, store: Callable[[Any], Any] | None = None,
                 unstore: Callable[[Any], None] | None = None, start: bool = False) -> None:
        self.size = max(1, size)
        self._env = inherited_env if env is None else env
        self._command = [sys.executable, "-m", "moe_tune.workers", *(["--setup", setup] if setup else [])]
        self._eager = start
        self._put, self._unstore = store, unstore
        self._idle: queue.Queue[Worker | None] = queue.Queue()
        for _ in range(self.size):
            self._idle.put(self._new_worker() if start else None)
        self._stored: tuple[str, Any] | None = None  # the shared payload as stored, by token
        self._storing = threading.Lock()  # a pending payload is stored on a thread of its own (`map`)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_worker(self) -> Worker:
        return Worker(self._command, self._env() if callable(self._env) else self._env)

    def map(self, fn: str, requests: Iterable[tuple[Any, tuple]], on_result: Callable[[Any, str, Any], None],
            timeout: float | None = None, shared: tuple[str, Any] | None = None, *,
            affinity: Callable[[Any], str | None] | None = None,
            on_progress: Callable[[Any, Any], None] | None = None) -> None:
        """Start each (tag, args) in order; as each ends, on_result(tag, "ok", value) or on_result(tag,
        "failed", WorkerFailure); `on_progress(tag, obj)` for what a request reports as it goes.

        A request that takes longer than `timeout` seconds has its worker killed. A worker that died or was
        killed is replaced before its next request. `affinity(tag)`: the request's key (see the module
        docstring). `shared` is (token, payload): see `Worker.call`; a `Pending` payload is stored as soon
        as it is made, while the workers run. Callbacks run one at a time, on the caller's thread, while the
        workers go on with the next requests. An exception from a callback (or an interrupt) stops the
        requests not yet started and is raised; those in flight finish in the background.
        """
        if shared is not None and isinstance(shared[1], Pending) and not shared[1].ready():
            token, made = shared  # stored once made, on a thread, while the workers run
            shared = (token, Deferred(lambda: self._store(token, made.get()), made.ready))
            threading.Thread(target=_quietly, args=(shared[1].get,), daemon=True).start()
        elif shared is not None:
            payload = shared[1].get() if isinstance(shared[1], Pending) else shared[1]
            shared = (shared[0], self._store(shared[0], payload))
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
                    report = None if on_progress is None else (lambda obj, tag=tag: results.put((tag, _PROGRESS, obj)))
                    key = None if affinity is None else affinity(tag)
                    results.put((tag, *self._run(fn, args, timeout, shared, key, report)))
            except BaseException as e:  # noqa: BLE001 - a bug here must reach the caller, not hang it
                results.put((None, _CRASHED, e))

        threads = [threading.Thread(target=drain, daemon=True) for _ in range(min(self.size, count))]
        for t in threads:
            t.start()
        try:
            done = 0
            while done < count:
                tag, status, value = results.get()
                if status == _CRASHED:
                    raise value
                if status == _PROGRESS:
                    on_progress(tag, value)
                    continue
                done += 1
                on_result(tag, status, value)
        except BaseException:
            stop.set()
            raise
        for t in threads:
            t.join()

    def _run(self, fn: str, args: tuple, timeout: float | None, shared: tuple[str, Any] | None, key: str | None,
             on_progress: Callable[[Any], None] | None) -> tuple[str, Any]:
        """One request on an idle worker: ("ok", value) or ("failed", WorkerFailure); the worker (or the one
        that replaced it, when it died or was killed) is idle again before this returns."""
        worker = self._idle.get()
        try:
            if worker is not None and not (worker.alive() and worker.serves(key)):  # not this request's fault
                worker.close()
                worker = None
            if worker is None:
                worker = self._new_worker()
            if key is not None:
                worker.key = key
            try:
                status, value = "ok", worker.call(fn, *args, timeout=timeout, shared=shared, on_progress=on_progress)
            except WorkerFailure as failure:
                status, value = "failed", failure
                if failure.kind != "error":
                    worker.close()
                    worker = self._new_worker() if self._eager else None
        finally:
            self._idle.put(worker)
        return status, value

    def _store(self, token: str, payload: Any) -> Any:
        """What is sent of the payload of `token`, stored once (the previous token's is removed); the payload
        itself without a `store`, or when it cannot be stored."""
        if self._put is None:
            return payload
        with self._storing:
            if self._stored is None or self._stored[0] != token:
                self._remove_stored()
                try:
                    self._stored = (token, self._put(payload))
                except OSError:  # e.g. a full /dev/shm
                    return payload
            return self._stored[1]

    def _remove_stored(self) -> None:
        if self._stored is not None and self._unstore is not None:
            self._unstore(self._stored[1])
        self._stored = None

    def pids(self) -> set[int]:
        """The process ids of the idle workers that run."""
        return {w.proc.pid for w in list(self._idle.queue) if w is not None and w.alive()}

    def close(self) -> None:
        """Stop the idle workers (those in flight stop when their request ends) and remove the stored payload."""
        while not self._idle.empty():
            worker = self._idle.get_nowait()
            if worker is not None:
                worker.close()
        with self._storing:
            self._remove_stored()


class Deferred:
    """A shared payload still being made: `get()` waits for it and makes it once (`make()`), whichever thread
    asks first; `ready()` says whether `get` would not wait for the producer. The pool also wraps a payload it
    stores when made in one."""

    def __init__(self, make: Callable[[], Any], ready: Callable[[], bool]) -> None:
        self._make, self.ready = make, ready
        self._lock = threading.Lock()
        self._made = False
        self._value: Any = None

    def get(self) -> Any:
        with self._lock:
            if not self._made:
                self._value, self._made = self._make(), True
        return self._value


def _quietly(get: Callable[[], Any]) -> None:
    """`get()`, its error left to whoever needs the value (`Worker._send_deferred`)."""
    try:
        get()
    except Exception:  # noqa: BLE001
        pass
