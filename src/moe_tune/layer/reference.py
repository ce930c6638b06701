"""Float64 references of one `moe_mlp` layer for the `moe_fusion` choice (`choice.py`): its output (the `fwd`
direction) and a training step's gradients (`bwd`), computed one expert at a time on the host.

The `bwd` check is light: it holds the full gradients of x and of the router logits, but the weight gradients
of a few experts only (`checked_experts`: the one with the most rows, the one with the fewest, possibly none,
and seeded others). The timed step still computes every gradient on the device (`choice.MoeFusionOp.run`
gathers the checked experts' by traced indices, so that XLA cannot drop the rest); only what is returned and
compared shrinks. The weights are never copied whole in float64: at deepseek-v2-lite 4096 tokens ep 1 float32
the full check held float64 copies of the 2.2 GB weights and of their gradients (~9 GB) plus a float32 copy of
every gradient; this one holds ~0.3 GB (`check_size`).

Each part of the check (dx, d(router logits), each checked expert's gradient of each weight) is compared at its
own scale (`check_vector`): one relative tolerance over all of them at once would let through a wrong dx,
whose values are ~8x smaller than the weight gradients' at deepseek-v2-lite 1024 tokens.

The loss is `sum(out * cotangent)`, a seeded random cotangent [tokens, hidden] (an input, in the layer's
dtype): with the plain sum every column of a down-projection gradient would be the same, and a bug that
mixes up columns would pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Seeded experts checked besides the most and the fewest loaded ones.
SEEDED_CHECKED = 2


def routed(top_k: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the router's float64 softmax probabilities [tokens, experts], the top_k experts of each token [tokens,
    top_k], highest first, ties to the lower index, their renormalized weights [tokens, top_k])."""
    logits = np.asarray(logits, np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(probs, chosen, axis=1)
    return probs, chosen, picked / picked.sum(axis=1, keepdims=True)


def checked_experts(problem: Any, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The local experts whose weight gradients a `bwd` check compares, int32 [2 + SEEDED_CHECKED] (distinct
    where the shard has that many): the one routed the most rows, the one routed the fewest (often none at
    skewed routing: a kernel that leaves an empty group's gradient unwritten is caught), then seeded others."""
    _, chosen, _ = routed(problem.top_k, logits)
    local = problem.local_experts
    rows = np.bincount(chosen.ravel(), minlength=problem.experts)[:local]
    first = [int(np.argmax(rows)), int(np.argmin(rows))]
    rest = [e for e in range(local) if e not in first]
    seeded = rng.choice(rest, size=min(SEEDED_CHECKED, len(rest)), replace=False) if rest else []
    picked = list(dict.fromkeys(first)) + [int(e) for e in seeded]
    return np.asarray(picked, np.int32)


def check_size(problem: Any) -> int:
    """Elements of a `bwd` check vector (`check_vector`): dx, d(router logits), the checked experts' three
    weight gradients, and one scale entry per part."""
    p = problem
    checked = min(2 + SEEDED_CHECKED, p.local_experts)
    return p.tokens * (p.hidden + p.experts) + checked * 3 * p.hidden * p.intermediate + 2 + 3 * checked


def _expert(inputs: Mapping[str, np.ndarray], e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expert e's gate, up and down weights in float64 (one expert's copy at a time)."""
    return tuple(np.asarray(inputs[name][e], np.float64) for name in ("w_gate", "w_up", "w_down"))


def layer_reference(problem: Any, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Float64 `moe_mlp` (softmax, top_k renormalized, SiLU-gated experts) of the shard's experts
    [0, experts/ep): [tokens, hidden]."""
    _, chosen, weights = routed(problem.top_k, inputs["router_logits"])
    out = np.zeros((problem.tokens, problem.hidden))
    for e in range(problem.local_experts):
        t, j = np.nonzero(chosen == e)  # a token picks an expert at most once: t holds no repeats
        if t.size:
            w_gate, w_up, w_down = _expert(inputs, e)
            x = np.asarray(inputs["x"][t], np.float64)
            gate, up = x @ w_gate, x @ w_up
            out[t] += weights[t, j][:, None] * ((gate / (1 + np.exp(-gate)) * up) @ w_down)
    return out


def training_reference(problem: Any, inputs: Mapping[str, np.ndarray],
                       experts: np.ndarray | None = None) -> list[np.ndarray]:
    """Float64 gradients of sum(`layer_reference` * cotangent): [dx [tokens, hidden], d(router logits)
    [tokens, experts] (through the softmax and the renormalized top_k weights; the choice of experts is
    constant), dw_gate [n, hidden, intermediate], dw_up [n, hidden, intermediate], dw_down [n, intermediate,
    hidden]] of the n `experts` (default: `inputs["checked_experts"]`; every local expert gives the full
    gradients)."""
    probs, chosen, weights = routed(problem.top_k, inputs["router_logits"])
    experts = np.asarray(inputs["checked_experts"] if experts is None else experts)
    cotangent = inputs["cotangent"]
    dx = np.zeros((problem.tokens, problem.hidden))
    dweights = np.zeros_like(weights)
    dw = [np.zeros((len(experts), *inputs[name].shape[1:])) for name in ("w_gate", "w_up", "w_down")]
    for e in range(problem.local_experts):
        t, j = np.nonzero(chosen == e)
        if not t.size:
            continue
        w_gate, w_up, w_down = _expert(inputs, e)
        x, ct, w = np.asarray(inputs["x"][t], np.float64), np.asarray(cotangent[t], np.float64), weights[t, j][:, None]
        gate, up = x @ w_gate, x @ w_up
        sig = 1 / (1 + np.exp(-gate))
        act = gate * sig
        h = act * up
        dweights[t, j] = np.sum((h @ w_down) * ct, axis=1)  # d(loss) / d(top-k weight)
        dout = w * ct
        dh = dout @ w_down.T
        dgate, dup = dh * up * sig * (1 + gate * (1 - sig)), dh * act
        dx[t] += dgate @ w_gate.T + dup @ w_up.T
        for i in np.flatnonzero(experts == e):
            dw[0][i], dw[1][i], dw[2][i] = x.T @ dgate, x.T @ dup, h.T @ dout
    # weights = picked / total, picked = the chosen softmax probabilities
    picked = np.take_along_axis(probs, chosen, axis=1)
    total = picked.sum(axis=1, keepdims=True)
    dpicked = dweights / total - (dweights * picked).sum(axis=1, keepdims=True) / total ** 2
    dprobs = np.zeros_like(probs)
    np.put_along_axis(dprobs, chosen, dpicked, axis=1)
    dlogits = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
    return [dx, dlogits, *dw]


def check_parts(grads: Sequence[Any]) -> list[Any]:
    """[dx, d(router logits), dw_gate, dw_up, dw_down] of the checked experts (`training_reference`'s
    order, NumPy or JAX arrays) as the check's parts: dx, d(router logits), then each weight's gradient of
    each checked expert on its own."""
    dx, dlogits, *dw = grads
    return [dx, dlogits, *(g[i] for g in dw for i in range(g.shape[0]))]


def check_vector(parts: Sequence[Any], xp: Any) -> Any:
    """The compared vector (`xp`: numpy for the reference, jax.numpy on the device): each part divided by its
    own max |value| (an all-zero part, an expert routed no rows, stays zero), then every part's max |value|
    over the largest one. So each part's values are checked at its own scale, and each part's scale to the
    tolerance relative to the largest (a part that is uniformly 2x off shows in its scale entry)."""
    peaks = xp.stack([xp.max(xp.abs(q)) for q in parts])
    tiny = xp.finfo(peaks.dtype).tiny
    scaled = [(q / xp.maximum(peak, tiny)).ravel() for q, peak in zip(parts, peaks)]
    return xp.concatenate([*scaled, peaks / xp.maximum(xp.max(peaks), tiny)])
