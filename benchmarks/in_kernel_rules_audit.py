"""The `in_kernel` fused kernels' VMEM rules (`layer/in_kernel_rules.py`) held to libtpu: each kernel alone
(`targets/in_kernel_alone.py`: `dispatch_gate_up` or `down_return` inside a jax.shard_map over a compile-only
2x2 slice), compiled for TPU v5e and v6e at real layer shapes (qwen3-30b-a3b, mixtral-8x22b split over a 2 x 2
(expert, tensor) mesh, deepseek-v3, qwen3-235b-a22b; the others over 4 devices of the expert axis) with
bfloat16 activations and bfloat16 or int8 weights, over a grid of tiles (tm 64..512, tk and tn every lane-aligned
divisor, up to and past the budget). Per (chip, layer, weights, kernel) it compiles the rules' own choice
(`tiles`), the `--per` kept tiles with the largest estimates and the `--per` refused ones with the smallest
(nearest the limit from either side), and a seeded `--spread` of the rest.

    PYTHONPATH=src .venv/bin/python benchmarks/in_kernel_rules_audit.py [--per 3] [--spread 1] [--out PATH]
        [--slices v5e:2x2,v6e:2x2] [--layers NAME,...] [--weights bfloat16,int8] [--update]

- false accept: the rule keeps the tile, the compiler refuses it (must be 0);
- false reject: the rule refuses it, the compiler takes it.
The rules' verdict: the VMEM estimate within the chip's scoped VMEM and, for the return, whole lanes of packed
words (`in_kernel_rules.words_aligned`); `rule_reason` says which refused a tile.

Per case: the rule's verdict and estimate (bytes), the chip's scoped VMEM, the compiler's status and first line
(its VMEM message when it refuses). Writes benchmarks/results/in_kernel_rules_audit_v5e_v6e_2026-12-02.json.
Compiles only: nothing ran on a chip. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import re
import time
from pathlib import Path

from moe_tune.core.chips import get_slice
from moe_tune.layer import in_kernel_gmm, in_kernel_return, in_kernel_rules
from moe_tune.layer.models import get_preset
from moe_tune.targets import wheels
from moe_tune.targets.compile import acting_as
from moe_tune.targets.in_kernel_alone import KERNELS, KernelCase, compile_kernels, local_operands

SLICES = ("v5e:2x2", "v6e:2x2")
# (preset, expert, tensor) on a 4-chip slice
LAYERS = (("qwen3-30b-a3b", 4, 1), ("mixtral-8x22b", 2, 2), ("deepseek-v3", 4, 1), ("qwen3-235b-a22b", 4, 1))
WEIGHTS = ("bfloat16", "int8")
TOKENS = 256  # per device
ROW_TILES = (64, 128, 256, 512)
_USED = re.compile(r"Used ([\d.]+)([KMG]) of ([\d.]+)([KMG]) vmem")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def lane_tiles(size: int, span: int) -> list[int]:
    """Every lane-aligned tile of a dimension of `size` (dividing `span`, the half a packed k step reads), and
    the whole dimension."""
    return sorted({size, *(t for t in range(128, size, 128) if span % t == 0)})


def estimate(case: KernelCase, tile: tuple[int, int, int]) -> int:
    """The rule's VMEM bytes for `case` at `tile` (judged for the case's chip by the caller)."""
    ops = local_operands(case)
    x = ops["x"]
    if case.kernel == "gate_up":
        packed = in_kernel_gmm._packs(x)
        return in_kernel_rules.gate_up_vmem_bytes(*tile, word_bytes=case.hidden * (2 if packed else 4),
                                                  x_dtype=x.dtype, weights=in_kernel_rules.weight_format(ops["w_gate"]))
    return in_kernel_rules.down_vmem_bytes(*tile, h_dtype=x.dtype, packed=in_kernel_return.packs(x.dtype, tile[2]),
                                           weights=in_kernel_rules.weight_format(ops["w_down"]))


def rule_verdict(case: KernelCase, tile: tuple[int, int, int], est: int) -> str | None:
    """Why the rules refuse `tile` for the case (`vmem`: its estimate past the budget; `lanes`: a packed return
    tile of part-lane words, `in_kernel_rules.words_aligned`), or None: kept."""
    if case.kernel == "down" and not in_kernel_rules.words_aligned(
            tile[2], case.hidden, packed=in_kernel_return.packs(case.dtype, tile[2])):
        return "lanes"
    return "vmem" if est > in_kernel_rules.vmem_budget() else None


def chosen(case: KernelCase) -> tuple[int, int, int] | None:
    """The kernel's own tiles for the case (`gate_up_tiles` / `down_tiles`)."""
    ops = local_operands(case)
    if case.kernel == "gate_up":
        return in_kernel_gmm.gate_up_tiles(ops["x"], ops["w_gate"], case.rows_in())
    return in_kernel_return.down_tiles(ops["rows"], ops["w_down"], ops["x"].dtype)


def grid(case: KernelCase) -> list[tuple[int, int, int]]:
    """(tm, tk, tn) over ROW_TILES x every valid tk and tn of the kernel at the case's shapes."""
    if case.kernel == "gate_up":
        packed = case.dtype == "bfloat16" and case.hidden % 2 == 0
        k_tiles = lane_tiles(case.hidden, case.hidden // 2 if packed else case.hidden)
        n_tiles = lane_tiles(case.width, case.width)
    else:
        k_tiles, n_tiles = lane_tiles(case.width, case.width), lane_tiles(case.hidden, case.hidden)
    return list(itertools.product(ROW_TILES, k_tiles, n_tiles))


def picks(case: KernelCase, per: int, spread: int, rng: random.Random) -> list[tuple[tuple[int, int, int], int]]:
    """(tile, estimate) of the case's compiles: the rules' choice, the `per` kept nearest the budget, the `per`
    refused nearest it, `spread` more of each side at random."""
    scored = sorted(((t, estimate(case, t)) for t in grid(case)), key=lambda p: p[1])
    kept = [p for p in scored if rule_verdict(case, *p) is None]
    over = [p for p in scored if rule_verdict(case, *p) is not None]
    own = chosen(case)
    picked = ([(own, estimate(case, own))] if own else []) + kept[-per:] + over[:per]
    rest_kept, rest_over = kept[:-per] if per else kept, over[per:]
    picked += rng.sample(rest_kept, min(spread, len(rest_kept))) + rng.sample(rest_over, min(spread, len(rest_over)))
    return list(dict.fromkeys(picked))


def used_bytes(message: str) -> int | None:
    """What the compiler said the kernel used ("Used 18.45M of 16.00M vmem"), or None."""
    found = _USED.search(message)
    return None if found is None else int(float(found.group(1)) * _UNITS[found.group(2)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per", type=int, default=3)
    parser.add_argument("--spread", type=int, default=1)
    parser.add_argument("--slices", default=",".join(SLICES))
    parser.add_argument("--layers", default=",".join(name for name, *_ in LAYERS))
    parser.add_argument("--weights", default=",".join(WEIGHTS))
    parser.add_argument("--update", action="store_true",
                        help="replace only the run's (chip, layer, weights) records in an existing --out file")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "in_kernel_rules_audit_v5e_v6e_2026-12-02.json")
    args = parser.parse_args()
    wheels.require("tpu")
    rng = random.Random(0)
    cases, records = [], []
    for name in args.slices.split(","):
        chip = get_slice(name).chip
        with acting_as(chip):
            budget = in_kernel_rules.vmem_budget()
            for preset_name, expert, tensor in LAYERS:
                if preset_name not in args.layers.split(","):
                    continue
                preset = get_preset(preset_name)
                for weights, kernel in itertools.product(args.weights.split(","), KERNELS):
                    base = KernelCase(kernel, name, expert, tensor, TOKENS, preset.hidden, preset.expert_intermediate,
                                      preset.experts, preset.top_k, "bfloat16", weights)
                    own = chosen(base)
                    for tile, est in picks(base, args.per, args.spread, rng):
                        reason = rule_verdict(base, tile, est)
                        cases.append(dataclasses.replace(base, tile=tile))
                        records.append({"chip": chip.name, "slice": name, "layer": preset_name, "expert": expert,
                                        "tensor": tensor, "tokens_per_chip": TOKENS, "dtype": "bfloat16",
                                        "weights": weights, "kernel": kernel, "tm": tile[0], "tk": tile[1],
                                        "tn": tile[2], "rules_choice": tile == own, "estimate_bytes": est,
                                        "budget_bytes": budget, "rule": "refuse" if reason else "keep",
                                        "rule_reason": reason})
    print(f"{len(cases)} compiles", flush=True)
    start = time.perf_counter()

    def arrived(index: int, status: str, value) -> None:
        record = records[index]
        if status == "ok":
            record.update(status=value["status"], message=value["message"], compile_s=round(value["compile_s"], 2),
                          memory=value["memory"])
        else:
            record.update(status="crashed", message=f"{value.kind}: {value.message[:200]}")
        record["compiler_used_bytes"] = used_bytes(record["message"])
        kept, ok = record["rule"] == "keep", record["status"] == "ok"
        record["verdict"] = "false accept" if kept and not ok else "false reject" if ok and not kept else ""
        print(f"{index:4d} {record['chip']} {record['layer']:16s} {record['weights']:8s} {record['kernel']:7s} "
              f"{record['tm']:4d} {record['tk']:5d} {record['tn']:5d} est {record['estimate_bytes'] / 2**20:6.2f} MiB "
              f"{record['rule']:6s} {record['status']:8s} {record['verdict']:12s} {record['message'][:90]}", flush=True)

    compile_kernels(cases, arrived)
    wall = round(time.perf_counter() - start, 1)
    if args.update and args.out.exists():
        ran = {(r["chip"], r["layer"], r["weights"]) for r in records}
        earlier = json.loads(args.out.read_text())
        records = [r for r in earlier["records"] if (r["chip"], r["layer"], r["weights"]) not in ran] + records
        wall = {"earlier": earlier["wall_s"], "update": wall}
    summary = {}
    for chip in sorted({r["chip"] for r in records}):
        mine = [r for r in records if r["chip"] == chip]
        summary[chip] = {"compiles": len(mine), "kept": sum(r["rule"] == "keep" for r in mine),
                         "refused": sum(r["rule"] == "refuse" for r in mine),
                         "false_accepts": sum(r["verdict"] == "false accept" for r in mine),
                         "false_rejects": sum(r["verdict"] == "false reject" for r in mine),
                         "rules_choice_ok": all(r["status"] == "ok" for r in mine if r["rules_choice"])}
    header = {"what": __doc__.splitlines()[0], "machine": "CPU host (2 cores), libtpu compile-only topologies",
              "date": "2026-12-02", "wall_s": wall, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**header, "records": records}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
