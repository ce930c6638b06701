"""A speed proxy for quantized expert weights on a GPU, from the compiled program alone: the triton ragged_dot
forward compiled for an H100 on this CPU-only machine (`moe_tune.targets`' compile-only CUDA plugin), and the
instruction mix of each kernel's k loop read from the PTX the compiler produced (`targets.ptx_mix`).

    PYTHONPATH=src .venv/bin/python benchmarks/gpu_quant_proxy.py [--max-candidates 8] [--seed 0] [--chip h100]
        [--formats bf16,int8,fp8/128,int4/128,mxfp4] [--workers 1] [--label L]

Beside triton, the `mosaic_gpu_quant` backend (Mosaic GPU, weights dequantized in registers into wgmma's
register operand, swap-AB) compiles its default and a seeded sample of its space for every format it serves
(`--backends`); a format it refuses is one row with its reason.

Why (FINDINGS.md: H100 4-bit weights, mxfp4 block_k 32): on a real H100 the tuned triton kernel took 1.11x
(int8), 2.20x (int4/128) and 3.55x (mxfp4) the bf16 kernel's time at m 4096, k 7168, n 2048, 32 groups.
For bf16, int8 (one scale per channel), fp8/128, int4/128 and mxfp4 weights (bf16 activations, bf16 out) at
m 4096 and m 256 (k 7168, n 2048, 32 groups, forward), the configs the tuner would try: the default and a
seeded sample of the backend's search space as the chip's rules prune it (`jobs.sample`, as
`--max-candidates` does), plus, for a format whose rules refuse configs for losing the tensor cores, a sample
of those refused ones (`rule` says why; they are the evidence of that rule). Each compiled in a compile
worker that dumps XLA's output (`targets.ptx_dump`); per config: `wgmma` count of the k loop, its
conversion share (`dequant_share`), scalar float32 FMAs, global load widths, shared-memory stores
(`round_trip`). Nothing runs on a GPU and nothing is timed. Writes
results/gpu_quant_proxy_<chip>_compile_<date>[_<label>].{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot.mosaic_gpu_quant_kernel import KERNEL_ENTRY
from moe_tune.targets import get_target, wheels
from moe_tune.targets.compile import acting_as
from moe_tune.targets.jobs import CompileJob, config_error, sample, search_space
from moe_tune.targets.ptx_mix import loop_mixes

RESULTS = Path(__file__).parent / "results"
SHAPES = {"m4096": dict(m=4096, k=7168, n=2048, groups=32), "m256": dict(m=256, k=7168, n=2048, groups=32)}
FORMATS = {"bf16": {}, "int8": dict(rhs_quant="int8"), "fp8/128": dict(rhs_quant="float8_e4m3fn", quant_block=128),
           "int4/128": dict(rhs_quant="int4", quant_block=128), "mxfp4": dict(rhs_quant="mxfp4")}
# not in the default run: blocks of 32, which a step of 64 or 128 dequantizes in the kernel as mxfp4's
EXTRA_FORMATS = {"fp8/32": dict(rhs_quant="float8_e4m3fn", quant_block=32),
                 "int4/32": dict(rhs_quant="int4", quant_block=32)}
ALL_FORMATS = {**FORMATS, **EXTRA_FORMATS}
KERNEL = "moe_tune_gmm"  # the triton forward's pallas_call name: its .entry in the PTX
QUANT_BACKEND = "mosaic_gpu_quant"
KERNELS = {"triton": KERNEL, QUANT_BACKEND: KERNEL_ENTRY}  # backend -> the .entry of its kernel
TENSOR_CORE_RULE = "loses the tensor cores"  # the words of the triton rule that refuses such configs


def candidates(chip, problem, size: int | None, seed: int) -> list[tuple[object, str | None]]:
    """(config, rule) pairs: the tuner's sample (rule None; None: the whole space), then a sample of the
    configs the backend refuses for losing the tensor cores (rule: its reason), as many as their share of the
    grid, at least 2 (None: all)."""
    backend = get_op("ragged_dot").backends.get("triton")
    tried = [(c, None) for c in sample(search_space(chip, "ragged_dot", "triton", problem), size, seed)]
    values = backend.candidate_values(problem)
    grid = [backend.config_cls(**dict(zip(values, combo))) for combo in itertools.product(*values.values())]
    refused = [(c, e) for c in grid
               if (e := config_error(chip, "ragged_dot", "triton", c, problem)) and TENSOR_CORE_RULE in e]
    if refused:
        share = len(refused) if size is None else max(2, round(size * len(refused) / len(grid)))
        picked = random.Random(seed).sample(range(len(refused)), min(share, len(refused)))
        tried += [refused[i] for i in sorted(picked)]
    return tried


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chip", default="h100", choices=["h100", "h200", "a100", "b200"])
    parser.add_argument("--max-candidates", type=int, default=8, help="per format and shape (0: the whole space)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(ALL_FORMATS)}")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--label", default="")
    parser.add_argument("--backends", default=",".join(KERNELS), help=f"of {', '.join(KERNELS)}")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    shapes = {name: SHAPES[name] for name in args.shapes.split(",") if name in SHAPES}
    if unknown := [f for f in formats if f not in ALL_FORMATS]:
        sys.exit(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(ALL_FORMATS)}")
    if not shapes:
        sys.exit(f"no known shape in {args.shapes!r}; choose from {', '.join(SHAPES)}")
    size = args.max_candidates or None
    wheels.require("gpu")
    from moe_tune.targets.ptx_dump import PtxPool

    chip = get_target(args.chip)
    spec = get_op("ragged_dot")
    backends = [b for b in args.backends.split(",") if b in KERNELS]
    jobs, meta, refused = [], [], []
    for fmt, (shape_name, shape) in itertools.product(formats, shapes.items()):
        problem = spec.problem(**shape, **ALL_FORMATS[fmt], dtype="bfloat16")
        if "triton" in backends:
            for config, rule in candidates(chip, problem, size, args.seed):
                jobs.append(CompileJob(chip.name, "ragged_dot", "triton", problem, config))
                meta.append({"backend": "triton", "format": fmt, "shape": shape_name, "config": config.to_dict(),
                             "rule": rule})
        if QUANT_BACKEND in backends:
            with acting_as(chip):
                why = spec.backends.get(QUANT_BACKEND).chip_error(problem)
            if why is not None:
                refused.append({"backend": QUANT_BACKEND, "format": fmt, "shape": shape_name, "config": None,
                                "rule": why, "status": "refused", "message": why})
                continue
            for config in sample(search_space(chip, "ragged_dot", QUANT_BACKEND, problem), size, args.seed):
                jobs.append(CompileJob(chip.name, "ragged_dot", QUANT_BACKEND, problem, config))
                meta.append({"backend": QUANT_BACKEND, "format": fmt, "shape": shape_name,
                             "config": config.to_dict(), "rule": None})
    print(f"{len(jobs)} compiles for {chip.name} ({args.workers} worker(s))", flush=True)
    started = time.perf_counter()
    rows = []
    with PtxPool(args.workers) as pool:
        for row, (result, ptx) in zip(meta, pool.compile(jobs)):
            row.update(status=result.status, message=result.message, compile_s=round(result.compile_s, 2))
            mix = loop_mixes(ptx).get(KERNELS[row["backend"]]) if result.ok else None
            if mix is not None:
                row["mix"] = mix.to_dict()
            rows.append(row)
    rows += refused
    wall = time.perf_counter() - started
    date = time.strftime("%Y-%m-%d")
    label = f"_{args.label}" if args.label else ""
    stem = RESULTS / f"gpu_quant_proxy_{chip.name}_compile_{date}{label}"
    report = {"meta": {"chip": chip.name, "device_kind": chip.device_kind, "date": date, "wall_s": round(wall, 1),
                       "max_candidates": args.max_candidates, "seed": args.seed, "shapes": shapes,
                       "formats": {f: ALL_FORMATS[f] for f in formats}, "kernels": {b: KERNELS[b] for b in backends},
                       "command": "benchmarks/gpu_quant_proxy.py " + " ".join(sys.argv[1:])},
              "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"written to {stem}.{{json,md}} in {wall:.0f} s")


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "-"


def markdown(report: dict) -> str:
    """Per backend, format and shape: how many configs keep the tensor cores, then one line per config."""
    meta, rows = report["meta"], report["rows"]
    kernels = meta.get("kernels", {"triton": KERNEL})
    lines = [f"# ragged_dot fwd compiled for {meta['chip']}: the k loop's instruction mix", "",
             (f"`{meta['command']}` (compile-only, cpu, {meta['date']}, {meta['wall_s']} s). Static counts of one "
              f"k step (the k loop of {', '.join(f'`{k}` ({b})' for b, k in kernels.items())} in the PTX, "
              "`targets/ptx_mix.py`). `rule`: refused by the backend's rules (compiled as evidence of them; a "
              "format a backend does not serve at all is one row, not compiled)."), "",
             ("| backend | format | shape | configs (tuner's / refused) | compiled | with wgmma | with mma.sync | "
              "no MMA | round trip | dequant share | fma.f32 per step |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r.get("backend", "triton"), r["format"], r["shape"])
    for (backend, fmt, shape), group in itertools.groupby(rows, key=key):
        group = list(group)
        mixes = [r["mix"] for r in group if "mix" in r]
        tuner = sum(r["rule"] is None for r in group)
        share = [m["dequant_share"] for m in mixes]
        fma = [m["fma_f32"] for m in mixes]
        span = lambda v, f: f"{f(min(v))}-{f(max(v))}" if v else "-"
        if all(r["config"] is None for r in group):
            lines.append(f"| {backend} | {fmt} | {shape} | refused: {group[0]['rule']} | | | | | | | |")
            continue
        lines.append(f"| {backend} | {fmt} | {shape} | {tuner} / {len(group) - tuner} | {len(mixes)} | "
                     f"{sum(m['wgmma'] > 0 for m in mixes)} | {sum(m['mma_sync'] > 0 for m in mixes)} | "
                     f"{sum(m['tensor_core'] == 0 for m in mixes)} | {sum(m['round_trip'] for m in mixes)} | "
                     f"{span(share, lambda x: f'{x:.2f}')} | {span(fma, str)} |")
    lines += ["", "| backend | format | shape | block m x n x k | warps | stages | rule | status | wgmma | mma.sync | "
              "dequant share | fma.f32 | convert | int bit ops | global loads | st.shared | instructions |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, m = r["config"], r.get("mix")
        if c is None:
            continue  # a format the backend does not serve: its summary line says why
        # Mosaic GPU: one warpgroup (4 warps), max_concurrent_steps the pipeline's stages
        head = (f"| {r.get('backend', 'triton')} | {r['format']} | {r['shape']} | {c['block_m']} x {c['block_n']} x "
                f"{c['block_k']} | {c.get('num_warps', 4)} | {c.get('num_stages', c.get('max_concurrent_steps'))} | "
                f"{'refused' if r['rule'] else ''} | {r['status']} |")
        if m is None:
            lines.append(head + " | | | | | | | | |")
            continue
        convert = sum(m["convert"].values())
        lines.append(f"{head} {m['wgmma']} | {m['mma_sync']} | {m['dequant_share']:.2f} | {m['fma_f32']} | {convert} | "
                     f"{m['int_bits']} | {_counts(m['global_loads'])} | {_counts(m['shared_store_widths'])} | "
                     f"{m['instructions']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
