"""Fused vs unfused MoE layer on CPU (FINDINGS.md: fused layer prefill, fused layer decode):
`moe_mlp(..., fused=True)` against
`moe_mlp(..., fused=False)` (today's layer: gather, three ragged_dots, gather-reduce), both with the kernels'
tables (shipped or yours) and defaults, compiled once each and timed interleaved in the same trace rounds
(`bench.time_variants`), forward and forward+backward (the gradient in x, the router logits and the three
weights), with each compiled program's temp memory (`compiled.memory_analysis()`).

    PYTHONPATH=src .venv/bin/python benchmarks/fused_cpu.py [--presets qwen3-30b-a3b,deepseek-v2-lite]
        [--tokens 256,4096] [--dtypes float32,bfloat16] [--ep 1,4] [--order 4096:4,256:1,...] [--samples 3]
        [--json OUT]
    PYTHONPATH=src .venv/bin/python benchmarks/fused_cpu.py --print OUT.json   # a saved run, printed again

With --ep E the layer is one expert-parallel shard (experts / E local experts, expert_offset 0), tokens per
shard as `moe-tune sweep --model` counts them. Targets: fused never slower beyond noise (the larger spread of
the two), and >= 1.1x for forward+backward at prefill (4096 tokens). Each case that misses gets a breakdown
of both programs (per-HLO-op self time from the profiler trace, the reader of `moe-tune report --breakdown`).
Nothing is asserted: the machine is shared and noisy; only the ratios of one run count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune import moe_mlp

from moe_tune.core import devices
from moe_tune.commands.breakdown.run import program, read_ops
from moe_tune.layer.models import get_preset
from moe_tune.tuner.timing import time_candidates, traceable

PREFILL = 4096


def layer_inputs(preset, tokens: int, ep: int, dtype: str, seed: int = 0) -> dict[str, jax.Array]:
    """x, router logits and one shard's expert weights, scaled so the layer's values are O(1)."""
    rng = np.random.default_rng(seed)
    local, d, f = preset.experts // ep, preset.hidden, preset.expert_intermediate
    normal = lambda shape, scale: jnp.asarray(rng.standard_normal(shape, np.float32) * scale, dtype)
    return {"x": normal((tokens, d), 1.0), "logits": jnp.asarray(rng.standard_normal((tokens, preset.experts)),
                                                                     jnp.float32),
            "w_gate": normal((local, d, f), d ** -0.5), "w_up": normal((local, d, f), d ** -0.5),
            "w_down": normal((local, f, d), f ** -0.5)}


def variants(preset, ep: int) -> dict[str, dict[str, object]]:
    """mode -> variant -> fn(inputs): the layer forward, and forward+backward (loss = sum of the output)."""
    def layer(fused):
        return lambda a: moe_mlp(a["x"], a["logits"], a["w_gate"], a["w_up"], a["w_down"], preset.top_k,
                                 expert_offset=0 if ep > 1 else None, fused=fused)

    def train(fused):
        loss = lambda a: jnp.sum(layer(fused)(a).astype(jnp.float32))
        return jax.grad(loss)

    return {"fwd": {"unfused": layer(False), "fused": layer(True)},
            "fwd+bwd": {"unfused": train(False), "fused": train(True)}}


def timed(fns: dict[str, object], inputs, samples: int) -> dict:
    """Each variant compiled once (its temp memory read from that compile), run once untimed, then all timed
    interleaved in the same trace rounds (what `bench.time_variants` does, keeping the compiled programs)."""
    compiled = {i: traceable(fn, i).lower(inputs).compile() for i, fn in enumerate(fns.values())}
    for c in compiled.values():
        jax.block_until_ready(c(inputs))
    timings, fallback = time_candidates({i: (lambda c=c: c(inputs)) for i, c in compiled.items()}, samples=samples,
                                        platform=devices.platform(), warmup=0)
    names = list(fns)
    return {"times_s": {name: timings[i].median_s for i, name in enumerate(names)},
            "spread": {name: timings[i].spread for i, name in enumerate(names)},
            "min_s": {name: timings[i].min_s for i, name in enumerate(names)},
            "method": timings[0].method, "timing_fallback": fallback,
            "temp_bytes": {name: int(compiled[i].memory_analysis().temp_size_in_bytes) for i, name in enumerate(names)}}


def describe(hlo_text: str, op: str) -> str:
    """What an HLO op of the compiled program is: its result shape and the jax op it came from, short (the
    trace names ops `ynn_fusion.4`; the text says e.g. `f32[128,2048] transpose(jvp())/while/body/.../dot_general`,
    a tile dot of a backward loop)."""
    found = re.search(r"%" + re.escape(op) + r" = (\S+) .*?op_name=\"([^\"]*)\"", hlo_text)
    if found is None:
        return ""
    shape, where = found.group(1).split("{")[0], found.group(2).split("/", 1)[-1]
    return f"{shape} {where.replace('closed_call/', '').replace('/body', '')}"


def breakdown(fns: dict[str, object], inputs, top: int) -> dict[str, list]:
    """variant -> its `top` ops by self time: (name, ms per run, what it is in the HLO), one traced run each."""
    found = {}
    for index, (name, fn) in enumerate(fns.items()):
        compiled = traceable(fn, index).lower(inputs).compile()
        jax.block_until_ready(compiled(inputs))
        with tempfile.TemporaryDirectory(prefix="fused_breakdown_") as trace_dir:
            with jax.profiler.trace(trace_dir):
                jax.block_until_ready(compiled(inputs))
            ops = read_ops(Path(trace_dir), "cpu", "trace", program(index), 1)[0][1]
        text = compiled.as_text()
        found[name] = [(op.name, round(op.seconds * 1e3, 2), describe(text, op.name)) for op in ops[:top]]
    return found


def run_case(preset, tokens: int, ep: int, dtype: str, samples: int, top: int, always: bool = False,
             modes: tuple[str, ...] = ("fwd", "fwd+bwd")) -> dict:
    inputs = layer_inputs(preset, tokens, ep, dtype)
    case = {"preset": preset.name, "tokens": tokens, "ep": ep, "dtype": dtype, "modes": {}}
    for mode, fns in variants(preset, ep).items():
        if mode not in modes:
            continue
        result = timed(fns, inputs, samples)
        result["speedup"] = speedup = result["times_s"]["unfused"] / result["times_s"]["fused"]
        noise = max(result["spread"].values())
        target = 1.1 if (mode == "fwd+bwd" and tokens >= PREFILL) else 1.0 / (1.0 + noise)
        result["target"], result["missed"] = target, speedup < target
        if result["missed"] or always:
            result["breakdown"] = breakdown(fns, inputs, top)
        case["modes"][mode] = result
        print(line(case, mode), flush=True)
    return case


def line(case: dict, mode: str) -> str:
    r = case["modes"][mode]
    mib = {k: v / 2**20 for k, v in r["temp_bytes"].items()}
    flag = "  MISSED (target {:.2f}x)".format(r["target"]) if r["missed"] else ""
    if "min_s" in r:  # other processes only add time: the ratio of the fastest samples, beside the medians'
        flag = f"  min ratio {r['min_s']['unfused'] / r['min_s']['fused']:.2f}x" + flag
    return (f"{case['preset']:<17} tokens={case['tokens']:<5} ep={case['ep']} {case['dtype']:<8} {mode:<7} "
            f"unfused {r['times_s']['unfused'] * 1e3:9.1f} ms  fused {r['times_s']['fused'] * 1e3:9.1f} ms  "
            f"{r['speedup']:5.2f}x (spread {max(r['spread'].values()):.0%})  temp MiB {mib['unfused']:8.1f} -> "
            f"{mib['fused']:8.1f}{flag}")


def show(results: dict) -> None:
    print(f"load before: {results['load_before']}  after: {results['load_after']}")
    for case in results["cases"]:
        for mode in case["modes"]:
            print(line(case, mode))
            for name, ops in (case["modes"][mode].get("breakdown") or {}).items():
                print(f"    {name} top ops (ms): " + ", ".join(f"{op[0]} {op[1]}" for op in ops))
                for op in ops:  # older result files saved (name, ms) only
                    if len(op) > 2 and op[2]:
                        print(f"      {op[0]:<28} {op[1]:9.2f}  {op[2]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v2-lite")
    parser.add_argument("--tokens", default="256,4096")
    parser.add_argument("--order", default=None, help="tokens:ep pairs in the order to run them (default: every "
                        "--tokens x --ep, tokens outermost), e.g. 4096:4,256:1")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--ep", default="1,4")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--top", type=int, default=10, help="ops per breakdown")
    parser.add_argument("--breakdown", action="store_true", help="a breakdown of every case, not only "
                        "of the misses")
    parser.add_argument("--json", default=None)
    parser.add_argument("--print", dest="saved", default=None)
    args = parser.parse_args()
    if args.saved:
        return show(json.loads(Path(args.saved).read_text()))
    load = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results = {"load_before": load(), "cpus": os.cpu_count(), "jax": jax.__version__, "cases": []}
    print(results["load_before"], flush=True)
    pairs = ([tuple(int(v) for v in pair.split(":")) for pair in args.order.split(",")] if args.order else
             [(int(t), int(e)) for t in args.tokens.split(",") for e in args.ep.split(",")])
    for tokens, ep in pairs:
        for name in args.presets.split(","):
            for dtype in args.dtypes.split(","):
                results["cases"].append(run_case(get_preset(name), tokens, ep, dtype, args.samples, args.top,
                                                      args.breakdown, tuple(args.modes.split(","))))
                results["load_after"] = load()
                if args.json:  # after each case: a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(results, indent=1))
    print(results["load_after"])


if __name__ == "__main__":
    sys.exit(main())
