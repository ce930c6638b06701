"""The framing between a pool and its workers: length-prefixed pickles over the worker's stdin and stdout.

Each message is an 8-byte little-endian length, then that many bytes of pickle. The pool sends a request
`(fn, args, share)` (`fn` as "module:function"; `share` None or `(token, payload)`, the payload `DEFERRED`
when it follows later) and, when asked, a deferred payload (None: it could not be made). The worker answers
each request with `("started", None)` once it has read it and imported `fn`, any number of
`("progress", obj)` and `("need", token)`, then one `("done", value)` or `("error", reason)`.

The pool side reads the raw pipe with a deadline (`read_message`); the worker side reads blocking streams
(`read_frame`), and unpickles apart (`unpack`) so that a request it cannot unpickle is an answer, not its end.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")
DEFERRED = "moe_tune.workers.deferred"  # a request's shared payload follows when the worker asks for it


class Timeout(Exception):
    """The deadline passed before a whole message arrived."""


def pack(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def unpack(data: bytes) -> Any:
    return pickle.loads(data)


def send(stream: BinaryIO, obj: Any) -> None:
    stream.write(pack(obj))
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes:
    """The next message's bytes from a blocking stream; EOFError when it closes first."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError("closed")
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("closed mid-message")
    return data


def receive(stream: BinaryIO) -> Any:
    return unpack(read_frame(stream))


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    """`size` bytes from the raw pipe `fd`; EOFError when it closes first, Timeout past `deadline`."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise Timeout
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(fd: int, deadline: float | None) -> Any:
    """The next message from the raw pipe `fd` (`deadline`: a `time.monotonic()` instant, or None)."""
    (size,) = HEADER.unpack(_read_exact(fd, HEADER.size, deadline))
    return unpack(_read_exact(fd, size, deadline))


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
