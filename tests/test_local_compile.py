"""Candidates compiled in this process on several threads (the GPU path, `local_compile.compile_here`):
each gets its own executable and its own count of XLA compilations, and a failure stays with its candidate."""

from __future__ import annotations

import jax
import numpy as np

from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.tuner.candidate import Candidate, Reference, check_all
from moe_tune.tuner.compiling import Kernel, compile_here

TINY = RaggedDotProblem(m=128, k=64, n=64, groups=4)


def test_threads_compile_each_candidate_once_and_keep_failures_apart(monkeypatch):
    op, backend = get_op("ragged_dot"), BACKENDS.get("tiled")
    host = op.make_inputs(TINY, "balanced", 0)
    inputs = jax.device_put(host)
    configs = backend.search_space(TINY)[:4]
    cands = [Candidate(i, cfg) for i, cfg in enumerate(configs)]
    broken = cands[2]
    kernel = Kernel(op, backend, TINY)
    compile_one = Kernel.compile

    def compile_or_fail(self, config, index, args):
        if index == broken.index:
            raise RuntimeError("planted compile failure")
        return compile_one(self, config, index, args)

    monkeypatch.setattr(Kernel, "compile", compile_or_fail)
    done = []
    compile_here(kernel, cands, inputs, on_done=done.append, threads=3)
    assert sorted(c.index for c in done) == [c.index for c in cands]
    assert broken.status == "failed" and broken.stage == "compile" and "planted" in broken.reason
    ok = [c for c in cands if c is not broken]
    assert all(c.executable is not None and c.compiles == 1 and c.compile_s > 0 for c in ok)
    check_all(ok, inputs, Reference.of(op.reference(TINY, host)), op.tolerance(TINY))
    assert all(c.status == "ok" and c.error is not None for c in ok)
    out = np.asarray(ok[0].executable(inputs))
    assert out.shape == (TINY.m, TINY.n) and np.isfinite(out).all()
