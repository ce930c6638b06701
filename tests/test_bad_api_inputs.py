"""Bad inputs, the Python API's share: group sizes and offsets out of range give one answer on
every registered backend (xla, tiled, and the Pallas ones in interpret mode) and a one-line UsageError when
their values are known; config mistakes name what the caller got wrong."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_tune
from moe_tune.core.errors import InvalidConfigError, UsageError
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
    """A shard of 2 groups out of 4 at a traced offset of 3 or 7 (or -1) selects no group: every backend (and
    every gradient) gives zeros, and 1 stays a real shard."""
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
    """Negatives count as 0 and rows past m are dropped, the same on every backend."""
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
    """Out-of-range sizes and offsets with concrete values (a Python int, a NumPy or a JAX array): a one-line UsageError."""
    lhs, rhs = operands
    rhs = rhs[:2] if offset is not None else rhs
    wrap = jnp.asarray if as_array else np.asarray
    off = offset if offset is None or not as_array else jnp.int32(offset)
    with pytest.raises(UsageError, match=message) as raised:
        moe_tune.ragged_dot(lhs, rhs, wrap(np.asarray(sizes, np.int32)), group_offset=off)
    assert "\n" not in str(raised.value)


def test_a_per_direction_config_with_an_unknown_direction_names_the_valid_ones(operands):
    """`{"fwd": ..., "bwd": ...}` names the valid directions, not `TiledConfig`'s fields."""
    lhs, rhs = operands
    with pytest.raises(UsageError, match=r"config keys \['bwd'\] are not directions: .* fwd, dlhs, drhs"):
        moe_tune.ragged_dot(lhs, rhs, jnp.full((TOTAL,), 16, jnp.int32), backend="tiled",
                            config={"fwd": {"tm": 32}, "bwd": {"tm": 32}})


def test_a_config_that_breaks_a_rule_with_a_default_says_the_default_was_not_given(operands):
    """`{"tm": 16}`, whose default tail (32) breaks a rule, says that tail is the default, not the caller's."""
    lhs, rhs = operands
    with pytest.raises(InvalidConfigError) as raised:
        moe_tune.ragged_dot(lhs, rhs, jnp.full((TOTAL,), 16, jnp.int32), backend="tiled", config={"tm": 16})
    message = str(raised.value)
    assert "{'tm': 16}" in message and "must not exceed tm (16)" in message
    assert "tail=32 is the default (not given)" in message


# The rest of the API (moe_mlp fused and unfused, 4-bit and in-kernel quantization, the
# fused ops), probed with user mistakes that used to end in a traceback from inside JAX or NumPy, a message
# naming another argument, or a silently wrong answer.

T, H, I, E = 8, 16, 8, 4  # moe_mlp: tokens, hidden, intermediate, experts


def _f32(*shape: int, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _layer() -> tuple:
    """x, router logits, w_gate, w_up, w_down of a tiny moe_mlp."""
    return _f32(T, H), _f32(T, E, seed=2), _f32(E, H, I, seed=3), _f32(E, H, I, seed=4), _f32(E, I, H, seed=5)


def _mlp(*, x=None, gate=None, top_k=2, **kwargs):
    x0, logits, w_gate, w_up, w_down = _layer()
    x = x0 if x is None else x
    return moe_tune.moe_mlp(x, logits, w_gate if gate is None else gate, w_up, w_down, top_k, **kwargs)


def _gather_gmm(rhs=None, x=None, **kwargs):
    rhs = _f32(TOTAL, K, N) if rhs is None else rhs
    return moe_tune.gather_gmm(_f32(T, K) if x is None else x, jnp.arange(16, dtype=jnp.int32) % T, rhs,
                               jnp.full((TOTAL,), 4, jnp.int32), **kwargs)


_RHS = _f32(TOTAL, K, N)
_BAD_CALLS = {
    # ragged_dot's group_offset: a vector failed in NumPy, a float or a string was cast (1.5 -> shard 1)
    "offset vector": (lambda lhs, rhs: moe_tune.ragged_dot(lhs, rhs[:2], jnp.full((TOTAL,), 16, jnp.int32),
                                                           group_offset=jnp.array([0, 1])),
                      r"group_offset must be an integer scalar .* got a int32 array of shape \(2,\)"),
    "offset float": (lambda lhs, rhs: moe_tune.ragged_dot(lhs, rhs[:2], jnp.full((TOTAL,), 16, jnp.int32),
                                                          group_offset=1.5), "group_offset must be an integer"),
    "offset string": (lambda lhs, rhs: moe_tune.ragged_dot(lhs, rhs[:2], jnp.full((TOTAL,), 16, jnp.int32),
                                                           group_offset="1"), "group_offset must be an integer"),
    "traced float offset": (lambda lhs, rhs: jax.jit(lambda o: moe_tune.ragged_dot(
        lhs, rhs[:2], jnp.full((TOTAL,), 16, jnp.int32), group_offset=o))(jnp.float32(1)),
        "group_offset must be an integer scalar .* float32"),
    "DynamicQuant rhs": (lambda lhs, rhs: moe_tune.ragged_dot(lhs, moe_tune.DynamicQuant(rhs, "int8"),
                                                              jnp.full((TOTAL,), 16, jnp.int32)),
                         "rhs cannot be a DynamicQuant"),
    # quant
    "quantize axis name": (lambda lhs, rhs: moe_tune.quantize(rhs, "int8", axis="k"),
                           r"axis 'k' is out of range .* an int in \[-3, 3\)"),
    "AsQArray of a string": (lambda lhs, rhs: moe_tune.ragged_dot(lhs, moe_tune.AsQArray("w", "int8"),
                                                                  jnp.full((TOTAL,), 16, jnp.int32)),
                             "an AsQArray's value must be a float array, got str"),
    "use_profiles of an int": (lambda lhs, rhs: moe_tune.use_profiles(3).__enter__(),
                               r"use_profiles takes a directory path \(str or os.PathLike\), got int"),
    "lookup of a dict": (lambda lhs, rhs: get_op("ragged_dot").lookup({"m": 64}),
                         r"ragged_dot.lookup takes the op's problem \(RaggedDotProblem, from get_op\('ragged_dot'\).problem\(...\)\), got dict"),
    "dequantize a float array": (lambda lhs, rhs: moe_tune.dequantize(rhs), "dequantize takes a QArray"),
    "packed_axis out of range": (lambda lhs, rhs: moe_tune.from_checkpoint(
        np.zeros((TOTAL, K // 2, N), np.uint8), np.ones((TOTAL, 1, N), np.float32), "int4", packed_axis=7),
        "packed_axis 7 is out of range"),
    "checkpoint values a string": (lambda lhs, rhs: moe_tune.from_checkpoint("v", "s", "int4"),
                                   "values must be a NumPy or JAX array, got str"),
    # moe_mlp
    "moe_mlp x rank 3": (lambda lhs, rhs: _mlp(x=_f32(1, T, H)), r"x must be \[tokens, hidden\]"),
    "moe_mlp x a string": (lambda lhs, rhs: _mlp(x="x"), r"x must be \[tokens, hidden\], got str"),
    "moe_mlp weights rank 2": (lambda lhs, rhs: _mlp(gate=_f32(H, I)),
                               r"expert weights must be \[local_experts, k, n\] .* w_gate \(16, 8\)"),
    "moe_mlp top_k float": (lambda lhs, rhs: _mlp(top_k=2.0), "top_k must be a Python int in"),
    "moe_mlp top_k array": (lambda lhs, rhs: _mlp(top_k=jnp.int32(2), fused=False), "top_k must be a Python int"),
    "moe_mlp expert_offset vector": (lambda lhs, rhs: _mlp(expert_offset=jnp.array([0, 1]), fused=False),
                                     "expert_offset must be an integer scalar"),
    "moe_mlp expert_offset string": (lambda lhs, rhs: _mlp(expert_offset="2", fused=True),
                                     "expert_offset must be an integer scalar"),
    "moe_mlp fused a string": (lambda lhs, rhs: _mlp(fused="yes"), "fused must be True, False or None"),
    "moe_mlp activation not callable": (lambda lhs, rhs: _mlp(activation=3),
                                        "activation must be a callable or one of silu, gelu, relu"),
    "moe_mlp fused gate QArray up float": (
        lambda lhs, rhs: _mlp(gate=moe_tune.quantize(_layer()[2], "int8", axis=1), fused=True),
        "fused=True: gate and up: weight parts must .* all float or all QArray"),
    # the gathers' start / end
    "ragged_gather start float": (lambda lhs, rhs: moe_tune.ragged_gather(_f32(T, H), jnp.arange(16) % T, 0.5, 16),
                                  "ragged_gather: start must be an integer scalar"),
    # the fused ops
    "gather_gmm gate and up of two widths": (lambda lhs, rhs: _gather_gmm((_RHS, _f32(TOTAL, K, 2 * N)), glu="silu"),
                                             r"with glu the weight parts are \(gate, up\) of one shape"),
    "gather_gmm three parts with glu": (lambda lhs, rhs: _gather_gmm((_RHS, _RHS, _RHS), glu="silu"),
                                        r"with glu the weight parts are \(gate, up\)"),
    "gather_gmm float and QArray parts": (
        lambda lhs, rhs: _gather_gmm((_RHS, moe_tune.quantize(_RHS, "int8", axis=1)), glu="silu"),
        "all float or all QArray, got ArrayImpl .*, QArray"),
    "gather_gmm AsQArray weights": (lambda lhs, rhs: _gather_gmm(moe_tune.AsQArray(_RHS, "int8")),
                                    "weights must be float arrays or QArrays, got AsQArray"),
    "gather_gmm x a string": (lambda lhs, rhs: _gather_gmm(x="x"), "the activations must be a float array"),
    "gather_gmm DynamicQuant x": (lambda lhs, rhs: _gather_gmm(moe_tune.quantize(_RHS, "int8", axis=1),
                                                               x=moe_tune.DynamicQuant(_f32(T, K), "int8")),
                                  "the activations must be a float array .* got DynamicQuant"),
    "gather_gmm config of unknown direction": (lambda lhs, rhs: _gather_gmm(backend="tiled",
                                                                            config={"fwd": {}, "dlhs": {}}),
                                               r"config keys \['dlhs'\] are not directions: .* fwd, bwd"),
    "gmm_combine rows shorter than h": (lambda lhs, rhs: moe_tune.gmm_combine(
        _f32(16, K), _RHS, jnp.full((TOTAL,), 4, jnp.int32), jnp.arange(8, dtype=jnp.int32), jnp.ones((8,)), T),
        r"rows must have one entry per row of h \(16\), got 8"),
}


@pytest.mark.parametrize("case", sorted(_BAD_CALLS))
def test_new_api_mistakes_are_one_line_usage_errors(operands, case):
    """Each of these used to raise from inside JAX/NumPy (TypeError, IndexError, AttributeError, a broadcast
    error in a kernel), name another argument, or run on a cast value; now one UsageError names it."""
    call, message = _BAD_CALLS[case]
    with pytest.raises(UsageError, match=message) as raised:
        call(*operands)
    assert "\n" not in str(raised.value)


def test_a_qarray_of_numpy_parts_runs_like_one_of_jax_arrays(operands):
    """A QArray of NumPy arrays failed in the tiled kernel (a traced group id indexing a NumPy scale)."""
    lhs, rhs = operands
    q = moe_tune.quantize(rhs, "int8", axis=1)
    sizes = jnp.full((TOTAL,), 16, jnp.int32)
    numpy_parts = moe_tune.QArray(np.asarray(q.qvalue), np.asarray(q.scale))
    np.testing.assert_array_equal(moe_tune.ragged_dot(lhs, numpy_parts, sizes, backend="tiled"),
                                  moe_tune.ragged_dot(lhs, q, sizes, backend="tiled"))


def test_moe_mlp_runs_gate_and_up_one_dispatch_cannot_read_unfused():
    """A quantized gate with a float up (or two scale blocks) failed with fused=None, where the tables chose the
    fused path that cannot read them as parts; now None runs them unfused, as fused=False does."""
    gate = moe_tune.quantize(_layer()[2], "int8", axis=1)
    np.testing.assert_array_equal(_mlp(gate=gate), _mlp(gate=gate, fused=False))


def test_moe_mlp_gives_x_dtype_and_takes_an_activation_by_name_on_both_paths():
    """Unfused, bf16 x with float32 weights came back float32 (fused: bf16, as documented), and
    activation="gelu" was `'str' object is not callable` (the fused path took the name)."""
    x = _layer()[0].astype(jnp.bfloat16)
    assert _mlp(x=x, fused=False).dtype == _mlp(x=x, fused=True).dtype == jnp.bfloat16
    np.testing.assert_array_equal(_mlp(activation="gelu", fused=False), _mlp(activation=jax.nn.gelu, fused=False))


# Quantization and the ops' problem(): an already quantized x, an empty axis, a block that is not an int, a
# keyword an op does not declare: each one UsageError naming the argument.

_W = np.ones((TOTAL, K, N), np.float32)
_RAGGED = dict(m=M, k=K, n=N, groups=TOTAL)
_QUANT_AND_OPTION_CALLS = {
    "quantize a QArray": (lambda: moe_tune.quantize(moe_tune.quantize(_W, "int8", axis=1), "int8", axis=1),
                          "quantize takes a float array, got a QArray: x is already quantized"),
    "quantize an empty axis": (lambda: moe_tune.quantize(np.zeros((2, 0, 3), np.float32), "int8", axis=1),
                               "nothing to quantize along axis 1: its length is 0"),
    "quantize a float block": (lambda: moe_tune.quantize(_W, "int8", axis=1, block_size=16.0),
                               r"block_size must be a positive integer .* got 16.0 \(float\)"),
    "quantize a bool block": (lambda: moe_tune.quantize(_W, "int8", axis=1, block_size=True),
                              r"block_size must be a positive integer .* got True \(bool\)"),
    "problem quant_blok": (lambda: get_op("ragged_dot").problem(**_RAGGED, rhs_quant="int4", quant_blok=8),
                           r"ragged_dot.problem\(\) takes no option 'quant_blok' \(did you mean 'quant_block'\?\)"),
    "problem dtyp": (lambda: get_op("ragged_dot").problem(**_RAGGED, dtyp="bfloat16"),
                     r"takes no option 'dtyp' \(did you mean 'dtype'\?\)"),
    "problem rhs_qdtype": (lambda: get_op("ragged_dot").problem(**_RAGGED, rhs_qdtype="int8"),
                           "takes no option 'rhs_qdtype' .*a field of RaggedDotProblem"),
    "problem rhs_qblock": (lambda: get_op("ragged_dot").problem(**_RAGGED, rhs_quant="int8", rhs_qblock=8),
                           "takes no option 'rhs_qblock'"),
    "problem lhs_qdynamic": (lambda: get_op("ragged_dot").problem(**_RAGGED, lhs_quant="int8", lhs_qdynamic=True),
                             r"takes no option 'lhs_qdynamic' .*; its options are .*lhs_dynamic"),
    "fused problem quant_blok": (lambda: get_op("fused_moe").problem(tokens=8, top_k=2, k=64, n=64, groups=4,
                                                                    rhs_quant="int8", quant_blok=32),
                                 r"fused_moe.problem\(\) takes no option 'quant_blok'"),
    "problem positional": (lambda: get_op("ragged_dot").problem(M, k=K, n=N, groups=TOTAL),
                           r"ragged_dot.problem\(\) takes keyword arguments only"),
    "problem without m": (lambda: get_op("ragged_dot").problem(k=K, n=N, groups=TOTAL),
                          r"ragged_dot.problem\(\) needs m"),
}


@pytest.mark.parametrize("case", sorted(_QUANT_AND_OPTION_CALLS))
def test_quantization_and_problem_option_mistakes_are_one_line_usage_errors(case):
    call, message = _QUANT_AND_OPTION_CALLS[case]
    with pytest.raises(UsageError, match=message) as raised:
        call()
    assert "\n" not in str(raised.value)


def _every_op() -> list[str]:
    from moe_tune.kernels import op_names

    return op_names()


@pytest.mark.parametrize("name", _every_op())
def test_every_ops_problem_refuses_a_keyword_it_does_not_declare(name):
    """Each op's problem() takes its declared options (and direction) only, and its own defaults are among
    them."""
    op = get_op(name)
    defaults = op.default_problem_options()
    op.problem(**defaults)
    with pytest.raises(UsageError, match=rf"{name}.problem\(\) takes no option 'bogus'; its options are"):
        op.problem(**defaults, bogus=1)


@pytest.mark.parametrize("name", _every_op())
def test_every_ops_problem_takes_the_keywords_it_declares(name):
    """Every declared option (`options`: what the CLI offers and `check_options` admits) is a keyword of the
    op's problem(), so none is refused by Python, and every keyword it requires is declared."""
    import inspect

    op = get_op(name)
    params = inspect.signature(op.problem).parameters
    assert {*op.option_names, "direction"} <= set(params)
    assert {p for p, param in params.items() if param.default is inspect.Parameter.empty} <= set(op.option_names)


# The fused ops' token indices: a known one out of range among the shard's rows is refused like known group
# sizes; traced ones read the same way on every backend (dispatch: clamped; combine: the row adds nothing).
FUSED_BACKENDS = tuple(get_op("fused_moe").backends.names())
_GROUP_SIZES = jnp.array([10, 10], jnp.int32)


def _fused_operands(seed: int = 0):
    """x [12, 128], the dispatch weights [2, 128, 128], h [20, 128], the combine weights, row weights, and token
    indices that name each token at most once per group (as top-k routing does)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    rows = np.r_[rng.permutation(12)[:10], rng.permutation(12)[:10]].astype(np.int32)
    return (normal(12, 128), normal(2, 128, 128), normal(20, 128), normal(2, 128, 128),
            jnp.asarray(rng.random(20), jnp.float32), rows)


@pytest.mark.parametrize("stage, bad, tokens, message", [
    ("dispatch", 15, 12, "rows[0] = 15 is outside x's 12 tokens"),
    ("dispatch", -1, 12, "rows[0] = -1 is outside x's 12 tokens"),
    ("combine", -2, 12, "rows[0] = -2 is outside the output's 12 tokens"),
    ("combine", None, 3, "is outside the output's 3 tokens"),  # rows up to token 11, 3 tokens asked
])
def test_known_token_indices_out_of_range_are_one_line_usage_errors(stage, bad, tokens, message):
    x, w, h, w2, row_weights, rows = _fused_operands()
    rows = jnp.asarray(rows if bad is None else np.r_[bad, rows[1:]])
    with pytest.raises(UsageError, match=re.escape(message)):
        if stage == "dispatch":
            moe_tune.gather_gmm(x, rows, w, _GROUP_SIZES)
        else:
            moe_tune.gmm_combine(h, w2, _GROUP_SIZES, rows, row_weights, tokens=tokens)


def test_a_row_outside_the_shard_may_hold_any_index_and_tokens_may_be_a_numpy_int():
    x, w, h, w2, row_weights, rows = _fused_operands()
    rows = jnp.asarray(np.r_[rows[:10], np.full(10, -7)])  # the second group is not this shard's
    out = moe_tune.gmm_combine(h, w2[:1], _GROUP_SIZES, rows, row_weights, tokens=np.int64(12), group_offset=0)
    assert out.shape == (12, 128)
    assert moe_tune.gather_gmm(x, rows, w[:1], _GROUP_SIZES, group_offset=0).shape == (20, 128)


@pytest.mark.slow  # the Pallas backends in interpret mode
def test_traced_token_indices_out_of_range_read_the_same_on_every_backend():
    x, w, h, w2, row_weights, rows = _fused_operands(1)
    rows[0], rows[11] = -2, 15
    rows = jnp.asarray(rows)
    combine = {b: np.asarray(jax.jit(lambda h, r, b=b: moe_tune.gmm_combine(h, w2, _GROUP_SIZES, r, row_weights,
                                                                              tokens=12, backend=b))(h, rows))
               for b in FUSED_BACKENDS}
    dispatch = {b: np.asarray(jax.jit(lambda x, r, b=b: moe_tune.gather_gmm(x, r, w, _GROUP_SIZES, backend=b))(x, rows))
                for b in FUSED_BACKENDS}
    # NumPy: the combine drops the two rows (they add nothing), the dispatch reads the clamped tokens
    h64, w64, x64 = (np.asarray(a, np.float64) for a in (h, w2, x))
    group = np.repeat([0, 1], 10)
    expected = np.zeros((12, 128))
    for i, t in enumerate(np.asarray(rows)):
        if 0 <= t < 12:
            expected[t] += float(row_weights[i]) * (h64[i] @ w64[group[i]])
    gathered = x64[np.clip(np.asarray(rows), 0, 11)]
    read = np.stack([gathered[i] @ np.asarray(w, np.float64)[group[i]] for i in range(20)])
    for backend in FUSED_BACKENDS:
        np.testing.assert_allclose(combine[backend], expected, rtol=1e-4, atol=1e-4, err_msg=backend)
        np.testing.assert_allclose(dispatch[backend], read, rtol=1e-4, atol=1e-4, err_msg=backend)


def test_lookup_of_another_ops_problem_names_the_problem_it_takes():
    problem = get_op("fused_moe").problem(tokens=32, top_k=2, k=64, n=64, groups=4)
    with pytest.raises(UsageError, match="ragged_dot.lookup takes the op's problem \\(RaggedDotProblem"):
        get_op("ragged_dot").lookup(problem)
