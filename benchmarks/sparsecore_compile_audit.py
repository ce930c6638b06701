"""The `sparsecore` gathers' rules held to libtpu: every config of the backend's grid (`candidate_values`), kept
or refused by `config_error`, compiled for compile-only v5p and v6e chips, at the problems of
tests/sparsecore_compile_cases.py (small shapes; qwen3-30b-a3b's dispatch, combines and combine gradient at 512
tokens), in float32 and bfloat16.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/sparsecore_compile_audit.py [--workers 2] [--out PATH]

- false accept: the rules keep it, the compiler rejects it (or dies compiling it);
- false reject: the rules refuse it, the compiler takes it.

Writes benchmarks/results/sparsecore_compile_audit_<date>.json and prints the table. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from sparsecore_compile_cases import BACKEND, TARGETS, grid, problems, split
from tabulate import tabulate

from moe_tune.targets.jobs import CompileJob, CompilePool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(__file__).parent / "results" / f"sparsecore_compile_audit_{datetime.date.today()}.json"
    cases, jobs = [], []
    for target in TARGETS:
        for label, op, problem in problems():
            kept, refused = split(target, op, problem, grid(op, problem))
            for config in kept + refused:
                cases.append({"target": target, "label": label, "op": op, "problem": problem.key_fields(),
                              "config": config.to_dict(), "kept": config in kept})
                jobs.append(CompileJob(target, op, BACKEND, problem, config))
    start = time.perf_counter()
    with CompilePool(workers=args.workers, timeout=600) as pool:
        results = pool.compile(jobs)
    for case, result in zip(cases, results):
        case.update(status=result.status, message=result.message, compile_s=round(result.compile_s, 3))
    rows = []
    for target in TARGETS:
        for op in sorted({c["op"] for c in cases}):
            mine = [c for c in cases if c["target"] == target and c["op"] == op]
            kept = [c for c in mine if c["kept"]]
            refused = [c for c in mine if not c["kept"]]
            rows.append({"target": target, "op": op, "compiled": len(mine), "kept": len(kept),
                         "kept_ok": sum(c["status"] == "ok" for c in kept),
                         "false_accepts": sum(c["status"] != "ok" for c in kept), "refused": len(refused),
                         "false_rejects": sum(c["status"] == "ok" for c in refused)})
    table = tabulate(rows, headers="keys")
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"comment": "benchmarks/sparsecore_compile_audit.py: libtpu compile verdicts of the "
                                          "sparsecore gathers' whole config grid, compile-only v5p:2x2x1 / v6e:2x2",
                               "seconds": round(time.perf_counter() - start, 1), "summary": rows, "cases": cases},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
