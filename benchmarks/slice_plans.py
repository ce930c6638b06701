"""Slice plans of the MoE layer across devices (`moe-tune plan`), for three presets on slices this machine does
not have, compiled with the real compilers (compile-only: libtpu for TPU v5e / v5p, XLA:GPU for H100s).

For deepseek-v3, qwen3-235b-a22b and mixtral-8x22b at `--tokens` per expert-axis shard on v5e:8x8, v5p:4x4x4
and h100x8: each way of the layer without a capacity factor (nothing dropped: all_to_all's buffers sized for the
worst case): all_gather, all_to_all over the ragged all-to-all and over the fixed-capacity one; and both
all_to_all exchanges with capacity factor 1.25. Per strategy: compiled, fits, GB per chip, GB a chip
sends in collectives, the floor from the chips' published facts, the TPU compiler's estimate and the compile
seconds. Estimates, not times: nothing here ran on the chips. Nothing is asserted.

  python benchmarks/slice_plans.py [--tokens 4096] [--workers 2] [--out benchmarks/results/NAME]

writes NAME.json (every plan's fields) and NAME.txt (the tables as printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import jax

from moe_tune.commands.slice_plan_view import COLUMNS, lines, row, title
from moe_tune.targets.slice_plan import FIXED_ALL_TO_ALL, STRATEGIES, PlanPool, PlanRequest, plans

PRESETS = ("deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b")
SLICES = ("v5e:8x8", "v5p:4x4x4", "h100x8")
# (strategies, capacity factor) per plan
RUNS = ((STRATEGIES, None), (("all_to_all", FIXED_ALL_TO_ALL), 1.25))


def _table(found) -> list[str]:
    widths = [max(len(c), *(len(str(r[i])) for r in map(row, found.strategies))) for i, c in enumerate(COLUMNS)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in
                                  enumerate(zip(cells, widths)))
    return [title(found), fmt(COLUMNS), *(fmt(row(p)) for p in found.strategies), *lines(found), ""]


def _write(out: Path, header: dict, found: list, text: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**header, "plans": [p.to_dict() for p in found]}, indent=1))
    out.with_suffix(".txt").write_text("\n".join(text) + f"\nwall {header['wall_s']} s\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--slices", default=",".join(SLICES))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "slice_plans_2026-12-01")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=Path(__file__).parent).stdout.strip()
    layer_edits = subprocess.run(["git", "status", "--short", "--", "src/moe_tune/layer"], capture_output=True,
                                 text=True, check=False, cwd=Path(__file__).parents[1]).stdout.split("\n")
    header = {"what": "moe-tune plan per preset and slice (compile-only; estimates, not times)",
              "tokens_per_expert_shard": args.tokens, "jax": jax.__version__, "commit": commit,
              "layer_uncommitted": [line.strip() for line in layer_edits if line.strip()],
              "machine": f"{platform.machine()} CPU, {len(os.sched_getaffinity(0))} cores",
              "runs": [{"strategies": list(s), "capacity_factor": c} for s, c in RUNS]}
    text, found = [json.dumps(header), ""], []
    start = time.perf_counter()
    with PlanPool(workers=args.workers, timeout=900) as pool:
        for slice_name in args.slices.split(","):
            for preset in args.presets.split(","):  # one preset's plans at a time, the files rewritten after each
                requests = [PlanRequest(preset, args.tokens, slice_name, strategies, capacity_factor=capacity)
                            for strategies, capacity in RUNS]
                for one in plans(requests, pool):
                    found.append(one)
                    block = _table(one)
                    print("\n".join(block), flush=True)
                    text += block
                header["wall_s"] = round(time.perf_counter() - start, 1)
                _write(args.out, header, found, text)
    print(f"wrote {args.out}.json and .txt ({header['wall_s']} s)")


if __name__ == "__main__":
    main()
