"""The whole GPU check in one call: the `triton` kernels (and, for ragged_dot, `mosaic_gpu`: JAX's Mosaic GPU
kernels, and `mosaic_gpu_quant`: quantized weights dequantized in registers into wgmma) compiled for real, checked at real MoE sizes, swept, and timed: ragged_dot against XLA's ragged dot
and a dense bf16 matmul of the same FLOPs, each backend in turn (`--backends`); dispatch
and combine against the plain-JAX fallback and the device's copy bandwidth measured in the same rounds.

    python benchmarks/gpu_check.py                 # on the GPU machine; JSON to $OUT (or --out)
    python benchmarks/gpu_check.py --small         # the same steps at toy sizes (CPU: interpret mode)

The cases run in this order, and none starts after `--time-limit` seconds (default 480: the run fits one
10-minute device call; those left are listed as `not_run`): the layers, then per ragged_dot shape and backend
the float directions and the quantized ones, then dispatch and combine. Narrow a run with --layers, --ops,
--models, --backends, --directions and --quant; --list prints the cases in order without running them.

Shapes (bf16, balanced group sizes), all three directions of the up projection:
  * DeepSeek-V3 expert layer: hidden 7168 -> expert width 2048, 256 experts over an expert-parallel group
    of 8 (32 local experts), 4096 tokens x top-8 routed / 8 shards = 4096 rows per shard;
  * DeepSeek-V3 decode: the same layer at 256 rows a shard (8 rows an expert: the weights' bytes dominate);
  * Mixtral-8x7B: hidden 4096 -> 14336, 8 experts, 4096 tokens x top-2 = 8192 rows.
Quantized weights (`--quant`, fwd and dlhs: the directions that read them): weight-only int8 with one scale
per channel, float8_e4m3fn and int4 with 128-wide blocks along k (32 in --small), and mxfp4 (OCP MX: blocks
of 32, e8m0 scales), each swept (every candidate
checked against the dequantized float64 reference), its error against the unquantized weights recorded, and
its tuned time compared with the bf16 kernel's of the same shape and direction (`vs_bf16`: the same backend's,
or triton's for `mosaic_gpu_quant`, which serves quantized weights only).
MoE layers (`--layers qwen3-30b-a3b:4096:1`, first): every forward kernel call swept on triton, then `moe_mlp`
fused on triton, fused on plain JAX and unfused timed side by side (`gpu_layer.py`).
Dispatch / combine (bf16): DeepSeek-V3 (4096 tokens, hidden 7168, top-8, 256 experts, ep=8: ragged ops) and
Mixtral-8x7B (4096 tokens, hidden 4096, top-2, ep=1: the dense combine).
Each ragged_dot case also records its `breakdown` (`moe-tune report --breakdown`): the tuned winner and the
default re-run under the profiler, time per HLO op from xprof's `hlo_stats` and per kernel from its
`kernel_stats` on GPU (the per-op trace events on CPU), largest first; a breakdown that fails is recorded as
`breakdown_error` and fails the run.
Each case's JSON is written as soon as it is measured, so a run cut short keeps what it finished; the sweeps'
tables are kept under OUT/tables/<device kind>/ (`--tables`), ready to ship in `profiles/data/`.
`winners` (in the JSON, printed at the end): per shape and direction, every ragged_dot backend's tuned time and
XLA's, and which is fastest: the evidence for the GPU default (`registry.py`). A backend that cannot run a
problem at all (`chip_error`: mosaic_gpu's float32 and quantized problems, mosaic_gpu_quant's float weights and
gradients) is recorded as `skipped` with its
reason.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax

from gpu_layer import layer_case
from moe_tune.commands import bench
from moe_tune.core import devices
from moe_tune.commands.breakdown import profile_entry
from moe_tune.commands.breakdown.run import as_json
from moe_tune.kernels import get_op
from moe_tune.tuner import SweepRequest, run_sweep

SHAPES = {
    "deepseek-v3 (ep=8)": dict(m=4096, k=7168, n=2048, groups=32),
    "deepseek-v3 decode (ep=8)": dict(m=256, k=7168, n=2048, groups=32),
    "mixtral-8x7b": dict(m=8192, k=4096, n=14336, groups=8),
}
SMALL = {"toy": dict(m=128, k=64, n=64, groups=4)}
GATHER_SHAPES = {
    "deepseek-v3 (ep=8)": dict(tokens=4096, hidden=7168, top_k=8, experts=256, ep=8),
    "mixtral-8x7b": dict(tokens=4096, hidden=4096, top_k=2, experts=8, ep=1),
}
GATHER_SMALL = {"toy (ep=2)": dict(tokens=32, hidden=128, top_k=4, experts=8, ep=2),
                "toy": dict(tokens=32, hidden=128, top_k=4, experts=8, ep=1)}
GATHER_OPS = ("ragged_gather", "ragged_gather_reduce", "dense_gather_reduce")
# Quantized weight modes: name -> the ragged_dot quantization options (block None: filled per run, see QUANT_BLOCK).
QUANT_MODES = {"int8": dict(rhs_quant="int8"), "fp8": dict(rhs_quant="float8_e4m3fn", quant_block=None),
               "int4": dict(rhs_quant="int4", quant_block=None), "mxfp4": dict(rhs_quant="mxfp4")}
QUANT_BLOCK = {"full": 128, "small": 32}
QUANT_DIRECTIONS = ("fwd", "dlhs")  # drhs reads no weights (it is the float kernel)


def _ragged_dot_case(name: str, problem, args, profile_dir: str, backend: str = "triton") -> dict:
    """Sweep `backend` for one ragged_dot problem and time it against the default, XLA and a dense matmul."""
    spec = get_op("ragged_dot")
    case = {"model": name, "backend": backend, "shape": problem.key_fields()}
    if (reason := spec.backends.get(backend).chip_error(problem)) is not None:
        case["skipped"] = reason
        print(f"\n{name} {problem.direction} [{backend}]: skipped: {reason}", flush=True)
        return case
    started = time.perf_counter()
    try:
        sweep = run_sweep(SweepRequest.make("ragged_dot", problem, backend=backend, max_candidates=args.max_candidates,
                                            profile_dir=profile_dir, cold=True))
        case["sweep"] = {key: getattr(sweep.entry, key) for key in ("candidates", "failures", "timing_fallback")}
        case["sweep"]["wall_s"] = time.perf_counter() - started
        case["default_error"] = sweep.default.error  # relative error vs the (dequantized) reference
        if problem.quantized:
            case["quantization_error"] = sweep.entry.quantization_error  # vs the unquantized weights
        compared = bench.compare(problem, backend, sweep.best.config, samples=args.samples)
        case.update(compared.to_dict())
        print(f"\n{name} [{backend}]: {spec.describe(problem)}")
        print("\n".join(bench.format_comparison(compared)), flush=True)
        case.update(_breakdown(sweep.entry, args))
    except Exception as e:  # noqa: BLE001 - record it and go on to the next case
        case["error"] = f"{type(e).__name__}: {e}"
        case["traceback"] = traceback.format_exc()[-4000:]
        print(f"\n{name} {problem.direction} [{backend}]: FAILED {case['error'][:300]}", flush=True)
    return case


def _winners(cases: list[dict]) -> list[dict]:
    """Per (model, direction, quant) of the ragged_dot cases: each backend's tuned time and XLA's (from that
    backend's run), and the fastest of them."""
    rows: dict[tuple, dict] = {}
    for c in cases:
        if c.get("op", "ragged_dot") != "ragged_dot" or "backend" not in c or "times_s" not in c:
            continue
        key = (c["model"], c["shape"]["direction"], c.get("quant", "float"))
        row = rows.setdefault(key, {"model": key[0], "direction": key[1], "mode": key[2], "times_s": {}})
        row["times_s"][c["backend"]] = c["times_s"]["tuned"]
        row["times_s"].setdefault("xla", c["times_s"]["xla"])
    for row in rows.values():
        row["fastest"] = min(row["times_s"], key=row["times_s"].get)
    return list(rows.values())


def _breakdown(entry, args) -> dict:
    """{"breakdown": ...} of a tuned entry (its winner and default per op / kernel), or {"breakdown_error": ...}."""
    try:
        found = profile_entry(entry, runs=args.breakdown_runs)
    except Exception as e:  # noqa: BLE001 - record it; the case's timings stand
        print(f"  breakdown FAILED: {type(e).__name__}: {e}", flush=True)
        return {"breakdown_error": f"{type(e).__name__}: {e}", "breakdown_traceback": traceback.format_exc()[-4000:]}
    for b in found:
        top = ", ".join(f"{op.name} {op.share:.0%}" for op in b.ops[:4])
        print(f"  {b.label} ({b.source}): {b.total_s * 1e3:.3f} ms of op time per run: {top}", flush=True)
    return {"breakdown": as_json(found, entry)}


def _quant_case(name: str, shape: dict, mode: str, direction: str, bf16: dict, args, profile_dir: str,
                backend: str, triton_bf16: dict | None = None) -> dict:
    """One quantized-weight case, with `vs_bf16`: its tuned time over the bf16 kernel's (`bf16`: direction ->
    that case, measured earlier in the same run; `triton_bf16`: triton's, for a backend with no float cases)."""
    block = QUANT_BLOCK["small" if args.small else "full"]
    options = {k: block if k == "quant_block" else v for k, v in QUANT_MODES[mode].items()}
    problem = get_op("ragged_dot").problem(**shape, **options, dtype=args.dtype, direction=direction)
    case = {"quant": mode, **_ragged_dot_case(name, problem, args, profile_dir, backend)}
    float_case = bf16.get(direction, {})
    if "times_s" not in float_case:  # a backend of quantized weights only: against triton's bf16 kernel
        float_case = (triton_bf16 or {}).get(direction, {})
    if "times_s" in case and "times_s" in float_case:
        case["vs_bf16"] = case["times_s"]["tuned"] / float_case["times_s"]["tuned"]
        print(f"  {mode} tuned / {args.dtype} tuned: {case['vs_bf16']:.2f}", flush=True)
    return case


def _gather_case(op: str, name: str, shape: dict, args, profile_dir: str) -> dict:
    """Sweep `triton` for one dispatch / combine problem and time it against the fallback and a copy."""
    spec = get_op(op)
    problem = spec.problem(**{k: v for k, v in shape.items() if k in spec.option_names}, dtype=args.dtype)
    case = {"model": name, "op": op, "shape": problem.key_fields()}
    started = time.perf_counter()
    sweep = run_sweep(SweepRequest.make(op, problem, backend="triton", max_candidates=args.max_candidates,
                                        profile_dir=profile_dir, cold=True))
    case["sweep"] = {key: getattr(sweep.entry, key) for key in ("candidates", "failures", "timing_fallback")}
    case["sweep"]["wall_s"] = time.perf_counter() - started
    case["default_error"] = sweep.default.error
    case.update(bench.compare_gather(op, problem, "triton", sweep.best.config, samples=args.samples).to_dict())
    t, r = case["times_s"], case["ratios"]
    print(f"\n{name}: {spec.describe(problem)}, valid fraction {case['valid_fraction']:.3f}")
    print("  " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items())
          + f"; copy {case['copy_gbps']:.0f} GB/s; fallback/tuned {r['fallback_vs_tuned']:.2f}, "
            f"tuned/roofline {r['tuned_vs_roofline']:.2f}", flush=True)
    return case


def _record(report: dict, case: dict, out_path: Path) -> None:
    """Append a case and rewrite the JSON at once: a run cut short keeps every finished case."""
    report["cases"].append(case)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1, default=str))


def _plan(args, profile_dir: str) -> list[tuple[str, Callable[[], dict]]]:
    """Every case of the run, (label, run it), in the order run: the layers, then per ragged_dot shape and
    backend the float directions and the quantized ones, then dispatch and combine."""
    plan, ops = [], args.ops.split(",")
    for layer in (text.split(":") for text in args.layers.split(",") if text):
        plan.append((f"layer {':'.join(layer)}", functools.partial(
            layer_case, layer[0], int(layer[1]), int(layer[2]), dtype=args.dtype, samples=args.samples,
            max_candidates=args.layer_candidates, profile_dir=profile_dir)))
    wanted = lambda shapes: {k: v for k, v in shapes.items() if not args.models
                             or any(m and m in k for m in args.models.split(","))}
    for name, shape in wanted(SMALL if args.small else SHAPES).items() if "ragged_dot" in ops else ():
        directions = args.directions.split(",")
        triton_bf16: dict[str, dict] = {}  # triton's float cases of this shape (vs_bf16 of mosaic_gpu_quant)
        for backend in args.backends.split(","):
            bf16: dict[str, dict] = {}  # direction -> its case, for the quantized cases' vs_bf16

            def float_case(direction, name=name, shape=shape, backend=backend, bf16=bf16, triton_bf16=triton_bf16):
                problem = get_op("ragged_dot").problem(**shape, dtype=args.dtype, direction=direction)
                bf16[direction] = _ragged_dot_case(name, problem, args, profile_dir, backend)
                if backend == "triton":
                    triton_bf16[direction] = bf16[direction]
                return bf16[direction]

            plan += [(f"{name} {backend} {d}", functools.partial(float_case, d)) for d in directions]
            plan += [(f"{name} {backend} {mode} {d}", functools.partial(_quant_case, name, shape, mode, d, bf16, args,
                                                                        profile_dir, backend, triton_bf16))
                     for mode in (args.quant.split(",") if args.quant else ())
                     for d in directions if d in QUANT_DIRECTIONS]
    for op in (op for op in GATHER_OPS if op in ops):
        for name, shape in wanted(GATHER_SMALL if args.small else GATHER_SHAPES).items():
            if (op == "dense_gather_reduce") == (shape["ep"] == 1):  # dense: ep 1; the ragged ops: expert-parallel
                plan.append((f"{name} {op}", functools.partial(_safe_gather_case, op, name, shape, args, profile_dir)))
    return plan


def _safe_gather_case(op: str, name: str, shape: dict, args, profile_dir: str) -> dict:
    try:
        return _gather_case(op, name, shape, args, profile_dir)
    except Exception as e:  # noqa: BLE001 - record it and go on to the next case
        print(f"\n{name} {op}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"model": name, "op": op, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for gpu_check.json")
    parser.add_argument("--small", action="store_true", help="toy shapes (a smoke test off GPU)")
    parser.add_argument("--tables", type=Path, default=None, help="where the sweeps' tables go (default: OUT/tables)")
    parser.add_argument("--directions", default="fwd,dlhs,drhs")
    parser.add_argument("--max-candidates", type=int, default=16, help="per sweep (the default config is first)")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--breakdown-runs", type=int, default=3, help="profiled runs per config of each breakdown")
    parser.add_argument("--ops", default="ragged_dot," + ",".join(GATHER_OPS))
    parser.add_argument("--models", default="", help="only the ragged_dot / gather shapes whose name has one of "
                                                      "these (comma-separated; default: all)")
    parser.add_argument("--backends", default="triton,mosaic_gpu,mosaic_gpu_quant",
                        help="the ragged_dot backends to sweep and time")
    parser.add_argument("--layers", default=None,
                        help="MoE layers PRESET:TOKENS:EP,... to sweep and time fused vs unfused (gpu_layer.py), "
                             "before the kernels (default: qwen3-30b-a3b:4096:1; toy:16:2 with --small; '' for none)")
    parser.add_argument("--layer-candidates", type=int, default=8, help="per sweep of a layer's kernel call")
    parser.add_argument("--quant", default=",".join(QUANT_MODES),
                        help=f"quantized weight modes of ragged_dot ({', '.join(QUANT_MODES)}; '' for none)")
    parser.add_argument("--list", action="store_true", help="print the cases this run would take, in order, and exit")
    parser.add_argument("--time-limit", type=float, default=480,
                        help="start no case after this many seconds (0: none); the rest are listed as not_run")
    args = parser.parse_args()
    if args.layers is None:
        args.layers = "toy:16:2" if args.small else "qwen3-30b-a3b:4096:1"

    plan = _plan(args, str(args.tables or Path(args.out) / "tables"))
    if args.list:
        print("\n".join(label for label, _ in plan))
        return 0
    out_path = Path(args.out) / "gpu_check.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "meta": {"device_kind": devices.device_kind(), "platform": devices.platform(), "jax": jax.__version__,
                 "date": time.strftime("%Y-%m-%d"), "devices": [str(d) for d in jax.devices()]},
        "cases": [],
    }
    print(f"device: {report['meta']['device_kind']} ({report['meta']['platform']}), jax {jax.__version__}", flush=True)
    # The sweeps' tables are kept beside the JSON: what a lent GPU tuned can be shipped (profiles/data/<device>/).
    started = time.perf_counter()
    for label, run in plan:
        if args.time_limit and time.perf_counter() - started > args.time_limit:
            report.setdefault("not_run", []).append(label)  # a lease ends: what did not start is listed
            continue
        _record(report, run(), out_path)
    report["winners"] = _winners(report["cases"])
    if report.get("not_run"):
        print(f"\n--time-limit {args.time_limit:.0f} s: not run: {', '.join(report['not_run'])}")
    for row in report.get("winners", []):
        times = ", ".join(f"{b} {t * 1e3:.3f} ms" for b, t in row["times_s"].items())
        print(f"{row['model']} {row['direction']} {row['mode']}: {times}; fastest {row['fastest']}")
    out_path.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out_path}")
    return 0 if all("error" not in c and "breakdown_error" not in c for c in report["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
