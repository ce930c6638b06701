"""The fused_moe backends (the base's tests) and the public fused ops: gradients, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fused_moe_base import FusedMoeBackendTests

from moe_tune import quantize
from moe_tune.errors import UsageError
from moe_tune.kernels.fused_moe.op import gather_gmm, gmm_combine
from moe_tune.kernels.fused_moe.tiled import TiledFusedConfig


class TestTiled(FusedMoeBackendTests):
    backend = "tiled"
    dtypes = ("bfloat16", "float16")

    def invalid_configs(self, problem):
        return [TiledFusedConfig(tm=16, tail=32), TiledFusedConfig(tm=0, tail=4), TiledFusedConfig(tm=2048, tail=4)]


class TestPlain(FusedMoeBackendTests):
    backend = "jax"
    dtypes = ()


def test_the_cli_names_a_dispatch_without_activation_none():
    """`--glu none` (a training layer's forward dispatch, gate and up kept concatenated) is a problem with no
    activation; the combine never has one; an unknown activation is refused by the CLI's choices."""
    from moe_tune.kernels import get_op
    from moe_tune.kernels.fused_moe.definition import GLU, NO_GLU

    op = get_op("fused_moe")
    shape = dict(tokens=16, top_k=2, k=32, n=64, groups=4)
    assert op.problem(**shape, glu=NO_GLU).glu is None
    assert op.problem(**shape, glu="silu").glu == "silu"
    assert op.problem(**shape, stage="combine", glu="silu").glu is None
    assert NO_GLU in GLU.type and "bogus" not in GLU.type


def test_the_tiled_default_is_one_for_the_sweep_and_for_the_layer_at_every_ep():
    """The tiled default (tiles of half an average group on the shard) is the same for the problem a sweep
    builds (`ep` set, total_groups = groups x ep) and for the one the op builds in an expert-parallel layer
    (total_groups from group_sizes, `ep` left at 1): before session 14 the layer's got a whole average
    group's tiles at ep > 1 (qwen3-30b-a3b prefill ep 4: tm 256 / tail 64 against the sweep's 128 / 32)."""
    from moe_tune.kernels import get_op
    from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
    from moe_tune.kernels.fused_moe.tiled import TiledFusedMoe

    backend, op = TiledFusedMoe(), get_op("fused_moe")
    for ep in (1, 4):
        swept = op.problem(tokens=4096, top_k=8, k=2048, n=1536, groups=128 // ep, ep=ep)
        layer = FusedMoeProblem(tokens=4096, m=32768, k=2048, n=1536, groups=128 // ep, dtype="float32",
                                stage="dispatch", total_groups=128 if ep > 1 else None)
        assert backend.default_config(swept) == backend.default_config(layer) == TiledFusedConfig(tm=128, tail=32)
