"""The `sparsecore` dispatch and combine kernels against the float64 references, in Pallas TPU interpret mode off
TPU. The interpreter runs one core and no indexed DMA (jax 0.10), so there the workers run one after the other
and each block's gather and write are one row DMA per live index (`sparsecore._row_dmas`); the work split, block and
range arithmetic, masks and float32 sums are the kernels' own. Its chip rules: SparseCore facts per chip, the
fall back to `pallas_tpu` where a TPU has none."""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gather_backend_tests import GatherBackendTests, GatherReduceBackendTests, routing

import moe_tune
from moe_tune.core import devices
from moe_tune.core.chips import get_target
from moe_tune.kernels import guard
from moe_tune.kernels.gather.definition import RAGGED_GATHER, RAGGED_GATHER_REDUCE
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.reference import (
    gather_reduce_reference,
    ragged_gather_reference,
)
from moe_tune.kernels.gather.sparsecore import (
    SparseCoreGather,
    SparseCoreGatherConfig,
    SparseCoreGatherReduce,
    SparseCoreGatherReduceConfig,
)

# 96 rows / 24 tokens and 24 rows / 12 tokens, each with its default config: off TPU the work is split as on
# v5p (64 workers, most of them with no block); the 24-row dispatch in 16-row steps and the 12-token combine in
# 8-token steps end with a block shifted back over the one before.
SHAPES = ((24, 4, 128), (12, 2, 256))
MAX_CONFIGS = 1
DTYPES = ("float32", "bfloat16")


def judged(target: str):
    chip = get_target(target)
    return devices.judging(devices.Device(chip.platform, chip.device_kind))


class TestSparseCoreGather(GatherBackendTests):
    backend = "sparsecore"
    shapes = SHAPES
    max_configs = MAX_CONFIGS
    dtypes = DTYPES

    def invalid_with_reasons(self, problem):
        return [({"rows_per_step": 0}, "rows_per_step must be a positive integer"),
                ({"rows_per_step": problem.rows + 1}, f"rows_per_step={problem.rows + 1} exceeds {problem.rows}"),
                ({"subcores": 17}, "exceeds the 16 vector subcores"),
                ({"subcores": 0}, "subcores must be a positive integer")]


class TestSparseCoreGatherReduce(GatherReduceBackendTests):
    backend = "sparsecore"
    shapes = SHAPES
    max_configs = MAX_CONFIGS
    dtypes = DTYPES

    def invalid_with_reasons(self, problem):
        return [({"tokens_per_step": -1}, "tokens_per_step must be a positive integer"),
                ({"tokens_per_step": problem.tokens + 1}, f"exceeds {problem.tokens}"),
                ({"subcores": 32}, "exceeds the 16 vector subcores")]


def test_unsupported_shapes_are_rejected_with_a_reason():
    for impl in (SparseCoreGather(), SparseCoreGatherReduce()):
        cfg = impl.default_config(GatherProblem(tokens=64, rows=512, hidden=128))
        assert "float32 and bfloat16" in impl.config_error(cfg, GatherProblem(tokens=64, rows=512, hidden=128,
                                                                              dtype="float16"))
        assert "multiple of 16" in impl.config_error(cfg, GatherProblem(tokens=64, rows=512, hidden=136,
                                                                        dtype="bfloat16"))
        assert "multiple of 8" in impl.config_error(cfg, GatherProblem(tokens=64, rows=512, hidden=100))


def test_vmem_rule_reads_each_chips_sparse_cores():
    """qwen3-30b-a3b's combine in bfloat16 (hidden 2048, top-8): 8 tokens a step need about 300 KiB, over a v6e
    subcore's 256 KiB, under a v5p subcore's 512 KiB; both chips' defaults fit their own budgets."""
    problem = GatherProblem(tokens=512, rows=4096, hidden=2048, dtype="bfloat16")
    impl = SparseCoreGatherReduce()
    with judged("v6e"):
        assert "256 KiB of a vector subcore" in impl.config_error(SparseCoreGatherReduceConfig(8, 16), problem)
        assert impl.config_error(impl.default_config(problem), problem) is None
        assert impl.default_config(problem).subcores == 16
    with judged("v5p"):
        assert impl.config_error(SparseCoreGatherReduceConfig(8, 16), problem) is None
        assert impl.config_error(impl.default_config(problem), problem) is None


@pytest.mark.parametrize("target", ["v5e", "v4"])
def test_a_tpu_without_sparse_cores_runs_pallas_tpu_with_one_warning(target, monkeypatch):
    monkeypatch.setattr(guard, "_warned", set())
    problem = GatherProblem(tokens=64, rows=512, hidden=256, dtype="bfloat16")
    with judged(target), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for op in (RAGGED_GATHER, RAGGED_GATHER_REDUCE, RAGGED_GATHER):
            assert op.resolve_config("sparsecore", problem).backend.name == "pallas_tpu"
        assert "has no SparseCores" in SparseCoreGather().config_error(SparseCoreGatherConfig(), problem)
    notes = [str(w.message) for w in caught if "sparsecore" in str(w.message)]
    assert len(notes) == 2 and all("has no SparseCores; using the backend 'pallas_tpu'" in n for n in notes), notes


def test_a_tpu_with_sparse_cores_keeps_it():
    problem = GatherProblem(tokens=64, rows=512, hidden=256, dtype="bfloat16")
    for target in ("v5p", "v6e"):
        with judged(target):
            assert RAGGED_GATHER.resolve_config("sparsecore", problem).backend.name == "sparsecore"


def test_ops_and_their_gradients_run_on_it():
    """The public ops with backend="sparsecore": dispatch forward and its gradient (a gather-reduce on the same
    backend), combine forward; against float64 and the plain backend's gradients."""
    tokens, top_k, hidden = 8, 2, 128
    rows = tokens * top_k
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    indices, combine_indices = (jnp.asarray(a) for a in routing(tokens, top_k, seed=5))
    w = jnp.asarray(rng.random(rows), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)
    out = moe_tune.ragged_gather(x, indices, 3, 13, weights=w, backend="sparsecore")
    np.testing.assert_allclose(np.asarray(out), ragged_gather_reference(x, indices, 3, 13, w), rtol=1e-5, atol=1e-6)
    loss = lambda backend: lambda x, w: jnp.sum(moe_tune.ragged_gather(x, indices, 3, 13, weights=w,
                                                                       backend=backend) * dout)
    ours, plain = (jax.grad(loss(b), (0, 1))(x, w) for b in ("sparsecore", "jax"))
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    xr = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)
    valid = jnp.asarray(np.asarray(combine_indices) < rows // 2)
    combined = moe_tune.ragged_gather_reduce(xr, combine_indices, w, valid, top_k, backend="sparsecore")
    np.testing.assert_allclose(np.asarray(combined), gather_reduce_reference(xr, combine_indices, w, valid, top_k),
                               rtol=1e-5, atol=1e-6)


def test_moe_mlp_runs_its_dispatch_and_combine_on_it():
    """`moe_mlp`'s unfused layer with its three gathers on sparsecore (`moe_tune.use_backend`): the one-device
    layer (dispatch, dense combine) and one expert-parallel shard (`expert_offset`: the combine masked to its
    experts), forward and gradients in x and the weights, against the same layer on the plain backends."""
    tokens, hidden, intermediate, experts, top_k = 8, 128, 128, 4, 2
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((experts, hidden, intermediate)) / hidden**0.5, jnp.float32)
                    for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((experts, intermediate, hidden)) / intermediate**0.5, jnp.float32)
    gathers = ("ragged_gather", "ragged_gather_reduce", "dense_gather_reduce")

    def layer(backend, offset):
        local = slice(None) if offset is None else slice(offset, offset + experts // 2)

        def loss(x, w_gate, w_up, w_down):
            out = moe_tune.moe_mlp(x, logits, w_gate[local], w_up[local], w_down[local], top_k, fused=False,
                                   expert_offset=offset)
            return jnp.sum(out * out), out

        with contextlib.ExitStack() as stack:
            for op in gathers:
                stack.enter_context(moe_tune.use_backend(op, backend))
            return jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(x, w_gate, w_up, w_down)

    for offset in (None, 2):
        (_, ours), ours_grads = layer("sparsecore", offset)
        (_, plain), plain_grads = layer("jax", offset)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(plain), rtol=1e-5, atol=1e-5)
        for a, b in zip(ours_grads, plain_grads):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
