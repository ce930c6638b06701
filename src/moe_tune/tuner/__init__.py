"""Search spaces -> search strategy -> parallel compile -> correctness gate -> timing from the profiler trace
-> sweep log and tables."""

from moe_tune.tuner.spec import Reporter, SweepError, SweepInterrupted, SweepResult, SweepSpec
from moe_tune.tuner.strategies import STRATEGIES, Strategy
from moe_tune.tuner.sweep import log_path_for, preflight, run_sweep

__all__ = ["STRATEGIES", "Reporter", "Strategy", "SweepError", "SweepInterrupted", "SweepResult", "SweepSpec",
           "log_path_for", "preflight", "run_sweep"]
