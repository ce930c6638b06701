"""Temp memory of the fused vs unfused MoE layer on CPU, compile only (FINDINGS.md: fused layer memory): each case of
`fused_cpu.py`'s matrix (presets x tokens x ep x dtypes, forward and forward+backward) lowered from abstract
inputs (`jax.ShapeDtypeStruct`: no weights allocated) and compiled; XLA's buffer assignment
(`compiled.memory_analysis().temp_size_in_bytes`) printed for both, with the [tokens x top_k, hidden] buffers
the fused layer does not write (`removed`) and whether fused <= unfused - removed.

    PYTHONPATH=src .venv/bin/python benchmarks/fused_memory_cpu.py [--presets qwen3-30b-a3b,deepseek-v2-lite]
        [--tokens 256,4096] [--ep 1,4] [--dtypes float32,bfloat16] [--modes fwd,fwd+bwd] [--json OUT]

Nothing is timed (no lock needed). `removed`: 2 buffers in both modes. Forward: the gathered rows and the
expert outputs. Forward+backward: the expert outputs (kept for the combine's weight gradient) and d(rows)
(the gate and up dlhs, which the gather's VJP scatter-adds into dx); both steps still write the gathered
rows and the weighted d(out) rows that the weights' drhs read (the fused backward gathers the rows again).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_tune.layer.models import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_cpu import variants  # noqa: E402  (the same layer programs the timed benchmark compiles)


def abstract_inputs(preset, tokens: int, ep: int, dtype: str) -> dict[str, jax.ShapeDtypeStruct]:
    """`fused_cpu.layer_inputs`' shapes and dtypes, without their values."""
    local, d, f = preset.experts // ep, preset.hidden, preset.expert_intermediate
    s = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    return {"x": s((tokens, d)), "logits": s((tokens, preset.experts), "float32"), "w_gate": s((local, d, f)),
            "w_up": s((local, d, f)), "w_down": s((local, f, d))}


# [tokens x top_k, hidden] buffers the fused program does not write, per mode (see the module doc)
REMOVED_BUFFERS = {"fwd": 2, "fwd+bwd": 2}


def temp_bytes(fn, inputs) -> int:
    return int(jax.jit(fn).lower(inputs).compile().memory_analysis().temp_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v2-lite")
    parser.add_argument("--tokens", default="256,4096")
    parser.add_argument("--ep", default="1,4")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results = {"load_before": load(), "jax": jax.__version__, "cases": []}
    print(results["load_before"], flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for ep in (int(e) for e in args.ep.split(",")):
            for name in args.presets.split(","):
                preset = get_preset(name)
                for dtype in args.dtypes.split(","):
                    inputs = abstract_inputs(preset, tokens, ep, dtype)
                    programs = variants(preset, ep)
                    for mode in args.modes.split(","):
                        temp = {v: temp_bytes(fn, inputs) for v, fn in programs[mode].items()}
                        buffer = tokens * preset.top_k * preset.hidden * jnp.dtype(dtype).itemsize
                        removed = REMOVED_BUFFERS[mode] * buffer
                        ok = temp["fused"] <= temp["unfused"] - removed
                        case = {"preset": name, "tokens": tokens, "ep": ep, "dtype": dtype, "mode": mode,
                                "temp_bytes": temp, "removed_bytes": removed, "met": ok}
                        results["cases"].append(case)
                        mib = lambda b: b / 2**20
                        print(f"{name:<17} tokens={tokens:<5} ep={ep} {dtype:<8} {mode:<7} temp MiB unfused "
                              f"{mib(temp['unfused']):8.1f} fused {mib(temp['fused']):8.1f}  removed "
                              f"{mib(removed):7.1f}  {'met' if ok else 'MISSED'}", flush=True)
                        if args.json:
                            Path(args.json).write_text(json.dumps(results, indent=1))
    results["load_after"] = load()
    print(results["load_after"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
