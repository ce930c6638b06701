"""Expert parallelism as a user first meets it, on this CPU with 8 host devices: sweep one preset's layer
across devices, run the sharded layer on global arrays, and see which tables its kernels used.

    .venv/bin/python benchmarks/expert_parallel_trial.py [--model qwen3-30b-a3b] [--tokens 16] [--ep 8]
        [--max-candidates 2] [--samples 1] [--workers 1]
        [--out benchmarks/results/expert_parallel_trial_cpu_2026-12-01.json]

The device count is fixed when JAX starts: the script re-executes itself with
XLA_FLAGS=--xla_force_host_platform_device_count=EP appended when that flag is missing.

1. `moe-tune sweep --model M --tokens T --ep EP --direction fwd --dtype bfloat16 --rhs-quant int8` (with the
   small settings given) into a fresh scratch profile dir ($MOE_TUNE_PROFILE_DIR, above every other table), run
   as a user would, in its own process; its wall time is recorded.
2. `moe-tune coverage --format json` of the same layer: how lookup answers each call it lists.
3. `moe_tune.sharded_moe_mlp` on global arrays of that layer (x [T x EP, hidden] bfloat16, router logits float32,
   int8 per-channel `moe_tune.quantize` weights [experts, ...]) under `jax.jit`, in the default shard_map over an
   expert axis of EP devices, with `ep_strategy=None` (the tables' choice), then with each strategy by name and
   with the tokens replicated (T tokens on every device); every kernel lookup each trace made is recorded
   (`KernelOp.resolve_config`'s INFO line, as tests/sharding_sweep_checks.py collects them) with its source,
   `exact` when a tuned entry answered for its own key; and the largest difference of each output from the
   one-device `moe_tune.moe_mlp` on the same inputs.

Writes one JSON file (machine, jax, commit, the sweep's command, exit code, wall time and summary lines, every
lookup, the error). Nothing is asserted. It takes minutes (the sweep and the compiles of the whole layer).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _devices_flag(ep: int) -> str:
    return f"--xla_force_host_platform_device_count={ep}"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per device of the expert axis")
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--max-candidates", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "expert_parallel_trial_cpu_2026-12-01.json")
    return parser.parse_args()


class Lookups(logging.Handler):
    """Every `KernelOp.resolve_config` line: (op, key fields, backend, config, source)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.found: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if ": backend " not in str(record.msg) or not isinstance(record.args, tuple) or len(record.args) != 5:
            return
        op, key, backend, config, source = record.args
        self.found.append({"op": op, "key": dict(key), "backend": backend, "config": config, "source": source,
                           "exact": str(source).startswith("exact")})


def _sweep(args: argparse.Namespace, env: dict) -> dict:
    command = ["sweep", "--model", args.model, "--tokens", str(args.tokens), "--ep", str(args.ep),
               "--direction", "fwd", "--dtype", "bfloat16", "--rhs-quant", "int8",
               "--max-candidates", str(args.max_candidates), "--samples", str(args.samples),
               "--workers", str(args.workers), "--seed", str(args.seed)]
    load_before = os.getloadavg()[0]  # the machine may be shared: its 1-minute load beside the wall time
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "from moe_tune.cli import cli; cli()", *command],
                          capture_output=True, text=True, env={**env, "COLUMNS": "200"}, check=False)
    wall = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    lines = [line.rstrip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return {"command": "moe-tune " + " ".join(command), "exit": done.returncode, "wall_s": round(wall, 1),
            "load_1min_before_after": [round(load_before, 2), round(load_after, 2)], "output_tail": lines[-25:]}


def _inputs(preset, total: int, seed: int):
    import jax.numpy as jnp
    import numpy as np

    import moe_tune

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((total, preset.hidden), np.float32), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((total, preset.experts), np.float32))
    shapes = ((preset.experts, preset.hidden, preset.expert_intermediate),) * 2 + (
        (preset.experts, preset.expert_intermediate, preset.hidden),)
    weights = [moe_tune.quantize(jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[1])), "int8", axis=1)
               for s in shapes]  # per channel: one scale per output column of each expert
    return x, logits, weights


def _run(layer, args, lookups: Lookups) -> tuple:
    """`layer(*args)` under jit, its lookups collected: (output as float32 numpy, seconds to compile and run)."""
    import jax
    import numpy as np

    logger = logging.getLogger("moe_tune")
    logger.setLevel(logging.INFO)
    logger.addHandler(lookups)
    try:
        started = time.perf_counter()
        out = np.asarray(jax.jit(layer)(*args).astype(np.float32))
        return out, round(time.perf_counter() - started, 1)
    finally:
        logger.removeHandler(lookups)


def _layer(args: argparse.Namespace) -> dict:
    """The sharded layer with ep_strategy None (the tables' choice), then each strategy by name and with the
    tokens replicated over the expert axis (the decode layout), each against the one-device layer."""
    import jax
    import numpy as np

    import moe_tune
    from moe_tune.layer.models import get_preset

    preset = get_preset(args.model)
    x, logits, weights = _inputs(preset, args.tokens * args.ep, args.seed)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:args.ep]), ("expert",))
    one_device = jax.devices()[0]
    runs = {}
    for name, strategy, replicated in (("tables_choice", None, False), ("all_gather", "all_gather", False),
                                       ("all_to_all", "all_to_all", False), ("replicated_tokens", None, True)):
        n = args.tokens if replicated else args.tokens * args.ep
        sharded, one = Lookups(), Lookups()
        got, seconds = _run(lambda x, logits, *w, s=strategy, r=replicated: moe_tune.sharded_moe_mlp(
            x, logits, *w, preset.top_k, mesh=mesh, ep_strategy=s, tokens_replicated=r),
            (x[:n], logits[:n], *weights), sharded)
        want, _ = _run(lambda x, logits, *w: moe_tune.moe_mlp(x, logits, *w, preset.top_k),
                       (jax.device_put(x[:n], one_device), jax.device_put(logits[:n], one_device), *weights), one)
        error, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
        runs[name] = {"ep_strategy": strategy, "tokens_replicated": replicated, "global_tokens": n,
                      "compile_and_run_s": seconds, "lookups": sharded.found,
                      "lookups_exact": sum(f["exact"] for f in sharded.found),
                      "lookups_not_exact": [f for f in sharded.found if not f["exact"]],
                      "max_abs_error_vs_one_device": error, "max_abs_one_device_output": scale,
                      "relative_error_vs_one_device": error / max(scale, 1e-30)}
        print(f"{name}: {runs[name]['lookups_exact']} of {len(sharded.found)} lookups exact, max error "
              f"{error:.3g} (output max {scale:.3g}), {seconds} s", flush=True)
    return runs


def _coverage(args: argparse.Namespace, env: dict) -> dict:
    """`moe-tune coverage --format json` of the swept layer: each call's lookup source, counted."""
    command = ["coverage", "--model", args.model, "--tokens", str(args.tokens), "--ep", str(args.ep),
               "--direction", "fwd", "--dtype", "bfloat16", "--rhs-quant", "int8", "--format", "json"]
    done = subprocess.run([sys.executable, "-c", "from moe_tune.cli import cli; cli()", *command],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        return {"command": "moe-tune " + " ".join(command), "exit": done.returncode, "error": done.stderr[-2000:]}
    found = json.loads(done.stdout)
    sources: dict[str, int] = {}
    for call in found["calls"]:
        sources[call["source"]] = sources.get(call["source"], 0) + 1
    return {"command": "moe-tune " + " ".join(command), "exit": 0, "summary": found["summary"],
            "sources": sources, "not_exact": [c["call"] for c in found["calls"] if c["source"] != "exact"],
            "collectives": len(found["collectives"])}


def main() -> int:
    args = _args()
    flag = _devices_flag(args.ep)
    if flag not in os.environ.get("XLA_FLAGS", ""):
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    import jax

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=ROOT).stdout.strip()
    edits = subprocess.run(["git", "status", "--short", "--", "src/moe_tune/layer"], capture_output=True,
                           text=True, check=False, cwd=ROOT).stdout.splitlines()
    result = {"what": "sweep of a preset's layer across devices, then the sharded layer's lookups and its error "
                      "vs the one-device layer",
              "model": args.model, "tokens_per_device": args.tokens, "ep": args.ep, "dtype": "bfloat16",
              "rhs_quant": "int8", "jax": jax.__version__, "commit": commit,
              "layer_uncommitted": [line.strip() for line in edits if line.strip()],
              "machine": f"{platform.machine()} CPU, {len(os.sched_getaffinity(0))} cores",
              "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}"}
    with tempfile.TemporaryDirectory(prefix="moe-tune-trial-") as scratch:
        os.environ["MOE_TUNE_PROFILE_DIR"] = scratch
        result["sweep"] = _sweep(args, dict(os.environ))
        print(json.dumps(result["sweep"], indent=1), flush=True)
        result["coverage"] = _coverage(args, dict(os.environ))
        result["layer"] = _layer(args)
    # the scratch dir is gone: name it as what it was
    text = json.dumps(result, indent=1).replace(scratch, "$MOE_TUNE_PROFILE_DIR")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(f"sweep {result['sweep']['wall_s']} s (exit {result['sweep']['exit']}); coverage: "
          f"{result['coverage'].get('sources')}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
