"""Adding a backend is a short recipe (kernels/README.md): a toy ragged_dot backend, registered and swept end
to end, then picked up by the public op from the table the sweep wrote; its test class inherits every test a
ragged_dot backend passes (`ragged_dot_base.RaggedDotBackendTests`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from ragged_dot_base import RaggedDotBackendTests

import moe_tune
from moe_tune.kernels import get_op
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot.base import RaggedDotBackend
from moe_tune.tuner import SweepRequest, run_sweep


# --- the recipe: a frozen config, a backend subclass (gmm, tgmm, a default, a search space) --------------
@dataclasses.dataclass(frozen=True)
class ToyConfig(KernelConfig):
    block_n: int = 64  # output columns per dense matmul


class ToyRaggedDot(RaggedDotBackend):
    """Every row times its group's matrix, `block_n` output columns at a time (dense, one-hot groups)."""

    name, revision, config_cls, platforms = "toy", 1, ToyConfig, ("cpu",)

    def default_config(self, problem):
        columns = problem.matmul_dims()[2]  # the output's: n (fwd, drhs) or k (dlhs)
        return ToyConfig(64 if columns % 64 == 0 else columns)

    def candidate_values(self, problem):
        return {"block_n": [32, 64, 128]}  # those that do not divide the output columns are pruned

    def config_error(self, config, problem):
        return None if problem.matmul_dims()[2] % config.block_n == 0 else "block_n must divide the output dim"

    def gmm(self, lhs, rhs, group_sizes, *, config, out_dtype, group_offset=None, transpose_rhs=False):
        onehot = _onehot(group_sizes, group_offset, lhs.shape[0], rhs.shape[0])
        rhs = _float32(rhs).swapaxes(1, 2) if transpose_rhs else _float32(rhs)
        blocks = [jnp.einsum("mg,mk,gkn->mn", onehot, _float32(lhs), rhs[..., j:j + config.block_n])
                  for j in range(0, rhs.shape[2], config.block_n)]
        return jnp.concatenate(blocks, axis=1).astype(out_dtype)

    def tgmm(self, lhs, dout, group_sizes, *, config, out_dtype, num_groups, group_offset=None):
        onehot = _onehot(group_sizes, group_offset, lhs.shape[0], num_groups)
        return jnp.einsum("mg,mk,mn->gkn", onehot, _float32(lhs), _float32(dout)).astype(out_dtype)


def _float32(x):
    """An operand's float32 values: a QArray (quantized values and scales) is dequantized; activations to be
    quantized in the kernel (`DynamicQuant`) are quantized whole, then dequantized."""
    x = x.quantize() if isinstance(x, moe_tune.DynamicQuant) else x
    return moe_tune.dequantize(x) if isinstance(x, moe_tune.QArray) else x.astype(jnp.float32)


def _onehot(group_sizes, group_offset, m: int, groups: int):
    """float32 [m, groups]: which local group (group_offset + i) each row belongs to (other rows: none)."""
    local = jnp.arange(groups) + (0 if group_offset is None else group_offset)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))[local]
    rows = jnp.arange(m)[:, None]
    return ((rows < ends) & (rows >= ends - group_sizes[local])).astype(jnp.float32)
# --- end of the recipe ---------------------------------------------------------------------------------


class TestToy(RaggedDotBackendTests):
    """The toy backend passes every test a backend inherits: float and quantized, all directions, shards."""

    backend, backend_instance = "toy", ToyRaggedDot()
    max_examples = 6

    def invalid_configs(self, problem):
        return [{"block_n": 7}]  # divides none of the test shapes' output columns


@pytest.fixture
def toy():
    backends = get_op("ragged_dot").backends
    yield backends.register(ToyRaggedDot())
    backends.unregister("toy")


def test_a_toy_backend_sweeps_end_to_end_and_is_used(toy, tmp_path):
    kernel_op = get_op("ragged_dot")
    problem = kernel_op.problem(m=128, k=64, n=128, groups=4)
    result = run_sweep(SweepRequest.make("ragged_dot", problem, backend="toy", samples=2, workers=1, max_candidates=2,
                                         profile_dir=tmp_path))
    assert result.entry.count("tried") == 2 and result.entry.count("wrong") == 0
    assert result.entry.backend == "toy" and result.entry.versions["backend_revision"] == 1

    inputs = kernel_op.make_inputs(problem, "balanced", 0)
    with moe_tune.use_profiles(tmp_path):
        found = kernel_op.lookup(problem, backend="toy")
        assert found.source == "exact" and found.config == ToyConfig(**result.entry.config)
        out = moe_tune.ragged_dot(jnp.asarray(inputs["a"]), jnp.asarray(inputs["b"]),
                                  jnp.asarray(inputs["group_sizes"]), backend="toy")
    np.testing.assert_allclose(np.asarray(out), kernel_op.reference(problem, inputs), rtol=1e-4, atol=1e-4)
