"""The tiled drhs (tgmm, per-group schedule) of a given file against the installed one, timed interleaved:
`old` = the kernel of a given file (the committed one before the change: the output carried as uint16 bits
from a zero init, bitcast to bfloat16 after the loop), `new` = the installed kernel (carried in its own dtype,
updated through its bits, started from group 0's result). Same config (the backend's default for the
problem's tm) in the per-group schedule (batched=False, the one changed; bfloat16's default), same inputs,
each program's temp memory printed with its time.

    git show <before>:src/moe_tune/kernels/ragged_dot/tiled.py > /tmp/old_tiled.py
    env PYTHONPATH=src .venv/bin/python benchmarks/tgmm_carry_cpu.py /tmp/old_tiled.py
        [--shapes m:k:n:groups,...] [--dtypes bfloat16,float32] [--samples 9]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core import distributions
from moe_tune.commands.bench import load_file_module, time_variants
from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
from moe_tune.kernels.ragged_dot.tiled import TiledRaggedDot, tiled_transposed_ragged_dot

# qwen3-30b-a3b's gate drhs at decode (256 tokens x 8, 128 experts) and at prefill on an ep=4 shard
# (4096 x 8 / 4 rows, 32 experts)
SHAPES = "2048:2048:768:128,8192:2048:768:32"


def compare_old_new(old_file: str, shapes: str, dtypes: str, samples: int,
                    judge: Callable[[dict, dict], str]) -> None:
    """For each `m:k:n:groups` shape and dtype: the drhs of `old_file`'s kernel (`old`) and of the installed one
    (`new`) in the per-group schedule, the backend's default tm, the same seeded inputs; prints both times (A B A B
    ..., twice in both orders), their ratio, the spread, each program's temp memory and what `judge(variants,
    inputs)` says of their outputs (it may raise: a bit-identity check)."""
    old = load_file_module(old_file, "old_tiled").tiled_transposed_ragged_dot
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("load before:", uptime(), flush=True)
    for shape in shapes.split(","):
        m, k, n, groups = (int(v) for v in shape.split(":"))
        for dtype in dtypes.split(","):
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
            verdict = judge(variants, inputs)
            temp = {name: jax.jit(fn).lower(inputs).compile().memory_analysis().temp_size_in_bytes / 2**20
                    for name, fn in variants.items()}
            result = time_variants({**variants, "old2": variants["old"], "new2": variants["new"]}, inputs,
                                   samples=samples)
            t = result["times_s"]
            ratio = (t["old"] + t["old2"]) / (t["new"] + t["new2"])
            print(f"m={m} k={k} n={n} g={groups} {dtype:<8} tm={config.tm}: "
                  f"old {t['old'] * 1e3:.1f}/{t['old2'] * 1e3:.1f} ms  new {t['new'] * 1e3:.1f}/{t['new2'] * 1e3:.1f} ms"
                  f"  old/new {ratio:.2f}x  spread {max(result['spread'].values()):.0%}{verdict}  temp MiB old "
                  f"{temp['old']:.1f} new {temp['new']:.1f}", flush=True)
    print("load after:", uptime())


def bit_identical(variants: dict, inputs: dict) -> str:
    outs = {name: np.asarray(jax.jit(fn)(inputs).astype(jnp.float32)) for name, fn in variants.items()}
    np.testing.assert_array_equal(outs["old"], outs["new"])
    return ""


def main_for(description: str, judge: Callable[[dict, dict], str], *, shapes: str, dtypes: str, samples: int) -> None:
    """A benchmark's command line (the old kernel's file, --shapes, --dtypes, --samples with these defaults),
    then `compare_old_new` with `judge`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("old", help="the tiled.py to compare against")
    parser.add_argument("--shapes", default=shapes)
    parser.add_argument("--dtypes", default=dtypes)
    parser.add_argument("--samples", type=int, default=samples)
    args = parser.parse_args()
    compare_old_new(args.old, args.shapes, args.dtypes, args.samples, judge)


def main() -> None:
    main_for(__doc__.splitlines()[0], bit_identical, shapes=SHAPES, dtypes="bfloat16,float32", samples=9)


if __name__ == "__main__":
    sys.exit(main())
