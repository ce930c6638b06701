"""The backend a `moe_tune.use_backend(op, name)` block names for an op (`kernels/__init__.py` has the context
manager, which checks the names; `KernelOp.backend` reads the choice). A layer built from several kernel calls
(`moe_mlp`: three ragged dots and the gathers) passes no `backend`, so without this only the platform default
(`registry.py`) could serve it; inside the block those calls run as if they passed `backend=name` (tables,
fallbacks and guards as for a named backend)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

_current: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("moe_tune_backends", default={})


@contextlib.contextmanager
def choose(op: str, name: str) -> Iterator[str]:
    """Inside, `current(op)` is `name` (names already checked by the caller)."""
    token = _current.set({**_current.get(), op: name})
    try:
        yield name
    finally:
        _current.reset(token)


def current(op: str) -> str | None:
    """The backend the innermost `use_backend` block names for `op`, or None outside every block."""
    return _current.get().get(op)
