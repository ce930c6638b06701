"""The dispatch and combine backends by name, and which one each platform uses by default."""

from moe_tune.kernels.base import BackendRegistry
from moe_tune.kernels.gather.pallas_tpu import PallasTpuGather, PallasTpuGatherReduce
from moe_tune.kernels.gather.plain_jax import PlainGather, PlainGatherReduce
from moe_tune.kernels.gather.sparsecore import SparseCoreGather, SparseCoreGatherReduce
from moe_tune.kernels.gather.tiled import TiledGather, TiledGatherReduce
from moe_tune.kernels.gather.triton import TritonGather, TritonGatherReduce

# The plain-JAX backend every fallback (flags, version guard) goes to.
FALLBACK = "jax"

# GPU defaults from the first real-GPU measurement (benchmarks/gpu_check.py on an H100, bf16,
# benchmarks/results/gpu_check_nvidia_h100_2026-11-25_gathers.json): the triton dispatch and ragged combine ran
# 1.8x faster than plain JAX (DeepSeek-V3, ep=8); the triton dense combine ran 2x SLOWER than plain JAX's (Mixtral,
# 4096 tokens, top-2), so that one stays on plain JAX.
_DEFAULTS = {"cpu": "tiled", "gpu": "triton", "tpu": "pallas_tpu"}
# `sparsecore` (v5p, v6e: the gathers on the SparseCores, beside the TensorCores' matmuls) is not the TPU default:
# nothing has timed it on a chip yet.

GATHER_BACKENDS = BackendRegistry("ragged_gather", platform_defaults=_DEFAULTS)
for _backend in (PlainGather(), TiledGather(), TritonGather(), PallasTpuGather(), SparseCoreGather()):
    GATHER_BACKENDS.register(_backend)

GATHER_REDUCE_BACKENDS = BackendRegistry("ragged_gather_reduce", platform_defaults=_DEFAULTS)
DENSE_GATHER_REDUCE_BACKENDS = BackendRegistry("dense_gather_reduce", platform_defaults={**_DEFAULTS, "gpu": FALLBACK})
for _registry in (GATHER_REDUCE_BACKENDS, DENSE_GATHER_REDUCE_BACKENDS):
    for _cls in (PlainGatherReduce, TiledGatherReduce, TritonGatherReduce, PallasTpuGatherReduce,
                 SparseCoreGatherReduce):
        _registry.register(_cls(op=_registry.op))
