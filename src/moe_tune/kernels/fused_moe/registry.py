"""The fused_moe backends by name, and which one each platform uses by default."""

from moe_tune.kernels.base import BackendRegistry
from moe_tune.kernels.fused_moe.pallas_tpu import PallasTpuFusedMoe
from moe_tune.kernels.fused_moe.plain_jax import PlainFusedMoe
from moe_tune.kernels.fused_moe.tiled import TiledFusedMoe
from moe_tune.kernels.fused_moe.triton import TritonFusedMoe

# The plain-JAX backend every fallback (version guard, can't-run) goes to.
FALLBACK = "jax"

# TPU runs the Pallas Mosaic kernels (interpret-mode correct, compiled for v5e; not yet run on a TPU), like the
# gathers and ragged_dot; GPU stays on the plain path until the triton kernels are measured on a real GPU.
BACKENDS = BackendRegistry("fused_moe", platform_defaults={"cpu": "tiled", "gpu": "jax", "tpu": "pallas_tpu"})
for _backend in (PlainFusedMoe(), TiledFusedMoe(), PallasTpuFusedMoe(), TritonFusedMoe()):
    BACKENDS.register(_backend)
