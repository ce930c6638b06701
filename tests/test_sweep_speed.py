"""The tuner's speed (FINDINGS.md: sweep speed): the check's relative error computed once per output against
a reference whose scale is computed once; the shared payload (inputs, reference) handed to the compile workers
through a file; seeded inputs and references without whole float64 copies (the same bits); the trace's runs
read with fewer stats (the same spans)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from moe_tune.kernels.kernel_op import error_scale, relative_error
from moe_tune.tuner.candidate import Reference


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

    from moe_tune.tuner import candidate as inputs

    monkeypatch.setattr(inputs, "_directory", lambda: str(tmp_path))
    stale = tmp_path / "moe_tune_shared_999999999_x"  # a pid no process has
    stale.write_bytes(b"old")
    expected = np.arange(12.0).reshape(3, 4)
    payload = {"a": np.ones((5, 3), ml_dtypes.bfloat16), "b": np.arange(10, dtype=np.int8)[::2],
               "empty": np.zeros(0, np.float32), "reference": Reference.of(expected)}
    stored = inputs.store(payload)
    assert not stale.exists() and os.path.dirname(stored.path) == str(tmp_path)
    back = inputs.load(stored)
    for name in ("a", "b", "empty"):
        assert back[name].dtype == payload[name].dtype and np.array_equal(back[name], payload[name])
    assert np.array_equal(back["reference"].expected, expected) and back["reference"].scale == 11.0
    assert not back["reference"].expected.flags.writeable
    inputs.remove(stored)
    assert not os.path.exists(stored.path)
    assert np.array_equal(back["reference"].expected, expected)  # the mapping outlives the file


def test_seeded_inputs_and_references_are_the_float64_formulas_bit_for_bit():
    """The inputs scaled in place in float32 and the references converting each group's rows to
    float64 as it is multiplied give the same bits as the whole-array float64 formulas they replaced (so
    every seed's inputs, and every stored entry's evidence, stay what they were)."""
    from moe_tune.kernels import get_op
    from moe_tune.kernels.ragged_dot.definition import OPERANDS

    op, (m, k, n, g) = get_op("ragged_dot"), (40, 24, 20, 5)
    shapes = {"lhs": ((m, k), 1.0), "rhs": ((g, k, n), np.sqrt(k)), "dout": ((m, n), np.sqrt(n))}
    for dtype, distribution, direction in [(d, dist, r) for d in ("float32", "bfloat16") for dist in ("skewed", "single")
                                           for r in ("fwd", "dlhs", "drhs")]:
        problem = op.problem(m=m, k=k, n=n, groups=g, dtype=dtype, direction=direction)
        inputs = op.make_inputs(problem, distribution, 3)
        rng, want_dtype = np.random.default_rng(3), np.float32 if dtype == "float32" else ml_dtypes.bfloat16
        for name, operand in zip(("a", "b"), OPERANDS[direction]):  # the formulas before in-place scaling
            shape, divisor = shapes[operand]
            x = rng.standard_normal(shape, np.float32)
            want = (x if operand == "lhs" else x / divisor).astype(want_dtype)
            assert inputs[name].dtype == want_dtype and np.array_equal(inputs[name], want), (dtype, direction, name)
        a64, b64 = np.asarray(inputs["a"], np.float64), np.asarray(inputs["b"], np.float64)
        sizes = np.asarray(inputs["group_sizes"], np.int64)
        want = np.zeros({"fwd": (m, n), "dlhs": (m, k), "drhs": (g, k, n)}[direction])
        for i, (s, e) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
            if direction == "fwd":
                want[s:e] = a64[s:e] @ b64[i]
            elif direction == "dlhs":
                want[s:e] = a64[s:e] @ b64[i].T
            else:
                want[i] = a64[s:e].T @ b64[s:e]
        got = op.reference(problem, inputs)
        assert got.dtype == np.float64 and np.array_equal(got, want), (dtype, distribution, direction)
        if distribution == "single":  # groups without rows are skipped: their output stays zero
            assert (sizes == 0).sum() == g - 1 and np.count_nonzero(got) == got.size // (g if direction == "drhs" else 1)


def test_spans_by_run_read_early_equal_the_spans_over_every_stat():
    """`_spans_by_run` reads each event's stats only up to its run id and module; on a real CPU
    trace of two programs run twice each it finds what grouping `plane_events` (every stat read) finds."""
    import collections

    import jax
    import jax.numpy as jnp

    from moe_tune.tuner import timing

    x = jnp.ones((64, 64))
    calls = {i: timing.traceable(lambda a, i=i: jnp.tanh(a @ a) + i, i).lower(x).compile() for i in (3, 7)}
    session_type = timing._session_type()
    if session_type is None:
        pytest.skip("this jaxlib hands no in-memory profile (the file path is covered by test_tuner)")
    session = session_type(timing._profile_options(None))
    for _ in range(2):
        for call in calls.values():
            jax.block_until_ready(call(x))
    profile = timing.stop_profiler(session)
    (plane,) = [list(profile.planes)[i] for i in timing.profile_reader.find_device_plane_ids(profile, "cpu")]
    spans, modules = {}, {}
    for _, _, start, duration, stats in timing.plane_events(plane):
        if (run := stats.get("run_id")) is not None:
            old = spans.get(run, (start, start + duration))
            spans[run] = (min(old[0], start), max(old[1], start + duration))
            if "hlo_module" in stats:
                modules.setdefault(run, stats["hlo_module"])
    want = collections.defaultdict(list)
    for run, (start, end) in spans.items():
        if (match := timing._EVENT.match(f"{modules.get(run, '')}(")) is not None:
            want[int(match[1])].append((end - start) * 1e-9)
    found = timing._spans_by_run(plane)
    assert sorted(found) == [3, 7] and all(len(v) == 2 for v in found.values())
    assert {i: sorted(v) for i, v in found.items()} == {i: sorted(v) for i, v in want.items()}
