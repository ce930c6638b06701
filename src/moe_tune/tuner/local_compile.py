"""Compile candidates in this process, without a timeout: one worker, TPU (one process per chip) and GPU.
A candidate compiled here is run for the first time by the correctness gate (`gate.check_all`).

On GPU the compiles run on `threads` threads: XLA's GPU compile (Triton's and Mosaic GPU's passes, ptxas)
releases the GIL, so they overlap. Worker processes cannot serve a GPU: each would open its own CUDA context
and take its own share of the device's memory, and a Mosaic GPU executable does not survive serialization
(its host symbols are not found when it is loaded in another process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from moe_tune.tuner.candidate import Candidate, failure_reason
from moe_tune.tuner.kernel import Kernel


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
