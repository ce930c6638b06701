"""The trace-time choices a `with` block makes for the calls traced inside it, all in one place.

Each is read when a call is traced, like the tables themselves: a function jitted and traced before a block is
entered keeps what it was traced with. Blocks nest; the innermost wins. Each block checks its argument (a
UsageError, one line) before it takes effect.

- `use_distribution(name)`: the routing (group-size distribution) a call's table lookup assumes, after the
  call's own `distribution=` argument and before `$MOE_TUNE_DISTRIBUTION`, else `balanced`. The ops capture the
  block's choice when they are called, so the gradient kernels (traced later by `jax.grad`) ask for the same one.
- `use_profiles(path)`: tables under `path` take precedence over every other profile dir (`profiles.table`).
- `use_stale_policy(policy)`: how lookups treat stale entries (`use`, `skip`, `error`), after an explicit
  policy and before `$MOE_TUNE_STALE_POLICY` (`profiles.entry`).
- `choose_backend(op, name)`: the backend calls of `op` that pass none run on (the public, checked form is
  `moe_tune.use_backend`, which knows the ops' registries; `KernelOp.backend` reads `chosen_backend`).

The distribution and the backend are context variables (per thread and task); the profile overlays and the
stale policy hold for the whole process, so that lookups made on worker threads inside a block see them too.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from moe_tune.core import distributions
from moe_tune.core.errors import UsageError

# --- routing distribution -------------------------------------------------------------------------------------

_distribution: contextvars.ContextVar[str | None] = contextvars.ContextVar("moe_tune_distribution", default=None)


@contextlib.contextmanager
def use_distribution(name: str) -> Iterator[str]:
    """Calls traced inside look entries up for routing distribution `name` (`balanced`, `skewed`, ...; see
    `distributions.DISTRIBUTIONS`) unless they pass their own. UsageError for an unknown name."""
    token = _distribution.set(distributions.check_name(name))
    try:
        yield name
    finally:
        _distribution.reset(token)


def current_distribution() -> str | None:
    """The distribution of the innermost `use_distribution` block, or None outside every block."""
    return _distribution.get()


def distribution_for_call(distribution: str | None) -> str | None:
    """What one call asks for: its own `distribution` (checked: UsageError for an unknown name), else the
    innermost block's; None leaves it to the environment (`$MOE_TUNE_DISTRIBUTION`, else `balanced`)."""
    if distribution is not None:
        return distributions.check_name(distribution)
    return current_distribution()


# --- backend per op -------------------------------------------------------------------------------------------

_backends: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("moe_tune_backends", default={})


@contextlib.contextmanager
def choose_backend(op: str, name: str) -> Iterator[str]:
    """Inside, `chosen_backend(op)` is `name` (the caller has checked both names)."""
    token = _backends.set({**_backends.get(), op: name})
    try:
        yield name
    finally:
        _backends.reset(token)


def chosen_backend(op: str) -> str | None:
    """The backend the innermost block names for `op`, or None outside every block."""
    return _backends.get().get(op)


# --- profile dirs ---------------------------------------------------------------------------------------------

_overlays: list[Path] = []


@contextlib.contextmanager
def use_profiles(path: str | os.PathLike) -> Iterator[Path]:
    """Within the block, tables under `path` take precedence over every other profile dir."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"use_profiles takes a directory path (str or os.PathLike), got {type(path).__name__}")
    directory = Path(path).expanduser()
    _overlays.append(directory)
    try:
        yield directory
    finally:
        _overlays.remove(directory)


def profile_overlays() -> list[Path]:
    """The `use_profiles` dirs in force, innermost first."""
    return list(reversed(_overlays))


# --- stale entries --------------------------------------------------------------------------------------------

STALE_POLICIES = ("use", "skip", "error")
DEFAULT_STALE_POLICY = "use"
_policies: list[str] = []


def check_policy(policy: str, source: str = "stale policy") -> str:
    """`policy` when it is one of `STALE_POLICIES`; UsageError naming `source` and the choices otherwise."""
    if policy not in STALE_POLICIES:
        raise UsageError(f"unknown {source} {policy!r}; choose from {', '.join(STALE_POLICIES)}")
    return policy


@contextlib.contextmanager
def use_stale_policy(policy: str) -> Iterator[str]:
    """Within the block, lookups treat stale entries by `policy` (`use`, `skip` or `error`)."""
    _policies.append(check_policy(policy))
    try:
        yield policy
    finally:
        _policies.pop()


def block_stale_policy() -> str | None:
    """The innermost `use_stale_policy` block's policy, or None outside every block."""
    return _policies[-1] if _policies else None
