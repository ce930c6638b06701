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
