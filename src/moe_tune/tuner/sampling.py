"""A quick budget that still sees the whole space: `--max-candidates N` keeps the default and a seeded sample
spread across the search space, not the first N configs in enumeration order (the smallest tiles, which miss
whatever lies at the other end, e.g. `single_pass=True`).

`spread(space, n, seed)` is a pure function of its arguments: a resumed sweep (whose log's identity holds
max_candidates and the seed) gets the same candidates again.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from moe_tune.kernels.base import KernelConfig


def _pairs(config: KernelConfig) -> set[tuple[str, str]]:
    """(tunable, value) pairs of a config (values as text: hashable whatever their type)."""
    return {(name, repr(value)) for name, value in config.to_dict().items()}


def spread(space: Sequence[KernelConfig], n: int, seed: int = 0) -> list[KernelConfig]:
    """The default (`space[0]`) and n - 1 more configs of `space`, in space order after the default: first,
    greedily, the config that shows the most (tunable, value) pairs not yet shown (each tunable weighing the
    same; ties broken by a seeded shuffle), so that every value of every tunable appears once n allows it;
    then, with room left, a seeded random sample of the rest. The whole space when n >= len(space)."""
    if n >= len(space):
        return list(space)
    n = max(1, n)
    rest = list(range(1, len(space)))
    random.Random(seed).shuffle(rest)  # the tie-break order
    chosen = [0]
    every = set().union(*(_pairs(c) for c in space))
    # each tunable weighs the same: one of its values counts 1 / (its number of values), so that a flag's other
    # value (`single_pass=True`) comes before the seventh tile size
    weight = {pair: 1 / sum(p[0] == pair[0] for p in every) for pair in every}
    missing = every - _pairs(space[0])

    def gain(i: int) -> float:
        return sum(weight[p] for p in _pairs(space[i]) & missing)

    while len(chosen) < n and missing:
        best = max(rest, key=gain)  # max keeps the first of equals: the seeded order breaks ties
        if not gain(best):
            break
        chosen.append(best)
        rest.remove(best)
        missing -= _pairs(space[best])
    chosen += rest[: n - len(chosen)]  # seeded: `rest` was shuffled
    return [space[0], *(space[i] for i in sorted(chosen[1:]))]
