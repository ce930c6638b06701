"""A payload that many worker requests share (a sweep's inputs and reference), handed to the workers through
one file in shared memory instead of through each worker's pipe.

The payload is pickled once (protocol 5): its large buffers (NumPy arrays, whatever their pytree or dataclass)
go out of band into the file, and only the small rest and the buffers' places travel with a request
(`Stored`). A worker maps the file and unpickles the arrays as read-only views of it, without a copy. Piped,
the 130 MB of a 64-candidate sweep's inputs and reference took ~0.95 s to reach both workers, which waited
for them before their first compile (NOTES.md, issue 32, session 15).

A payload still being made (the tuner's reference, computed while the first compiles run) is a `Deferred`:
the pool writes it when a worker first asks for it (`workers.DEFERRED`).

The file lives in /dev/shm where there is one (the temp dir otherwise), named with this process's id; the pool
removes it when the payload changes or the pool closes, and removes files of processes that no longer run
(a sweep killed with SIGKILL) the next time it stores one.
"""

from __future__ import annotations

import dataclasses
import glob
import mmap
import os
import pickle
import tempfile
import threading
from collections.abc import Callable
from typing import Any

_PREFIX = "moe_tune_shared_"


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where a payload is: the pickle without its large buffers, and each buffer's (offset, size) in `path`."""

    path: str
    head: bytes
    spans: tuple[tuple[int, int], ...]


class Deferred:
    """A shared payload still being made: `get()` waits for it and makes it once (`make()`), whichever thread
    asks first; `ready()` says whether `get` would not wait for the producer."""

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


def _directory() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def store(payload: Any) -> Stored:
    """Write `payload`'s large buffers to a new file; what a worker needs to `load` it."""
    _remove_stale()
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
    fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}_", dir=_directory())
    spans, offset = [], 0
    try:
        with os.fdopen(fd, "wb") as f:
            for buffer in buffers:
                raw = buffer.raw()
                f.write(raw)
                spans.append((offset, raw.nbytes))
                offset += raw.nbytes
    except BaseException:
        os.unlink(path)
        raise
    return Stored(path, head, tuple(spans))


def load(stored: Stored) -> Any:
    """The payload, its arrays read-only views of the mapped file (valid after the file is removed)."""
    views = [memoryview(b"")] * len(stored.spans)
    if any(size for _, size in stored.spans):  # (an empty file cannot be mapped)
        with open(stored.path, "rb") as f:
            mapped = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        views = [mapped[offset:offset + size] for offset, size in stored.spans]
    return pickle.loads(stored.head, buffers=views)


def remove(stored: Stored) -> None:
    try:
        os.unlink(stored.path)
    except FileNotFoundError:
        pass


def _remove_stale() -> None:
    """Remove the payload files of processes that no longer run."""
    for path in glob.glob(os.path.join(_directory(), f"{_PREFIX}*")):
        pid = os.path.basename(path)[len(_PREFIX):].split("_", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
