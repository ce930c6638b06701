"""The `tiled` fused MoE kernels' row tiling on CPU: a few (tm, tail) configs of each of a layer's four fused
calls, compiled once each and timed interleaved (`tuner.timing.time_candidates`), at one preset's shape.

Why: XLA CPU packs the weights for every dot call, so a 16-row tail tile costs about what a 256-row full
tile does (benchmarks/results/fused_cpu_*: the dx kernel's [16, 2048] tail dots took as long as its
[256, 2048] full ones); where groups hold about tm rows most of them run in tails.

    PYTHONPATH=src .venv/bin/python benchmarks/fused_tiles_cpu.py \
        [--preset qwen3-30b-a3b] [--tokens 4096] [--ep 1] [--dtype bfloat16] [--configs 256:16,256:64,...]
        [--samples 3] [--json OUT] [--direction fwd]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_tune.core import devices
from moe_tune.kernels.fused_moe.definition import FUSED_MOE
from moe_tune.kernels.fused_moe.tiled import TiledFusedConfig, TiledFusedMoe
from moe_tune.layer.models import fused_runs, get_preset
from moe_tune.tuner.timing import time_candidates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--configs", default="256:16,256:64,256:128,128:32,128:64,64:64")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--direction", default="all", choices=("all", "fwd"),
                        help="the calls of training (all) or of serving (fwd: the gated dispatch and the combine)")
    args = parser.parse_args()
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result = {"load_before": uptime(), "args": vars(args), "calls": []}
    print(result["load_before"], flush=True)
    backend = TiledFusedMoe()
    cases = [c for c in fused_runs(get_preset(args.preset), args.tokens, ep=args.ep, dtype=args.dtype, quant={},
                                   direction=args.direction) if c.op == "fused_moe"]
    for case in cases:
        problem = case.problem
        inputs = {k: (jnp.asarray(v) if hasattr(v, "shape") else v)
                  for k, v in FUSED_MOE.make_inputs(problem, "balanced", 0).items()}
        configs = {}
        for text in [backend.default_config(problem).label()] + args.configs.split(","):
            tm, tail = (int(v) for v in text.replace("tm=", "").replace(" tail=", ":").split(":"))
            config = TiledFusedConfig(tm=tm, tail=tail)
            if backend.config_error(config, problem) is None:
                configs.setdefault(f"{tm}:{tail}", config)
        compiled = {name: jax.jit(lambda i, c=c: backend.run(problem, c, i)).lower(inputs).compile()
                    for name, c in configs.items()}
        for c in compiled.values():
            jax.block_until_ready(c(inputs))
        timings, _ = time_candidates({name: (lambda c=c: c(inputs)) for name, c in compiled.items()},
                                     samples=args.samples, platform=devices.platform(), warmup=0)
        default = next(iter(configs))
        row = {"call": f"{case.role} {problem.direction}", "problem": problem.key_fields(), "default": default,
               "ms": {name: timings[name].median_s * 1e3 for name in configs},
               "spread": {name: timings[name].spread for name in configs},
               "min_ms": {name: timings[name].min_s * 1e3 for name in configs}}
        result["calls"].append(row)
        print(f"{row['call']:<22} " + "  ".join(
            f"{name} {ms:8.1f} ms ({row['spread'][name]:.0%}, min {row['min_ms'][name]:.1f})" for name, ms in row["ms"].items()), flush=True)
    result["load_after"] = uptime()
    print(result["load_after"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
