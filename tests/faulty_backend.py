"""A ragged_dot backend for tests whose search space holds a good config, a fast wrong one, one that fails
to compile and one that fails at run time."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.kernels.ragged_dot.tiled import tiled_ragged_dot, tiled_transposed_ragged_dot

MODES = ("good", "wrong", "fail_compile", "fail_run")  # also "hang" and "crash" (compile workers only)


@dataclasses.dataclass(frozen=True)
class FaultyConfig(KernelConfig):
    mode: str = "good"
    tm: int = 64


def _raise(x):
    raise RuntimeError("deliberate run-time failure")


class FaultyRaggedDot(RaggedDotBackend):
    name = "faulty_test"
    config_cls = FaultyConfig
    platforms = ("cpu", "gpu", "tpu")

    def default_config(self, problem):
        return FaultyConfig("good", 64)

    def candidate_values(self, problem):
        return {"mode": list(MODES), "tm": [32, 64]}

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        return tiled_transposed_ragged_dot(lhs, dout, group_sizes, tm=config.tm, tk=lhs.shape[1], tn=dout.shape[1],
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
        out = tiled_ragged_dot(lhs, rhs, group_sizes, tm=config.tm, tk=lhs.shape[1], tn=rhs.shape[2],
                               out_dtype=out_dtype, group_offset=group_offset)
        if config.mode == "fail_run":
            out = out + io_callback(_raise, jax.ShapeDtypeStruct((), out_dtype), out[0, 0])
        return out
