"""How many XLA compilations this process has run, from JAX's monitoring events.

JAX records the compile-duration event around "compile, or load from the persistent cache", and a cache hit
event when it loads: real compilations are the difference. The listeners are registered once, when this
module is first imported (in the sweep's process and in each compile worker). JAX sends both events on the
thread that compiles, so the count is kept per thread: compiles on other threads (GPU candidates compile on
several, `local_compile`) do not leak into a candidate's count.
"""

from __future__ import annotations

import threading
from typing import Any

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_per_thread = threading.local()


def _add(n: int) -> None:
    _per_thread.compiles = getattr(_per_thread, "compiles", 0) + n


def _count_compiles(event: str, seconds: float, **_: Any) -> None:
    if event == _COMPILE_EVENT:
        _add(1)


def _count_cache_hits(event: str, **_: Any) -> None:
    if event == _CACHE_HIT_EVENT:
        _add(-1)


jax.monitoring.register_event_duration_secs_listener(_count_compiles)
jax.monitoring.register_event_listener(_count_cache_hits)


def backend_compiles() -> int:
    """XLA compilations this thread has run so far (persistent-cache hits are loads, not compilations, and do
    not count)."""
    return getattr(_per_thread, "compiles", 0)
