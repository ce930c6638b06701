"""The tuner's worker processes: one process-wide `moe_tune.workers.WorkerPool` per size, started once
(each start costs a JAX import), whose requests compile and run candidates (`worker_side.compile_and_run`).

The payload a sweep's requests share (its inputs and reference, `inputs.SweepInputs.payload`) is written once
to a shared-memory file (`inputs.store`), or sent while still being made (a `workers.pool.Deferred`, a
`moe_tune.workers.Pending`); in a worker, `shared(token)` reads it back (`inputs.load`), once per token.
Each worker enables the persistent compile cache when the sweep's process did (`worker_side.prepare`), and
caps its address space at `MOE_TUNE_WORKER_MEMORY_LIMIT` when that is set (`MEMORY_LIMIT_ENV`; the tests'
out-of-memory candidate uses it, so that it fails the same way whatever the machine's overcommit policy).
"""

from __future__ import annotations

import atexit
from typing import Any

from moe_tune import workers
from moe_tune.core import settings
from moe_tune.tuner import inputs
from moe_tune.workers import WorkerPool

MEMORY_LIMIT_ENV = settings.WORKER_MEMORY_LIMIT

_pools: dict[int, WorkerPool] = {}


def pool(size: int) -> WorkerPool:
    """The process-wide pool of `size` workers, started now; their environment is this process's as it is
    when each starts (`close_pools` after changing it)."""
    if size not in _pools:
        _pools[size] = WorkerPool(size, setup="moe_tune.tuner.worker_side:prepare", store=inputs.store,
                                  unstore=inputs.remove, start=True)
    return _pools[size]


@atexit.register
def close_pools() -> None:
    """Stop every worker; the next `pool(...)` starts fresh ones (e.g. after changing their environment)."""
    while _pools:
        _pools.popitem()[1].close()


_loaded: dict[str, Any] = {}


def shared(token: str) -> Any:
    """In a worker: the payload shared under `token`, read from its file once (one payload at a time)."""
    if token not in _loaded:
        payload = workers.shared(token)
        _loaded.clear()
        _loaded[token] = inputs.load(payload) if isinstance(payload, inputs.Stored) else payload
    return _loaded[token]
