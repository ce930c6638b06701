"""The activations a fused dispatch may apply in its epilogue, by name (a name is static and keyable; a
callable is not): the JAX function the kernels apply and the float64 NumPy one the reference applies.

`glu=<name>`: the weights are gate and up concatenated along n, and the output is `act(h[:, :f]) * h[:, f:]`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np


def _np_gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


# name -> (JAX activation, float64 NumPy activation). `gelu` is jax.nn.gelu's default (tanh approximation).
ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "silu": (jax.nn.silu, lambda x: x / (1.0 + np.exp(-x))),
    "gelu": (jax.nn.gelu, _np_gelu_tanh),
    "relu": (jax.nn.relu, lambda x: np.maximum(x, 0.0)),
}


def activation_name(fn: Callable | str | None) -> str | None:
    """The name of a known activation (a name is returned as is), None for one the fused epilogue does not
    know (the caller then applies it outside the kernel)."""
    if fn is None or isinstance(fn, str):
        return fn if fn is None or fn in ACTIVATIONS else None
    for name, (jax_fn, _) in ACTIVATIONS.items():
        if fn is jax_fn:
            return name
    return None


def apply(name: str, h):
    """The JAX gated epilogue: act(h[:, :f]) * h[:, f:] computed in h's dtype (float32 inside the kernels)."""
    f = h.shape[-1] // 2
    return ACTIVATIONS[name][0](h[..., :f]) * h[..., f:]


def apply_reference(name: str, h: np.ndarray) -> np.ndarray:
    """The float64 gated epilogue."""
    f = h.shape[-1] // 2
    return ACTIVATIONS[name][1](h[..., :f]) * h[..., f:]
