"""The triton ragged_dot forward with mxfp4 weights beside bfloat16 activations, compiled for a GPU on this
CPU-only machine (`moe_tune.targets`' compile-only CUDA plugin): per config, the shared memory the compiler
gives the kernel (or the size it refused), the backend's rule for it, and the PTX's count of Hopper tensor-core
instructions (`wgmma.mma_async`) and of scalar float32 FMAs (`fma.rn.f32`).

    PYTHONPATH=src .venv/bin/python benchmarks/triton_mxfp4_compile.py [--chip h100|a100] [--weights int4:128]
        [--label L]

Why (FINDINGS.md: mxfp4 block_k 32): on a real H100 (results/gpu_check_nvidia_h100_2026-11-26_quant_4bit.*) the tuned mxfp4 kernel took 3.55x the bf16
kernel's time at DeepSeek-V3's ep-8 gate/up (m 4096, k 7168, n 2048, 32 groups), with block_k 32: one MX scale
block a k step. A longer step dequantizes its weights in the kernel; this shows what the compiler makes of it.
The problem is that shape; the configs every combination of block_m 64/128, block_n 64/128/256, block_k
32/64/128 and 2-4 stages, 8 warps. Nothing runs on a GPU and nothing is timed.
`--weights int4:128` compiles int4 weights in blocks of 128 instead (a step of at most 128 holds one block, so
none is dequantized in the kernel). Writes results/triton_mxfp4_compile_<chip>[_<weights>]_<date>[_<label>].jsonl,
one line per config.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# block_m, block_n, block_k, stages
CONFIGS = list(itertools.product([64, 128], [64, 128, 256], [32, 64, 128], [2, 3, 4]))


def _compile_all(chip: str, dump: str, qdtype: str, qblock: int) -> None:
    """In a worker process (the compile-only wheels on its path): compile every config, print a JSON line each."""
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump}"  # read once, when the backend starts: set it first
    import jax

    from moe_tune.kernels import get_op
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
    from moe_tune.targets import get_target
    from moe_tune.targets.calls import abstract_inputs, kernel_call
    from moe_tune.targets.compile import acting_as, topology_device

    target = get_target(chip)
    device = topology_device(target)
    problem = RaggedDotProblem(m=4096, k=7168, n=2048, groups=32, lhs_dtype="bfloat16", out_dtype="bfloat16",
                               rhs_qdtype=qdtype, rhs_qblock=qblock)
    backend = get_op("ragged_dot").backends.get("triton")
    for block_m, block_n, block_k, stages in CONFIGS:
        config = backend.config_cls(block_m=block_m, block_k=block_k, block_n=block_n, num_warps=8,
                                    num_stages=stages)
        before = set(glob.glob(f"{dump}/*thunk_sequence.txt"))
        row = {"config": config.to_dict()}
        with acting_as(target):
            row["rule_bytes"] = backend.shared_memory_bytes(config, problem)
            try:
                call = jax.jit(kernel_call("ragged_dot", "triton", problem, config))
                call.lower(abstract_inputs("ragged_dot", problem, device)).compile()
            except Exception as e:  # noqa: BLE001 - the compiler's refusal is the datum
                found = re.search(r"requested (\d+)", str(e))
                row["refused_bytes"] = int(found.group(1)) if found else None
                row["message"] = str(e).splitlines()[0][:200]
                print(json.dumps(row), flush=True)
                continue
        new = sorted(set(glob.glob(f"{dump}/*thunk_sequence.txt")) - before)
        modules = {Path(f).name.split(".")[0] for f in new}
        ptx = "".join(Path(f).read_text() for f in glob.glob(f"{dump}/*.ptx") if Path(f).name.split(".")[0] in modules)
        row["compiler_bytes"] = max(int(b) for f in new for b in re.findall(r"shared_memory: (\d+) bytes",
                                                                            Path(f).read_text()))
        row["wgmma"] = ptx.count("wgmma.mma_async")
        row["fma_f32"] = ptx.count("fma.rn.f32")
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chip", default="h100", choices=["h100", "a100", "b200"])
    parser.add_argument("--label", default="")
    parser.add_argument("--weights", default="float4_e2m1fn:32", help="the weights' stored dtype and block along k "
                        "(int4:128 compares int4, whose block of 128 a step of at most 128 holds whole)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        qdtype, qblock = args.weights.split(":")
        _compile_all(args.chip, args.worker, qdtype, int(qblock))
        return
    from moe_tune.targets import wheels

    wheels.require("gpu")
    with tempfile.TemporaryDirectory() as dump:
        command = [sys.executable, __file__, "--chip", args.chip, "--weights", args.weights, "--worker", dump]
        proc = subprocess.run(command, env=wheels.worker_env(), capture_output=True, text=True, timeout=3600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or len(rows) != len(CONFIGS):
        sys.exit(f"the compile worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    weights = "" if args.weights == "float4_e2m1fn:32" else "_" + args.weights.replace(":", "_")
    label = f"_{args.label}" if args.label else ""
    out = RESULTS / f"triton_mxfp4_compile_{args.chip}{weights}_{time.strftime('%Y-%m-%d')}{label}.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    compiled = [r for r in rows if "compiler_bytes" in r]
    under = [r for r in rows if r["rule_bytes"] < r.get("compiler_bytes", r.get("refused_bytes") or 0)]
    print(f"{args.chip}: {len(compiled)} of {len(rows)} configs compile; with tensor-core MMAs (wgmma): "
          f"{sum(r['wgmma'] > 0 for r in compiled)}; rule == compiler's bytes: "
          f"{sum(r['rule_bytes'] == r.get('compiler_bytes', r.get('refused_bytes')) for r in rows)}, "
          f"rule under it: {len(under)}")
    for r in rows:
        c = r["config"]
        figure = (f"{r['compiler_bytes']:>7} B, wgmma {r['wgmma']:>3}, fma.f32 {r['fma_f32']:>5}"
                  if "compiler_bytes" in r else f"refused ({r.get('refused_bytes')} B)")
        print(f"  {c['block_m']:>3} x {c['block_n']:>3} x {c['block_k']:>3}, {c['num_stages']} stages: rule "
              f"{r['rule_bytes']:>7} B; {figure}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
