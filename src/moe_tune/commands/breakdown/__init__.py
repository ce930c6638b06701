"""Where a tuned kernel's time goes: its winner and default re-run under the profiler, time per HLO op (or
GPU kernel), largest first, with the share of the total (`moe-tune report --breakdown`).

- `ops`: the result types and the aggregation of per-op trace events into self times;
- `xprof_tools`: xprof's converters (`trace_viewer`, `hlo_stats`, `kernel_stats`), imported lazily;
- `run`: re-running an entry's configs under `jax.profiler.trace` and reading the traces.
"""

from moe_tune.commands.breakdown.ops import Breakdown, OpTime
from moe_tune.commands.breakdown.run import SOURCES, profile_entry

__all__ = ["SOURCES", "Breakdown", "OpTime", "profile_entry"]
