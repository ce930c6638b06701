"""The tiled fused dispatch (gate and up, gated) of a given file against the installed one, timed interleaved:
`old` = the kernel of a given file (the committed one before: the output carried as uint16 bits in bf16 and
bitcast after the loop, tail tiles read-modify-write, a group's weights held whole), `new` = the installed
kernel (the output only written, in column chunks where a group's weights outweigh the output). (More files: more variants.) Same config
(the backend's default for the problem), same inputs (balanced group sizes, random rows), outputs compared,
each program's temp memory printed with its time.

    git show 06f4a9d:src/moe_tune/kernels/fused_moe/tiled.py > /tmp/old_fused_tiled.py
    env PYTHONPATH=src .venv/bin/python benchmarks/fused_dispatch_carry_cpu.py \\
        /tmp/old_fused_tiled.py [--shapes tokens:top_k:hidden:width:experts,...] [--dtypes ...] [--samples 5] \\
        [--config tm:tail] [--weights-per-tile rule|yes|no]
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.core import distributions
from moe_tune.commands.bench import load_file_module, time_variants
from moe_tune.kernels import get_op
from moe_tune.kernels.fused_moe.tiled import TiledFusedConfig, TiledFusedMoe, tiled_gather_gmm

# qwen3-30b-a3b and deepseek-v2-lite's gate+up dispatch at prefill (4096 tokens) and decode (256), ep 1
SHAPES = "4096:8:2048:768:128,4096:6:2048:1408:64,256:8:2048:768:128,256:6:2048:1408:64"


def load_old(path: str):
    return load_file_module(path, "old_fused_tiled").tiled_gather_gmm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", nargs="+", help="the fused_moe/tiled.py to compare against (more files: more "
                        "variants, old2, old3, ...)")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--config", default=None, help="tm:tail for every variant (default: the backend's default "
                        "for the problem)")
    parser.add_argument("--weights-per-tile", default="rule", choices=("rule", "yes", "no"),
                        help="the installed kernel's `weights_per_tile` (rule: its own choice)")
    args = parser.parse_args()
    olds = {("old" if i == 0 else f"old{i + 1}"): load_old(path) for i, path in enumerate(args.old)}
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("load before:", uptime(), flush=True)
    for shape in args.shapes.split(","):
        tokens, top_k, hidden, width, experts = (int(v) for v in shape.split(":"))
        m = tokens * top_k
        for dtype in args.dtypes.split(","):
            problem = get_op("fused_moe").problem(tokens=tokens, top_k=top_k, k=hidden, n=2 * width,
                                                  groups=experts, glu="silu", dtype=dtype)
            config = TiledFusedMoe().default_config(problem)
            if args.config:
                config = TiledFusedConfig(*(int(v) for v in args.config.split(":")))
            per_tile = {"rule": None, "yes": True, "no": False}[args.weights_per_tile]
            new = functools.partial(tiled_gather_gmm, weights_per_tile=per_tile)
            rng = np.random.default_rng(0)
            normal = lambda shape, scale: jnp.asarray(rng.standard_normal(shape, np.float32) * scale, dtype)
            inputs = {"x": normal((tokens, hidden), 1.0), "rows": jnp.asarray(rng.integers(0, tokens, m), jnp.int32),
                      "w": (normal((experts, hidden, width), hidden ** -0.5),
                            normal((experts, hidden, width), hidden ** -0.5)),
                      "sizes": jnp.asarray(distributions.group_sizes("balanced", m, experts, 0), jnp.int32)}
            variants = {name: (lambda a, fn=fn: fn(a["x"], a["rows"], a["w"], a["sizes"], tm=config.tm,
                                                     tail=config.tail, out_dtype=jnp.dtype(dtype), glu="silu"))
                        for name, fn in [*olds.items(), ("new", new)]}
            outs = {name: np.asarray(jax.jit(fn)(inputs).astype(jnp.float32)) for name, fn in variants.items()}
            # the same products, up to the dots' accumulation order (a column chunk's dot is narrower)
            scale = float(np.abs(outs["old"]).max())
            error = max(float(np.abs(outs["old"] - out).max()) / scale for out in outs.values())
            temp = {name: jax.jit(fn).lower(inputs).compile().memory_analysis().temp_size_in_bytes / 2**20
                    for name, fn in variants.items()}
            # A B ... then ... B A: each variant twice, in both orders
            names = list(variants)
            order = {**{n: variants[n] for n in names}, **{n + "'": variants[n] for n in reversed(names)}}
            result = time_variants(order, inputs, samples=args.samples)
            t = {n: result["times_s"][n] + result["times_s"][n + "'"] for n in names}
            times = "  ".join(f"{n} {result['times_s'][n] * 1e3:.1f}/{result['times_s'][n + chr(39)] * 1e3:.1f} ms"
                              for n in names)
            ratios = "  ".join(f"{n}/new {t[n] / t['new']:.2f}x" for n in names if n != "new")
            temps = " ".join(f"{n} {temp[n]:.1f}" for n in names)
            print(f"tokens={tokens} top_k={top_k} d={hidden} f={width} g={experts} {dtype:<8} tm={config.tm} "
                  f"tail={config.tail}: {times}  {ratios}  spread {max(result['spread'].values()):.0%}  temp MiB "
                  f"{temps}  max|old-x|/max|old| {error:.1e}", flush=True)
    print("load after:", uptime())


if __name__ == "__main__":
    sys.exit(main())
