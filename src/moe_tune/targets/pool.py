"""Compile many kernel calls for target chips in parallel worker processes.

Each worker is a fresh `python -m moe_tune.targets.worker` with the compile-only wheels on its path
(`wheels.worker_env`), so the process using the pool never loads libtpu or the CUDA plugin. A worker keeps
its topologies between jobs, but serves one GPU target only: once a process has compiled Mosaic GPU code for
one compute capability, ptxas rejects another's (sm_100 after sm_90: "SM version specified by .target is higher
than default SM version assumed"), so a job for another GPU target gets a fresh worker. A job that kills its
worker (an LLVM fatal error aborts the process) is a `crashed` result naming the last error the worker printed,
and the worker is replaced.
"""

from __future__ import annotations

import dataclasses
import base64
import json
import pickle
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moe_tune.kernels.base import KernelConfig
from moe_tune.targets import wheels
from moe_tune.core.chips import get_target
from moe_tune.targets.compile import CRASHED, CompileResult
from moe_tune.targets.worker import RESULT_PREFIX

STARTUP_TIMEOUT_S = 120.0
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


class _Worker:
    """One worker process and the file its stderr goes to."""

    def __init__(self) -> None:
        self.gpu_target: str | None = None  # the one GPU target this process has compiled for
        self.stderr = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen([sys.executable, "-m", "moe_tune.targets.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=wheels.worker_env(), text=True)
        if self._read(STARTUP_TIMEOUT_S) is None:
            raise RuntimeError(f"a compile worker did not start: {self._stderr_since(0) or 'no message'}")

    def _read(self, timeout: float | None) -> dict | None:
        """The next result line, or None when the process died (or was killed for passing `timeout`)."""
        timer = threading.Timer(timeout, self.proc.kill) if timeout else None
        if timer:
            timer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(RESULT_PREFIX):
                    return json.loads(line[len(RESULT_PREFIX):])
            return None
        finally:
            if timer:
                timer.cancel()

    def _stderr_since(self, offset: int) -> str:
        self.stderr.seek(offset)
        text = self.stderr.read().decode("utf-8", "replace")
        self.stderr.seek(0, 2)
        return crash_line(text)

    def run(self, job_id: int, job: CompileJob, timeout: float | None) -> CompileResult:
        offset = self.stderr.seek(0, 2)
        self.proc.stdin.write(base64.b64encode(pickle.dumps((job_id, job))).decode() + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout)
        if reply is not None:
            return CompileResult.from_dict(reply)
        code = self.proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        said = self._stderr_since(offset)
        if code == -signal.SIGKILL and timeout:
            said = f"timed out after {timeout:.0f} s"
        return CompileResult(job.target, CRASHED, f"the compiling process died ({how}): {said}".rstrip(": "),
                             "compile")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def serves(self, target: str) -> bool:
        """Whether this process may compile for `target` (alive, and no other GPU target compiled in it)."""
        return self.alive and (get_target(target).platform != "gpu" or self.gpu_target in (None, target))

    def close(self) -> None:
        if self.alive:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


class CompilePool:
    """`workers` compile worker processes, started on first use and kept until `close()` (a context manager).

    `compile(jobs)` returns one `CompileResult` per job, in order; `on_result(index, job, result)` is called
    as each arrives (from the pool's threads, one at a time). `timeout` (seconds per job) kills a worker
    that takes longer, recorded as `crashed`.
    """

    def __init__(self, workers: int = 2, timeout: float | None = 600.0) -> None:
        self.size, self.timeout = max(1, workers), timeout
        self._workers: list[_Worker | None] = [None] * self.size
        self._lock = threading.Lock()

    def __enter__(self) -> "CompilePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compile(self, jobs: Iterable[CompileJob],
                on_result: Callable[[int, CompileJob, CompileResult], None] | None = None) -> list[CompileResult]:
        jobs = list(jobs)
        for platform in sorted({get_target(job.target).platform for job in jobs}):
            wheels.require(platform)
        results: list[CompileResult | None] = [None] * len(jobs)
        todo: queue.Queue[int] = queue.Queue()
        for index in sorted(range(len(jobs)), key=lambda i: jobs[i].target):  # one target's jobs together
            todo.put(index)
        errors: list[BaseException] = []

        def drain(slot: int) -> None:
            try:
                while True:
                    try:
                        index = todo.get_nowait()
                    except queue.Empty:
                        return
                    worker, target = self._workers[slot], jobs[index].target
                    if worker is None or not worker.serves(target):
                        if worker is not None:
                            worker.close()
                        worker = self._workers[slot] = _Worker()
                    if get_target(target).platform == "gpu":
                        worker.gpu_target = target
                    results[index] = result = worker.run(index, jobs[index], self.timeout)
                    if on_result is not None:
                        with self._lock:
                            on_result(index, jobs[index], result)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=drain, args=(slot,), daemon=True)
                   for slot in range(min(self.size, len(jobs)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.close()
            self._workers[slot] = None
