"""Which configs to compile for a target (a backend's search space as the chip's own rules prune it), and
compiling them in worker processes (`CompilePool`, on a `moe_tune.workers` pool).

Each worker is a fresh `python -m moe_tune.workers` with the compile-only wheels on its path
(`wheels.worker_env`), so the process using the pool never loads libtpu or the CUDA plugin; it runs
`compile_job` for each job. A worker keeps its topologies between jobs, but serves one GPU target only: once
a process has compiled Mosaic GPU code for one compute capability, ptxas rejects another's (sm_100 after
sm_90: "SM version specified by .target is higher than default SM version assumed"), so a job for another GPU
target gets a fresh worker (the job's affinity is its GPU target). A job that kills its worker (an LLVM
fatal error aborts the process) is a `crashed` result naming the last error the worker printed, and the
worker is replaced.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from moe_tune.core.chips import Target, get_target
from moe_tune.kernels import get_op
from moe_tune.kernels.base import KernelConfig
from moe_tune.targets import wheels
from moe_tune.targets.compile import CRASHED, ERROR, CompileResult, acting_as, first_line
from moe_tune.workers import WorkerFailure, WorkerPool

# the prefix of an absl / glog line (`E1125 14:35:56.083957    8580 file.cc:460] `), stripped before reading
_LOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
# lines that never explain a crash: start-up chatter and the frame of a stack trace
_NOISE = re.compile(r"cuda drivers|All log messages before|Logging before InitGoogle|stack trace \*\*\*|^@ ")


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One kernel call to compile: target name, op, backend name, problem and config."""

    target: str
    op: str
    backend: str
    problem: Any
    config: KernelConfig


def search_space(target: Target, op: str, backend: str, problem: Any) -> list[KernelConfig]:
    """The backend's search space for `problem` as it is on the target chip (its budgets, its platform)."""
    with acting_as(target):
        return get_op(op).backends.get(backend).search_space(problem)


def config_error(target: Target, op: str, backend: str, config: KernelConfig, problem: Any) -> str | None:
    """The backend's `config_error` as it is on the target chip."""
    with acting_as(target):
        return get_op(op).backends.get(backend).config_error(config, problem)


def representative(space: list[KernelConfig], extra: int = 2) -> list[KernelConfig]:
    """The default (first) config, then the smallest and the largest of the rest by the product of their
    fields (the largest is the one nearest the chip's limits); `extra` = 1 keeps only the largest."""
    rest = sorted(space[1:], key=lambda c: (math.prod(dataclasses.astuple(c)), dataclasses.astuple(c)))
    ends = ([*rest[:1], *rest[-1:]] if extra >= 2 else rest[-1:]) if rest else []
    return list(dict.fromkeys([space[0], *ends]))


def sample(space: list[KernelConfig], size: int | None, seed: int = 0) -> list[KernelConfig]:
    """`space` whole when `size` is None or covers it, else the default and a seeded sample of the rest."""
    if size is None or len(space) <= size:
        return list(space)
    return [space[0], *random.Random(seed).sample(space[1:], size - 1)]


def jobs_for(target: Target, op: str, backend: str, problem: Any, configs: list[KernelConfig]) -> list[CompileJob]:
    return [CompileJob(target.name, op, backend, problem, config) for config in configs]


def compile_job(job: CompileJob) -> CompileResult:
    """In a compile worker: compile one job for its target (`compile.compile_call`); a call that cannot be
    traced is an `error` result (its traceback printed to stderr), and the worker goes on."""
    from moe_tune.targets.calls import abstract_inputs, kernel_call
    from moe_tune.targets.compile import compile_call

    target = get_target(job.target)
    start = time.perf_counter()
    try:
        fn = kernel_call(job.op, job.backend, job.problem, job.config)
        return compile_call(target, fn, lambda device: abstract_inputs(job.op, job.problem, device))
    except Exception as e:  # noqa: BLE001 - reported as the job's result, the worker goes on
        traceback.print_exc()
        return CompileResult(target.name, ERROR, first_line(f"{type(e).__name__}: {e}"), "trace",
                             time.perf_counter() - start)


def crash_line(stderr_text: str) -> str:
    """What a dead worker said that explains its death: its last line naming a fatal error, else an error
    or an abort, else its last line that is not start-up chatter (log prefixes stripped)."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in stderr_text.splitlines()]
    lines = [line for line in lines if line and not _NOISE.search(line)]
    for pattern in (r"fatal", r"error|abort"):
        found = [line for line in lines if re.search(pattern, line, re.I)]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else ""


def _affinity(job: CompileJob) -> str | None:
    """The one GPU target a process may compile for (TPU targets share any process)."""
    return job.target if get_target(job.target).platform == "gpu" else None


def _failed(job: CompileJob, failure: WorkerFailure) -> CompileResult:
    """The result of a job whose worker died, was killed past the deadline, or raised."""
    if not failure.started:
        raise RuntimeError(f"a compile worker did not start: {crash_line(failure.output) or 'no message'}")
    if failure.kind == "error":
        return CompileResult(job.target, ERROR, first_line(failure.message), "trace")
    if failure.kind == "timeout":
        how, said = "signal SIGKILL", f"timed out after {failure.timeout:.0f} s"
    else:
        code = failure.returncode
        how = (f"signal {failure.signal_name}" if code is not None and code < 0 else
               "unknown exit status" if code is None else f"exit code {code}")
        said = crash_line(failure.output)
    return CompileResult(job.target, CRASHED, f"the compiling process died ({how}): {said}".rstrip(": "), "compile")


class CompilePool:
    """`workers` compile worker processes, started on first use and kept until `close()` (a context manager).

    `compile(jobs)` returns one `CompileResult` per job, in order; `on_result(index, job, result)` is called
    on the caller's thread as each arrives. `timeout` (seconds per job) kills a worker that takes longer,
    recorded as `crashed`. MissingCompilerError (one line) when the jobs' compilers are not installed.
    """

    def __init__(self, workers: int = 2, timeout: float | None = 600.0) -> None:
        self.size, self.timeout = max(1, workers), timeout
        self._pool = WorkerPool(self.size, env=wheels.worker_env)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compile(self, jobs: Iterable[CompileJob],
                on_result: Callable[[int, CompileJob, CompileResult], None] | None = None) -> list[CompileResult]:
        jobs = list(jobs)
        for platform in sorted({get_target(job.target).platform for job in jobs}):
            wheels.require(platform)
        results: list[CompileResult | None] = [None] * len(jobs)

        def arrived(index: int, status: str, value: Any) -> None:
            results[index] = result = value if status == "ok" else _failed(jobs[index], value)
            if on_result is not None:
                on_result(index, jobs[index], result)

        order = sorted(range(len(jobs)), key=lambda i: jobs[i].target)  # one target's jobs together
        self._pool.map("moe_tune.targets.jobs:compile_job", [(i, (jobs[i],)) for i in order], arrived,
                       timeout=self.timeout, affinity=lambda i: _affinity(jobs[i]))
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self._pool.close()
