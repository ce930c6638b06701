"""The ragged_dot backends by name, and which one each platform uses by default."""

from moe_tune.kernels.base import BackendRegistry
from moe_tune.kernels.ragged_dot.megablox import MegabloxRaggedDot
from moe_tune.kernels.ragged_dot.mosaic_gpu import MosaicGpuRaggedDot
from moe_tune.kernels.ragged_dot.mosaic_gpu_quant import MosaicGpuQuantRaggedDot
from moe_tune.kernels.ragged_dot.tiled import TiledRaggedDot
from moe_tune.kernels.ragged_dot.triton import TritonRaggedDot
from moe_tune.kernels.ragged_dot.xla import XlaRaggedDot

# GPU: triton, from the first real-GPU measurement (benchmarks/gpu_check.py on an H100, JAX 0.11.2,
# benchmarks/results/gpu_check_nvidia_h100_2026-11-25_*.json): tuned triton ran 4.0-9.2x faster than XLA's ragged
# dot (bf16, DeepSeek-V3 and Mixtral shapes, all three directions), and its untuned default 2.3-7.3x. mosaic_gpu
# matched it within noise (fwd, dlhs) but serves bf16/f16 on sm_90+ only; triton serves every dtype, quantized
# weights and older GPUs. backend="mosaic_gpu" or "xla" opts out.
BACKENDS = BackendRegistry("ragged_dot", platform_defaults={"cpu": "tiled", "gpu": "triton", "tpu": "megablox"})
for _backend in (XlaRaggedDot(), TiledRaggedDot(), MegabloxRaggedDot(), TritonRaggedDot(), MosaicGpuRaggedDot(),
                 MosaicGpuQuantRaggedDot()):
    BACKENDS.register(_backend)
