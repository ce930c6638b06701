"""Which configs to compile for a target: a backend's search space as the chip's own rules prune it."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from moe_tune.kernels import get_op
from moe_tune.kernels.base import KernelConfig
from moe_tune.core.chips import Target
from moe_tune.targets.compile import acting_as
from moe_tune.targets.pool import CompileJob


def search_space(target: Target, op: str, backend: str, problem: Any) -> list[KernelConfig]:
    """The backend's search space for `problem` as it is on the target chip (its budgets, its platform)."""
    with acting_as(target):
        return get_op(op).backends.get(backend).search_space(problem)


def config_error(target: Target, op: str, backend: str, config: KernelConfig, problem: Any) -> str | None:
    """The backend's `config_error` as it is on the target chip."""
    with acting_as(target):
        return get_op(op).backends.get(backend).config_error(config, problem)


def representative(space: list[KernelConfig], extra: int = 2) -> list[KernelConfig]:
    """The default (first) config, then the smallest and the largest of the rest by the product of their
    fields (the largest is the one nearest the chip's limits); `extra` = 1 keeps only the largest."""
    rest = sorted(space[1:], key=lambda c: (math.prod(dataclasses.astuple(c)), dataclasses.astuple(c)))
    ends = ([*rest[:1], *rest[-1:]] if extra >= 2 else rest[-1:]) if rest else []
    return list(dict.fromkeys([space[0], *ends]))


def sample(space: list[KernelConfig], size: int | None, seed: int = 0) -> list[KernelConfig]:
    """`space` whole when `size` is None or covers it, else the default and a seeded sample of the rest."""
    if size is None or len(space) <= size:
        return list(space)
    return [space[0], *random.Random(seed).sample(space[1:], size - 1)]


def jobs_for(target: Target, op: str, backend: str, problem: Any, configs: list[KernelConfig]) -> list[CompileJob]:
    return [CompileJob(target.name, op, backend, problem, config) for config in configs]
