"""Compiling candidates ahead of time, once each, and running each once: in worker processes or here.

- With workers (`workers > 1` on CPU), each candidate is compiled and run once on the sweep's real inputs in a
  worker subprocess (`workers.py` running `worker_side.compile_and_run`), under one per-candidate timeout. The
  worker sends back the serialized executable and the output's relative error against the sweep's `Reference`;
  the inputs and the reference reach each worker once per sweep through a shared-memory file (`tuner.inputs`).
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
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
from jax.experimental import serialize_executable

from moe_tune.core import devices
from moe_tune.kernels import get_op
from moe_tune.kernels.base import Backend, KernelConfig
from moe_tune.kernels.kernel_op import KernelOp
from moe_tune.tuner import workers as workers_module
from moe_tune.tuner.candidate import Candidate, Reference, failure_reason, short
from moe_tune.tuner.inputs import SweepInputs
from moe_tune.tuner.timing import traceable
from moe_tune.workers import WorkerFailure
from moe_tune.workers.pool import Deferred


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
        workers_module.pool(workers)


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
    workers_module.pool(workers).map("moe_tune.tuner.worker_side:compile_and_run", requests, finish,
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
