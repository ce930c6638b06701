"""A ragged_dot backend for tests whose search space holds a good config, a fast wrong one, one that fails
to compile and one that fails at run time.

More modes, outside the default search space (tests pick them with `candidate_values`), each a failure
that a candidate must only ever cause inside a worker process:

* "hang", "crash": the trace (so the compile) sleeps for an hour, or aborts the process.
* "hang_run", "crash_run": the compiled program calls back to Python (io_callback), which sleeps for an
  hour, or aborts the process (SIGABRT). Host callbacks make these executables unserializable ("local").
* "sigkill_run": the program's io_callback SIGKILLs its own process, as the kernel's OOM killer would.
* "oom_run": the compiled program needs a ~1e13-byte temporary buffer (a cumulative sum over a broadcast,
  which XLA does not fuse away), so running it fails when the buffer is allocated, before any of it is
  touched: XLA CPU reports RESOURCE_EXHAUSTED. It compiles fine (shapes are metadata). Whether the
  allocation fails, rather than succeeding virtually and being OOM-killed as it fills up, depends on the
  kernel's overcommit policy (the default heuristic refuses it); tests that run it set
  `workers.MEMORY_LIMIT_ENV` so that the workers' address space is capped (RLIMIT_AS) and it fails the
  same way on any machine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.tiled import tiled_ragged_dot, tiled_transposed_ragged_dot

MODES = ("good", "wrong", "fail_compile", "fail_run")
# Only ever in worker processes: "hang", "crash" (at compile) and RUN_FAILURES (at run).
RUN_FAILURES = ("crash_run", "hang_run", "oom_run", "sigkill_run")
OOM_BYTES = 10**13


@dataclasses.dataclass(frozen=True)
class FaultyConfig(KernelConfig):
    mode: str = "good"
    tm: int = 64


def _raise(x):
    raise RuntimeError("deliberate run-time failure")


def _abort(x):
    import os

    os.abort()


def _sigkill(x):
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _sleep(x):
    import time

    time.sleep(3600)
    return x


def _huge_temporary(x):
    """A scalar that XLA computes through a temporary of OOM_BYTES bytes (never touched: it cannot be had)."""
    big = jnp.broadcast_to(x.astype(jnp.float32), (OOM_BYTES // 4,))
    return jnp.cumsum(big)[-1].astype(x.dtype)


class FaultyRaggedDot(RaggedDotBackend):
    name = "faulty_test"
    config_cls = FaultyConfig
    platforms = ("cpu", "gpu", "tpu")

    def default_config(self, problem):
        return FaultyConfig("good", 64)

    def candidate_values(self, problem):
        return {"mode": list(MODES), "tm": [32, 64]}

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        return tiled_transposed_ragged_dot(lhs, dout, group_sizes, tm=config.tm, batched=True,
                                           out_dtype=out_dtype, num_groups=num_groups, group_offset=group_offset)

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        assert not transpose_rhs, "the tests sweep the forward direction only"
        if config.mode == "fail_compile":
            raise RuntimeError("deliberate compile failure")
        if config.mode == "hang":
            import time

            time.sleep(3600)
        if config.mode == "crash":
            import os

            os.abort()
        if config.mode == "wrong":  # the fastest possible answer, and wrong: it must never win
            return jnp.zeros((lhs.shape[0], rhs.shape[2]), out_dtype)
        out = tiled_ragged_dot(lhs, rhs, group_sizes, tm=config.tm, tail=config.tm, tk=lhs.shape[1],
                               tn=rhs.shape[2], out_dtype=out_dtype, group_offset=group_offset)
        if config.mode == "fail_run":
            out = out + io_callback(_raise, jax.ShapeDtypeStruct((), out_dtype), out[0, 0])
        if config.mode in ("crash_run", "hang_run", "sigkill_run"):
            callback = {"crash_run": _abort, "hang_run": _sleep, "sigkill_run": _sigkill}[config.mode]
            out = out + 0 * io_callback(callback, jax.ShapeDtypeStruct((), out_dtype), out[0, 0])
        if config.mode == "oom_run":
            out = out + 0 * _huge_temporary(out[0, 0])
        return out
