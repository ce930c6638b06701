"""The tuner's speed (issue 32 item 5, session 15): the check's relative error computed once per output against
a reference whose scale is computed once; the shared payload (inputs, reference) handed to the compile workers
through a file."""

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


def test_a_shared_payload_comes_back_from_its_file_as_read_only_views(tmp_path, monkeypatch):
    """`shared_payload`: the arrays of any picklable payload (a dict, a dataclass, bf16, an empty or a
    strided array) come back equal, read-only; the file goes with `remove`, and a dead process's with the
    next `store`."""
    import os

    from moe_tune.tuner import shared_payload

    monkeypatch.setattr(shared_payload, "_directory", lambda: str(tmp_path))
    stale = tmp_path / "moe_tune_shared_999999999_x"  # a pid no process has
    stale.write_bytes(b"old")
    expected = np.arange(12.0).reshape(3, 4)
    payload = {"a": np.ones((5, 3), ml_dtypes.bfloat16), "b": np.arange(10, dtype=np.int8)[::2],
               "empty": np.zeros(0, np.float32), "reference": Reference.of(expected)}
    stored = shared_payload.store(payload)
    assert not stale.exists() and os.path.dirname(stored.path) == str(tmp_path)
    back = shared_payload.load(stored)
    for name in ("a", "b", "empty"):
        assert back[name].dtype == payload[name].dtype and np.array_equal(back[name], payload[name])
    assert np.array_equal(back["reference"].expected, expected) and back["reference"].scale == 11.0
    assert not back["reference"].expected.flags.writeable
    shared_payload.remove(stored)
    assert not os.path.exists(stored.path)
    assert np.array_equal(back["reference"].expected, expected)  # the mapping outlives the file
