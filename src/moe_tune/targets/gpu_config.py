"""A GPU target's `GpuTargetConfigProto` in text form: what XLA's GPU compiler builds a compile-only device
from (`get_topology_desc(platform="cuda", target_config=TEXT)`), with no GPU attached."""

from __future__ import annotations

from moe_tune.core.chips import GpuFacts, Target

# The proto's text format, filled from `GpuFacts` (field names are those of xla/stream_executor's
# GpuDeviceInfoProto). dnn_version_info names a cuDNN recent enough for XLA's passes to consider it.
_TEMPLATE = """\
gpu_device_info {{
  cuda_compute_capability {{ major: {cc_major} minor: {cc_minor} }}
  threads_per_block_limit: {threads_per_block}
  threads_per_warp: {threads_per_warp}
  shared_memory_per_block: {shared_memory_per_block}
  shared_memory_per_core: {shared_memory_per_sm}
  threads_per_core_limit: {threads_per_sm}
  core_count: {sm_count}
  fpus_per_core: {fp32_units_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {memory_bandwidth}
  l2_cache_size: {l2_cache_bytes}
  clock_rate_ghz: {clock_ghz}
  device_memory_size: {memory_bytes}
  shared_memory_per_block_optin: {shared_memory_per_block_optin}
  registers_per_core_limit: {registers_per_sm}
  registers_per_block_limit: {registers_per_block}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 3 patch: 0 }}
device_description_str: "{description}"
"""


def target_config_text(target: Target) -> str:
    """The `GpuTargetConfigProto` text of a GPU target; ValueError for a TPU one."""
    facts: GpuFacts | None = target.gpu
    if facts is None:
        raise ValueError(f"{target.name} is not a GPU target")
    fields = {name: getattr(facts, name) for name in facts.__dataclass_fields__ if name != "compute_capability"}
    cc_major, cc_minor = facts.compute_capability
    return _TEMPLATE.format(cc_major=cc_major, cc_minor=cc_minor, description=target.description, **fields)
