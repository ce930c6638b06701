"""ragged_dot (Megablox gmm): problem description, group metadata, backends (xla, tiled, megablox)."""

from moe_tune.kernels.ragged_dot.metadata import GroupMetadata, make_group_metadata
from moe_tune.kernels.ragged_dot.op import ragged_dot
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.registry import BACKENDS

__all__ = ["BACKENDS", "GroupMetadata", "RaggedDotProblem", "make_group_metadata", "ragged_dot"]
