"""The tuner's speed rules (issue 32 item 5, session 15): the check's relative error computed once per output
against a reference whose scale is computed once."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from moe_tune.kernels.kernel_op import error_scale, relative_error
from moe_tune.tuner.gate import Reference


def _by_definition(out: np.ndarray, expected: np.ndarray) -> float:
    """max |out - expected| / max |expected| with whole float64 copies (what `relative_error` computes)."""
    out64, exp64 = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    if not np.isfinite(out64).all():
        return float("inf")
    return float(np.max(np.abs(out64 - exp64)) / max(float(np.max(np.abs(exp64))), 1e-30))


def test_relative_error_and_the_reference_compute_the_definition():
    rng = np.random.default_rng(0)
    expected = rng.standard_normal((48, 40))
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        out = (expected + 1e-3 * rng.standard_normal(expected.shape)).astype(dtype)
        want = _by_definition(out, expected)
        assert relative_error(out, expected) == want
        assert relative_error(out, expected, error_scale(expected)) == want
        assert Reference.of(expected).error(out) == want
        assert relative_error(out, expected.astype(np.float32)) == _by_definition(out, expected.astype(np.float32))
    bad = expected.astype(np.float32)
    bad[3, 4] = np.nan
    assert relative_error(bad, expected) == Reference.of(expected).error(bad) == float("inf")
    bad[3, 4] = -np.inf
    assert Reference.of(expected).error(bad) == float("inf")
    assert Reference.of(expected).error(expected.T) == float("inf")  # another shape
    assert error_scale(np.zeros(0)) == 0.0 and relative_error(np.zeros(0), np.zeros(0)) == 0.0
