"""The ragged_dot backends by name, and which one each platform uses by default."""

from moe_tune.kernels.base import BackendRegistry
from moe_tune.kernels.ragged_dot.megablox import MegabloxRaggedDot
from moe_tune.kernels.ragged_dot.mosaic_gpu import MosaicGpuRaggedDot
from moe_tune.kernels.ragged_dot.tiled import TiledRaggedDot
from moe_tune.kernels.ragged_dot.triton import TritonRaggedDot
from moe_tune.kernels.ragged_dot.xla import XlaRaggedDot

# GPU stays on XLA until the triton kernels have been compiled and measured on a real GPU
# (benchmarks/gpu_check.py); pass backend="triton" or backend="mosaic_gpu" (JAX's Mosaic GPU kernels) to use them.
BACKENDS = BackendRegistry("ragged_dot", platform_defaults={"cpu": "tiled", "gpu": "xla", "tpu": "megablox"})
for _backend in (XlaRaggedDot(), TiledRaggedDot(), MegabloxRaggedDot(), TritonRaggedDot(), MosaicGpuRaggedDot()):
    BACKENDS.register(_backend)
