"""Inputs given on the device as compile workers get them: a token and a host (NumPy) copy, the same for every
call with the same arrays, so that each worker gets them once, with its first request, even when they are
compiled for in several chunks (`workers.WorkerPool.map`'s `shared`). Forgotten when the arrays are freed.
A sweep's own inputs carry their token from the start (`tuner/inputs.py`); this serves `compile_all` called
with arrays (`SweepInputs.given`).
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

import jax
import numpy as np

_sent: tuple[Any, list[weakref.ref], str, Any] | None = None  # (treedef, leaves, token, host inputs)


def shared_inputs(inputs: Any) -> tuple[str, Any]:
    """(token, host copy) of `inputs` (a pytree of arrays)."""
    global _sent
    leaves, treedef = jax.tree.flatten(inputs)
    if (_sent is not None and _sent[0] == treedef and len(_sent[1]) == len(leaves)
            and all(ref() is leaf for ref, leaf in zip(_sent[1], leaves))):
        return _sent[2], _sent[3]
    token, host = uuid.uuid4().hex, jax.tree.map(np.asarray, inputs)
    try:
        refs = [weakref.ref(leaf) for leaf in leaves]
    except TypeError:  # a leaf that cannot be referenced weakly (a Python scalar): no reuse across calls
        return token, host
    _sent = (treedef, refs, token, host)
    if leaves:
        weakref.finalize(leaves[0], _forget, token)
    return token, host


def _forget(token: str) -> None:
    global _sent
    if _sent is not None and _sent[2] == token:
        _sent = None
