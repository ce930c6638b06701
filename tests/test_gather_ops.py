"""The public dispatch / combine ops: gradients, zero-weight NaN handling, fallback flags, the version guard,
jit / vmap, input errors, and sweeps whose entries the runtime uses."""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gather_backend_tests import routing

import moe_tune
from moe_tune.core.errors import UsageError
from moe_tune.kernels import guard
from moe_tune.kernels.gather import op as gather_op
from moe_tune.kernels.gather.definition import RAGGED_GATHER
from moe_tune.kernels.gather.plain_jax import PlainGather, PlainGatherReduce
from moe_tune.kernels.gather.reference import gather_reduce_reference, ragged_gather_reference
from moe_tune.kernels.gather.tiled import TiledGather, TiledGatherReduce
from moe_tune.tuner import SweepRequest, run_sweep

TOKENS, TOP_K, HIDDEN = 16, 4, 32
ROWS = TOKENS * TOP_K


def plain_gather(x, indices, start, end, weights):
    """The op's meaning in plain jnp, differentiated by JAX itself: the reference for the custom VJPs."""
    i = jnp.arange(indices.shape[0])
    valid = (i >= start) & (i < end)
    rows = x[jnp.clip(indices, 0, x.shape[0] - 1)] * (1.0 if weights is None else weights[:, None])
    return jnp.where(valid[:, None], rows, 0.0)


def plain_gather_reduce(x, indices, weights, valid, r):
    rows = jnp.where(valid[:, None], x[jnp.clip(indices, 0, x.shape[0] - 1)] * weights[:, None], 0.0)
    return rows.reshape(-1, r, x.shape[1]).sum(1)


def close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b), initial=0.0) <= tol * max(np.max(np.abs(b), initial=0.0), 1.0)


KERNELS = {("jax", "gather"): PlainGather, ("jax", "gather_reduce"): PlainGatherReduce,
           ("tiled", "gather"): TiledGather, ("tiled", "gather_reduce"): TiledGatherReduce}


def count_runs(monkeypatch, backend: str, method: str) -> list[str]:
    """Wrap `backend`'s `method` kernel so that each *execution* of it (not each trace) appends to the list
    returned: a debug callback in the traced kernel runs only where its `lax.cond` branch is taken."""
    cls = KERNELS[backend, method]
    runs: list[str] = []
    original = getattr(cls, method)

    def counted(self, *args, **kwargs):
        jax.debug.callback(lambda: runs.append(method))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, counted)
    return runs


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    gather_indices, combine_indices = routing(TOKENS, TOP_K, seed=0)
    return {
        "x": jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32),
        "expert_out": jnp.asarray(rng.standard_normal((ROWS, HIDDEN)), jnp.float32),
        "gather_indices": jnp.asarray(gather_indices),
        "combine_indices": jnp.asarray(combine_indices),
        "weights": jnp.asarray(rng.random(ROWS), jnp.float32),
        "dout_rows": jnp.asarray(rng.standard_normal((ROWS, HIDDEN)), jnp.float32),
        "dout_tokens": jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32),
    }


# --------------------------------------------------------------------------------------------------------
# Values and gradients


@pytest.mark.parametrize("backend", ["jax", "tiled"])
@pytest.mark.parametrize("fan_out", [True, False], ids=["fan_out", "random_indices"])
def test_ragged_gather_matches_reference_with_gradients(data, backend, fan_out, monkeypatch):
    """Forward vs float64, and grad in x and weights vs JAX's own autodiff of the plain formula, for the MoE
    fan-out (the gather-reduce kernel runs the backward: it runs once) and arbitrary indices (the segment-sum
    path: the kernel never runs)."""
    x, w, dout = data["x"], data["weights"], data["dout_rows"]
    indices = data["gather_indices"] if fan_out else jnp.asarray(np.random.default_rng(1).integers(0, TOKENS, ROWS),
                                                                  jnp.int32)
    start, end = 9, 47
    out = moe_tune.ragged_gather(x, indices, start, end, weights=w, backend=backend)
    assert close(out, ragged_gather_reference(x, indices, start, end, w))

    loss = lambda f: lambda x, w: jnp.sum(f(x, indices, start, end, w) * dout)
    runs = count_runs(monkeypatch, backend, "gather_reduce")
    ours = jax.grad(loss(lambda *a: moe_tune.ragged_gather(*a[:4], weights=a[4], backend=backend)), (0, 1))(x, w)
    jax.effects_barrier()
    assert runs == (["gather_reduce"] if fan_out else [])
    ref = jax.grad(loss(plain_gather), (0, 1))(x, w)
    for got, want in zip(ours, ref):
        assert close(got, want)


def test_ragged_gather_without_weights_has_x_gradient(data):
    x, indices, dout = data["x"], data["gather_indices"], data["dout_rows"]
    got = jax.grad(lambda x: jnp.sum(moe_tune.ragged_gather(x, indices, 0, ROWS) * dout))(x)
    want = jax.grad(lambda x: jnp.sum(plain_gather(x, indices, 0, ROWS, None) * dout))(x)
    assert close(got, want)


@pytest.mark.parametrize("backend", ["jax", "tiled"])
@pytest.mark.parametrize("permutation", [True, False], ids=["permutation", "repeated_rows"])
def test_ragged_gather_reduce_matches_reference_with_gradients(data, backend, permutation, monkeypatch):
    """Rows of x that no valid entry reads are NaN (another shard's): value and gradients stay finite and
    match; the x gradient runs on the gather kernel (once) when indices is a permutation, else never."""
    w, dout = data["weights"], data["dout_tokens"]
    if permutation:
        indices = data["combine_indices"]
    else:
        indices = jnp.asarray(np.random.default_rng(2).integers(0, ROWS, ROWS), jnp.int32)
    valid = indices < ROWS // 3
    x = jnp.where((jnp.arange(ROWS) < ROWS // 3)[:, None], data["expert_out"], jnp.nan)

    out = moe_tune.ragged_gather_reduce(x, indices, w, valid, TOP_K, backend=backend)
    assert close(out, gather_reduce_reference(x, indices, w, valid, TOP_K))

    loss = lambda f: lambda x, w: jnp.sum(f(x, indices, w, valid, TOP_K) * dout)
    runs = count_runs(monkeypatch, backend, "gather")
    ours = jax.grad(loss(lambda *a: moe_tune.ragged_gather_reduce(*a, backend=backend)), (0, 1))(x, w)
    jax.effects_barrier()
    assert runs == (["gather"] if permutation else [])
    x_clean = jnp.nan_to_num(x)  # autodiff of the plain formula would spread NaN through the select's zeros
    ref = jax.grad(loss(plain_gather_reduce), (0, 1))(x_clean, w)
    for got, want in zip(ours, ref):
        assert np.all(np.isfinite(np.asarray(got))) and close(got, want)


@pytest.mark.parametrize("backend", ["jax", "tiled"])
def test_dense_gather_reduce_matches_reference_with_gradients(data, backend, monkeypatch):
    """The combine's indices are a permutation: the x gradient runs on the gather kernel, once."""
    x, indices, w, dout = data["expert_out"], data["combine_indices"], data["weights"], data["dout_tokens"]
    out = moe_tune.dense_gather_reduce(x, indices, w, TOP_K, backend=backend)
    assert close(out, gather_reduce_reference(x, indices, w, None, TOP_K))
    everything = jnp.ones(ROWS, bool)
    runs = count_runs(monkeypatch, backend, "gather")
    ours = jax.grad(lambda x, w: jnp.sum(moe_tune.dense_gather_reduce(x, indices, w, TOP_K, backend=backend) * dout),
                    (0, 1))(x, w)
    jax.effects_barrier()
    assert runs == ["gather"]
    ref = jax.grad(lambda x, w: jnp.sum(plain_gather_reduce(x, indices, w, everything, TOP_K) * dout), (0, 1))(x, w)
    for got, want in zip(ours, ref):
        assert close(got, want)


@pytest.mark.parametrize("op", ["ragged", "dense"])
def test_zero_weight_times_nan(data, op):
    """NaN in an expert output whose top-k weight is 0: NaN by default (a weighted sum propagates it), 0 with
    skip_zero_weights=True; other tokens are unaffected either way."""
    indices, w = data["combine_indices"], data["weights"].at[0].set(0.0)  # entry 0 belongs to token 0
    x = data["expert_out"].at[indices[0]].set(jnp.nan)

    def call(**kw):
        if op == "ragged":
            return moe_tune.ragged_gather_reduce(x, indices, w, jnp.ones(ROWS, bool), TOP_K, **kw)
        return moe_tune.dense_gather_reduce(x, indices, w, TOP_K, **kw)

    propagated = np.asarray(call())
    assert np.all(np.isnan(propagated[0])) and np.all(np.isfinite(propagated[1:]))
    skipped = np.asarray(call(skip_zero_weights=True))
    assert np.all(np.isfinite(skipped))
    assert close(skipped, gather_reduce_reference(np.nan_to_num(x), indices, w, None, TOP_K))
    grads = jax.grad(lambda x: jnp.sum(call(skip_zero_weights=True)))(x)
    assert np.all(np.isfinite(np.asarray(grads)))


def test_jit_and_vmap(data):
    """Traced ranges under jit (one trace and one compile for every range), and vmapped batches (of shards with
    different ranges; of combines with different inputs and masks), each element against the reference."""
    x, indices = data["x"], data["gather_indices"]
    traces = []

    def gather(x, s, e):
        traces.append(1)
        return moe_tune.ragged_gather(x, indices, s, e)

    fn = jax.jit(gather)
    for s, e in [(0, ROWS), (4, 20), (30, 31)]:
        assert close(fn(x, s, e), ragged_gather_reference(x, indices, s, e))
    assert len(traces) == 1 and fn._cache_size() == 1
    starts, ends = jnp.array([0, 16, 40]), jnp.array([16, 40, ROWS])
    batched = jax.vmap(lambda s, e: moe_tune.ragged_gather(x, indices, s, e))(starts, ends)
    for i in range(3):
        assert close(batched[i], ragged_gather_reference(x, indices, int(starts[i]), int(ends[i]))), i
    assert close(batched.sum(0), ragged_gather_reference(x, indices, 0, ROWS))

    xs = jnp.stack([data["expert_out"], -2 * data["expert_out"][::-1]])
    valid = jnp.stack([jnp.ones(ROWS, bool), data["combine_indices"] < ROWS // 2])
    combine = jax.vmap(lambda x, v: moe_tune.ragged_gather_reduce(x, data["combine_indices"], data["weights"],
                                                                  v, TOP_K))(xs, valid)
    for i in range(2):
        want = gather_reduce_reference(xs[i], data["combine_indices"], data["weights"], valid[i], TOP_K)
        assert np.abs(np.asarray(want)).max() > 0.1 and close(combine[i], want), i


def test_input_errors_are_usage_errors(data):
    x, indices, w = data["expert_out"], data["combine_indices"], data["weights"]
    with pytest.raises(UsageError, match="reduce_group_size"):
        moe_tune.dense_gather_reduce(x, indices, w, 3)
    with pytest.raises(UsageError, match="topk_weights"):
        moe_tune.dense_gather_reduce(x, indices, w[:-1], TOP_K)
    with pytest.raises(UsageError, match="indices"):
        moe_tune.ragged_gather(data["x"], indices.astype(jnp.float32), 0, 4)
    with pytest.raises(UsageError, match="start"):
        moe_tune.ragged_gather(data["x"], data["gather_indices"], jnp.zeros(2, jnp.int32), 4)
    with pytest.raises(UsageError, match="unknown backend"):
        moe_tune.ragged_gather(data["x"], data["gather_indices"], 0, 4, backend="nope")


# --------------------------------------------------------------------------------------------------------
# Fallback flags and the version guard


def backends_used(caplog) -> list[tuple[str, str]]:
    """(op, backend) of every kernel traced while caplog was capturing, from the op's log line."""
    found = []
    for record in caplog.records:
        words = record.getMessage().split()
        if "backend" in words:
            found.append((words[0], words[words.index("backend") + 1].rstrip(",")))
    return found


def combine_loss(data, **flags):
    def loss(x, w):
        return jnp.sum(moe_tune.ragged_gather_reduce(x, data["combine_indices"], w, jnp.ones(ROWS, bool), TOP_K,
                                                     **flags) * data["dout_tokens"])
    return jax.grad(loss, (0, 1))(data["expert_out"], data["weights"])


@pytest.mark.parametrize("how", ["keyword", "environment"])
def test_fallback_flags_pick_the_plain_path_per_kernel(data, caplog, monkeypatch, how):
    """Each flag switches its own kernel, forward or backward: ragged_gather_fallback alone moves the combine's
    backward gather to `jax` and leaves the combine itself on `tiled`; results are unchanged."""
    caplog.set_level(logging.INFO, logger="moe_tune")
    reference = combine_loss(data)
    assert backends_used(caplog) == [("ragged_gather_reduce", "tiled"), ("ragged_gather", "tiled")]

    caplog.clear()
    if how == "keyword":
        got = combine_loss(data, ragged_gather_fallback=True)
    else:
        monkeypatch.setenv(gather_op.ENV_GATHER_FALLBACK, "1")
        got = combine_loss(data)
    assert backends_used(caplog) == [("ragged_gather_reduce", "tiled"), ("ragged_gather", "jax")]
    for a, b in zip(got, reference):
        assert close(a, b)

    caplog.clear()
    if how == "keyword":
        got = combine_loss(data, ragged_gather_fallback=True, ragged_gather_reduce_fallback=True)
    else:
        monkeypatch.setenv(gather_op.ENV_GATHER_REDUCE_FALLBACK, "true")
        got = combine_loss(data)
    assert backends_used(caplog) == [("ragged_gather_reduce", "jax"), ("ragged_gather", "jax")]
    for a, b in zip(got, reference):
        assert close(a, b)


def test_keyword_overrides_environment(data, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="moe_tune")
    monkeypatch.setenv(gather_op.ENV_GATHER_FALLBACK, "1")
    moe_tune.ragged_gather(data["x"], data["gather_indices"], 0, ROWS, ragged_gather_fallback=False)
    assert backends_used(caplog) == [("ragged_gather", "tiled")]


def test_version_guard_falls_back_with_one_warning(data, caplog, monkeypatch):
    """A backend whose declared JAX range excludes the installed JAX is replaced by the plain path, with one
    warning naming both versions, however many calls; in-range backends are untouched."""
    caplog.set_level(logging.INFO, logger="moe_tune")
    monkeypatch.setattr(TiledGather, "jax_versions", ">=0.4,<0.5")
    monkeypatch.setattr(guard, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = moe_tune.ragged_gather(data["x"], data["gather_indices"], 0, ROWS)
        moe_tune.ragged_gather(data["x"], data["gather_indices"], 3, ROWS)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert ">=0.4,<0.5" in messages[0] and jax.__version__ in messages[0] and "'jax'" in messages[0]
    assert [b for _, b in backends_used(caplog)] == ["jax", "jax"]
    assert close(first, ragged_gather_reference(data["x"], data["gather_indices"], 0, ROWS))

    caplog.clear()  # the combine kernel still supports this JAX: it stays on tiled
    moe_tune.dense_gather_reduce(data["expert_out"], data["combine_indices"], data["weights"], TOP_K)
    assert backends_used(caplog) == [("dense_gather_reduce", "tiled")]


def test_declared_ranges_cover_the_installed_jax():
    """Every registered backend supports the JAX this suite runs on (else the suite tests fallbacks only)."""
    from moe_tune.kernels import get_op, op_names
    for name in op_names():
        for backend in get_op(name).backends.names():
            assert guard.supports_installed_jax(get_op(name).backends.get(backend)), (name, backend)


def test_version_check_uses_pep440(monkeypatch):
    monkeypatch.setattr(TiledGatherReduce, "jax_versions", ">=0.10,<0.12")
    impl = TiledGatherReduce()
    for version, ok in [("0.10.2", True), ("0.11.1", True), ("0.12.0", False), ("0.9.9", False)]:
        monkeypatch.setattr(guard, "installed_jax", lambda v=version: v)
        assert guard.supports_installed_jax(impl) is ok, version


# --------------------------------------------------------------------------------------------------------
# Sweeps write entries the runtime uses


@pytest.mark.parametrize("op", ["ragged_gather", "ragged_gather_reduce", "dense_gather_reduce"])
def test_sweep_entry_is_used_at_run_time(op, caplog):
    from moe_tune.kernels import get_op
    kernel_op = get_op(op)
    ep = {"ep": 2} if "ep" in kernel_op.option_names else {}  # dense_gather_reduce takes no ep
    problem = kernel_op.problem(tokens=64, hidden=128, top_k=4, experts=8, dtype="float32", **ep)
    result = run_sweep(SweepRequest.make(op, problem, samples=2, workers=1, max_candidates=3))
    entry = result.entry
    assert entry.count("tried") == 3 and entry.count("wrong") == 0
    record = entry.distribution
    assert record["experts"] == 8 and record["ep"] == ep.get("ep", 1)
    assert 0.3 < record["valid_fraction"] < 0.7 if ep else record["valid_fraction"] == 1.0

    caplog.set_level(logging.INFO, logger="moe_tune")
    inputs = kernel_op.make_inputs(problem, "balanced", 0)
    x = jnp.asarray(inputs["x"])
    if op == "ragged_gather":
        out = moe_tune.ragged_gather(x, inputs["indices"], inputs["start"], inputs["end"])
    elif op == "ragged_gather_reduce":
        out = moe_tune.ragged_gather_reduce(x, inputs["indices"], inputs["weights"], inputs["valid"], 4)
    else:
        out = moe_tune.dense_gather_reduce(x, inputs["indices"], inputs["weights"], 4)
    assert close(out, kernel_op.reference(problem, inputs))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(op))
    assert "(exact: tuned entry in" in line and entry.config["rows_per_chunk"] == int(
        line.split("rows_per_chunk=")[1].split()[0])


def test_sweep_inputs_hide_other_shards_rows_as_nan():
    """The combine sweep's x holds NaN outside the shard, so a kernel that reads invalid rows is caught as
    wrong by the correctness gate, not timed."""
    from moe_tune.kernels import get_op
    spec = get_op("ragged_gather_reduce")
    problem = spec.problem(tokens=32, hidden=128, top_k=4, experts=8, ep=4)
    inputs = spec.make_inputs(problem, "balanced", 0)
    assert np.isnan(inputs["x"]).any() and np.isfinite(spec.reference(problem, inputs)).all()
    gather = RAGGED_GATHER.make_inputs(RAGGED_GATHER.problem(tokens=32, hidden=128, top_k=4, experts=8, ep=4),
                                       "balanced", 0)
    assert 0 < gather["end"] < 32 * 4


def test_shape_a_backend_cannot_serve_runs_on_the_plain_path(data, caplog):
    """pallas_tpu needs hidden % 128 == 0; without a caller's config the op still runs (plain path) and says why."""
    caplog.set_level(logging.INFO, logger="moe_tune")
    out = moe_tune.ragged_gather(data["x"], data["gather_indices"], 0, ROWS, backend="pallas_tpu")  # hidden 32
    assert close(out, ragged_gather_reference(data["x"], data["gather_indices"], 0, ROWS))
    assert backends_used(caplog) == [("ragged_gather", "jax")]
    assert "pallas_tpu cannot run it" in caplog.records[0].getMessage()
    with pytest.raises(moe_tune.core.errors.InvalidConfigError):  # a caller's config is never silently replaced
        moe_tune.ragged_gather(data["x"], data["gather_indices"], 0, ROWS, backend="pallas_tpu",
                               config={"block_rows": 8, "dmas_in_flight": 4})
