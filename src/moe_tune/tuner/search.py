"""Search strategies: which configs of a backend's search space a sweep measures, round by round.

A strategy proposes rounds of configs (the default config always first, in the first round, then the warm
start's seeds, `tuner/warm_start.py`: the winners of the nearest tuned shapes, mapped onto this space); the sweep
measures each round (compile, check, time) and passes everything measured so far to `next_round`. A
strategy never proposes a config twice, never one outside the space (valid configs only), and never more
than `budget` configs in all. Proposals depend only on the space, the budget, the seed and the measured
results, so a resumed sweep, whose results come from its log, replays the same proposals.

- `grid`: the whole space in order; `budget` keeps its first N. With seeds (a warm start) it runs the warm
  local search below instead (`--cold` asks for the whole grid).
- `random`: the default, the seeds, then a seeded random sample of the rest, `budget` configs in all.
- `coordinate`: coordinate descent from the heuristic default: the first round is the default and its
  neighbours, each later round the unmeasured neighbours of the best config so far (along each tunable, the
  nearest smaller and larger value among the configs of the space that differ from it in that tunable
  only). It moves to the best measured config and stops when a round finds nothing faster (or the budget
  is spent). With seeds it runs the warm local search.
- The warm local search (`grid` and `coordinate` with seeds; `Strategy.local`): the first round is the
  default, the seeds and the configs bracketed by the seeds (`bracket`: between two seeds that differ in one
  tunable, as a ladder implies: m/2 won tm=32 and 2m won tm=128, so tm=64 is tried), timed side by side; then
  coordinate descent from the best of them along the OPEN tunables only (`open_tunables`: those on which the
  default and the seeds do not all agree; never empty, a seed differs from the default), moving only to a
  neighbour faster by more than `NOISE` (`speedup`: paired round by round when the two ran in the same
  rounds; a smaller gain is within the run-to-run noise of a 3-sample median,
  and chasing it walks the space). A tunable that the default and every tuned neighbour's winner agree on is
  not walked: walking every tunable made the warm descent's confirming round cost as much as a cold round
  (FINDINGS.md: warm start). With ONE seed (the neighbours agree, or all kept their defaults: `warm_start`) the descent
  starts only when the seed beat the default in the first round by the least gain the final round can call
  a win (`verdict.PAIRED_MIN_NOISE`, 10%; round by round when they ran in the same rounds): otherwise the
  evidence and the measurement agree on the default, and the search stops at two candidates (a 3% gate on
  3 rounds let noise start a descent in 3 of 8 such sweeps, none of which found anything). The default stays
  the first
  candidate, and a warm search measures at least the default and one seed (no seed: the cold walk).

The sweep itself stops asking for rounds when its time budget is spent.

The search stage: ask the strategy (tuner/strategies) for rounds of configs until it is done or the time
budget is spent; take each config's result from the sweep log when an earlier run finished it, and measure
the others chunk by chunk (tuner/measure).

A quick budget that still sees the whole space: `--max-candidates N` keeps the default and a seeded sample
spread across the search space, not the first N configs in enumeration order (the smallest tiles, which miss
whatever lies at the other end, e.g. `single_pass=True`).

`spread(space, n, seed)` is a pure function of its arguments: a resumed sweep (whose log's identity holds
max_candidates and the seed) gets the same candidates again.
"""

from __future__ import annotations

from collections.abc import Iterator

from moe_tune.kernels.base import KernelConfig
from moe_tune.tuner import log as sweep_log
from moe_tune.tuner import measure
from moe_tune.tuner.candidate import Candidate
from moe_tune.tuner.state import Step, SweepState
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




