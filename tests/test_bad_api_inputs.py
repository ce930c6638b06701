"""Issue 27, the Python API's share: group sizes and offsets out of range (items 1, 2) give one answer on
every registered backend (xla, tiled, and the Pallas ones in interpret mode) and a one-line UsageError when
their values are known; config mistakes (item 15) name what the caller got wrong."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_tune
from moe_tune.errors import InvalidConfigError, UsageError
from moe_tune.kernels import get_op

# Every backend registered with the op, read at import (collection), so a new backend is covered; backends
# that tests register at run time (the toy of test_backend_recipe.py, the faulty ones) are not there yet.
BACKENDS = tuple(get_op("ragged_dot").backends.names())
M, K, N, TOTAL = 64, 16, 8, 4


@pytest.fixture(scope="module")
def operands() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((M, K)), jnp.float32),
            jnp.asarray(rng.standard_normal((TOTAL, K, N)), jnp.float32))


def _traced(backend: str, lhs, rhs, sizes, offset=None, grad: bool = False):
    """The op under jit (sizes and offset traced, so no check can see them), or the gradients of its sum."""
    def fwd(x, w, g, o):
        return moe_tune.ragged_dot(x, w, g, group_offset=o, backend=backend)

    if grad:
        return jax.jit(jax.grad(lambda x, w, g, o: fwd(x, w, g, o).sum(), argnums=(0, 1)))(lhs, rhs, sizes, offset)
    return jax.jit(fwd)(lhs, rhs, sizes, offset)


def _expected(lhs, rhs, sizes, offset: int | None) -> np.ndarray:
    """The shared rule in NumPy: negative sizes count as 0, rows past m are dropped, a shard outside
    group_sizes selects no group."""
    sizes = np.maximum(np.asarray(sizes), 0)
    ends = np.minimum(np.cumsum(sizes), M)
    starts = np.concatenate([[0], ends[:-1]])
    first = 0 if offset is None else offset
    out = np.zeros((M, N), np.float32)
    if not 0 <= first <= TOTAL - rhs.shape[0]:
        return out
    for local in range(rhs.shape[0]):
        lo, hi = starts[first + local], ends[first + local]
        out[lo:hi] = np.asarray(lhs)[lo:hi] @ np.asarray(rhs)[local]
    return out


@pytest.mark.slow  # the Pallas kernels' gradients in interpret mode
@pytest.mark.parametrize("offset", [-1, 1, 3, 7])
def test_a_traced_offset_out_of_range_selects_no_group_on_every_backend(operands, offset):
    """Item 1: a shard of 2 groups out of 4 at offset 3 or 7 (or -1) used to give 32, 16 or 0 rows,
    depending on the backend; now every backend (and every gradient) gives zeros, and 1 stays a real shard."""
    lhs, rhs = operands
    sizes = jnp.full((TOTAL,), M // TOTAL, jnp.int32)
    want = _expected(lhs, rhs[:2], sizes, offset)
    assert (np.abs(want).sum(1) > 0).sum() == (32 if offset == 1 else 0)
    for backend in BACKENDS:
        np.testing.assert_allclose(_traced(backend, lhs, rhs[:2], sizes, jnp.int32(offset)), want, atol=1e-4,
                                   err_msg=backend)
        if offset != 1:
            dlhs, drhs = _traced(backend, lhs, rhs[:2], sizes, jnp.int32(offset), grad=True)
            assert not np.asarray(dlhs).any() and not np.asarray(drhs).any(), backend


@pytest.mark.parametrize("sizes", [[20, -5, 30, 10], [-3, -3, 70, 0], [40, 30, 20, 10], [10, 10, 10, 50]])
def test_traced_negative_sizes_and_rows_past_m_agree_on_every_backend(operands, sizes):
    """Item 2: negatives count as 0 and rows past m are dropped, the same on every backend (tiled and xla
    used to differ by up to 40)."""
    lhs, rhs = operands
    want = _expected(lhs, rhs, sizes, None)
    for backend in BACKENDS:
        out = _traced(backend, lhs, rhs, jnp.asarray(sizes, jnp.int32))
        np.testing.assert_allclose(out, want, atol=1e-4, err_msg=backend)


@pytest.mark.parametrize("sizes, offset, message", [
    ([16, 16, 16, 16], 3, r"group_offset 3 is out of range: .* must be in \[0, 2\]"),
    ([16, 16, 16, 16], -1, r"group_offset -1 is out of range"),
    ([20, -5, 30, 10], None, r"group_sizes must be >= 0, got -5 for group 1"),
    ([40, 30, 20, 10], None, r"sum\(group_sizes\) = 100 exceeds lhs's 64 rows"),
])
@pytest.mark.parametrize("as_array", [False, True])
def test_known_bad_sizes_and_offsets_are_one_line_usage_errors(operands, sizes, offset, message, as_array):
    """Items 1 and 2 with concrete values (a Python int, a NumPy or a JAX array): a one-line UsageError."""
    lhs, rhs = operands
    rhs = rhs[:2] if offset is not None else rhs
    wrap = jnp.asarray if as_array else np.asarray
    off = offset if offset is None or not as_array else jnp.int32(offset)
    with pytest.raises(UsageError, match=message) as raised:
        moe_tune.ragged_dot(lhs, rhs, wrap(np.asarray(sizes, np.int32)), group_offset=off)
    assert "\n" not in str(raised.value)


def test_a_per_direction_config_with_an_unknown_direction_names_the_valid_ones(operands):
    """Item 15: `{"fwd": ..., "bwd": ...}` said `TiledConfig has no field(s) ['bwd', 'fwd']`."""
    lhs, rhs = operands
    with pytest.raises(UsageError, match=r"config keys \['bwd'\] are not directions: .* fwd, dlhs, drhs"):
        moe_tune.ragged_dot(lhs, rhs, jnp.full((TOTAL,), 16, jnp.int32), backend="tiled",
                            config={"fwd": {"tm": 32}, "bwd": {"tm": 32}})


def test_a_config_that_breaks_a_rule_with_a_default_says_the_default_was_not_given(operands):
    """Item 15: `{"tm": 16}` blamed `tail (32)`, a value the caller never passed."""
    lhs, rhs = operands
    with pytest.raises(InvalidConfigError) as raised:
        moe_tune.ragged_dot(lhs, rhs, jnp.full((TOTAL,), 16, jnp.int32), backend="tiled", config={"tm": 16})
    message = str(raised.value)
    assert "{'tm': 16}" in message and "must not exceed tm (16)" in message
    assert "tail=32 is the default (not given)" in message
