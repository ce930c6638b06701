"""The MoE layer above the kernels: `moe_mlp` (route, dispatch, experts, combine), the model presets and the
kernel calls a layer makes (`models`), and the layer-level choices it tunes (`moe_fusion`, registered here with
the kernels' ops so that `kernels.get_op("moe_fusion")` answers wherever moe_tune is imported; `moe_sharding`,
the sharded layer's strategy, likewise)."""

from moe_tune.kernels import register_op
from moe_tune.layer.fusion_op import MOE_FUSION
from moe_tune.layer.sharding_op import MOE_SHARDING

register_op(MOE_FUSION)
register_op(MOE_SHARDING)
