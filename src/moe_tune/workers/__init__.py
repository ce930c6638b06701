"""One crash-isolating worker pool, for whatever must run in processes of its own: the tuner compiles and
runs candidates in it, the compile targets compile calls for chips this machine does not have.

- `pool`: `WorkerPool` (the processes: their environment, a setup function, deadlines and kills, restarts,
  affinity keys, shared payloads, progress), `Worker`, `WorkerFailure` (how a request did not come back).
- `protocol`: the framing between the pool and its workers.
- `worker`: the worker's side (`python -m moe_tune.workers`); `progress` and `shared` for the requests'
  functions.

The pool knows nothing of what its requests do: a request names its function as "module:function".
It imports only the standard library and `moe_tune.core`.
"""

from moe_tune.workers.pool import START_LIMIT_S, Pending, Worker, WorkerFailure, WorkerPool, inherited_env
from moe_tune.workers.worker import progress, shared

__all__ = ["START_LIMIT_S", "Pending", "Worker", "WorkerFailure", "WorkerPool", "inherited_env", "progress",
           "shared"]
