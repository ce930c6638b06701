"""moe-tune: tuned ragged kernels for Mixture-of-Experts layers in JAX.

    import moe_tune
    out = moe_tune.ragged_dot(lhs, rhs, group_sizes)   # uses the tuned config for this shape, if any
"""

__version__ = "0.1.0"

from moe_tune import profiles  # noqa: E402
from moe_tune.core import devices  # noqa: E402  (moe_tune.devices.platform(): the one platform switch)
from moe_tune.core.contexts import use_distribution  # noqa: E402
from moe_tune.core.quant import (AsQArray, DynamicQuant, QArray, dequantize, from_checkpoint, quantize,  # noqa: E402
                                 relayout)
from moe_tune.kernels import use_backend  # noqa: E402
from moe_tune.kernels.fused_moe.op import gather_gmm, gmm_combine  # noqa: E402
from moe_tune.kernels.gather import dense_gather_reduce, ragged_gather, ragged_gather_reduce  # noqa: E402
from moe_tune.kernels.ragged_dot import ragged_dot  # noqa: E402
from moe_tune.layer.moe import moe_mlp  # noqa: E402
from moe_tune.layer.moe import sharded_moe_mlp  # noqa: E402
from moe_tune.profiles import use_profiles  # noqa: E402

__all__ = ["AsQArray", "DynamicQuant", "QArray", "__version__", "dense_gather_reduce", "dequantize", "devices", "from_checkpoint",
           "gather_gmm", "gmm_combine", "moe_mlp", "profiles", "quantize", "ragged_dot", "relayout", "ragged_gather", "ragged_gather_reduce", "sharded_moe_mlp", "use_backend", "use_distribution",
           "use_profiles"]
