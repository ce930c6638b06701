"""The routing (group-size distribution) a call's table lookup assumes, chosen per call or per block.

Entries are keyed on the distribution of rows over groups they were tuned with (`distributions.py`). Which
one a call asks for, highest first:

1. the call's own `distribution=` argument (`moe_tune.ragged_dot`, the gathers, `moe_tune.moe_mlp`);
2. the innermost `with moe_tune.use_distribution(NAME):` block around the call;
3. `$MOE_TUNE_DISTRIBUTION`;
4. `balanced`.

Like the configs themselves, this is decided when a call is traced: a function jitted and traced before
(outside the block) is not traced again because a block is entered later. The ops capture the block's
choice when they are called, so the gradient kernels (traced later by `jax.grad`) ask for the same one.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from moe_tune.core import distributions

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("moe_tune_distribution", default=None)


@contextlib.contextmanager
def use_distribution(name: str) -> Iterator[str]:
    """Calls traced inside the block look entries up for routing distribution `name` (`balanced`, `skewed`,
    ...; see `distributions.DISTRIBUTIONS`) unless they pass their own. Blocks nest; UsageError for an unknown
    name."""
    token = _current.set(distributions.check_name(name))
    try:
        yield name
    finally:
        _current.reset(token)


def current() -> str | None:
    """The distribution of the innermost `use_distribution` block, or None outside every block."""
    return _current.get()


def for_call(distribution: str | None) -> str | None:
    """What one call asks for: its own `distribution` (checked: UsageError for an unknown name), else the
    innermost block's; None leaves it to the environment (`$MOE_TUNE_DISTRIBUTION`, else `balanced`)."""
    if distribution is not None:
        return distributions.check_name(distribution)
    return current()
