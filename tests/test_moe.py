"""`moe_mlp` end to end: output and gradients against a dense per-expert reference, expert-parallel shards
that add up to the whole layer, and the fallback flags (same numbers, plain path)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_tune
from moe_tune.core.errors import UsageError

TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 24, 32, 16, 8, 2


def dense_moe(x, logits, w_gate, w_up, w_down):
    """Every expert on every token, each output weighted by the token's combine weight for that expert
    (0 unless it is in the token's top-k): no sorting, gathering or ragged matmuls, and none of moe_tune's
    routing: softmax, top-k and renormalization are written out here."""
    z = logits - jax.lax.stop_gradient(logits.max(axis=1, keepdims=True))
    probs = jnp.exp(z) / jnp.sum(jnp.exp(z), axis=1, keepdims=True)
    chosen = jnp.argsort(-jax.lax.stop_gradient(probs), axis=1, stable=True)[:, :TOP_K]
    in_top_k = jnp.sum(jax.nn.one_hot(chosen, EXPERTS), axis=1)  # [tokens, experts], 1 on the top-k
    kept = probs * in_top_k
    combine = kept / jnp.sum(kept, axis=1, keepdims=True)  # [tokens, experts]
    hidden = jax.nn.silu(jnp.einsum("td,edf->etf", x, w_gate)) * jnp.einsum("td,edf->etf", x, w_up)
    return jnp.einsum("etf,efd,te->td", hidden, w_down, combine)


def dense_moe_float64(x, logits, w_gate, w_up, w_down) -> np.ndarray:
    """The same in float64 NumPy, one token and expert at a time."""
    x, logits = np.asarray(x, np.float64), np.asarray(logits, np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[:TOP_K]
        weights = probs[t, top] / probs[t, top].sum()
        for e, w in zip(top, weights):
            gate, up = x[t] @ np.asarray(w_gate[e], np.float64), x[t] @ np.asarray(w_up[e], np.float64)
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ np.asarray(w_down[e], np.float64))
    return out


@pytest.fixture
def layer():
    rng = np.random.default_rng(0)
    f32 = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
    return (f32(TOKENS, HIDDEN), f32(TOKENS, EXPERTS), f32(EXPERTS, HIDDEN, INTERMEDIATE, scale=HIDDEN ** -0.5),
            f32(EXPERTS, HIDDEN, INTERMEDIATE, scale=HIDDEN ** -0.5),
            f32(EXPERTS, INTERMEDIATE, HIDDEN, scale=INTERMEDIATE ** -0.5))


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_output_matches_dense_per_expert_reference(layer):
    out = moe_tune.moe_mlp(*layer, TOP_K)
    assert out.shape == (TOKENS, HIDDEN) and out.dtype == jnp.float32
    assert relative(out, dense_moe_float64(*layer)) < 1e-5


def test_gradients_match_dense_reference(layer):
    """d/d(x, router logits, w_gate, w_up, w_down) of the whole block, through both gather ops' custom VJPs
    and ragged_dot's, against JAX's autodiff of the dense block."""
    dout = jnp.asarray(np.random.default_rng(1).standard_normal((TOKENS, HIDDEN)), jnp.float32)
    ours = jax.grad(lambda *a: jnp.sum(moe_tune.moe_mlp(*a, TOP_K) * dout), argnums=range(5))(*layer)
    want = jax.grad(lambda *a: jnp.sum(dense_moe(*a) * dout), argnums=range(5))(*layer)
    for name, got, ref in zip(["x", "router_logits", "w_gate", "w_up", "w_down"], ours, want):
        assert relative(got, ref) < 1e-4, name


def test_expert_parallel_shards_add_up_to_the_layer(layer):
    """Each shard holds EXPERTS / 4 experts; its ragged kernels only touch its own rows. The sum of the
    shards' outputs (what a psum would compute) is the whole layer, and so are its gradients."""
    x, logits, w_gate, w_up, w_down = layer
    shard = EXPERTS // 4

    def sharded(x, logits, w_gate, w_up, w_down):
        return sum(moe_tune.moe_mlp(x, logits, w_gate[o:o + shard], w_up[o:o + shard], w_down[o:o + shard], TOP_K,
                                    expert_offset=o) for o in range(0, EXPERTS, shard))

    assert relative(jax.jit(sharded)(*layer), moe_tune.moe_mlp(*layer, TOP_K)) < 1e-6
    ours = jax.grad(lambda *a: jnp.sum(sharded(*a) ** 2), argnums=(0, 1, 4))(*layer)
    want = jax.grad(lambda *a: jnp.sum(dense_moe(*a) ** 2), argnums=(0, 1, 4))(*layer)
    for got, ref in zip(ours, want):
        assert relative(got, ref) < 1e-4


def gather_backends(caplog) -> dict[str, set[str]]:
    """Gather op -> the backends its kernels were traced with, from the ops' INFO log lines."""
    found: dict[str, set[str]] = {}
    for record in caplog.records:
        words = record.getMessage().split()
        if words and words[0] != "ragged_dot" and "backend" in words:
            found.setdefault(words[0], set()).add(words[words.index("backend") + 1].rstrip(","))
    return found


def test_fallback_flags_give_the_same_block(layer, caplog):
    """The flags reach the gather kernels of the unfused block, forward and backward: the plain path (`jax`)
    runs them all, not the CPU's `tiled`, and the block's value and gradient are unchanged."""
    caplog.set_level(logging.INFO, logger="moe_tune")

    def run(**flags):
        """The block's value, and the backends of its kernels forward and backward (the gradient traced only)."""
        caplog.clear()
        out = moe_tune.moe_mlp(*layer, TOP_K, fused=False, **flags)
        jax.make_jaxpr(jax.grad(lambda x: jnp.sum(moe_tune.moe_mlp(x, *layer[1:], TOP_K, fused=False, **flags))))(
            layer[0])
        return out, gather_backends(caplog)

    reference, backends = run()
    assert backends == {"ragged_gather": {"tiled"}, "dense_gather_reduce": {"tiled"},
                        "ragged_gather_reduce": {"tiled"}}  # the last: the backward of the dispatch
    plain, backends = run(ragged_gather_fallback=True, ragged_gather_reduce_fallback=True)
    assert backends == {"ragged_gather": {"jax"}, "dense_gather_reduce": {"jax"}, "ragged_gather_reduce": {"jax"}}
    assert relative(plain, reference) < 1e-6


def test_bfloat16_block(layer):
    as_bf16 = [a.astype(jnp.bfloat16) for a in layer]
    out = jax.jit(lambda *a: moe_tune.moe_mlp(*a, TOP_K))(*as_bf16)
    assert out.dtype == jnp.bfloat16
    assert relative(out, dense_moe_float64(*as_bf16)) < 3e-2


def test_bad_shapes_are_usage_errors(layer):
    x, logits, w_gate, w_up, w_down = layer
    with pytest.raises(UsageError, match="expert_offset"):
        moe_tune.moe_mlp(x, logits, w_gate[:4], w_up[:4], w_down[:4], TOP_K)
    with pytest.raises(UsageError, match="top_k"):
        moe_tune.moe_mlp(*layer, EXPERTS + 1)
    with pytest.raises(UsageError, match="disagree"):
        moe_tune.moe_mlp(x, logits, w_gate, w_up, w_gate, TOP_K)
