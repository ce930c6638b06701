"""`moe_mlp(..., fused=...)`: the fused experts (kernels/fused_moe/) against today's unfused layer, the compiled
program's temp memory, the measured choice (`moe_fusion`) behind fused=None, and the fused ops' bad input."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune import AsQArray, moe_mlp, quantize
from moe_tune.core.errors import UsageError
from moe_tune.kernels.fused_moe.op import gather_gmm, gmm_combine
from moe_tune.kernels.kernel_op import relative_error
from moe_tune.layer.fusion_choice import FusionConfig, FusionProblem, LayerChoice
from moe_tune.layer.fusion_op import MOE_FUSION

TOKENS, HIDDEN, WIDTH, EXPERTS, TOP_K = 16, 32, 12, 8, 2


def _layer(seed: int = 0, dtype=jnp.float32, tokens: int = TOKENS, hidden: int = HIDDEN, width: int = WIDTH):
    rng = np.random.default_rng(seed)
    normal = lambda shape, scale: jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    return (normal((tokens, hidden), 1.0), normal((tokens, EXPERTS), 1.0).astype(jnp.float32),
            normal((EXPERTS, hidden, width), hidden ** -0.5), normal((EXPERTS, hidden, width), hidden ** -0.5),
            normal((EXPERTS, width, hidden), width ** -0.5))


def _loss(fused, offset=None, **kw):
    def loss(x, logits, gate, up, down):
        out = moe_mlp(x, logits, gate, up, down, TOP_K, expert_offset=offset, fused=fused, **kw)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.parametrize("shard", [2])
def test_fused_equals_unfused_forward_and_gradients(shard):
    """Up to float32 accumulation order, on an expert-parallel shard (experts 2..5; the kernels' tests cover
    whole layers)."""
    x, logits, gate, up, down = _layer()
    sl = slice(None) if shard is None else slice(shard, shard + 4)
    args = (x, logits, gate[sl], up[sl], down[sl])
    (_, fused_out), fused_grads = _loss(True, shard)(*args)
    (_, plain_out), plain_grads = _loss(False, shard)(*args)
    np.testing.assert_allclose(fused_out, plain_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(fused_grads, plain_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))


def test_bfloat16_and_quantized_weights():
    x, logits, gate, up, down = _layer(1, jnp.bfloat16)
    run = lambda fused, *w: jax.jit(lambda *a: moe_mlp(*a, TOP_K, fused=fused))(x, logits, *w)
    np.testing.assert_allclose(run(True, gate, up, down).astype(np.float32),
                               run(False, gate, up, down).astype(np.float32), rtol=0.05, atol=0.05)
    q = [quantize(w.astype(jnp.float32), "int8", axis=1) for w in (gate, up, down)]
    x = x.astype(jnp.float32)
    fused = jax.jit(lambda *a: moe_mlp(*a, TOP_K, fused=True))(x, logits, *q)
    np.testing.assert_allclose(fused, jax.jit(lambda *a: moe_mlp(*a, TOP_K, fused=False))(x, logits, *q),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_temp_memory_is_smaller_by_the_removed_buffers(dtype):
    """The compiled forward's temp memory (XLA's buffer assignment) drops by at least the two [tokens x top_k,
    hidden] buffers the fused kernels do not write: the gathered rows and the expert outputs. (The bf16
    dispatch's copy of its output that made the full-size bf16 layers miss this is checked on the kernel:
    test_fused_moe.py, test_tiled_dispatch_temp_holds_no_second_output.) top_k is deepseek-v2-lite's: the fused
    combine's float32 [tokens, hidden] accumulator is 2 / top_k of a bf16 [tokens x top_k, hidden] buffer, half
    of one at top_k 4, which the margin no longer covers once the unfused bf16 dispatch gather lost its copy of
    its output (FINDINGS.md: gather loop carry; benchmarks/fused_memory_cpu.py checks the presets' shapes)."""
    tokens, hidden, top_k = 128, 256, 6
    args = _layer(2, dtype, tokens=tokens, hidden=hidden, width=64)
    temp = {fused: jax.jit(lambda *a, fused=fused: moe_mlp(*a, top_k, fused=fused)).lower(*args).compile()
            .memory_analysis().temp_size_in_bytes for fused in (False, True)}
    removed = 2 * tokens * top_k * hidden * jnp.dtype(dtype).itemsize
    assert temp[False] - temp[True] >= removed, temp


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_training_temp_memory_is_smaller_by_the_removed_buffers(dtype):
    """The compiled forward+backward (gradients in x, the router logits and the three weights) drops by at
    least the two [tokens x top_k, hidden] buffers (x's dtype) that only the unfused step writes: the expert
    outputs (kept for the combine's weight gradient) and d(rows) (the gate and up dlhs, scattered into dx by
    the gather's VJP). Both steps still write two: the gathered rows and the weighted d(out) rows that the
    weights' drhs read. The shape is decode-like (weights 6x one such buffer). A bf16 drhs loop that
    carried its result as uint16 bits and copied it out left the fused step's gate and up
    drhs holding two weight-sized carries at once (temp above the unfused step's; FINDINGS.md: drhs carry in its
    output)."""
    tokens, hidden, width, top_k = 64, 256, 96, 2
    args = _layer(2, dtype, tokens=tokens, hidden=hidden, width=width)

    def temp(fused: bool) -> int:
        loss = lambda *a: jnp.sum(moe_mlp(*a, top_k, fused=fused).astype(jnp.float32))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    unfused, fused = temp(False), temp(True)
    removed = 2 * tokens * top_k * hidden * jnp.dtype(dtype).itemsize
    assert unfused - fused >= removed, (unfused, fused, removed)


def test_fused_none_runs_the_choice_and_aqt_weights_stay_unfused(monkeypatch, caplog):
    """fused=None asks moe_fusion (here its default, patched to unfused); quantization-aware weights cannot be
    fused: None runs them unfused, True is a UsageError."""
    x, logits, gate, up, down = _layer(3)
    caplog.set_level(logging.INFO, logger="moe_tune")
    monkeypatch.setattr(LayerChoice, "default_config", lambda self, problem: FusionConfig(fused=False))
    jax.jit(lambda *a: moe_mlp(*a, TOP_K))(x, logits, gate, up, down)
    ops = {r.getMessage().split(" ")[0] for r in caplog.records}
    assert "moe_fusion" in ops and "ragged_gather" in ops and "fused_moe" not in ops, ops
    monkeypatch.undo()
    caplog.clear()
    jax.jit(lambda *a: moe_mlp(*a, TOP_K))(x[:8], logits[:8], gate, up, down)  # another key (lookups are cached)
    assert "fused_moe" in {r.getMessage().split(" ")[0] for r in caplog.records}  # the default: fused
    aqt = AsQArray(gate, "int8")
    out = moe_mlp(x, logits, aqt, up, down, TOP_K)  # None: unfused
    assert out.shape == x.shape
    with pytest.raises(UsageError, match="AsQArray"):
        moe_mlp(x, logits, aqt, up, down, TOP_K, fused=True)


def test_fused_ops_reject_bad_input():
    x, _, gate, up, down = _layer(4)
    rows = jnp.zeros((TOKENS * TOP_K,), jnp.int32)
    sizes = jnp.full((EXPERTS,), 4, jnp.int32)
    with pytest.raises(UsageError, match="activations"):
        gather_gmm(x[:, :5], rows, gate, sizes)
    with pytest.raises(UsageError, match="glu"):
        gather_gmm(x, rows, (gate, up), sizes, glu="swish")
    with pytest.raises(UsageError, match="group_offset"):
        gather_gmm(x, rows, gate[:4], sizes)
    h = jnp.zeros((TOKENS * TOP_K, WIDTH), jnp.float32)
    with pytest.raises(UsageError, match="row_weights"):
        gmm_combine(h, down, sizes, rows, jnp.ones((3,)), TOKENS)
    with pytest.raises(UsageError, match="tokens"):
        gmm_combine(h, down, sizes, rows, jnp.ones((TOKENS * TOP_K,)), 0)


def test_fused_none_trains_on_the_choice_timed_forward_and_backward(monkeypatch, caplog):
    """moe_fusion's two directions apart (patched defaults: the forward fused, forward+backward unfused): a
    forward-only call runs the fused kernels, a differentiated one the unfused layer (its value and
    gradients those of fused=False); the bwd choice's timed program is the layer's gradients, checked
    against float64."""
    x, logits, gate, up, down = _layer(4)
    caplog.set_level(logging.INFO, logger="moe_tune")
    monkeypatch.setattr(LayerChoice, "default_config",
                        lambda self, problem: FusionConfig(fused=problem.direction == "fwd"))
    args = (x[:12], logits[:12], gate, up, down)  # a key no other test looked up (lookups are cached)
    forward = jax.jit(lambda *a: moe_mlp(*a, TOP_K))(*args)
    traced = {r.getMessage().split(" ")[0] for r in caplog.records}
    assert "fused_moe" in traced and "ragged_gather" not in traced, traced
    caplog.clear()
    (_, out), grads = _loss(None)(*args)
    traced = {r.getMessage().split(" ")[0] for r in caplog.records}
    assert "ragged_gather" in traced and "fused_moe" not in traced, traced
    (_, plain_out), plain_grads = _loss(False)(*args)
    np.testing.assert_allclose(out, plain_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(forward, plain_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, plain_grads):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    monkeypatch.undo()
    problem = FusionProblem(tokens=16, hidden=32, intermediate=12, experts=8, top_k=2, ep=2, direction="bwd")
    inputs = MOE_FUSION.make_inputs(problem, "balanced", 0)
    expected = MOE_FUSION.reference(problem, inputs)
    for fused in (True, False):
        got = jax.jit(lambda i, f=fused: MOE_FUSION.run(LayerChoice(), FusionConfig(fused=f), problem, i))(inputs)
        assert relative_error(np.asarray(got), expected) < 1e-5


def test_the_gpu_defaults_follow_the_h100_measurements(monkeypatch):
    """On GPU `moe_fusion` defaults to unfused and `fused_moe` to its triton kernels (an H100,
    benchmarks/results/gpu_check_nvidia_h100_2026-11-26_layer*: unfused forwards 1.17-1.93x faster than fused
    triton, the plain-JAX fused layer 3.1-45x slower than it); CPU stays fused on its tiled kernels."""
    from moe_tune.core import devices
    from moe_tune.kernels.fused_moe.registry import BACKENDS

    problem = FusionProblem(tokens=TOKENS, hidden=HIDDEN, intermediate=WIDTH, experts=EXPERTS, top_k=TOP_K, ep=1,
                            dtype="bfloat16", direction="fwd")
    for platform, fused, kernels in (("cpu", True, "tiled"), ("gpu", False, "triton"), ("tpu", True, "pallas_tpu")):
        monkeypatch.setattr(devices, "platform", lambda platform=platform: platform)
        assert LayerChoice().default_config(problem) == FusionConfig(fused=fused), platform
        assert BACKENDS.default_for(platform).name == kernels, platform
