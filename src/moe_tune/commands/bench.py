"""Side-by-side timing of one problem: every variant compiled once and timed interleaved in the same trace
rounds (`time_variants`).

- ragged_dot (`compare` -> `RaggedDotComparison`): tuned vs default config of a backend vs XLA's ragged dot
  vs a dense matmul of the same FLOPs.
- dispatch / combine (`compare_gather` -> `GatherComparison`): tuned vs default config vs the plain-JAX
  fallback vs a copy of the same bytes (this machine's copy bandwidth, measured in the same rounds).
- the fused-or-not choice of a layer (`compare_fusion` -> `FusionComparison`): `moe_mlp` fused and unfused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from moe_tune.core import devices, distributions
from moe_tune.kernels import get_op
from moe_tune.kernels.base import KernelConfig
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.kernels.gather.registry import FALLBACK
from moe_tune.kernels.ragged_dot import BACKENDS, RaggedDotProblem
from moe_tune.profiles import evidence
from moe_tune.core.quant import as_float
from moe_tune.tuner.memory import check_fits
from moe_tune.tuner.timing import time_candidates, traceable

# A dense matmul with the FLOPs of each direction: [m,k]x[k,n], [m,n]x[n,k], [k,m]x[m,n].
DENSE = {
    "fwd": lambda a, b: a @ b[0],
    "dlhs": lambda a, b: a @ b[0].T,
    "drhs": lambda a, b: a.T @ b,
}


def write_results(path: str, results: list[dict[str, Any]]) -> None:
    """A benchmark's results as JSON, with what they were measured on and when."""
    meta = {"device_kind": devices.device_kind(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """Times (s) of one problem's variants, measured interleaved in the same trace rounds, and their ratios.

    `baseline` names the variant the CLI compares the tuned config with (its `<baseline>_vs_tuned` ratio);
    The lookup's source and reason are set by `bench_case`."""

    baseline: ClassVar[str]
    backend: str
    tuned_config: dict[str, Any]
    default_config: dict[str, Any]
    times_s: dict[str, float]
    spread: dict[str, float]
    timing_method: str
    timing_fallback: str | None
    copy_gbps: float  # this machine's copy bandwidth, measured in the same rounds
    roofline_s: float
    ratios: dict[str, float]
    op: str = ""
    shape: dict[str, Any] | None = None
    lookup_source: str | None = None
    lookup_reason: str | None = None
    lookup_marks: tuple[str, ...] = ()  # the entry's marks (`profiles.evidence.marks`): unverified, low budget...

    def to_dict(self) -> dict[str, Any]:
        """As the benchmarks' JSON holds it."""
        return dataclasses.asdict(self)

    def notes(self) -> list[str]:
        """What a reader should know, with the next step: the tuned config is the default (a difference
        between them is noise), the baseline beats the tuned kernel, the entry is marked."""
        found = []
        if self.tuned_config == self.default_config:
            found.append("tuned = default: the same config, any difference is noise")
        ratio = self.ratios.get(f"{self.baseline}_vs_tuned")
        if ratio is not None and ratio < 1:
            sweep = ("tune this shape (`moe-tune sweep`)" if self.lookup_source == "default" else
                     "sweep it with a larger budget (`moe-tune sweep --fresh`, no --max-candidates)")
            found.append(f"{self.baseline} is {1 / ratio:.2f}x faster than the tuned kernel: "
                         f"{self.baseline_advice()}, or {sweep}")
        if self.lookup_marks:
            found.append(f"entry {', '.join(self.lookup_marks)}: sweep it again with --fresh and a larger budget")
        return found

    def baseline_advice(self) -> str:
        """How to run the baseline instead, when it is faster."""
        raise NotImplementedError

    def vs_baseline(self) -> str:
        return f"{self.baseline}/tuned {self.ratios[f'{self.baseline}_vs_tuned']:.2f}"

    def reference(self) -> str:
        """What else bounds the tuned time, in words (the CLI's `reference` column)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedDotComparison(Comparison):
    """ragged_dot: tuned, default, xla, dense (a matmul of the same FLOPs), skewed (tuned, skewed group sizes),
    copy. `roofline_s` = max(dense time, the least bytes moved at the copy bandwidth)."""

    baseline: ClassVar[str] = "xla"
    tflops: dict[str, float]
    min_bytes: int
    roofline_bound: str  # "compute" or "memory"

    def baseline_advice(self) -> str:
        return "pass backend='xla' for this shape"

    def reference(self) -> str:
        return (f"roofline {self.roofline_s * 1e3:.3f} ms, {self.roofline_bound}-bound (tuned/roofline "
                f"{self.ratios['tuned_vs_roofline']:.2f}); dense {self.times_s['dense'] * 1e3:.3f} ms")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherComparison(Comparison):
    """Dispatch / combine: tuned, default, the plain-JAX fallback, copy, output_write. `roofline_s` = the op's
    least bytes moved at the copy bandwidth."""

    baseline: ClassVar[str] = "fallback"
    valid_fraction: float
    least_bytes: int

    def baseline_advice(self) -> str:
        flag = "ragged_gather_fallback" if self.op == "ragged_gather" else "ragged_gather_reduce_fallback"
        return f"pass {flag}=True for this shape (or set MOE_TUNE_{flag.upper()}=1 for a whole run)"

    def reference(self) -> str:
        return (f"copy roofline {self.roofline_s * 1e3:.3f} ms ({self.copy_gbps:.1f} GB/s); output write "
                f"{self.times_s['output_write'] * 1e3:.3f} ms")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusionComparison(Comparison):
    """`moe_fusion`: one `moe_mlp` layer with its experts fused and unfused, side by side (times `fused` and
    `unfused`; `tuned` is the looked-up choice's, `default` the heuristic one's). No roofline: copy_gbps and
    roofline_s are 0."""

    baseline: ClassVar[str] = "unfused"

    def baseline_advice(self) -> str:
        return "pass fused=False to moe_mlp for this shape"

    def reference(self) -> str:
        return (f"fused {self.times_s['fused'] * 1e3:.3f} ms, unfused {self.times_s['unfused'] * 1e3:.3f} ms "
                f"(unfused/fused {self.ratios['unfused_vs_fused']:.2f})")


def compare_fusion(problem: Any, tuned: KernelConfig, *, samples: int = 7, distribution: str = distributions.DEFAULT,
                   seed: int = 1) -> FusionComparison:
    """The layer fused and unfused (each with its kernels' looked-up configs), timed interleaved."""
    kernel_op = get_op("moe_fusion")
    impl = kernel_op.backends.get("layer")
    default = impl.default_config(problem)
    inputs = jax.device_put(kernel_op.make_inputs(problem, distribution, seed))
    paths = {"fused": True, "unfused": False}
    timed = time_variants({name: (lambda a, fused=fused: kernel_op.run(impl, impl.config_cls(fused=fused), problem, a))
                           for name, fused in paths.items()}, inputs, samples=samples)
    times, spread = dict(timed["times_s"]), dict(timed["spread"])
    for label, config in (("tuned", tuned), ("default", default)):
        path = "fused" if config.fused else "unfused"
        times[label], spread[label] = times[path], spread[path]
    ratios = {"unfused_vs_tuned": times["unfused"] / times["tuned"], "default_vs_tuned": times["default"] / times["tuned"],
              "unfused_vs_fused": times["unfused"] / times["fused"]}
    return FusionComparison(backend=impl.name, tuned_config=tuned.to_dict(), default_config=default.to_dict(),
                            times_s=times, spread=spread, timing_method=timed["timing_method"],
                            timing_fallback=timed["timing_fallback"], copy_gbps=0.0, roofline_s=0.0, ratios=ratios,
                            op="moe_fusion", shape=problem.key_fields())


def time_variants(variants: Mapping[str, Callable[[Any], Any]], inputs: Any, *, samples: int = 7) -> dict[str, Any]:
    """Compile each `fn(inputs)` once, then time them all interleaved: times_s (medians), spread,
    timing_method, timing_fallback."""
    names = list(variants)
    compiled = {i: traceable(variants[name], i).lower(inputs).compile() for i, name in enumerate(names)}
    for c in compiled.values():
        jax.block_until_ready(c(inputs))
    timings, fallback = time_candidates({i: (lambda c=c: c(inputs)) for i, c in compiled.items()},
                                        samples=samples, platform=devices.platform(), warmup=0)
    return {
        "times_s": {name: timings[i].median_s for i, name in enumerate(names)},
        "spread": {name: timings[i].spread for i, name in enumerate(names)},
        "timing_method": timings[0].method,
        "timing_fallback": fallback,
    }


def compare(problem: RaggedDotProblem, backend: str, tuned: KernelConfig, *, samples: int = 7,
            distribution: str = distributions.DEFAULT, seed: int = 1) -> RaggedDotComparison:
    """`backend` tuned vs its default vs xla vs dense (a matmul of the same FLOPs), on group sizes drawn from
    `distribution`, vs `skewed` (tuned, on the same operands with skewed group sizes) vs `copy` (an
    elementwise copy of an array of the problem's largest operand's size: read + written bytes over its time
    are the copy bandwidth)."""
    kernel_op = get_op("ragged_dot")
    impl, xla = BACKENDS.get(backend), BACKENDS.get("xla")
    default = impl.default_config(problem)
    host = kernel_op.make_inputs(problem, distribution, seed=seed)
    host["skewed_sizes"] = distributions.group_sizes("skewed", problem.m, problem.num_group_sizes, seed)
    largest = max(problem.m * problem.k, problem.m * problem.n, problem.groups * problem.k * problem.n)
    inputs = jax.device_put(host)
    inputs["copy_source"] = jnp.ones((largest,), jnp.float32)
    run = lambda b, config, sizes="group_sizes": lambda x: b.run(problem, config, x["a"], x["b"], x[sizes])
    measured = time_variants({
        "tuned": run(impl, tuned),
        "default": run(impl, default),
        "xla": run(xla, xla.default_config(problem)),
        "dense": lambda x: DENSE[problem.direction](*map(as_float, (x["a"], x["b"]))),  # quantized: dequantized
        "skewed": run(impl, tuned, "skewed_sizes"),
        "copy": lambda x: x["copy_source"] + 1,  # not x * 1 or x + 0, which XLA may fold to no copy
    }, inputs, samples=samples)
    times = measured["times_s"]
    bandwidth = 2 * 4 * largest / times["copy"]
    roofline = max(times["dense"], problem.min_bytes / bandwidth)
    return RaggedDotComparison(
        op="ragged_dot", shape=problem.key_fields(), backend=backend, tuned_config=tuned.to_dict(),
        default_config=default.to_dict(),
        **measured,
        tflops={name: problem.flops / t / 1e12 for name, t in times.items() if name != "copy"},
        copy_gbps=bandwidth / 1e9, min_bytes=problem.min_bytes, roofline_s=roofline,
        roofline_bound="compute" if roofline == times["dense"] else "memory",
        ratios={
            "tuned_vs_roofline": times["tuned"] / roofline,
            "tuned_vs_dense": times["tuned"] / times["dense"],
            "default_vs_dense": times["default"] / times["dense"],
            "xla_vs_dense": times["xla"] / times["dense"],
            "xla_vs_tuned": times["xla"] / times["tuned"],
            "default_vs_tuned": times["default"] / times["tuned"],
            "skewed_vs_balanced": times["skewed"] / times["tuned"],
        },
    )


def format_comparison(result: RaggedDotComparison) -> list[str]:
    """Lines for a terminal: each variant's time, its ratio to dense, and the headline ratios."""
    t, r = result.times_s, result.ratios
    lines = [f"  tuned config {result.tuned_config}, default {result.default_config}"]
    for name, seconds in t.items():
        tflops = result.tflops.get(name)
        rate = f"{tflops:8.3f} TFLOP/s" if tflops is not None else f"{result.copy_gbps:8.1f} GB/s  "
        lines.append(f"  {name:<8} {seconds * 1e3:10.3f} ms  {seconds / t['dense']:6.2f}x dense  {rate}  "
                     f"(spread {result.spread[name]:.0%})")
    same = " (the same config: any difference is noise)" if result.tuned_config == result.default_config else ""
    lines.append(f"  roofline {result.roofline_s * 1e3:.3f} ms ({result.roofline_bound}-bound; "
                 f"{result.min_bytes / 2**20:.0f} MiB at least at {result.copy_gbps:.1f} GB/s)")
    lines.append(f"  time ratios: tuned/roofline {r['tuned_vs_roofline']:.2f}, "
                 f"default/tuned {r['default_vs_tuned']:.2f}{same}, xla/tuned {r['xla_vs_tuned']:.2f}, "
                 f"tuned/dense {r['tuned_vs_dense']:.2f}, skewed/balanced {r['skewed_vs_balanced']:.2f}")
    return lines


def compare_gather(op: str, problem: GatherProblem, backend: str, tuned: KernelConfig, *, samples: int = 7,
                   distribution: str = distributions.DEFAULT, seed: int = 1) -> GatherComparison:
    """`backend` tuned vs its default vs the plain-JAX fallback vs `copy`: a jitted elementwise copy of one
    array, whose bytes read + written give the copy bandwidth. The copied array has the size of the op's
    larger side ([rows, hidden]: dispatch's output, combine's input), so that it streams from memory as the
    op does rather than from cache. `output_write` fills a fresh array of the output's shape with a
    constant: no kernel can return its output faster, whatever the valid fraction."""
    kernel_op = get_op(op)
    impl, plain = kernel_op.backends.get(backend), kernel_op.backends.get(FALLBACK)
    default = impl.default_config(problem)
    host = kernel_op.make_inputs(problem, distribution, seed)
    valid_fraction = kernel_op.distribution_record(problem, distribution, seed, host)["valid_fraction"]
    inputs = jax.device_put(host)
    inputs["copy_source"] = jnp.ones((problem.rows, problem.hidden), problem.dtype)
    inputs["fill"] = jnp.zeros((), problem.dtype)  # an input, so that XLA cannot fold the fill to a constant
    output_shape = (kernel_op.output_rows(problem), problem.hidden)
    run = lambda b, config: lambda x: kernel_op.run(b, config, problem, x)
    measured = time_variants({
        "tuned": run(impl, tuned),
        "default": run(impl, default),
        "fallback": run(plain, plain.default_config(problem)),
        "copy": lambda x: x["copy_source"] + 1,  # not x * 1 or x + 0, which XLA may fold to no copy
        "output_write": lambda x: jnp.full(output_shape, x["fill"]),
    }, inputs, samples=samples)
    times = measured["times_s"]
    bandwidth = 2 * problem.rows * problem.row_bytes() / times["copy"]
    least_bytes = kernel_op.bytes_moved(problem, valid_fraction)
    return GatherComparison(
        op=op, shape=problem.key_fields(), backend=backend, valid_fraction=valid_fraction, tuned_config=tuned.to_dict(),
        default_config=default.to_dict(), **measured, copy_gbps=bandwidth / 1e9, least_bytes=least_bytes,
        roofline_s=least_bytes / bandwidth,
        ratios={
            "fallback_vs_tuned": times["fallback"] / times["tuned"],
            "default_vs_tuned": times["default"] / times["tuned"],
            "tuned_vs_roofline": times["tuned"] * bandwidth / least_bytes,
            "tuned_vs_output_write": times["tuned"] / times["output_write"],
        },
    )


def bench_case(op: str, problem: Any, *, backend: str | None = None, samples: int = 7,
               distribution: str | None = None) -> Comparison:
    """What `moe-tune bench` measures for one problem: the config the runtime would use for `distribution`'s
    routing (the tables' exact or nearest entry, else the default; `lookup_source` says which) against the
    default and the baselines, on inputs routed by it (default: `distributions.DEFAULT`). A problem that
    cannot fit in memory is refused first (UsageError)."""
    kernel_op = get_op(op)
    check_fits(kernel_op, problem)
    distribution = distribution or distributions.DEFAULT
    found = kernel_op.lookup(problem, backend=backend, distribution=distribution)
    if isinstance(problem, RaggedDotProblem):
        result = compare(problem, found.backend, found.config, samples=samples, distribution=distribution)
    elif op == "moe_fusion":
        result = compare_fusion(problem, found.config, samples=samples, distribution=distribution)
    else:
        result = compare_gather(op, problem, found.backend, found.config, samples=samples, distribution=distribution)
    marks = tuple(evidence.marks(found.entry)) if found.entry is not None else ()
    return dataclasses.replace(result, lookup_source=found.source, lookup_reason=found.reason, lookup_marks=marks)


def load_file_module(path: str, name: str):
    """A module loaded from a source file under its own `name` (e.g. an older copy of a kernel module that a
    benchmark times against the installed one). Registered in sys.modules: its dataclasses look it up."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
