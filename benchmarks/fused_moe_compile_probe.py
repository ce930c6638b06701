"""The fused MoE Pallas backends' budget rules held to the real compilers (FINDINGS.md: fused kernel rules vs
compilers): pallas_tpu for a TPU v5e
(scoped VMEM), triton for an H100 (shared memory).

    PYTHONPATH=src .venv/bin/python benchmarks/fused_moe_compile_probe.py [--per 2] [--label float]
        [--quant int8 | --quant fp8] [--backends pallas_tpu,triton] [--dtypes bfloat16,float32]

For one Qwen3-30B-A3B layer (hidden 2048, expert width 768, 128 experts, top-8) at 512 and 4096 tokens, in
bfloat16 and float32 (with `--quant`: bfloat16 activations at 512 tokens, int8 weights per channel or
float8_e4m3fn weights in 128-row blocks), for each of the four fused directions (dispatch / combine, fwd / bwd) it compiles the
default config, the `--per` configs the rules keep with the largest budget estimate (nearest the limit), and
the `--per` configs the rules refuse only for the budget with the smallest estimate (nearest kept). The grid
is the backend's `candidate_values` widened to tm 1024 (pallas_tpu) and 5 pipeline stages (triton).

- false accept: the rules keep it, the compiler rejects it;
- false reject: the rules refuse it, the compiler takes it.

Writes benchmarks/results/fused_moe_compile_cpu_2core_<date>_<label>.{json,txt}. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from tabulate import tabulate

from moe_tune.kernels import get_op
from moe_tune.kernels.fused_moe import pallas_tpu
from moe_tune.kernels.fused_moe.problem import FusedMoeProblem
from moe_tune.targets import get_target
from moe_tune.targets.compile import acting_as
from moe_tune.targets.jobs import CompileJob, CompilePool

RESULTS = Path(__file__).parent / "results"
BUDGET_WORDS = {"pallas_tpu": "VMEM", "triton": "shared memory"}


QUANT = {None: {}, "int8": {"rhs_qdtype": "int8"}, "fp8": {"rhs_qdtype": "float8_e4m3fn", "rhs_qblock": 128}}


def problems(tokens: int, dtype: str, quant: str | None = None) -> list[FusedMoeProblem]:
    out = []
    for stage in ("dispatch", "combine"):
        shape = dict(k=2048, n=1536, glu="silu") if stage == "dispatch" else dict(k=768, n=2048)
        for direction in ("fwd", "bwd"):
            out.append(FusedMoeProblem(tokens=tokens, m=8 * tokens, groups=128, dtype=dtype, stage=stage,
                                       direction=direction, **shape, **QUANT[quant]))
    return out


def estimate(backend, config, problem) -> int:
    if backend.name == "pallas_tpu":
        return pallas_tpu.vmem_bytes(config, problem)
    return backend.shared_memory_bytes(config, problem)


def pick(backend, problem, per: int) -> list:
    values = dict(backend.candidate_values(problem))
    if backend.name == "pallas_tpu":
        values["tm"] = sorted({*values["tm"], 1024})
    else:
        values["num_stages"] = [2, 3, 4, 5]
    grid = [backend.config_cls(**dict(zip(values, combo))) for combo in itertools.product(*values.values())]
    kept = sorted((c for c in grid if backend.config_error(c, problem) is None), key=lambda c: estimate(backend, c, problem))
    over = sorted((c for c in grid if BUDGET_WORDS[backend.name] in (backend.config_error(c, problem) or "")),
                  key=lambda c: estimate(backend, c, problem))
    return list(dict.fromkeys([backend.default_config(problem), *kept[-per:], *over[:per]]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per", type=int, default=2)
    parser.add_argument("--label", default="float")
    parser.add_argument("--quant", choices=["int8", "fp8"], default=None)
    parser.add_argument("--backends", default="pallas_tpu,triton", help="comma-separated subset")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated subset (float runs)")
    args = parser.parse_args()
    op = get_op("fused_moe")
    jobs, meta = [], []
    for name, target_name in (("pallas_tpu", "v5e"), ("triton", "h100")):
        if name not in args.backends.split(","):
            continue
        target, backend = get_target(target_name), op.backends.get(name)
        with acting_as(target):
            cases = [(512, "bfloat16")] if args.quant else itertools.product((512, 4096), args.dtypes.split(","))
            for tokens, dtype in cases:
                for problem in problems(tokens, dtype, args.quant):
                    for config in pick(backend, problem, args.per):
                        jobs.append(CompileJob(target_name, "fused_moe", name, problem, config))
                        meta.append((backend.config_error(config, problem), estimate(backend, config, problem)))
    start = time.time()
    with CompilePool(workers=1, timeout=300) as pool:
        results = pool.compile(jobs)
    rows, records = [], []
    for job, (rule, est), result in zip(jobs, meta, results):
        verdict = "false accept" if rule is None and not result.ok else "false reject" if rule and result.ok else ""
        p = job.problem
        dtype = p.dtype + (f"/{p.rhs_qdtype}" if p.rhs_qdtype else "")
        rows.append([job.target, job.backend, p.tokens, dtype, f"{p.stage} {p.direction}", job.config.label(),
                     f"{est / 2**20:.2f}", "keep" if rule is None else "refuse", result.status,
                     result.message[:70], verdict])
        records.append({"target": job.target, "backend": job.backend, "problem": p.key_fields(),
                        "config": job.config.to_dict(), "estimate_bytes": est, "rule": rule,
                        "result": result.to_dict(), "verdict": verdict})
    header = ["target", "backend", "tokens", "dtype", "direction", "config", "est MiB", "rules", "compiler",
              "message", "verdict"]
    summary = {v: sum(r["verdict"] == v for r in records) for v in ("false accept", "false reject")}
    text = (tabulate(rows, header) + f"\n\n{len(records)} compiles in {time.time() - start:.0f} s; "
            f"false accepts: {summary['false accept']}, false rejects: {summary['false reject']}\n")
    print(text)
    stem = RESULTS / f"fused_moe_compile_cpu_2core_{time.strftime('%Y-%m-%d')}_{args.label}"
    stem.with_suffix(".txt").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"summary": summary, "records": records}, indent=1))


if __name__ == "__main__":
    main()
