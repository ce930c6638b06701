"""The search stage: ask the strategy (tuner/strategies) for rounds of configs until it is done or the time
budget is spent; take each config's result from the sweep log when an earlier run finished it, and measure
the others chunk by chunk (tuner/measure)."""

from __future__ import annotations

from collections.abc import Iterator

from moe_tune.kernels.base import KernelConfig
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner import measure
from moe_tune.tuner.candidate import Candidate
from moe_tune.tuner.state import SweepState
from moe_tune.tuner.step import Step
from moe_tune.tuner.strategies import Strategy

STAGES = ("compile", "check", "time")


def search(state: SweepState, strategy: Strategy) -> Iterator[Step]:
    """Measure the strategy's rounds, yielding what was done; the last step says why the search stopped."""
    settings = state.settings
    planned = strategy.planned()
    for stage in STAGES:
        state.reporter.stage(stage, planned)
    # a chunk is compiled in parallel: a whole number of timing batches, at least one per worker
    chunk = settings.batch_size * -(-settings.workers // settings.batch_size)
    while True:
        if state.out_of_time():
            yield Step(stopped="time budget")
            return
        configs = strategy.next_round(state.measured)
        if not configs:
            yield Step(stopped=strategy.stopped)
            return
        todo = []
        for config in configs:
            is_default = config == strategy.default
            index = next(state.indices)
            if restore(state, config, index, is_default):
                yield Step(resumed=1)
            else:
                todo.append(Candidate(index, config, is_default=is_default))
        for start in range(0, len(todo), chunk):
            if state.out_of_time():
                yield Step(stopped="time budget")
                return
            yield from measure.measure_chunk(state, todo[start:start + chunk])


def restore(state: SweepState, config: KernelConfig, index: int, is_default: bool) -> bool:
    """Whether an earlier run finished `config` (its line in the log is usable): then it is counted as done
    here, as candidate `index`, without being measured again."""
    line = state.log.restored.get(sweep_log.config_key(config.to_dict()))
    cand = None if line is None else sweep_log.parse_candidate(line, index, config, is_default)
    if cand is None:
        return False
    if isinstance(line.get("batch"), int):  # its rounds pair with its batch's (`candidate.same_rounds`)
        cand.batch = line["batch"]
    state.add(cand)
    for stage in STAGES:
        state.reporter.advance(stage)
    return True
