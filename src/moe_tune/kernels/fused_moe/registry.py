"""The fused_moe backends by name, and which one each platform uses by default."""

from moe_tune.kernels.base import BackendRegistry
from moe_tune.kernels.fused_moe.pallas_tpu import PallasTpuFusedMoe
from moe_tune.kernels.fused_moe.plain_jax import PlainFusedMoe
from moe_tune.kernels.fused_moe.tiled import TiledFusedMoe
from moe_tune.kernels.fused_moe.triton import TritonFusedMoe

# The plain-JAX backend every fallback (version guard, can't-run) goes to.
FALLBACK = "jax"

# TPU runs the Pallas Mosaic kernels (interpret-mode correct, compiled for v5e; not yet run on a TPU), like the
# gathers and ragged_dot. GPU runs triton: on an H100 (JAX 0.11.2, benchmarks/gpu_check.py --layers,
# benchmarks/results/gpu_check_nvidia_h100_2026-11-26_layer*) the plain path's layer forward took 3.7x (qwen3-30b-a3b,
# 256 tokens) to 45x (deepseek-v3 ep 8, 4096 tokens) the triton kernels' time (forward+backward 3.1-20x), and
# 1.9-35 GB of temp memory.
BACKENDS = BackendRegistry("fused_moe", platform_defaults={"cpu": "tiled", "gpu": "triton", "tpu": "pallas_tpu"})
for _backend in (PlainFusedMoe(), TiledFusedMoe(), PallasTpuFusedMoe(), TritonFusedMoe()):
    BACKENDS.register(_backend)
