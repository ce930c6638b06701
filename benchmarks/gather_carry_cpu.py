"""The tiled dispatch gather (`ragged_gather`'s loop) of a given file against the installed one, and its
single pass, timed interleaved: `old` = the loop of a given file (the committed one before the change: the
output carried as uint16 bits from a zero init and bitcast after the loop), `new` = the installed loop (carried
in its own dtype, updated through its bits), `single` = the installed single pass. Same rows, chunk and inputs;
each program's temp memory printed with its time; outputs checked equal.

    git show <before>:src/moe_tune/kernels/gather/tiled.py > /tmp/old_gather_tiled.py
    env PYTHONPATH=src .venv/bin/python benchmarks/gather_carry_cpu.py \
        /tmp/old_gather_tiled.py [--shapes tokens:rows:hidden:valid_fraction,...] [--dtypes bfloat16,float32]
        [--weighted 1] [--chunk 64] [--samples 7]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.commands.bench import load_file_module, time_variants
from moe_tune.kernels.gather.tiled import single_pass_gather, tiled_gather

# deepseek-v2-lite prefill (4096 tokens x top_k 6, hidden 2048): every row valid (ep 1), a quarter (ep 4)
SHAPES = "4096:24576:2048:1,4096:24576:2048:0.25"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the gather tiled.py to compare against")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--weighted", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--samples", type=int, default=7)
    args = parser.parse_args()
    old = load_file_module(args.old, "old_gather_tiled").tiled_gather
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("load before:", uptime(), flush=True)
    for shape in args.shapes.split(","):
        tokens, rows, hidden, fraction = shape.split(":")
        tokens, rows, hidden = int(tokens), int(rows), int(hidden)
        valid = int(rows * float(fraction))
        start = (rows - valid) // 2  # a shard's rows in the middle, as at ep 4
        for dtype in args.dtypes.split(","):
            rng = np.random.default_rng(0)
            inputs = {"x": jnp.asarray(rng.standard_normal((tokens, hidden), np.float32), dtype),
                      "idx": jnp.asarray(rng.integers(0, tokens, rows), jnp.int32),
                      "w": jnp.asarray(rng.random(rows, np.float32)) if args.weighted else None,
                      "start": jnp.int32(start), "end": jnp.int32(start + valid)}
            loop = lambda fn: (lambda a: fn(a["x"], a["idx"], a["start"], a["end"], a["w"],
                                            rows_per_chunk=args.chunk))
            variants = {"old": loop(old), "new": loop(tiled_gather),
                        "single": lambda a: single_pass_gather(a["x"], a["idx"], a["start"], a["end"], a["w"])}
            outs = {n: np.asarray(jax.jit(fn)(inputs).astype(jnp.float32)) for n, fn in variants.items()}
            for n in ("new", "single"):
                np.testing.assert_array_equal(outs["old"], outs[n])
            temp = {n: jax.jit(fn).lower(inputs).compile().memory_analysis().temp_size_in_bytes / 2**20
                    for n, fn in variants.items()}
            # A B C A B C, twice
            result = time_variants({**variants, **{n + "2": fn for n, fn in variants.items()}}, inputs,
                                   samples=args.samples)
            t = {n: (result["times_s"][n] + result["times_s"][n + "2"]) / 2 for n in variants}
            spread = max(result["spread"].values())
            print(f"tokens={tokens} rows={rows} hidden={hidden} valid={valid} {dtype:<8} chunk={args.chunk} "
                  f"weighted={bool(args.weighted)}: old {t['old'] * 1e3:.1f} ms  new {t['new'] * 1e3:.1f} ms  "
                  f"single {t['single'] * 1e3:.1f} ms  old/new {t['old'] / t['new']:.2f}x  "
                  f"old/single {t['old'] / t['single']:.2f}x  spread {spread:.0%}  temp MiB "
                  + " ".join(f"{n} {v:.1f}" for n, v in temp.items()), flush=True)
    print("load after:", uptime())


if __name__ == "__main__":
    sys.exit(main())
