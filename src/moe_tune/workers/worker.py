"""The worker's side: `python -m moe_tune.workers [--setup module:function]` serves requests until its stdin
closes. For each request it imports `fn` ("module:function"), answers "started", runs `fn(*args)` and answers
its value ("done") or the exception in one line ("error"; the worker stays usable). The requests' functions
call `progress(obj)` to say how far they got and `shared(token)` for the payload their request shares with
others (one held at a time; a deferred one is asked for when first needed).

Before serving, the worker caps its address space at `MOE_TUNE_WORKER_MEMORY_LIMIT` bytes when that is set
(RLIMIT_AS: an allocation past it fails cleanly, MemoryError / RESOURCE_EXHAUSTED, instead of growing until
the kernel's OOM killer steps in), points its stdout (fd 1 and `sys.stdout`) at stderr, so that what the
requests or C++ libraries print cannot corrupt the protocol stream, and runs the pool's `--setup` function
once.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from moe_tune.core import settings
from moe_tune.workers import protocol

_out: BinaryIO | None = None
_in: BinaryIO | None = None
_shared: dict[str, Any] = {}
_deferred: str | None = None  # the token of a payload this worker gets when it asks (`protocol.DEFERRED`)


def progress(obj: Any) -> None:
    """From a request running in a worker: tell the pool how far it got (kept if the worker then dies or
    hangs; the pool's `on_progress` sees it at once). A no-op outside a worker."""
    if _out is not None:
        protocol.send(_out, ("progress", obj))


def shared(token: str) -> Any:
    """In a worker: the shared payload sent with `token` (KeyError if this worker does not hold it). A
    payload the request deferred is asked for now, and waited for."""
    global _deferred
    if token not in _shared and token == _deferred and _out is not None and _in is not None:
        protocol.send(_out, ("need", token))
        payload = protocol.receive(_in)
        if payload is None:
            raise RuntimeError("the shared payload could not be made")
        _hold(token, payload)
        _deferred = None
    return _shared[token]


def _hold(token: str, payload: Any) -> None:
    _shared.clear()  # one payload at a time: a new token means the previous one is done with
    _shared[token] = payload


def _function(name: str) -> Callable[..., Any]:
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _limit_memory() -> None:
    limit = settings.worker_memory_limit()
    if limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _answer(frame: bytes) -> tuple[str, Any]:
    global _deferred
    try:
        fn, args, share = protocol.unpack(frame)
        if share is not None and isinstance(share[1], str) and share[1] == protocol.DEFERRED:
            _deferred = share[0]
        elif share is not None:
            _hold(*share)
        function = _function(fn)
        protocol.send(_out, ("started", None))
        return "done", function(*args)
    except Exception as e:  # noqa: BLE001 - reported to the pool; the worker stays usable
        return "error", _one_line(e)


def serve(setup: str | None = None) -> None:
    global _out, _in
    _limit_memory()
    _out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _in = sys.stdin.buffer
    if setup:
        _function(setup)()
    while True:
        try:
            frame = protocol.read_frame(_in)
        except EOFError:
            return
        answer = _answer(frame)
        try:
            data = protocol.pack(answer)
        except Exception as e:  # noqa: BLE001
            data = protocol.pack(("error", f"the answer could not be pickled: {_one_line(e)}"))
        _out.write(data)
        _out.flush()


def main(argv: Sequence[str]) -> None:
    setup = None
    if len(argv) == 2 and argv[0] == "--setup":
        setup = argv[1]
    elif argv:
        raise SystemExit(f"usage: python -m moe_tune.workers [--setup module:function], not {' '.join(argv)}")
    serve(setup)
