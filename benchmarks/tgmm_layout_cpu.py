"""The tiled drhs (tgmm, per-group schedule) before and after session 16's transposed-lhs windows, timed
interleaved: `old` = the kernel of a given file (each bf16 window's dot contracts the rows of both operands,
[window, k]^T @ [window, n], which XLA CPU runs in float32), `new` = the installed kernel (lhs transposed once
to [k, m]; each window's dot is [k, window] @ [window, n] in bf16, XLA CPU's `__ynn_fusion`). Same config
(the backend's default for the problem), same inputs; each variant's error against a float64 reference of
the same bf16 inputs and its temp memory are printed with its time.

    git show <before>:src/moe_tune/kernels/ragged_dot/tiled.py > /tmp/old_tiled.py
    flock /work/coord/bench.lock env PYTHONPATH=src .venv/bin/python benchmarks/tgmm_layout_cpu.py /tmp/old_tiled.py
        [--shapes m:k:n:groups,...] [--dtypes bfloat16] [--samples 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune import distributions
from moe_tune.bench import load_file_module, time_variants
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.tiled import TiledRaggedDot, tiled_transposed_ragged_dot

# deepseek-v2-lite prefill (4096 tokens x 6, 64 experts): the gate / up drhs and the down drhs
SHAPES = "24576:2048:1408:64,24576:1408:2048:64"


def reference(lhs, dout, sizes) -> np.ndarray:
    """[groups, k, n] float64: each group's lhs rows^T @ its dout rows."""
    x, d = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
    return np.stack([x[a:b].T @ d[a:b] for a, b in zip(bounds[:-1], bounds[1:])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the tiled.py to compare against")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()
    old = load_file_module(args.old, "old_tiled").tiled_transposed_ragged_dot
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("load before:", uptime(), flush=True)
    for shape in args.shapes.split(","):
        m, k, n, groups = (int(v) for v in shape.split(":"))
        for dtype in args.dtypes.split(","):
            problem = RaggedDotProblem(m=m, k=k, n=n, groups=groups, lhs_dtype=dtype, rhs_dtype=dtype,
                                       out_dtype=dtype, direction="drhs")
            config = TiledRaggedDot().default_config(problem)
            rng = np.random.default_rng(0)
            inputs = {"lhs": jnp.asarray(rng.standard_normal((m, k), np.float32), dtype),
                      "dout": jnp.asarray(rng.standard_normal((m, n), np.float32), dtype),
                      "sizes": jnp.asarray(distributions.group_sizes("balanced", m, groups, 0), jnp.int32)}
            variants = {name: (lambda a, fn=fn: fn(a["lhs"], a["dout"], a["sizes"], tm=config.tm,
                                                     batched=False, out_dtype=jnp.dtype(dtype),
                                                     num_groups=groups))
                        for name, fn in (("old", old), ("new", tiled_transposed_ragged_dot))}
            want = reference(inputs["lhs"], inputs["dout"], inputs["sizes"])
            scale = np.max(np.abs(want))
            error = {name: float(np.max(np.abs(np.asarray(jax.jit(fn)(inputs), np.float64) - want)) / scale)
                     for name, fn in variants.items()}
            temp = {name: jax.jit(fn).lower(inputs).compile().memory_analysis().temp_size_in_bytes / 2**20
                    for name, fn in variants.items()}
            # A B A B ... twice, in both orders
            result = time_variants({**variants, "old2": variants["old"], "new2": variants["new"]}, inputs,
                                   samples=args.samples)
            t = result["times_s"]
            ratio = (t["old"] + t["old2"]) / (t["new"] + t["new2"])
            print(f"m={m} k={k} n={n} g={groups} {dtype:<8} tm={config.tm}: "
                  f"old {t['old'] * 1e3:.1f}/{t['old2'] * 1e3:.1f} ms  new {t['new'] * 1e3:.1f}/{t['new2'] * 1e3:.1f} ms"
                  f"  old/new {ratio:.2f}x  spread {max(result['spread'].values()):.0%}"
                  f"  max error / max |ref| old "
                  f"{error['old']:.1e} new {error['new']:.1e}  temp MiB old {temp['old']:.1f} new {temp['new']:.1f}",
                  flush=True)
    print("load after:", uptime())


if __name__ == "__main__":
    sys.exit(main())
