"""Search spaces -> search strategy -> parallel compile -> correctness gate -> timing from the profiler trace
-> sweep log and tables. One sweep is a `SweepRequest` (op, problem, backend, `SweepSettings`) run by
`run_sweep`; many sweeps are a campaign (`moe_tune.campaign`)."""

from moe_tune.tuner.request import SweepRequest, SweepSettings
from moe_tune.tuner.search import STRATEGIES, Strategy
from moe_tune.tuner.state import Reporter, SweepError, SweepInterrupted, SweepResult
from moe_tune.tuner.sweep import log_path_for, preflight, run_sweep

__all__ = ["STRATEGIES", "Reporter", "Strategy", "SweepError", "SweepInterrupted", "SweepRequest", "SweepResult",
           "SweepSettings", "log_path_for", "preflight", "run_sweep"]
