"""Compiling candidates ahead of time, once each, and running each once: in worker processes or here.

- With workers (`workers > 1` on CPU), each candidate is compiled and run once on the sweep's real inputs in a
  worker subprocess (`pool`, running `worker_side.compile_and_run`), under one per-candidate timeout. The
  worker sends back the serialized executable and the output's relative error against the sweep's `Reference`;
  the inputs and the reference reach each worker once per sweep through a shared-memory file (`tuner.candidate`).
  Isolation is the point: a candidate that segfaults, aborts, hangs or runs out of memory takes down only its
  worker and is recorded as failed (stage "compile" or "run", with the reason); the worker is restarted and
  the sweep goes on. The executable compiled in the worker is the one timed; a candidate whose executable
  cannot be serialized (a Python host callback) is compiled again here for timing, only after it ran
  correctly there.
- With one worker, and on TPU (one process per chip), candidates compile here one at a time without a
  timeout (`compile_here`); on GPU they compile here on several threads, since XLA's GPU compile releases the
  GIL and worker processes cannot share a GPU (each would open its own CUDA context, and a Mosaic GPU
  executable does not survive serialization).

`Kernel` binds one op, one of its backends and one problem (it travels to workers by the op's name).
`backend_compiles` counts this thread's real XLA compilations from JAX's monitoring events (compile events
minus persistent-cache hits). Timing (`tuner.timing`) always runs in this process.

The worker processes: one process-wide `moe_tune.workers.WorkerPool` per size, started once
(each start costs a JAX import), whose requests compile and run candidates (`worker_side.compile_and_run`).

The payload a sweep's requests share (its inputs and reference, `candidate.SweepInputs.payload`) is written once
to a shared-memory file (`candidate.store`), or sent while still being made (a `workers.pool.Deferred`, a
`moe_tune.workers.Pending`); in a worker, `shared(token)` reads it back (`candidate.load`), once per token.
Each worker enables the persistent compile cache when the sweep's process did (`worker_side.prepare`), and
caps its address space at `MOE_TUNE_WORKER_MEMORY_LIMIT` when that is set (`MEMORY_LIMIT_ENV`; the tests'
out-of-memory candidate uses it, so that it fails the same way whatever the machine's overcommit policy).

The compile cache: JAX's persistent compilation cache for sweeps, so that re-running or resuming a sweep (and the finalists
recompiled on resume) costs no XLA compile for a candidate compiled before.

Only the tuner turns it on (the CLI's `sweep`, and every compile worker): a model that imports moe-tune
keeps whatever cache settings it has.

JAX never deletes from this cache: every candidate of every sweep stays (2,930 entries, 76 MB, after a day of
CPU sweeps here; a GPU's executables are larger). So a sweep that turns it on first trims it back below
`$MOE_TUNE_COMPILE_CACHE_MAX_BYTES` (4 GiB by default), oldest entries first. JAX's own bound
(`jax_compilation_cache_max_size`) would do it at every write, reading every entry's access-time file under
a lock: per compile, a cost that grows with the cache.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from moe_tune import workers
from moe_tune.core import devices, settings
from moe_tune.core.settings import writable_dir
from moe_tune.kernels import get_op
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.tuner.candidate import (
    Candidate,
    Reference,
    Stored,
    SweepInputs,
    failure_reason,
    load,
    remove,
    short,
    store,
)
from moe_tune.tuner.timing import traceable
from moe_tune.workers import WorkerFailure, WorkerPool
from moe_tune.workers.pool import Deferred

MEMORY_LIMIT_ENV = settings.WORKER_MEMORY_LIMIT

_pools: dict[int, WorkerPool] = {}


def pool(size: int) -> WorkerPool:
    """The process-wide pool of `size` workers, started now; their environment is this process's as it is
    when each starts (`close_pools` after changing it)."""
    if size not in _pools:
        _pools[size] = WorkerPool(size, setup="moe_tune.tuner.worker_side:prepare", store=store,
                                  unstore=remove, start=True)
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
        _loaded[token] = load(payload) if isinstance(payload, Stored) else payload
    return _loaded[token]


@dataclasses.dataclass(frozen=True)
class Kernel:
    op: KernelOp
    backend: Backend
    problem: Any  # the op's problem object (RaggedDotProblem, GatherProblem)

    def __reduce__(self) -> tuple[Callable, tuple[str, Backend, Any]]:
        return _by_name, (self.op.name, self.backend, self.problem)

    def function(self, config: KernelConfig, index: int) -> Callable:
        """The jitted candidate `index`: inputs -> output, named for the profiler trace (`timing.traceable`)."""
        return traceable(lambda inputs: self.op.run(self.backend, config, self.problem, inputs), index)

    def compile(self, config: KernelConfig, index: int, args: Any) -> tuple[Any, int]:
        """(executable for `args` (arrays or ShapeDtypeStructs), how many XLA compilations building it took:
        one, or zero on a persistent-cache hit)."""
        before = backend_compiles()
        compiled = self.function(config, index).lower(args).compile()
        return compiled, backend_compiles() - before


def _by_name(op: str, backend: Backend, problem: Any) -> Kernel:
    return Kernel(get_op(op), backend, problem)


OK, WRONG, FAILED = "ok", "wrong", "failed"














def compile_here(kernel: Kernel, candidates: Sequence[Candidate], inputs: Any,
                 on_done: Callable[[Candidate], None] | None = None, threads: int = 1) -> None:
    """Compile each candidate for `inputs`; a failure is recorded at stage "compile" with its reason.
    `on_done(candidate)` is called on this thread as each is done."""
    if threads <= 1 or len(candidates) <= 1:
        for cand in candidates:
            _compile_one(kernel, cand, inputs)
            if on_done is not None:
                on_done(cand)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moe-tune-compile") as pool:
        futures = [pool.submit(_compile_one, kernel, cand, inputs) for cand in candidates]
        for future in as_completed(futures):
            cand = future.result()
            if on_done is not None:
                on_done(cand)


def _compile_one(kernel: Kernel, cand: Candidate, inputs: Any) -> Candidate:
    start = time.perf_counter()
    try:
        cand.executable, compiles = kernel.compile(cand.config, cand.index, inputs)
        cand.compiles += compiles
    except Exception as e:  # noqa: BLE001 - any failure is recorded as the candidate's reason
        cand.fail("compile", failure_reason(e))
    cand.compile_s = time.perf_counter() - start
    return cand


OnDone = Callable[[Candidate], None]


def uses_workers(workers: int) -> bool:
    """Whether `compile_all` compiles in worker processes (see the module docstring)."""
    return workers > 1 and devices.platform() == "cpu"


def start_workers(workers: int) -> None:
    """Start the worker processes `compile_all` will use, if it will, so that their start-up (a JAX import
    each, about a second) overlaps whatever the caller does before compiling."""
    if uses_workers(workers):
        pool(workers)


def compile_all(kernel: Kernel, candidates: Sequence[Candidate], inputs: Mapping[str, jax.Array] | SweepInputs,
                reference: Reference | None = None, *, workers: int, on_done: OnDone | None = None,
                timeout: float | None = None) -> None:
    """Compile every candidate once, ahead of time; `on_done(candidate)` as each is done.

    `inputs`: the inputs on the device with their `reference`, or a sweep's `SweepInputs` (which holds its
    reference): with workers, their compiles then start before its reference and device copy are made.

    With `workers > 1` on CPU, each candidate is compiled and run once in a worker process (JAX's
    compile does not run two at once in one process, and a candidate that crashes, hangs or runs out of
    memory must not take the sweep with it); it comes back serialized, with its relative error against
    `reference` (`worker_error`) for `check_all`.
    A candidate whose compile and first run take longer than `timeout` seconds has its worker killed and
    is recorded as failed, as is one whose worker dies. Otherwise candidates compile here: one at a time,
    or on GPU on `workers` threads.
    """
    if uses_workers(workers):
        prepared = inputs if isinstance(inputs, SweepInputs) else SweepInputs.given(inputs, reference)
        _compile_in_workers(kernel, candidates, prepared, workers, on_done, timeout)
    else:
        threads = workers if devices.platform() == "gpu" else 1
        compile_here(kernel, candidates, inputs.device if isinstance(inputs, SweepInputs) else inputs, on_done,
                     threads=threads)


def _compile_in_workers(kernel: Kernel, candidates: Sequence[Candidate], inputs: SweepInputs, workers: int,
                        on_done: OnDone | None, timeout: float | None) -> None:
    shapes, token = inputs.shapes, inputs.token  # one payload per (inputs, reference): once per worker per sweep
    local: list[Candidate] = []  # ran fine in a worker but cannot travel: compiled here for timing

    def finish(cand: Candidate, status: str, value: Any) -> None:
        if inputs.failed():  # inputs that could not be made raise their error here: no candidate's failure
            inputs.wait()
        if status != "ok":
            _record_worker_failure(cand, value)
        elif not _take_result(cand, value):
            local.append(cand)
            return
        if on_done is not None:
            on_done(cand)

    requests = [(c, (kernel, c.config, c.index, shapes, token)) for c in candidates]
    pool(workers).map("moe_tune.tuner.worker_side:compile_and_run", requests, finish,
                                     timeout=timeout, shared=(token, Deferred(inputs.payload, inputs.payload_ready)))
    worker_s = {c.index: c.compile_s or 0.0 for c in local}
    if local:
        compile_here(kernel, local, inputs.device)
    for cand in local:
        cand.compile_s = (cand.compile_s or 0.0) + worker_s[cand.index]
        if on_done is not None:
            on_done(cand)


def _take_result(cand: Candidate, value: dict[str, Any]) -> bool:
    """Record a worker's answer (`worker_side.compile_and_run`) on `cand`; False when the candidate ran
    correctly there but its executable cannot travel (it is compiled here, for timing)."""
    cand.compile_s, cand.compiles = value["compile_s"], value["compiles"]
    if value["status"] != OK:
        cand.fail(value["stage"], value["reason"])
        return True
    cand.worker_error = value["error"]
    if value["executable"] is None:
        return False
    try:
        cand.executable = serialize_executable.deserialize_and_load(*value["executable"])
    except Exception as e:  # noqa: BLE001
        cand.worker_error = None
        cand.fail("compile", f"could not load the executable compiled in the worker: {short(e)}")
    return True


def _record_worker_failure(cand: Candidate, failure: WorkerFailure) -> None:
    """Record a request whose worker died, hung or raised; the stage is the one it had reached."""
    compiled = next((p for p in failure.progress if isinstance(p, dict) and p.get("compiled")), None)
    if compiled is not None:
        cand.compile_s, cand.compiles = compiled["compile_s"], compiled["compiles"]
    stage = "run" if compiled is not None else "compile"
    doing = "running the candidate" if compiled is not None else "compiling the candidate"
    if failure.kind == "died" and failure.returncode == -signal.SIGKILL:
        # The pool kills a worker only on timeout, which is recorded as such: SIGKILL from elsewhere on
        # Linux is nearly always the kernel's OOM killer.
        reason = (f"out of memory: {failure.describe()} {doing} (killed from outside the sweep; on Linux "
                  f"usually the kernel's OOM killer)")
    elif failure.kind == "error":
        reason = f"{failure.message} (in the worker, {doing})"
    else:
        reason = f"{failure.describe()} {doing}"
    cand.fail(stage, reason)


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


def cache_dir() -> Path | None:
    """`$MOE_TUNE_COMPILE_CACHE_DIR` ("off" disables), else `<user cache dir>/moe-tune/jax_cache`."""
    return settings.compile_cache_dir()


def check_cache() -> Path | None:
    """`cache_dir()`, created, once a file can be written in it (None when disabled); a MoeTuneError naming
    it and the variable otherwise (JAX would only warn at each cache write), a UsageError for a bad
    `$MOE_TUNE_COMPILE_CACHE_MAX_BYTES`. A sweep's preflight calls it."""
    directory = cache_dir()
    if directory is None:
        return None
    settings.compile_cache_max_bytes()  # a bad value: one line naming the variable, before the sweep
    return writable_dir(directory, "cannot create or write the compile cache dir",
                        f"; set ${settings.COMPILE_CACHE_DIR} to a writable dir, or to `off`")


def enable_cache(*, trim_to_size: bool = True) -> Path | None:
    """Point JAX's persistent compilation cache at `cache_dir()` and cache every executable, however quick
    its compile (JAX's default skips compiles under a second: most candidates of a CPU sweep). Returns the
    dir, or None when disabled. Call before the first compile. Raises what `check` raises. `trim_to_size`:
    first `trim` it to `$MOE_TUNE_COMPILE_CACHE_MAX_BYTES` (the sweep's process does; its workers do not)."""
    directory = check_cache()
    if directory is None:
        return None
    if trim_to_size:
        trim_cache(directory, settings.compile_cache_max_bytes())
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    settings.share_compile_cache_dir(directory)  # compile workers inherit the same dir
    return directory


# The files JAX's cache writes (jax/_src/lru_cache.py): only these are ever removed, whatever else the dir holds.
ENTRY_SUFFIXES = ("-cache", "-atime")


def trim_cache(directory: Path, max_bytes: int) -> int:
    """When the cache entries in `directory` take more than `max_bytes`, remove the oldest written until they
    take at most 3/4 of it (so that the next sweeps need not trim again); returns the bytes removed. An entry
    another process removes or replaces meanwhile is passed over."""
    entries = []
    with os.scandir(directory) as found:
        for entry in found:
            if entry.name.endswith(ENTRY_SUFFIXES):
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entries.append((stat.st_mtime_ns, stat.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    removed = 0
    for _, size, path in sorted(entries):
        if total - removed <= max_bytes * 3 // 4:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed += size
    return removed
