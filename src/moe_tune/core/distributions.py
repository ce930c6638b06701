"""Named, seeded distributions of rows over groups (tokens over experts), stored with every tuned entry.

The same name and seed always give the same group sizes, so a sweep can be reproduced from its entry.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moe_tune.core.errors import UsageError

DEFAULT = "balanced"


def _balanced(rows: int, groups: int, rng: np.random.Generator) -> np.ndarray:
    """Multinomial with equal probabilities: what a well-trained, load-balanced router produces."""
    return rng.multinomial(rows, np.full(groups, 1.0 / groups))


def _skewed(rows: int, groups: int, rng: np.random.Generator) -> np.ndarray:
    """Zipf-like (p ~ 1 / rank^1.2, ranks shuffled): a few hot experts and a long tail, many nearly empty."""
    p = 1.0 / np.arange(1, groups + 1) ** 1.2
    return rng.multinomial(rows, rng.permutation(p / p.sum()))


def _uniform(rows: int, groups: int, rng: np.random.Generator) -> np.ndarray:
    """Exactly equal split (the remainder goes to the first groups)."""
    sizes = np.full(groups, rows // groups)
    sizes[: rows % groups] += 1
    return sizes


def _single(rows: int, groups: int, rng: np.random.Generator) -> np.ndarray:
    """Every row in one (seeded) group, the others empty: the worst case for load balance."""
    sizes = np.zeros(groups, np.int64)
    sizes[rng.integers(groups)] = rows
    return sizes


DISTRIBUTIONS: dict[str, Callable[[int, int, np.random.Generator], np.ndarray]] = {
    "balanced": _balanced,
    "skewed": _skewed,
    "uniform": _uniform,
    "single": _single,
}


def check_name(name: str) -> str:
    if name not in DISTRIBUTIONS:
        raise UsageError(f"unknown distribution {name!r}; choose from {', '.join(DISTRIBUTIONS)}")
    return name


def group_sizes(name: str, rows: int, groups: int, seed: int = 0) -> np.ndarray:
    """int32 [groups] summing to `rows`, drawn from distribution `name` with `seed`."""
    sizes = DISTRIBUTIONS[check_name(name)](rows, groups, np.random.default_rng(seed))
    return np.asarray(sizes, np.int32)
