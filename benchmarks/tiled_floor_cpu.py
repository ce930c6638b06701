"""The `tiled` ragged_dot fwd against its floors, float32 and bfloat16, timed interleaved in one process:
(a) the tuned config (the table lookup `moe_tune.ragged_dot(..., backend="tiled")` runs), (b) the backend's
default config, (c) `jax.lax.ragged_dot`, (d) one dense matmul of the same FLOPs ([m, k] @ [k, n]) and (e) the
per-group floor: each group's rows as its own dense dot, back to back (static slices at the host's group
sizes, as `targets_cpu.per_group_dense`). Every variant is jitted and compiled first, warmed up, then run
once per round in a shuffled order for `--rounds` rounds; the median per variant is printed with its ratio
over the per-group floor and over the dense matmul of the same dtype, and the load average before and after.

    .venv/bin/python benchmarks/tiled_floor_cpu.py [--m 4096 --k 1024 --n 1024 --groups 8]
        [--dtypes float32,bfloat16] [--rounds 40] [--config tm=512,tk=1024,tn=1024,tail=64] [--json OUT]

`--config` replaces the default config (b) by a fixed one (the same kernel code at each revision then runs
the same tiles). Nothing is asserted: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_tune
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot import BACKENDS


def per_group_floor(sizes: np.ndarray):
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    spans = list(zip(bounds[:-1], bounds[1:]))
    return lambda a, b: jnp.concatenate([a[s:e] @ b[g] for g, (s, e) in enumerate(spans)])


def commit_of(path: str) -> str:
    """The git commit of the checkout `path` lies in ('' outside one)."""
    try:
        return subprocess.run(["git", "-C", os.path.dirname(path), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return ""


def parse_config(text: str | None) -> dict | None:
    if not text:
        return None
    return {key: int(value) for key, value in (item.split("=") for item in text.split(","))}


def config_dict(config) -> dict:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def variants_for(dtype: str, args, sizes: np.ndarray, fixed: dict | None):
    """(name -> jitted fn of (a, b, gs), configs used) for one dtype."""
    op, impl = get_op("ragged_dot"), BACKENDS.get("tiled")
    problem = op.problem(m=args.m, k=args.k, n=args.n, groups=args.groups, dtype=dtype)
    default = fixed if fixed is not None else config_dict(impl.default_config(problem))
    try:
        looked = op.lookup(problem, backend="tiled")
        tuned = {"config": config_dict(looked.config), "source": str(getattr(looked, "source", ""))}
    except Exception as e:  # noqa: BLE001 - the lookup's API is not what is measured
        tuned = {"config": None, "source": f"lookup failed: {type(e).__name__}"}
    floor = per_group_floor(sizes)
    fns = {
        "tuned": lambda a, b, gs: moe_tune.ragged_dot(a, b, gs, backend="tiled"),
        "default": lambda a, b, gs: moe_tune.ragged_dot(a, b, gs, backend="tiled", config=default),
        "xla": lambda a, b, gs: jax.lax.ragged_dot(a, b, gs),
        "dense": lambda a, b, gs: a @ b[0],
        "floor": lambda a, b, gs: floor(a, b),
    }
    return {name: jax.jit(fn) for name, fn in fns.items()}, {"tuned": tuned, "default": default}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--config", default=None, help="fixed config for (b), e.g. tm=512,tk=1024,tn=1024,tail=64")
    parser.add_argument("--only", default=None, help="comma-separated subset of tuned,default,xla,dense,floor")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    sizes = rng.multinomial(args.m, np.full(args.groups, 1.0 / args.groups))  # balanced routing
    a32 = rng.standard_normal((args.m, args.k), dtype=np.float32)
    b32 = rng.standard_normal((args.groups, args.k, args.n), dtype=np.float32) / np.sqrt(args.k)
    gs = jnp.asarray(sizes, jnp.int32)
    load_before = os.getloadavg()

    calls, configs = {}, {}
    for dtype in args.dtypes.split(","):
        a, b = jnp.asarray(a32, dtype), jnp.asarray(b32, dtype)
        fns, configs[dtype] = variants_for(dtype, args, sizes, parse_config(args.config))
        keep = args.only.split(",") if args.only else list(fns)
        for name in keep:
            compiled = fns[name].lower(a, b, gs).compile()
            calls[(dtype, name)] = (lambda c=compiled, a=a, b=b: c(a, b, gs))
    for _ in range(args.warmup):
        for call in calls.values():
            jax.block_until_ready(call())
    samples = {key: [] for key in calls}
    order = list(calls)
    for _ in range(args.rounds):
        random.shuffle(order)
        for key in order:
            start = time.perf_counter()
            jax.block_until_ready(calls[key]())
            samples[key].append(time.perf_counter() - start)
    load_after = os.getloadavg()

    results = []
    print(f"tiled ragged_dot fwd m={args.m} k={args.k} n={args.n} groups={args.groups} sizes={sizes.tolist()}; "
          f"{args.rounds} rounds; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    for dtype in args.dtypes.split(","):
        med = {name: float(np.median(samples[(dtype, name)])) for (d, name) in calls if d == dtype}
        q = {name: [float(np.percentile(samples[(dtype, name)], p)) for p in (25, 75)] for name in med}
        ratios = {}
        for base in ("floor", "dense"):
            if base in med:
                ratios[base] = {name: med[name] / med[base] for name in med if name != base}
        print(f"{dtype}: tuned {configs[dtype]['tuned']['config']} ({configs[dtype]['tuned']['source']}), "
              f"default {configs[dtype]['default']}")
        for name, t in med.items():
            over = "  ".join(f"{r[name]:.3f}x {base}" for base, r in ratios.items() if name in r)
            print(f"  {name:8s} {t * 1e3:8.2f} ms (IQR {q[name][0] * 1e3:.2f}-{q[name][1] * 1e3:.2f})  {over}")
        results.append({"dtype": dtype, "median_ms": {k: v * 1e3 for k, v in med.items()},
                        "iqr_ms": {k: [v * 1e3 for v in q[k]] for k in q}, "ratio_over": ratios,
                        "configs": configs[dtype]})
    if len(results) > 1 and all("default" in r["median_ms"] for r in results):
        base = results[0]
        for r in results[1:]:
            print(f"default {r['dtype']} / default {base['dtype']}: "
                  f"{r['median_ms']['default'] / base['median_ms']['default']:.3f}")
    if args.json:
        meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "jax": jax.__version__,
                "moe_tune": os.path.dirname(moe_tune.__file__), "commit": commit_of(moe_tune.__file__),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "load_average_before": load_before, "load_average_after": load_after,
                "shape": {"m": args.m, "k": args.k, "n": args.n, "groups": args.groups},
                "group_sizes": sizes.tolist(), "rounds": args.rounds, "warmup": args.warmup}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
