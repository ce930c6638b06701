"""The PTX a GPU target's compiler produced for each compiled kernel call, from compile workers that dump it.

`PtxPool` runs compile workers (`jobs.compile_job` in `moe_tune.workers` processes with the compile-only
wheels, as `jobs.CompilePool` does) whose `XLA_FLAGS` carry `--xla_dump_to=DIR`, one fresh folder per worker
process: XLA:GPU writes each compiled module's PTX there (`module_NNNN.<name>....ptx`, every kernel of the
module, Triton's included). A job's PTX is that of the modules whose files appeared while it compiled (one
job at a time per worker, so no other job's); their files are removed once read. A Mosaic GPU kernel's PTX
is not in XLA's dump (the custom call carries its own compiled module): the workers also set
`MOSAIC_GPU_DUMP_PTX`, and its files are read the same way. `ptx_mix` reads the text.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moe_tune.core.chips import get_target
from moe_tune.targets import wheels
from moe_tune.targets.compile import CompileResult
from moe_tune.targets.jobs import CompileJob, _failed, compile_job
from moe_tune.workers import WorkerPool

_DUMP_FLAG = "--xla_dump_to="
_MOSAIC_DIR = "MOSAIC_GPU_DUMP_TO"


def _dump_dir() -> Path | None:
    """This process's XLA dump folder (from `XLA_FLAGS`), None when it dumps nothing."""
    found = re.search(re.escape(_DUMP_FLAG) + r"(\S+)", os.environ.get("XLA_FLAGS", ""))
    return Path(found.group(1)) if found else None


def _modules(folder: Path) -> set[str]:
    """The dumped modules (`module_0012.jit_call`) that have PTX in `folder`."""
    return {".".join(p.name.split(".")[:2]) for p in folder.glob("*.ptx")}


def compile_with_ptx(job: CompileJob) -> tuple[CompileResult, str]:
    """In a dumping compile worker: `jobs.compile_job(job)` and the PTX of the modules it compiled (empty
    when it compiled none, or the process dumps nothing)."""
    folder = _dump_dir()
    before = _modules(folder) if folder is not None and folder.is_dir() else set()
    result = compile_job(job)
    mosaic = _mosaic_gpu_ptx()
    if folder is None or not result.ok:
        return result, ""
    new = sorted(_modules(folder) - before)
    ptx = "".join(p.read_text() for name in new for p in sorted(folder.glob(f"{name}.*.ptx"))) + mosaic
    for name in new:  # read: free the disk as it goes (a module's dumps, HLO and LLVM IR, run to megabytes)
        for path in folder.glob(f"{name}.*"):
            path.unlink(missing_ok=True)
    return result, ptx


def _mosaic_gpu_ptx() -> str:
    """The PTX of the Mosaic GPU kernels compiled since the last call: their compiler writes it apart from
    XLA's (`MOSAIC_GPU_DUMP_PTX`, into `MOSAIC_GPU_DUMP_TO`: `<kernel>_<n>.ptx`, beside the pass logs and
    ptxas' report); every file there is removed once read, so a file's name may come back."""
    folder = os.environ.get(_MOSAIC_DIR)
    if not folder or not Path(folder).is_dir():
        return ""
    ptx = "".join(p.read_text() for p in sorted(Path(folder).glob("*.ptx")))
    for path in Path(folder).iterdir():
        path.unlink(missing_ok=True)
    return ptx


class PtxPool:
    """`workers` dumping compile workers; `compile(jobs)` -> one (CompileResult, PTX text) per job, in order.

    Each worker dumps into its own temporary folder, removed by `close()` (a context manager)."""

    def __init__(self, workers: int = 1, timeout: float | None = 600.0) -> None:
        self._folders: list[str] = []
        self.timeout = timeout
        self._pool = WorkerPool(max(1, workers), env=self._env)

    def _env(self) -> dict[str, str]:
        folder = tempfile.mkdtemp(prefix="moe_tune_ptx_")
        self._folders.append(folder)
        env = wheels.worker_env()
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_DUMP_FLAG}{folder}".strip()
        mosaic = os.path.join(folder, "mosaic_gpu")  # the Mosaic GPU compiler's own dumps (it needs the folder)
        os.makedirs(mosaic)
        env.update({"MOSAIC_GPU_DUMP_PTX": "1", _MOSAIC_DIR: mosaic})
        return env

    def __enter__(self) -> PtxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compile(self, jobs: Iterable[CompileJob],
                on_result: Callable[[int, CompileJob, CompileResult, str], None] | None = None,
                ) -> list[tuple[CompileResult, str]]:
        jobs = list(jobs)
        for platform in sorted({get_target(job.target).platform for job in jobs}):
            wheels.require(platform)
        out: list[Any] = [None] * len(jobs)

        def arrived(index: int, status: str, value: Any) -> None:
            out[index] = value if status == "ok" else (_failed(jobs[index], value), "")
            if on_result is not None:
                on_result(index, jobs[index], *out[index])

        self._pool.map("moe_tune.targets.ptx_dump:compile_with_ptx", [(i, (job,)) for i, job in enumerate(jobs)],
                       arrived, timeout=self.timeout, affinity=lambda i: jobs[i].target)
        return out

    def close(self) -> None:
        self._pool.close()
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)
        self._folders.clear()
