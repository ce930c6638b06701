"""Side-by-side timing of one ragged_dot problem: tuned vs default config of a backend vs XLA's ragged dot
vs a dense matmul of the same FLOPs, all compiled once and timed interleaved in the same trace rounds."""

from __future__ import annotations

from typing import Any

import jax

from moe_tune import devices
from moe_tune.kernels import get_op
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.tuner.timing import time_candidates, traceable

# A dense matmul with the FLOPs of each direction: [m,k]x[k,n], [m,n]x[n,k], [k,m]x[m,n].
DENSE = {
    "fwd": lambda a, b: a @ b[0],
    "dlhs": lambda a, b: a @ b[0].T,
    "drhs": lambda a, b: a.T @ b,
}


def compare(problem: RaggedDotProblem, backend: str, tuned: KernelConfig, *, samples: int = 7,
            seed: int = 1) -> dict[str, Any]:
    """Times (s), spreads and ratios of: `backend` tuned, `backend` default, xla, dense."""
    spec = get_op("ragged_dot")
    impl, xla = BACKENDS.get(backend), BACKENDS.get("xla")
    default = impl.default_config(problem)
    inputs = jax.device_put(spec.make_inputs(problem, "balanced", seed=seed))
    run = lambda b, config: lambda x: b.run(problem, config, x["a"], x["b"], x["group_sizes"])
    variants = {
        "tuned": run(impl, tuned),
        "default": run(impl, default),
        "xla": run(xla, xla.default_config(problem)),
        "dense": lambda x: DENSE[problem.direction](x["a"], x["b"]),
    }
    names = list(variants)
    compiled = {i: traceable(variants[name], i).lower(inputs).compile() for i, name in enumerate(names)}
    for c in compiled.values():
        jax.block_until_ready(c(inputs))
    timings, fallback = time_candidates({i: (lambda c=c: c(inputs)) for i, c in compiled.items()},
                                        samples=samples, platform=devices.platform())
    times = {name: timings[i].median_s for i, name in enumerate(names)}
    return {
        "backend": backend,
        "tuned_config": tuned.to_dict(),
        "default_config": default.to_dict(),
        "times_s": times,
        "spread": {name: timings[i].spread for i, name in enumerate(names)},
        "timing_method": timings[0].method,
        "timing_fallback": fallback,
        "tflops": {name: problem.flops / t / 1e12 for name, t in times.items()},
        "ratios": {
            "tuned_vs_dense": times["tuned"] / times["dense"],
            "default_vs_dense": times["default"] / times["dense"],
            "xla_vs_dense": times["xla"] / times["dense"],
            "xla_vs_tuned": times["xla"] / times["tuned"],
            "default_vs_tuned": times["default"] / times["tuned"],
        },
    }


def format_comparison(result: dict[str, Any]) -> list[str]:
    """Lines for a terminal: each variant's time, its ratio to dense, and the headline ratios."""
    t, r = result["times_s"], result["ratios"]
    lines = [f"  tuned config {result['tuned_config']}, default {result['default_config']}"]
    for name, seconds in t.items():
        lines.append(f"  {name:<8} {seconds * 1e3:10.3f} ms  {seconds / t['dense']:6.2f}x dense  "
                     f"{result['tflops'][name]:8.3f} TFLOP/s  (spread {result['spread'][name]:.0%})")
    same = " (the same config: any difference is noise)" if result["tuned_config"] == result["default_config"] else ""
    lines.append(f"  time ratios: default/tuned {r['default_vs_tuned']:.2f}{same}, xla/tuned {r['xla_vs_tuned']:.2f}, "
                 f"tuned/dense {r['tuned_vs_dense']:.2f}")
    return lines
