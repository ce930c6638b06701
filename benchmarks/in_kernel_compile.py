"""The MoE layer's `in_kernel` strategy compiled by libtpu for TPU slices this machine does not have (compile-only
topologies v5e:2x2, v5e:4x4 and v6e:2x2), beside `all_to_all` over the ragged all-to-all, at the qwen3-30b-a3b
preset in bfloat16 with the experts split over every chip (nothing dropped: buffers sized for the worst case),
with bfloat16 expert weights and, at 512 tokens per chip, int8 (one scale per column) and float8_e4m3fn (scale
blocks of 128) ones; and in_kernel alone on v5e:2x2 as a 2 x 2 (expert, tensor) mesh, and on v5e:4x4 with
capacity factor 1.25, at 512 tokens per chip.

Per compile: status, seconds, per-chip memory from the compiled program's `memory_analysis`, the kernels (custom
calls) and the collectives left in the optimized HLO with their bytes, how many of those that could carry the
exchange (all-gather, all-to-all, ragged-all-to-all, collective-permute, reduce-scatter) move at least one token
row (hidden x 2 bytes: in_kernel should have none, its rows travel by remote DMA inside its kernels; an all-reduce
is the tensor axis' sum of the outputs, or a small all-gather XLA rewrote), and the
bytes a chip's kernels send by DMA under balanced routing (`slice_plan.layer_work`). Compiles only: nothing here
ran on a chip, and nothing is a time.

  python benchmarks/in_kernel_compile.py [--tokens 512,4096] [--workers 2] [--out benchmarks/results/NAME.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from moe_tune.core.chips import get_slice
from moe_tune.layer.models import get_preset
from moe_tune.targets.slice_compile import LAYER, SliceJob
from moe_tune.targets.slice_plan import PlanPool, layer_work

SLICES = ("v5e:2x2", "v5e:4x4", "v6e:2x2")
STRATEGIES = ("in_kernel", "all_to_all")
PRESET = "qwen3-30b-a3b"
EXCHANGE_KINDS = ("all-gather", "all-to-all", "ragged-all-to-all", "collective-permute", "reduce-scatter")
# quantized expert weights (stored dtype, scale block along the contraction) compiled at 512 tokens per chip
QUANTIZED = (("int8", None), ("float8_e4m3fn", 128))
# (slice, expert, tensor, capacity factor) of the in_kernel-only compiles at 512 tokens per chip
EXTRAS = (("v5e:2x2", 2, 2, None), ("v5e:4x4", 16, 1, 1.25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,4096", help="tokens per chip, comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "in_kernel_compile_v5e_v6e_2026-12-02.json")
    args = parser.parse_args()
    preset = get_preset(PRESET)
    row_bytes = preset.hidden * 2
    jobs = [SliceJob(name, preset.hidden, preset.expert_intermediate, preset.experts, preset.top_k, tokens,
                     get_slice(name).chips, 1, "bfloat16", LAYER, strategy)
            for name in SLICES for tokens in map(int, args.tokens.split(",")) for strategy in STRATEGIES]
    jobs += [SliceJob(name, preset.hidden, preset.expert_intermediate, preset.experts, preset.top_k, 512,
                      get_slice(name).chips, 1, "bfloat16", LAYER, strategy, weights=weights, weights_block=block)
             for name in SLICES for weights, block in QUANTIZED for strategy in STRATEGIES]
    jobs += [SliceJob(name, preset.hidden, preset.expert_intermediate, preset.experts, preset.top_k, 512, expert,
                      tensor, "bfloat16", LAYER, "in_kernel", factor) for name, expert, tensor, factor in EXTRAS]
    start = time.perf_counter()
    with PlanPool(workers=args.workers, timeout=1200) as pool:
        compiled = pool.compile(jobs)
    results = []
    for job, done in zip(jobs, compiled):
        work = layer_work(preset, job.tokens, job.expert, job.tensor, 2)
        rows = [c for c in done.collectives if c["kind"] in EXCHANGE_KINDS and c["operand_bytes"] >= row_bytes]
        results.append({
            "slice": job.slice, "expert": job.expert, "tensor": job.tensor, "capacity_factor": job.capacity_factor,
            "tokens_per_chip": job.tokens, "strategy": job.strategy, "weights": job.weights or "bfloat16",
            "weights_block": job.weights_block,
            "status": done.status, "message": done.message, "backend": done.backend,
            "compile_s": round(done.compile_s, 1),
            "chip_bytes": done.chip_bytes, "memory": done.memory, "kernels": done.kernels,
            "collectives": done.collectives, "token_row_collectives": len(rows),
            "collective_sent_bytes": sum(c["sent_bytes"] for c in done.collectives),
            "kernel_dma_sent_bytes": int(work.dma_bytes) if job.strategy == "in_kernel" else 0,
        })
        print(f"{job.slice} {job.expert}x{job.tensor} cf {job.capacity_factor} tokens {job.tokens} {job.strategy} "
              f"{job.weights or 'bfloat16'}: "
              f"{done.status} {done.message[:200]} "
              f"{done.chip_bytes / 1e9:.3f} GB/chip, collectives {[c['kind'] for c in done.collectives]}, "
              f"token-row collectives {len(rows)}, {done.compile_s:.0f} s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=Path(__file__).parent).stdout.strip()
    header = {"what": __doc__.splitlines()[0], "preset": PRESET, "dtype": "bfloat16 activations", "commit": commit,
              "machine": "CPU host, libtpu compile-only topologies", "wall_s": round(time.perf_counter() - start, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**header, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
