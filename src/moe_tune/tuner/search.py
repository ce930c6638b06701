"""The search stage: ask the strategy (tuner/strategies) for rounds of configs until it is done or the time
budget is spent; take each config's result from the sweep log when an earlier run finished it, and measure
the others chunk by chunk (tuner/measure)."""

from __future__ import annotations

from moe_tune.kernels.base import KernelConfig
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner import measure
from moe_tune.tuner.candidates import FAILED, OK, WRONG, Candidate
from moe_tune.tuner.state import SweepState
from moe_tune.tuner.strategies import Strategy
from moe_tune.tuner.timing import Timing

STAGES = ("compile", "check", "time")


def search(state: SweepState, strategy: Strategy) -> None:
    """Measure the strategy's rounds; sets `state.stopped` to why the search stopped."""
    spec = state.spec
    planned = strategy.planned()
    for stage in STAGES:
        state.reporter.stage(stage, planned)
    # a chunk is compiled in parallel: a whole number of timing batches, at least one per worker
    chunk = spec.batch_size * -(-spec.workers // spec.batch_size)
    while True:
        if state.out_of_time():
            state.stopped = "time budget"
            return
        configs = strategy.next_round(state.measured)
        if not configs:
            state.stopped = strategy.stopped
            return
        todo = []
        for config in configs:
            is_default = config == strategy.default
            if restore(state, config, is_default) is None:
                todo.append(Candidate(state.next_index, config, is_default=is_default))
            state.next_index += 1
        for start in range(0, len(todo), chunk):
            if state.out_of_time():
                state.stopped = "time budget"
                return
            measure.measure_chunk(state, todo[start:start + chunk])


def restore(state: SweepState, config: KernelConfig, is_default: bool) -> Candidate | None:
    """The finished candidate for `config` from the log (now counted as done), or None when it has to be
    measured (not in the log, or its line is unusable)."""
    line = state.log.restored.get(sweep_log.config_key(config.to_dict()))
    if line is None or line.get("status") not in (OK, FAILED, WRONG):
        return None
    timing = None
    if line.get("timing"):
        try:
            timing = Timing(**{**line["timing"], "samples_s": tuple(line["timing"]["samples_s"])})
        except (TypeError, KeyError):
            return None
    if line["status"] == OK and timing is None:
        return None
    cand = Candidate(state.next_index, config, is_default=is_default, status=line["status"],
                     stage=line.get("stage") or "", reason=line.get("reason") or "", error=line.get("error"),
                     compile_s=line.get("compile_s"), compiles=line.get("compiles") or 0, timing=timing)
    state.add(cand)
    state.resumed += 1
    for stage in STAGES:
        state.reporter.advance(stage)
    return cand
