"""A tiny MoE layer for tests that sweep a whole layer and then run it: the preset, quick sweep settings, and
seeded float32 inputs of one expert-parallel shard."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.layer.models import ModelPreset
from moe_tune.tuner import SweepSettings

TINY = ModelPreset(name="tiny", hidden=128, expert_intermediate=64, experts=4, top_k=2, shared_experts=0)
# a real sweep, as small as one gets: two candidates (the default and one more), one sample, no workers
FAST = SweepSettings(samples=1, max_candidates=2, workers=1, finalists=1)


def layer_inputs(preset: ModelPreset, tokens: int, ep: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """(x [tokens, hidden], router logits [tokens, experts], w_gate [local, hidden, inter],
    w_down [local, inter, hidden]) in float32, for the shard of `preset.experts // ep` local experts."""
    rng = np.random.default_rng(seed)
    local = preset.experts // ep
    x = jnp.asarray(rng.standard_normal((tokens, preset.hidden)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((tokens, preset.experts)), jnp.float32)
    w_gate = jnp.asarray(rng.standard_normal((local, preset.hidden, preset.expert_intermediate)), jnp.float32)
    w_down = jnp.asarray(rng.standard_normal((local, preset.expert_intermediate, preset.hidden)), jnp.float32)
    return x, logits, w_gate, w_down
