"""Side-by-side timing of one problem: every variant compiled once and timed interleaved in the same trace
rounds (`time_variants`).

`compare_kernel` times a backend's tuned config against its default and the op's baselines
(`KernelOp.bench_plan`: e.g. XLA's ragged dot and a dense matmul of the same FLOPs, the plain-JAX gather, the
layer fused and unfused), with a copy of the op's bytes where it has a memory roofline; `bench_case` is what
`moe-tune bench` measures for one problem, `model_cases` the problems of a model's layer it benches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moe_tune.core import devices, distributions
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op, op_names
from moe_tune.kernels.base import KernelConfig
from moe_tune.layer import models
from moe_tune.profiles.entry import entry_key
from moe_tune.profiles.verdict import marks
from moe_tune.tuner.request import check_fits
from moe_tune.tuner.timing import time_candidates, traceable


def write_results(path: str, results: list[dict[str, Any]]) -> None:
    """A benchmark's results as JSON, with what they were measured on and when."""
    meta = {"device_kind": devices.device_kind(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """Times (s) of one problem's variants, measured interleaved in the same trace rounds, and their ratios.

    `baseline` names the variant the CLI compares the tuned config with (its `<baseline>_vs_tuned` ratio),
    `advice` how to run it instead; `roofline_s` is the larger of the compute bound (a variant's time) and the
    least bytes moved at the copy bandwidth (0: none), `roofline_bound` which; `shown` the variants the
    reference column names. The lookup's source and reason are set by `bench_case`."""

    backend: str
    tuned_config: dict[str, Any]
    default_config: dict[str, Any]
    times_s: dict[str, float]
    spread: dict[str, float]
    timing_method: str
    timing_fallback: str | None
    copy_gbps: float  # this machine's copy bandwidth, measured in the same rounds (0: not measured)
    roofline_s: float
    ratios: dict[str, float]
    baseline: str = "fallback"
    advice: str = ""
    roofline_bound: str | None = None  # "compute" or "memory"
    tflops: dict[str, float] = dataclasses.field(default_factory=dict)
    shown: tuple[str, ...] = ()
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    op: str = ""
    shape: dict[str, Any] | None = None
    lookup_source: str | None = None
    lookup_reason: str | None = None
    lookup_marks: tuple[str, ...] = ()  # the entry's marks (`profiles.verdict.marks`): unverified, low budget...

    def to_dict(self) -> dict[str, Any]:
        """As the benchmarks' JSON holds it: the plan's details (the valid fraction, ...) beside the fields."""
        fields = dataclasses.asdict(self)
        details = fields.pop("details")
        return {**fields, **details}

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
                         f"{self.advice}, or {sweep}")
        if self.lookup_marks:
            found.append(f"entry {', '.join(self.lookup_marks)}: sweep it again with --fresh and a larger budget")
        return found

    def vs_baseline(self) -> str:
        return f"{self.baseline}/tuned {self.ratios[f'{self.baseline}_vs_tuned']:.2f}"

    def reference(self) -> str:
        """What else bounds the tuned time, in words (the CLI's `reference` column)."""
        parts = []
        if self.roofline_s:
            parts.append(f"roofline {self.roofline_s * 1e3:.3f} ms, {self.roofline_bound}-bound (tuned/roofline "
                         f"{self.ratios['tuned_vs_roofline']:.2f}; copy {self.copy_gbps:.1f} GB/s)")
        parts += [f"{name} {self.times_s[name] * 1e3:.3f} ms" for name in self.shown]
        return "; ".join(parts) or "-"


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


def compare_kernel(op: str, problem: Any, backend: str, tuned: KernelConfig, *, samples: int = 7,
                   distribution: str = distributions.DEFAULT, seed: int = 1) -> Comparison:
    """`backend` of `op` with `tuned` vs its default config vs the op's baselines (`KernelOp.bench_plan`), on
    inputs routed by `distribution`, and `copy` (an elementwise copy of the plan's bytes: read + written bytes
    over its time are the copy bandwidth) where the plan has a memory roofline."""
    kernel_op = get_op(op)
    impl = kernel_op.backends.get(backend)
    default = impl.default_config(problem)
    host = kernel_op.make_inputs(problem, distribution, seed)
    plan = kernel_op.bench_plan(problem, impl, tuned, host, distribution=distribution, seed=seed)
    inputs = jax.device_put({**host, **plan.inputs})
    run = lambda config: lambda x: kernel_op.run(impl, config, problem, x)
    variants = {"tuned": run(tuned), "default": run(default), **plan.variants}
    if plan.copy_bytes:
        inputs["copy_source"] = jnp.ones((plan.copy_bytes // 4,), jnp.float32)
        variants["copy"] = lambda x: x["copy_source"] + 1  # not x * 1 or x + 0, which XLA may fold to no copy
    measured = time_variants({name: fn for name, fn in variants.items() if name not in plan.same_as}, inputs,
                             samples=samples)
    times, spread = measured["times_s"], measured["spread"]
    for name, same in plan.same_as.items():  # timed once, as the variant that runs it
        times[name], spread[name] = times[same], spread[same]
    times = {name: times[name] for name in variants}
    bandwidth = 2 * (plan.copy_bytes // 4) * 4 / times["copy"] if plan.copy_bytes else 0.0
    compute = times[plan.compute_bound] if plan.compute_bound else 0.0
    roofline = max(compute, plan.least_bytes / bandwidth if plan.least_bytes and bandwidth else 0.0)
    bound = None if not roofline else "compute" if roofline == compute else "memory"
    ratios = {f"{name}_vs_tuned": times[name] / times["tuned"] for name in ("default", plan.baseline)}
    if roofline:
        ratios["tuned_vs_roofline"] = times["tuned"] / roofline
    ratios.update({name: times[a] / times[b] for name, (a, b) in plan.ratios.items()})
    flops = kernel_op.flops(problem)
    return Comparison(
        op=op, shape=problem.key_fields(), backend=impl.name, tuned_config=tuned.to_dict(),
        default_config=default.to_dict(), times_s=times, spread={name: spread[name] for name in times},
        timing_method=measured["timing_method"], timing_fallback=measured["timing_fallback"],
        copy_gbps=bandwidth / 1e9, roofline_s=roofline, roofline_bound=bound, ratios=ratios,
        baseline=plan.baseline, advice=plan.advice, shown=tuple(plan.shown), details=dict(plan.details),
        tflops={name: flops / t / 1e12 for name, t in times.items() if name != "copy"} if flops else {})


def _op_of(problem: Any) -> str:
    """The op whose problem class `problem` is (UsageError where several ops share it: name the op)."""
    found = [name for name in op_names() if isinstance(problem, get_op(name).problem_class)]
    if len(found) != 1:
        raise UsageError(f"a {type(problem).__name__} is a problem of {', '.join(found) or 'no op'}: name the op "
                         "(compare_kernel)")
    return found[0]


def compare(problem: Any, backend: str, tuned: KernelConfig, **options: Any) -> Comparison:
    """`compare_kernel` for the op of `problem`'s class (one op's: e.g. a ragged dot's)."""
    return compare_kernel(_op_of(problem), problem, backend, tuned, **options)


def compare_gather(op: str, problem: Any, backend: str, tuned: KernelConfig, **options: Any) -> Comparison:
    """`compare_kernel`, the op named first (the gathers share their problem class)."""
    return compare_kernel(op, problem, backend, tuned, **options)


def format_comparison(result: Comparison) -> list[str]:
    """Lines for a terminal: each variant's time, its ratio to the baseline, its rate, and the headline ratios."""
    t, r = result.times_s, result.ratios
    lines = [f"  tuned config {result.tuned_config}, default {result.default_config}"]
    for name, seconds in t.items():
        tflops = result.tflops.get(name)
        rate = (f"{tflops:8.3f} TFLOP/s" if tflops is not None else f"{result.copy_gbps:8.1f} GB/s  "
                if name == "copy" else "")
        lines.append(f"  {name:<12} {seconds * 1e3:10.3f} ms  {seconds / t[result.baseline]:6.2f}x "
                     f"{result.baseline}  {rate}  (spread {result.spread[name]:.0%})")
    same = " (the same config: any difference is noise)" if result.tuned_config == result.default_config else ""
    if result.roofline_s:
        lines.append(f"  roofline {result.roofline_s * 1e3:.3f} ms ({result.roofline_bound}-bound; "
                     f"copy {result.copy_gbps:.1f} GB/s)")
    lines.append("  time ratios: " + ", ".join(f"{name.replace('_vs_', '/')} {value:.2f}" for name, value in r.items())
                 + same)
    return lines


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
    result = compare_kernel(op, problem, found.backend, found.config, samples=samples, distribution=distribution)
    entry_marks = tuple(marks(found.entry)) if found.entry is not None else ()
    return dataclasses.replace(result, lookup_source=found.source, lookup_reason=found.reason, lookup_marks=entry_marks)


def model_cases(model: str, tokens: int | list[int] | None, *, ep: int | None = None, dtype: str | None = None,
                quant: Mapping[str, Any] | None = None, op: str | None = None,
                direction: str | None = None) -> list[tuple[str, Any]]:
    """(op, problem) of every kernel call one layer of `model` looks up at each of `tokens` (`models.layer_cases`:
    serving's with `direction` fwd, training's with all, the default; at `ep` > 1 the layer across that many
    devices, `tokens` per device of the expert axis), once per table key; with `op` that op's alone (UsageError
    when the layer runs none)."""
    preset = models.get_preset(model)
    runs = direction or models.LAYER_DEFAULTS["direction"]
    cases = {}
    for _, case in models.layer_cases(preset, tokens, ep=ep, dtype=dtype, quant=quant, direction=runs):
        if op is None or case.op == op:
            cases.setdefault(entry_key(case.op, case.problem, "-", "-"), (case.op, case.problem))
    if not cases:
        raise UsageError(f"the layer of {model} runs no {op} kernel (see `moe-tune models {model}`)")
    return list(cases.values())


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
