"""Search spaces -> parallel compile -> correctness gate -> timing from the profiler trace -> tables."""

from moe_tune.tuner.sweep import Reporter, SweepError, SweepResult, SweepSpec, run_sweep

__all__ = ["Reporter", "SweepError", "SweepResult", "SweepSpec", "run_sweep"]
