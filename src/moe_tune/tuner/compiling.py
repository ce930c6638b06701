"""Compile candidates ahead of time, once each, and run each once: in worker processes, or in this process.

What runs where:

* With workers (`workers > 1` on CPU and GPU), each candidate is compiled AND run once, on the sweep's
  real inputs, in a worker subprocess (`workers.py`, running `worker_side.compile_and_run`), under one
  per-candidate timeout for both. The worker sends back the serialized executable and the output's relative
  error against the sweep's reference (`gate.Reference`), computed there. The inputs and the reference go to
  each worker once per sweep (`SweepInputs.token`), not with every request, through one shared-memory file
  (`shared_payload`). A sweep's requests go out before its reference is made (`tuner/inputs.py`): a worker
  compiles, then asks for them. `gate.check_all` then judges the candidate here by that error, without running it in
  this process. (Sending the output back cost a copy through the pipe and a comparison here per candidate, ~1.6 s
  of this process's time in a 64-candidate sweep, on the cores the workers compile on: NOTES.md, issue 32,
  session 15.) The reason is isolation: a candidate that segfaults, aborts, hangs or runs out of memory
  when run takes down (or stalls) only its worker; it is recorded as failed at stage "run" with the reason
  -- "worker died (SIGABRT, signal 6) running the candidate", "worker hung: timed out after N s running the
  candidate", "out of memory: ..." (XLA's RESOURCE_EXHAUSTED, a MemoryError, or the worker SIGKILLed, which
  on Linux usually means the OOM killer) -- the worker is restarted and the sweep goes on. The same failures
  during the compile are recorded at stage "compile". The executable compiled in the worker is the one that
  is timed: nothing is compiled twice, with one exception: a candidate whose executable cannot be
  serialized (a Python host callback) is still compiled and checked in the worker, and only if it ran there
  correctly is it compiled a second time here, for timing (its `compiles` counts both). A candidate that
  crashed or hung in a worker is never run in this process.
* With one worker, and on TPU (one process per chip), candidates compile here (`local_compile`), one at a
  time, without a timeout, and `check_all` runs each once here: a crashing candidate then takes the sweep
  down with it. On GPU they compile here too, on `workers` threads (`local_compile` says why not in
  worker processes).

Timing (`timing.py`) always runs in this process, on the executables compiled as above.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental import serialize_executable

from moe_tune.core import devices
from moe_tune.tuner import workers as workers_module
from moe_tune.tuner.candidate import OK, Candidate, short
from moe_tune.tuner.gate import Reference
from moe_tune.tuner.kernel import Kernel
from moe_tune.tuner.inputs import SweepInputs
from moe_tune.tuner.local_compile import compile_here
from moe_tune.tuner.shared_payload import Deferred

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


def _record_worker_failure(cand: Candidate, failure: workers_module.WorkerFailure) -> None:
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
