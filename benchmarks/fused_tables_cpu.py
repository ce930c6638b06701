"""Sweep the fused MoE kernels (`fused_moe`) at exactly the layer shapes benchmarks/fused_cpu.py measures, so
that the fused path runs tuned configs as the unfused one runs ragged_dot's tuned tables.

Per preset, tokens, ep and dtype: the calls `models.fused_runs` lists for training (dispatch forward without
the activation, both backward directions, the combine forward) and for serving (the dispatch forward with
SiLU), as one campaign (`campaign.runner`; a sweep the table already holds is skipped). Short sweeps:
coordinate descent from the default config, `--budget` candidates, `--samples` first-round samples.

    PYTHONPATH=src .venv/bin/python benchmarks/fused_tables_cpu.py \
        --preset qwen3-30b-a3b --tokens 4096 --ep 1 --dtype bfloat16 [--budget 4] [--samples 2] \
        [--profile-dir DIR]

Then merge DIR/cpu/fused_moe.json into the shipped table (`moe-tune merge`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from moe_tune.campaign import runner
from moe_tune.campaign.request import Case
from moe_tune.layer.models import fused_runs, get_preset
from moe_tune.tuner import SweepSettings


def cases(preset_name: str, tokens: int, ep: int, dtype: str) -> list[Case]:
    """The fused_moe calls of one layer, training's and serving's (duplicates removed by the planner)."""
    preset = get_preset(preset_name)
    runs = [c for direction in ("all", "fwd") for c in fused_runs(preset, tokens, ep=ep, dtype=dtype, quant={},
                                                                   direction=direction)]
    label = f"{preset_name} tokens={tokens} ep={ep} {dtype}"
    return [Case(c.op, c.problem, f"{label} {c.role}") for c in runs if c.op == "fused_moe"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--profile-dir", default=None)
    parser.add_argument("--dry-run", action="store_true", help="print the sweeps to run and exit")
    args = parser.parse_args()
    settings = SweepSettings(samples=args.samples, strategy="coordinate", budget=args.budget, workers=args.workers,
                             profile_dir=Path(args.profile_dir) if args.profile_dir else None)
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("load before:", uptime(), flush=True)
    campaign = runner.prepare(cases(args.preset, args.tokens, args.ep, args.dtype), settings)
    print(f"{len(campaign.todo)} sweeps to run:", *(s.label for s in campaign.todo), sep="\n  ", flush=True)
    if args.dry_run:
        return
    for outcome in runner.run_sweeps(campaign):
        entry = outcome.entry
        print(outcome.sweep.key, "->", None if entry is None else entry.config,
              None if entry is None else entry.verdict, outcome.error or "", flush=True)
    print("load after:", uptime(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
