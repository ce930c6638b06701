"""Quantized expert weights on CPU (FINDINGS.md: int8 decode bound, sub-channel dequantize, 4-bit on XLA CPU): each quantization mode of ragged_dot, tuned on the
tiled backend, against the tuned float32 and bfloat16 kernels and against "dequantize, then the tuned float32
kernel", all timed side by side in one set of interleaved rounds per shape, with the weight bytes read and
the quantization error.

    PYTHONPATH=src .venv/bin/python benchmarks/quant_cpu.py [--shapes qwen3-30b-a3b,deepseek-v2-lite]
        [--m 256,4096] [--groups 16,64] [--modes float32,bfloat16,int8,int8/128,fp8/128,w8a8,int8 a16,...]
        [--directions fwd,dlhs] [--budget 12] [--json OUT]
    PYTHONPATH=src .venv/bin/python benchmarks/quant_cpu.py --small   # toy sizes: the test suite runs it
    PYTHONPATH=src .venv/bin/python benchmarks/quant_cpu.py --print OUT.json   # a saved run, printed again

Per (shape, m, groups, direction): every mode is swept with the real tuner (coordinate strategy, a fresh
temporary profile dir), then one `bench.time_variants` call times together: each mode's tuned kernel,
`deq+f32:<mode>` (the QArray dequantized to float32 inside the same jitted function, then the float32
kernel with the tuned float32 config), `f32@tiles:<mode>` for each judged mode whose tuned tiles differ from
float32's (the float32 kernel at those tiles: the `same tiles` column, f32 at the mode's tiles / mode), a dense matmul of the same FLOPs (the compute floor) and a copy and a
sum of an array of the float32 weights' size (this machine's copy and read bandwidths; the memory floor of
each mode is its least bytes moved at the read bandwidth). Errors: max-abs relative error (`relative_error`)
of each mode's output against the float64 reference of the unquantized operands and against that of its own
dequantized operands.
Targets (CPU, at m=256): int8 weight-only per channel (with float32 activations, and with bfloat16 ones) >= 1.5x
faster than the tuned float32 kernel; 4-bit weights at least as fast as the 1-byte mode they replace,
each tuned, with the same activations: int4/128 vs int8 per channel, mxfp4 vs fp8/128 (`PAIR_TARGETS`). Each case also says which floor bounds the float32 kernel on this machine
(its weight bytes at the read rate or its FLOPs at the dense rate): 1-byte weights cut only the first.
Nothing is asserted; the machine is shared and noisy, only the ratios of one run count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.commands import bench

from moe_tune.core import devices
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS
from moe_tune.kernels.kernel_op import relative_error
from moe_tune.kernels.ragged_dot.definition import DENSE
from moe_tune.core.quant import FOUR_BIT, as_float
from moe_tune.tuner import SweepRequest, run_sweep

sys.path.insert(0, os.path.dirname(__file__))
from targets_cpu import verdict  # noqa: E402  (the scripts share their met/MISSED wording)

# gate/up projection of one expert: k = hidden, n = expert width (moe_tune.layer.models presets)
SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v2-lite": (2048, 1408)}
SMALL_SHAPES = {"toy": (256, 128)}
# problem options of each mode; the float operands are float32 unless the mode says otherwise
MODES = {
    "float32": {},
    "bfloat16": dict(dtype="bfloat16"),
    "int8": dict(rhs_quant="int8"),  # weight-only, one scale per channel
    "int8/128": dict(rhs_quant="int8", quant_block=128),  # weight-only, sub-channel
    "fp8/128": dict(rhs_quant="float8_e4m3fn", quant_block=128),
    "w8a8": dict(rhs_quant="int8", lhs_quant="int8"),  # lhs one scale per row, rhs per channel
    # weight-only with bfloat16 activations (a bf16 checkpoint's weights quantized): a bf16 dot
    "int8 a16": dict(dtype="bfloat16", rhs_quant="int8"),
    "fp8 a16": dict(dtype="bfloat16", rhs_quant="float8_e4m3fn", quant_block=128),
    # 4-bit weights (AWQ/GPTQ-style int4 in blocks of 128; OCP mxfp4, blocks of 32) and activations quantized
    # inside the kernel (dynamic w8a8: per row, the scale from each tile)
    "int4/128": dict(rhs_quant="int4", quant_block=128),
    "mxfp4": dict(rhs_quant="mxfp4"),
    "w8a8 dynamic": dict(rhs_quant="int8", lhs_quant="int8", lhs_dynamic=True),
    "int4 a16": dict(dtype="bfloat16", rhs_quant="int4", quant_block=128),
    "mxfp4 a16": dict(dtype="bfloat16", rhs_quant="mxfp4"),
}
TARGETS = ("int8", "int8 a16")  # modes judged: tuned f32 time / mode time at least TARGET at m = TARGET_M
TARGET, TARGET_M = 1.5, 256
# (mode, the mode it must be at least as fast as): time(base) / time(mode) >= 1 at m = TARGET_M, fwd
PAIR_TARGETS = (("int4/128", "int8"), ("int4 a16", "int8 a16"), ("mxfp4", "fp8/128"), ("mxfp4 a16", "fp8 a16"))


def weight_bytes(b) -> int:
    """Bytes of the weight operand as stored: values + scales of a QArray (4-bit values two a byte, as XLA
    packs them, where NumPy holds one a byte)."""
    packed = lambda x: 2 if np.dtype(x.dtype).name in FOUR_BIT else 1
    return sum(int(np.asarray(x).nbytes) // packed(np.asarray(x)) for x in jax.tree.leaves(b))


def bench_case(args, spec, k, n, m, groups, direction, profile_dir):
    """Sweep every mode, then time them all side by side; returns the case's record."""
    tiled = BACKENDS.get("tiled")
    problems, inputs, sweeps, sweep_s = {}, {}, {}, {}
    for mode in args.modes:
        if direction == "dlhs" and "lhs_quant" in MODES[mode]:
            continue  # w8a8's dlhs takes a float dout: it is the weight-only dlhs (dynamic too)
        problems[mode] = spec.problem(m=m, k=k, n=n, groups=groups, direction=direction,
                                      **{"dtype": "float32", **MODES[mode]})
        started = time.perf_counter()
        sweeps[mode] = run_sweep(SweepRequest.make("ragged_dot", problems[mode], backend="tiled", strategy="coordinate",
                                                   profile_dir=profile_dir, workers=1, samples=args.samples,
                                                   budget=args.budget))
        sweep_s[mode] = time.perf_counter() - started
        inputs[mode] = spec.make_inputs(problems[mode], "balanced", seed=1)  # the same draws for every mode
    f32 = problems["float32"]
    f32_config = sweeps["float32"].best.config
    run = lambda mode, problem, config: lambda x: tiled.run(problem, config, x[mode]["a"], x[mode]["b"],
                                                            x[mode]["group_sizes"])
    variants = {mode: run(mode, problems[mode], sweeps[mode].best.config) for mode in problems}
    for mode in problems:
        if problems[mode].quantized:
            variants[f"deq+f32:{mode}"] = (lambda mode: lambda x: tiled.run(
                f32, f32_config, *(as_float(x[mode][o]).astype(jnp.float32) for o in "ab"), x[mode]["group_sizes"]))(mode)
    # the float32 kernel at a judged mode's tiles, where they differ from float32's own: how much of the mode's
    # gain is its weight format and how much its tiles (its search space can differ: tiled.candidate_values)
    for mode in (m for m in TARGETS if m in problems and sweeps[m].best.config != f32_config):
        variants[f"f32@tiles:{mode}"] = run("float32", f32, sweeps[mode].best.config)
    variants["dense"] = lambda x: DENSE[direction](x["float32"]["a"], x["float32"]["b"])
    variants["copy"] = lambda x: x["copy_source"] + 1  # the f32 weights' size, read and written
    variants["read"] = lambda x: jnp.sum(x["copy_source"])  # the same array read only: no fresh output
    device_inputs = jax.device_put(inputs)
    device_inputs["copy_source"] = jnp.ones((groups * k * n,), jnp.float32)
    measured = bench.time_variants(variants, device_inputs, samples=args.samples_compare)
    times = measured["times_s"]
    # a ragged_dot reads its weights and writes a small output: its floor is at the read bandwidth
    bandwidth = 4 * groups * k * n / times["read"]

    unquantized = spec.reference(f32, inputs["float32"])
    rows = {}
    for mode, problem in problems.items():
        out = np.asarray(jax.jit(variants[mode])(device_inputs), np.float64)
        config = sweeps[mode].best.config.to_dict()
        rows[mode] = {
            "time_s": times[mode], "spread": measured["spread"][mode],
            "f32_vs_mode": times["float32"] / times[mode],
            "deq_f32_time_s": times.get(f"deq+f32:{mode}"),
            "f32_at_mode_tiles_vs_mode": times.get(f"f32@tiles:{mode}", times["float32"]) / times[mode]
            if mode in TARGETS and direction == "fwd" else None,
            "weight_bytes": weight_bytes(inputs[mode]["b"]), "min_bytes": problem.min_bytes,
            "memory_floor_s": problem.min_bytes / bandwidth,
            "error_vs_unquantized": relative_error(out, unquantized),
            "error_vs_dequantized": relative_error(out, spec.reference(problem, inputs[mode])),
            "tuned_config": config, "default_config": tiled.default_config(problem).to_dict(),
            "differs_from_f32": _tiles(config) != _tiles(f32_config.to_dict()),
            "sweep_candidates": len(sweeps[mode].candidates), "sweep_s": sweep_s[mode],
            "key": sweeps[mode].key,
        }
    jax.clear_caches()
    # Which floor bounds the float32 kernel on this machine: its weight bytes at the read rate, or its FLOPs at
    # the dense matmul's rate. Quantized weights cut only the first (a 1-byte weight still meets an f32 dot).
    floors = {"memory": 4 * groups * k * n / bandwidth, "compute": times["dense"]}
    return {"m": m, "k": k, "n": n, "groups": groups, "direction": direction, "flops": f32.flops,
            "f32_floors_s": floors, "bound": max(floors, key=floors.get),
            "times_s": times, "timing_method": measured["timing_method"], "copy_gbps": 2 * 4 * groups * k * n / times["copy"] / 1e9,
            "read_gbps": bandwidth / 1e9,
            "dense_tflops": f32.flops / times["dense"] / 1e12, "modes": rows}


def _tiles(config: dict) -> dict:
    """A tiled config's tiles: without `dequantize`, an option only sub-channel weights have."""
    return {field: value for field, value in config.items() if field != "dequantize"}


def print_case(name, case) -> None:
    t = case["times_s"]
    print(f"\nragged_dot {case['direction']} m={case['m']} k={case['k']} n={case['n']} g={case['groups']} ({name}): "
          f"dense {t['dense'] * 1e3:.3f} ms ({case['dense_tflops'] * 1e3:.0f} GFLOP/s), copy "
          f"{case['copy_gbps']:.1f} GB/s, read {case['read_gbps']:.1f} GB/s (mem floor: least bytes at the read rate); timed by {case['timing_method']}")
    floors = case["f32_floors_s"]
    print(f"  float32 floors here: weights at the read rate {floors['memory'] * 1e3:.3f} ms, FLOPs at the dense rate "
          f"{floors['compute'] * 1e3:.3f} ms: {case['bound']}-bound on this machine")
    print(f"  {'mode':<12} {'ms':>8} {'f32/mode':>8} {'same tiles':>10} {'deq+f32 ms':>10} {'weight MiB':>10} "
          f"{'mem floor':>9} {'err/unq':>8} {'err/deq':>8}  tuned config (differs: its tiles differ from f32's)")
    for mode, r in case["modes"].items():
        deq = f"{r['deq_f32_time_s'] * 1e3:10.3f}" if r["deq_f32_time_s"] else f"{'-':>10}"
        same = r.get("f32_at_mode_tiles_vs_mode")
        same = f"{same:10.2f}" if same else f"{'-':>10}"
        c = r["tuned_config"]
        print(f"  {mode:<12} {r['time_s'] * 1e3:8.3f} {r['f32_vs_mode']:8.2f} {same} {deq} {r['weight_bytes'] / 2**20:10.1f} "
              f"{r['memory_floor_s'] * 1e3:9.3f} {r['error_vs_unquantized']:8.1e} {r['error_vs_dequantized']:8.1e}  "
              f"tm={c['tm']} tail={c['tail']} tk={c['tk']} tn={c['tn']}{' dequantize' if c.get('dequantize') else ''}"
              f"{' (differs)' if r['differs_from_f32'] else ''}"
              f" [{r['sweep_candidates']} cand, {r['sweep_s']:.0f} s]", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--m", default="256,4096", help="routed rows: 256 memory-bound, 4096 compute-bound")
    parser.add_argument("--groups", default="16,64")
    parser.add_argument("--modes", default=",".join(MODES), help="float32 is always included (the baseline)")
    parser.add_argument("--directions", default="fwd")
    parser.add_argument("--samples", type=int, default=3, help="first-round samples of each sweep")
    parser.add_argument("--budget", type=int, default=12, help="candidates per sweep at most")
    parser.add_argument("--samples-compare", type=int, default=7, help="samples of the side-by-side rounds")
    parser.add_argument("--small", action="store_true", help="toy sizes (k=256 n=128, m=256, 4 groups)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--print", dest="saved", default=None, metavar="JSON",
                        help="print a run saved with --json again, measuring nothing")
    args = parser.parse_args()
    if args.saved:
        print_saved(args.saved)
        return 0
    if args.small:
        args.shapes, args.m, args.groups, args.budget, args.samples_compare = "toy", "256", "4", 1, 1
    shapes = SMALL_SHAPES if args.small else SHAPES
    args.modes = ["float32", *(m for m in args.modes.split(",") if m != "float32")]
    unknown = (set(args.shapes.split(",")) - set(shapes)) | (set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"unknown shape(s)/mode(s) {', '.join(sorted(unknown))}")

    spec, cases, summary = get_op("ragged_dot"), [], []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as profile_dir:
        for name in args.shapes.split(","):
            k, n = shapes[name]
            for m in map(int, args.m.split(",")):
                for groups in map(int, args.groups.split(",")):
                    for direction in args.directions.split(","):
                        case = {"name": name, **bench_case(args, spec, k, n, m, groups, direction, profile_dir)}
                        cases.append(case)
                        print_case(name, case)
                        for mode in (t for t in TARGETS if t in case["modes"] and m == TARGET_M and direction == "fwd"):
                            ratio = case["modes"][mode]["f32_vs_mode"]
                            summary.append({"target": f"{mode} weight-only vs tuned f32, {name} m={m} g={groups}",
                                            "value": ratio, "wanted": f">= {TARGET}", "met": ratio >= TARGET,
                                            "bound": case["bound"]})
                        for mode, base in PAIR_TARGETS:
                            if mode in case["modes"] and base in case["modes"] and m == TARGET_M and direction == "fwd":
                                ratio = case["times_s"][base] / case["times_s"][mode]
                                summary.append({"target": f"{mode} vs tuned {base}, {name} m={m} g={groups}",
                                                "value": ratio, "wanted": ">= 1", "met": ratio >= 1,
                                                "bound": case["bound"]})
                        if args.json:
                            bench.write_results(args.json, [{"summary": summary}, {"cases": cases}])
    print_summary(summary, cases, f"{devices.device_kind()}, {time.perf_counter() - started:.0f} s")
    return 0


def print_summary(summary: list[dict], cases: list[dict], measured_on: str) -> None:
    print(f"\nSummary ({measured_on}):")
    for s in summary:
        print(f"  {s['target']:<55} {s['value']:6.2f}x  target {s['wanted']}  {verdict(s['met'])}"
              f"  (f32 {s['bound']}-bound here)")
    differ = [f"{c['name']} m={c['m']} g={c['groups']} {c['direction']} {mode}" for c in cases
              for mode, r in c["modes"].items() if r["differs_from_f32"]]
    print(f"  tuned tiles differ from float32's: {len(differ)} of "
          f"{sum(len(c['modes']) - 1 for c in cases)} (mode, case) pairs" + (f": {'; '.join(differ)}" if differ else ""))


def print_saved(path: str) -> None:
    """Prints a run saved with --json again, as it printed when measured (nothing is re-measured)."""
    with open(path) as f:
        saved = json.load(f)
    results = {k: v for part in saved["results"] for k, v in part.items()}
    for case in results["cases"]:
        # by this script's `_tiles` (a run saved before `dequantize` existed counted it as a tile)
        f32_tiles = _tiles(case["modes"]["float32"]["tuned_config"])
        for r in case["modes"].values():
            r["differs_from_f32"] = _tiles(r["tuned_config"]) != f32_tiles
        print_case(case["name"], case)
    meta = saved["meta"]
    print_summary(results["summary"], results["cases"],
                  f"{meta['device_kind']}, {meta['cpus']} CPUs, jax {meta['jax']}, {meta['date']}, re-printed from {path}")


if __name__ == "__main__":
    sys.exit(main())
