"""moe-tune: tuned ragged kernels for Mixture-of-Experts layers in JAX.

    import moe_tune
    out = moe_tune.ragged_dot(lhs, rhs, group_sizes)   # uses the tuned config for this shape, if any
"""

__version__ = "0.1.0"

from moe_tune import profiles  # noqa: E402
from moe_tune.kernels.ragged_dot import ragged_dot  # noqa: E402
from moe_tune.profiles import use_profiles  # noqa: E402

__all__ = ["__version__", "profiles", "ragged_dot", "use_profiles"]
