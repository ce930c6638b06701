"""The MoE layer's compiled per-chip memory on a compile-only `v6e:2x2` (expert axis 4) with the TensorCore
gathers (the chip's kernels, `pallas_tpu`) and with the `sparsecore` gathers beside the chip's other kernels
(`moe-tune plan --backend sparsecore`), per strategy, for qwen3-30b-a3b and deepseek-v2-lite at 256 tokens per
chip, bfloat16.

    .venv/bin/python benchmarks/sparsecore_layer_memory.py [--tokens 256] [--out PATH]

Per strategy and backend: the compile's status, the backend it compiled with (and why the one asked for did
not), per-chip bytes (`memory_analysis`: arguments + outputs + temporaries + code - aliased) and their parts,
and the program's SparseCore kernels. The all_gather strategy runs the fused gather-matmul kernels and has no
separate gathers for a backend to move. Writes benchmarks/results/sparsecore_layer_memory_v6e_<date>.json and
prints the table. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from tabulate import tabulate

from moe_tune.targets.slice_plan import STRATEGIES, PlanPool, PlanRequest, plans

SLICE = "v6e:2x2"
PRESETS = ("qwen3-30b-a3b", "deepseek-v2-lite")
BACKENDS = {"tensorcore": None, "sparsecore": "sparsecore"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or (Path(__file__).parent / "results" /
                       f"sparsecore_layer_memory_v6e_{datetime.date.today()}.json")
    requests = [PlanRequest(model, args.tokens, SLICE, STRATEGIES, backend=backend)
                for model in PRESETS for backend in BACKENDS.values()]
    start = time.perf_counter()
    with PlanPool(workers=args.workers, timeout=900) as pool:
        found = plans(requests, pool)
    rows, cases = [], []
    for request, plan in zip(requests, found):
        label = next(k for k, v in BACKENDS.items() if v == request.backend)
        for p in plan.strategies:
            c = p.compiled
            case = {"model": plan.model, "tokens_per_chip": plan.tokens, "expert": plan.expert,
                    "asked": label, "strategy": p.strategy, "status": c.status, "compiled_with": c.backend,
                    "fallback_reason": c.fallback_reason, "message": c.message, "chip_bytes": p.chip_bytes,
                    "fits": p.fits, "memory": c.memory, "sparsecore_kernels": [k for k in c.kernels if "sparsecore" in k],
                    "kernels": c.kernels, "compile_s": round(c.compile_s, 1)}
            cases.append(case)
    for model in PRESETS:
        for strategy in STRATEGIES:
            pair = {c["asked"]: c for c in cases if c["model"] == model and c["strategy"] == strategy}
            tc, sc = pair["tensorcore"], pair["sparsecore"]
            rows.append({"model": model, "strategy": strategy, "tensorcore": tc["status"], "tc_chip_MB":
                         round(tc["chip_bytes"] / 1e6, 2), "sparsecore": f"{sc['status']} ({sc['compiled_with']})",
                         "sc_chip_MB": round(sc["chip_bytes"] / 1e6, 2),
                         "sc_temp_MB": round(sc["memory"].get("temp_size_in_bytes", 0) / 1e6, 2),
                         "tc_temp_MB": round(tc["memory"].get("temp_size_in_bytes", 0) / 1e6, 2),
                         "sc_kernels": ", ".join(sc["sparsecore_kernels"]) or "-"})
    print(tabulate(rows, headers="keys"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"comment": f"benchmarks/sparsecore_layer_memory.py: the layer compiled for a "
                                          f"compile-only {SLICE} (expert 4), bfloat16, TensorCore gathers (the "
                                          "chip's kernels) against sparsecore gathers; bytes per chip from "
                                          "memory_analysis",
                               "slice": SLICE, "seconds": round(time.perf_counter() - start, 1), "summary": rows,
                               "cases": cases}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
