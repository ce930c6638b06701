"""The tiled drhs (tgmm, per-group schedule) of a given file against the installed transposed-lhs windows, timed
interleaved: `old` = the kernel of a given file (each bf16 window's dot contracts the rows of both operands,
[window, k]^T @ [window, n], which XLA CPU runs in float32), `new` = the installed kernel (lhs transposed once
to [k, m]; each window's dot is [k, window] @ [window, n] in bf16, XLA CPU's `__ynn_fusion`). Same config
(the backend's default for the problem), same inputs; each variant's error against a float64 reference of
the same bf16 inputs and its temp memory are printed with its time.

    git show <before>:src/moe_tune/kernels/ragged_dot/tiled.py > /tmp/old_tiled.py
    env PYTHONPATH=src .venv/bin/python benchmarks/tgmm_layout_cpu.py /tmp/old_tiled.py
        [--shapes m:k:n:groups,...] [--dtypes bfloat16] [--samples 5]
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from tgmm_carry_cpu import main_for  # noqa: E402 - the same old/new timing, another judge

# deepseek-v2-lite prefill (4096 tokens x 6, 64 experts): the gate / up drhs and the down drhs
SHAPES = "24576:2048:1408:64,24576:1408:2048:64"


def reference(lhs, dout, sizes) -> np.ndarray:
    """[groups, k, n] float64: each group's lhs rows^T @ its dout rows."""
    x, d = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
    return np.stack([x[a:b].T @ d[a:b] for a, b in zip(bounds[:-1], bounds[1:])])


def errors_against_float64(variants: dict, inputs: dict) -> str:
    want = reference(inputs["lhs"], inputs["dout"], inputs["sizes"])
    scale = np.max(np.abs(want))
    error = {name: float(np.max(np.abs(np.asarray(jax.jit(fn)(inputs), np.float64) - want)) / scale)
             for name, fn in variants.items()}
    return f"  max error / max |ref| old {error['old']:.1e} new {error['new']:.1e}"


def main() -> None:
    main_for(__doc__.splitlines()[0], errors_against_float64, shapes=SHAPES, dtypes="bfloat16", samples=5)


if __name__ == "__main__":
    sys.exit(main())
