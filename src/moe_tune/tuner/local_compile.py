"""Compile candidates in this process, one at a time and without a timeout (one worker, or TPU: one process
per chip). A candidate compiled here is run for the first time by the correctness gate (`gate.check_all`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from moe_tune.tuner.candidate import Candidate, failure_reason
from moe_tune.tuner.kernel import Kernel


def compile_here(kernel: Kernel, candidates: Sequence[Candidate], inputs: Any,
                 on_done: Callable[[Candidate], None] | None = None) -> None:
    """Compile each candidate for `inputs`; a failure is recorded at stage "compile" with its reason."""
    for cand in candidates:
        start = time.perf_counter()
        try:
            cand.executable, compiles = kernel.compile(cand.config, cand.index, inputs)
            cand.compiles += compiles
        except Exception as e:  # noqa: BLE001 - any failure is recorded as the candidate's reason
            cand.fail("compile", failure_reason(e))
        cand.compile_s = time.perf_counter() - start
        if on_done is not None:
            on_done(cand)
