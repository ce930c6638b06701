"""Every performance target of moe-tune on this machine, measured side by side in one run, with the ratio
each target is judged on.

    .venv/bin/python benchmarks/targets_cpu.py [--shapes square,deepseek-v2-lite,qwen3-30b-a3b]
        [--groups 8,32,128] [--directions fwd,dlhs,drhs] [--gather-ops ...] [--skip-tuner] [--json OUT]
    .venv/bin/python benchmarks/targets_cpu.py --small   # toy sizes: the test suite runs it end to end

1. Roofline: for each ragged_dot case, a dense matmul of the same FLOPs (the compute roof) and a copy of
   the largest operand's size (the copy bandwidth) are timed in the same rounds as the kernels; the roofline
   is max(dense time, least bytes moved / copy bandwidth) (`moe_tune.commands.bench.compare`).
2. ragged_dot (tiled, swept here first; balanced groups): tuned/roofline, xla/tuned (`jax.lax.ragged_dot`),
   and the tuned config on skewed group sizes over balanced.
3. Dispatch and combine (tiled, swept here first): tuned/roofline at valid fractions 1, 1/4, 1/16, and the
   ragged time at each fraction over the time at fraction 1. Printed beside them, not a target: the time to
   fill a fresh array of the output's shape, which no kernel can beat at any fraction.
4. Dtypes (`--dtypes`, default float32, bfloat16, float16; each tuned by its own sweep): every ragged_dot case
   and dispatch/combine case again, each dtype's tuned kernel beside the others in the same rounds, with the
   dense matmul of each dtype and per-group dense dots (each group's rows as its own dot, back to back) as
   floors: tuned low-precision / tuned float32 (ragged_dot <= 1.1, gathers <= 1.0: half the bytes), and
   tuned / per-group floor of the same dtype at g=8 (<= 1.15). `--skip-baselines` leaves out 2 and 3's
   float32 comparisons (roofline, xla, skew), which take most of a real run.
5. The tuner: a 64-candidate ragged_dot sweep with a cold compilation cache (`sweep_cpu.py`'s child).
6. GPU targets: `gpu_check.py`, on a GPU machine.

Nothing is asserted: the machines are shared and noisy. Each ratio is printed next to its target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune.commands import bench
from moe_tune.core import devices
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS
from moe_tune.kernels.ragged_dot.definition import DENSE
from moe_tune.tuner import SweepRequest, SweepSettings, run_sweep

# [m, k, n] of the ragged_dot cases: the square case and the gate/up expert shapes of two presets
# (k = hidden, n = expert width) at 4096 routed rows.
SHAPES = {"square": (4096, 1024, 1024), "deepseek-v2-lite": (4096, 2048, 1408), "qwen3-30b-a3b": (4096, 2048, 768)}
# dispatch/combine: DeepSeek-V2-Lite's routing (64 experts, top 6) of 2048 tokens; expert-parallel sizes 1, 4
# and 16 leave valid fractions of about 1, 1/4 and 1/16
GATHER_SHAPE = dict(tokens=2048, hidden=2048, top_k=6, experts=64)
GATHER_EP = (1, 4, 16)
# --small: the same cases at toy sizes, to keep this script from rotting (its ratios mean nothing)
SMALL_SHAPES = {"toy": (256, 64, 64)}
SMALL_GATHER_SHAPE = dict(tokens=64, hidden=128, top_k=4, experts=16)
ROOFLINE_TARGET = {8: 1.15, 32: 1.3, 128: 1.5}  # tuned / roofline, by group count
XLA_TARGET = {8: 10.0, 32: 30.0}  # xla / tuned, by group count
SKEW_TARGET = 1.3  # skewed / balanced
GATHER_ROOFLINE_TARGET = 1.5
TUNER_TARGET_S = 30.0
DTYPE_TARGET = 1.1  # tuned bf16 / f16 ragged_dot over tuned f32, same shape
PER_GROUP_TARGET = {8: 1.15}  # tuned / per-group dense floor of the same dtype, by group count
GATHER_DTYPE_TARGET = 1.0  # tuned bf16 / f16 dispatch or combine over tuned f32 (half the bytes)


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def shape_table(args) -> dict[str, tuple[int, int, int]]:
    """The ragged_dot shapes `--shapes` names: the real ones, or the toy ones with `--small`."""
    return SMALL_SHAPES if args.small else SHAPES


def tuned_config(op: str, problem, profile_dir: str, strategy: str):
    started = time.perf_counter()
    sweep = run_sweep(SweepRequest.make(op, problem, backend="tiled", strategy=strategy, profile_dir=profile_dir))
    return sweep, time.perf_counter() - started


def per_group_dense(direction: str, sizes: np.ndarray):
    """Each group's rows as its own dense dot, back to back (static slices at the host's group sizes): the
    floor of a grouped matmul made of XLA's dots, without the loop or tiles around them."""
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    spans = list(zip(bounds[:-1], bounds[1:]))
    if direction == "drhs":
        return lambda a, b: jnp.stack([a[s:e].T @ b[s:e] for s, e in spans])
    dot = (lambda x, w: x @ w.T) if direction == "dlhs" else (lambda x, w: x @ w)
    return lambda a, b: jnp.concatenate([dot(a[s:e], b[g]) for g, (s, e) in enumerate(spans)])


def ragged_dot_dtype_round(problems: dict, configs: dict, samples: int) -> dict:
    """The tuned kernel of every dtype, the dense matmul and the per-group dense dots of each, side by side
    in the same rounds on the same values (the float32 inputs rounded to each dtype)."""
    spec, impl = get_op("ragged_dot"), BACKENDS.get("tiled")
    first = next(iter(problems.values()))
    host = spec.make_inputs(float32_problem(first), "balanced", seed=1)
    floor = per_group_dense(first.direction, host["group_sizes"])
    inputs, variants = {"group_sizes": host["group_sizes"]}, {}
    for dtype, problem in problems.items():
        inputs[dtype] = {"a": host["a"].astype(jnp.dtype(dtype)), "b": host["b"].astype(jnp.dtype(dtype))}
        variants[f"tuned {dtype}"] = lambda x, p=problem, c=configs[dtype], d=dtype: impl.run(
            p, c, x[d]["a"], x[d]["b"], x["group_sizes"])
        variants[f"dense {dtype}"] = lambda x, d=dtype: DENSE[first.direction](x[d]["a"], x[d]["b"])
        variants[f"per-group {dtype}"] = lambda x, d=dtype: floor(x[d]["a"], x[d]["b"])
    return bench.time_variants(variants, jax.device_put(inputs), samples=samples)


def float32_problem(problem):
    return get_op("ragged_dot").problem(m=problem.m, k=problem.k, n=problem.n, groups=problem.groups,
                                        dtype="float32", direction=problem.direction)


def dtype_summary(kind: str, label: str, times: dict, dtypes: list[str], target: float, summary: list) -> None:
    """One line per dtype: its time over float32's (printed with every variant's time)."""
    print("  dtypes, same rounds: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items()), flush=True)
    if "float32" not in dtypes:
        return
    for dtype in dtypes:
        if dtype != "float32":
            ratio = times[f"tuned {dtype}"] / times["tuned float32"]
            summary.append((f"{kind} {dtype}/float32 tuned {label}", ratio, f"<= {target}", ratio <= target))


def ragged_dot_targets(args, profile_dir: str, summary: list, results: list, save, dtype_results: list) -> None:
    spec = get_op("ragged_dot")
    dtypes = args.dtypes.split(",")
    for shape in args.shapes.split(","):
        m, k, n = shape_table(args)[shape]
        for groups in (int(g) for g in args.groups.split(",")):
            for direction in args.directions.split(","):
                label = f"{shape} g={groups} {direction}"
                problems = {d: spec.problem(m=m, k=k, n=n, groups=groups, dtype=d, direction=direction) for d in dtypes}
                sweeps = {d: tuned_config("ragged_dot", p, profile_dir, args.strategy) for d, p in problems.items()}
                if not args.skip_baselines:
                    ragged_dot_baselines(args, label, shape, problems[args.dtype], *sweeps[args.dtype], summary,
                                         results)
                configs = {d: sweep.best.config for d, (sweep, _) in sweeps.items()}
                times = ragged_dot_dtype_round(problems, configs, args.samples)
                print(f"\n{label}: tuned configs " + "; ".join(f"{d} {c.to_dict()}" for d, c in configs.items()))
                dtype_summary("ragged_dot", label, times["times_s"], dtypes, DTYPE_TARGET, summary)
                for dtype in dtypes:
                    if groups in PER_GROUP_TARGET and dtype != "float32":
                        ratio = times["times_s"][f"tuned {dtype}"] / times["times_s"][f"per-group {dtype}"]
                        summary.append((f"ragged_dot {dtype} tuned/per-group dense {label}", ratio,
                                        f"<= {PER_GROUP_TARGET[groups]}", ratio <= PER_GROUP_TARGET[groups]))
                dtype_results.append({"op": "ragged_dot", "name": shape, "groups": groups, "direction": direction,
                                      "configs": {d: c.to_dict() for d, c in configs.items()}, **times})
                save()


def ragged_dot_baselines(args, label, shape, problem, sweep, sweep_s, summary: list, results: list) -> None:
    """The float32 (--dtype) comparison of 2.: roofline, xla, skewed group sizes."""
    spec = get_op("ragged_dot")
    r = bench.compare(problem, "tiled", sweep.best.config, samples=args.samples)
    results.append({**r.to_dict(), "name": shape, "sweep_s": sweep_s, "sweep_candidates": len(sweep.candidates)})
    print(f"\n{spec.describe(problem)} ({shape}; {args.strategy} sweep of {len(sweep.candidates)} "
          f"candidates, {sweep_s:.0f} s; timed by {r.timing_method})")
    print("\n".join(bench.format_comparison(r)), flush=True)
    ratios, groups = r.ratios, problem.groups
    if groups in ROOFLINE_TARGET:
        summary.append((f"ragged_dot tuned/roofline {label}", ratios["tuned_vs_roofline"],
                        f"<= {ROOFLINE_TARGET[groups]}", ratios["tuned_vs_roofline"] <= ROOFLINE_TARGET[groups]))
    if groups in XLA_TARGET:
        summary.append((f"ragged_dot xla/tuned {label}", ratios["xla_vs_tuned"],
                        f">= {XLA_TARGET[groups]:.0f}", ratios["xla_vs_tuned"] >= XLA_TARGET[groups]))
    summary.append((f"ragged_dot skewed/balanced {label}", ratios["skewed_vs_balanced"],
                    f"<= {SKEW_TARGET}", ratios["skewed_vs_balanced"] <= SKEW_TARGET))


def gather_dtype_round(op: str, problems: dict, configs: dict, samples: int) -> dict:
    """The tuned kernel of every dtype side by side in the same rounds (the same routing; x rounded)."""
    spec = get_op(op)
    impl = spec.backends.get("tiled")
    inputs = {d: spec.make_inputs(p, "balanced", 1) for d, p in problems.items()}
    variants = {f"tuned {d}": lambda x, d=d, p=p: spec.run(impl, configs[d], p, x[d]) for d, p in problems.items()}
    return bench.time_variants(variants, jax.device_put(inputs), samples=samples)


def gather_targets(args, profile_dir: str, summary: list, results: list, save, dtype_results: list) -> None:
    dtypes = args.dtypes.split(",")
    for op in args.gather_ops.split(","):
        spec = get_op(op)
        eps = GATHER_EP if "ep" in spec.option_names else [1]
        full = None
        for ep in eps:
            shape = SMALL_GATHER_SHAPE if args.small else GATHER_SHAPE
            sharded = {"ep": ep} if "ep" in spec.option_names else {}  # an op's declared options only
            problems = {d: spec.problem(**shape, **sharded, dtype=d) for d in dtypes}
            sweeps = {d: tuned_config(op, p, profile_dir, args.strategy) for d, p in problems.items()}
            configs = {d: sweep.best.config for d, (sweep, _) in sweeps.items()}
            times = gather_dtype_round(op, problems, configs, args.samples)
            print(f"\n{op} ep={ep}: tuned configs " + "; ".join(f"{d} {c.to_dict()}" for d, c in configs.items()))
            dtype_summary(op, f"ep={ep}", times["times_s"], dtypes, GATHER_DTYPE_TARGET, summary)
            dtype_results.append({"op": op, "ep": ep, "configs": {d: c.to_dict() for d, c in configs.items()}, **times})
            save()
            if args.skip_baselines:
                continue
            problem, (sweep, sweep_s) = problems[args.dtype], sweeps[args.dtype]
            r = {**bench.compare_gather(op, problem, "tiled", sweep.best.config, samples=args.samples).to_dict(),
                 "ep": ep, "sweep_s": sweep_s}
            results.append(r)
            full = full or r
            t = r["times_s"]
            relative = t["tuned"] / full["times_s"]["tuned"]
            print(f"\n{spec.describe(problem)}: valid fraction {r['valid_fraction']:.3f}; tuned {r['tuned_config']}"
                  f", default {r['default_config']} (timed by {r['timing_method']})")
            print(f"  tuned {t['tuned'] * 1e3:.3f} ms, default {t['default'] * 1e3:.3f}, fallback "
                  f"{t['fallback'] * 1e3:.3f}, copy {t['copy'] * 1e3:.3f} ({r['copy_gbps']:.1f} GB/s), output write "
                  f"{t['output_write'] * 1e3:.3f}; roofline {r['roofline_s'] * 1e3:.3f} ms "
                  f"({r['least_bytes'] / 2**20:.1f} MiB moved at least)")
            print(f"  ratios: tuned/roofline {r['ratios']['tuned_vs_roofline']:.2f}, tuned/output write "
                  f"{r['ratios']['tuned_vs_output_write']:.2f}, fallback/tuned "
                  f"{r['ratios']['fallback_vs_tuned']:.2f}, default/tuned {r['ratios']['default_vs_tuned']:.2f}; "
                  f"time vs fraction 1: tuned {relative:.2f}, fallback "
                  f"{t['fallback'] / full['times_s']['fallback']:.2f}", flush=True)
            label = f"{op} fraction {r['valid_fraction']:.3f}"
            ratio = r["ratios"]["tuned_vs_roofline"]
            summary.append((f"{label} tuned/roofline", ratio, f"<= {GATHER_ROOFLINE_TARGET}", ratio <= GATHER_ROOFLINE_TARGET))
            if ep > 1:
                # proportional: the time at fraction f is about f times the full time (within the same 1.5x)
                fraction = r["valid_fraction"] / full["valid_fraction"]
                summary.append((f"{label} time/(fraction x full time)", relative / fraction,
                                f"<= {GATHER_ROOFLINE_TARGET}", relative / fraction <= GATHER_ROOFLINE_TARGET))
            save()


def tuner_target(args, summary: list) -> dict:
    """sweep_cpu.py's child in a fresh process with an empty compilation cache and profile dir."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MOE_TUNE_COMPILE_CACHE_DIR": os.path.join(tmp, "cache"),
               "MOE_TUNE_PROFILE_DIR": os.path.join(tmp, "profiles")}
        script = Path(__file__).with_name("sweep_cpu.py")
        proc = subprocess.run([sys.executable, str(script), "--child", str(args.workers), "--candidates",
                               str(args.tuner_candidates),
                               "--samples", str(args.tuner_samples)], env=env, capture_output=True, text=True,
                              check=True)
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in run["stages_s"].items())
    print(f"\ntuner: {run['candidates']['tried']} candidates, {args.workers} workers, cold cache: "
          f"{run['wall_s']:.1f} s ({stages}); {run['compiles_per_candidate']:.2f} compiles per candidate", flush=True)
    summary.append((f"tuner: {args.tuner_candidates}-candidate sweep wall (s)", run["wall_s"],
                    f"<= {TUNER_TARGET_S:.0f}", run["wall_s"] <= TUNER_TARGET_S))
    summary.append(("tuner: XLA compiles per candidate", run["compiles_per_candidate"], "== 1",
                    run["compiles_per_candidate"] == 1))
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--groups", default="8,32,128")
    parser.add_argument("--directions", default="fwd,dlhs,drhs")
    parser.add_argument("--gather-ops", default="ragged_gather,ragged_gather_reduce,dense_gather_reduce")
    parser.add_argument("--dtype", default="float32", help="dtype of the roofline / xla / skew comparisons")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16", help="dtypes compared side by side")
    parser.add_argument("--skip-baselines", action="store_true",
                        help="only the dtype comparisons (no roofline / xla / skew / fraction targets)")
    parser.add_argument("--strategy", default="coordinate", help="sweep strategy for the tuned configs")
    parser.add_argument("--samples", type=int, default=7, help="timing samples of the side-by-side rounds")
    parser.add_argument("--workers", type=int, default=2, help="compile workers of the tuner target")
    parser.add_argument("--tuner-samples", type=int, default=SweepSettings.samples,
                        help="first-round samples of the tuner target (default: the tuner's)")
    parser.add_argument("--tuner-candidates", type=int, default=64, help="candidates of the tuner target")
    parser.add_argument("--skip-tuner", action="store_true")
    parser.add_argument("--small", action="store_true",
                        help=f"toy sizes (shape {', '.join(SMALL_SHAPES)}, 8 groups; a 2-candidate tuner sweep)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.small:
        args.shapes, args.groups, args.tuner_candidates = ",".join(SMALL_SHAPES), "8", 2
    unknown = set(filter(None, args.shapes.split(","))) - set(shape_table(args))
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(sorted(unknown))}; choose from {', '.join(shape_table(args))}")

    if args.dtype not in args.dtypes.split(","):  # the baselines' dtype is swept with the others
        args.dtypes = f"{args.dtype},{args.dtypes}"
    summary: list[tuple[str, float, str, bool]] = []
    results: dict = {"ragged_dot": [], "gather": [], "dtypes": [], "tuner": None}

    def save() -> None:
        """After every case: write what is measured so far (a long run killed midway keeps its cases), and
        drop JAX's compiled functions, which pile up over the run and slow every later sweep."""
        if args.json:
            bench.write_results(args.json, [{"summary": [dict(zip(("target", "value", "wanted", "met"), s))
                                                         for s in summary]}, results])
        jax.clear_caches()

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as profile_dir:
        if args.shapes:
            ragged_dot_targets(args, profile_dir, summary, results["ragged_dot"], save, results["dtypes"])
        if args.gather_ops:
            gather_targets(args, profile_dir, summary, results["gather"], save, results["dtypes"])
    if not args.skip_tuner:
        results["tuner"] = tuner_target(args, summary)
        save()
    if devices.platform() != "gpu":
        print("\nGPU targets: not measured here (no GPU); run benchmarks/gpu_check.py on a GPU machine.")

    print(f"\nSummary ({devices.device_kind()}, {os.cpu_count()} CPUs, {time.perf_counter() - started:.0f} s):")
    width = max(len(name) for name, *_ in summary) if summary else 10
    for name, value, target, ok in summary:
        print(f"  {name:<{width}}  {value:8.2f}  target {target:<7}  {verdict(ok)}")
    met = sum(ok for *_, ok in summary)
    print(f"  {met} of {len(summary)} met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
