"""The fused MoE layer on a fused_moe kernel backend that reads gate and up as two arrays (`split_weights`),
compiled for its chip on this CPU-only machine (`moe_tune.targets`' compile-only wheels): `triton` for an H100
(`--chip h100`, the CUDA plugin), `pallas_tpu` for a TPU v5e (`--chip v5e`, libtpu's Mosaic). XLA's temp memory
with gate and up as two arrays against the op concatenating them first (the same
kernels given one [groups, hidden, 2f] array), and whether the compiled program still holds a concatenate of
that shape. Then the dispatch's kernels alone near the chip's budget (shared memory / scoped VMEM), on one
array and on (gate, up) (`_kernel_verdicts`): whether the rules still say what the compiler does.

    PYTHONPATH=src .venv/bin/python benchmarks/fused_weights_parts_compile.py [--chip h100|v5e]
        [--cases qwen3-30b-a3b:4096:1,...] [--label L] [--no-kernels]

For each case (preset:tokens:ep, bfloat16, `moe_mlp(..., fused=True)` under `use_backend("fused_moe",
backend)`, the forward and the forward+backward (gradients in every input)), `compiled.memory_analysis()`
of the chip's program, before and after, and the gate+up weights' bytes (what "after" should save). The
GPU measurement this answers (FINDINGS.md: H100 MoE layer, gate and up as two parts):
benchmarks/results/gpu_check_nvidia_h100_2026-11-26_layer*.json (fused_triton
temp 856 MB at qwen3-30b-a3b 4096 tokens, 808 MB at 256, 2.0 GB at deepseek-v3 ep 8; unfused 235 / 15 / 738
MB). Configs are the defaults (and the shipped tables for the other ops), the same in both variants.
Writes benchmarks/results/fused_<backend>_weights_<chip>_compile_<date>[_<label>].txt. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CASES = "qwen3-30b-a3b:4096:1,qwen3-30b-a3b:256:1,deepseek-v3:4096:8"
# chip -> (fused_moe backend, the compile-only wheel, the budget its rules hold the kernels to)
CHIPS = {"h100": ("triton", "gpu", "shared memory"), "v5e": ("pallas_tpu", "tpu", "scoped VMEM")}


def _compile_case(chip: str, name: str, tokens: int, ep: int, split: bool, mode: str) -> dict:
    """Compile one variant for `chip` (in a worker process: the compile-only wheel is on its path)."""
    import jax
    import jax.numpy as jnp

    from moe_tune import moe_mlp, use_backend
    from moe_tune.kernels import get_op
    from moe_tune.layer.models import get_preset
    from moe_tune.targets import get_target
    from moe_tune.targets.compile import acting_as, topology_device

    backend = CHIPS[chip][0]
    target = get_target(chip)
    device = topology_device(target)
    sharding = jax.sharding.SingleDeviceSharding(device)
    preset = get_preset(name)
    local, d, f = preset.experts // ep, preset.hidden, preset.expert_intermediate
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    args = (spec((tokens, d)), spec((tokens, preset.experts), jnp.float32), spec((local, d, f)), spec((local, d, f)),
            spec((local, f, d)))

    def layer(x, logits, gate, up, down):
        with use_backend("fused_moe", backend):
            return moe_mlp(x, logits, gate, up, down, preset.top_k, expert_offset=0 if ep > 1 else None, fused=True)

    fn = layer if mode == "fwd" else jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
    cls = type(get_op("fused_moe").backends.get(backend))
    saved = cls.split_weights
    cls.split_weights = split  # False: the op concatenates gate and up (the backend before)
    try:
        start = time.perf_counter()
        with acting_as(target):
            lowered = jax.jit(fn).lower(*args)
            compiled = lowered.compile()
        seconds = time.perf_counter() - start
    finally:
        cls.split_weights = saved
    memory = compiled.memory_analysis()
    weights_shape = f"bf16[{local},{d},{2 * f}]"
    # Instructions of the entry computation that make an array of the concatenated weights' shape (XLA TPU
    # writes a concatenate as a pad-and-maximum fusion; a fused computation's inner lines are not counted).
    entry = compiled.as_text().split("\nENTRY ", 1)[1].split("\n}", 1)[0]
    concatenates = [line for line in entry.splitlines() if re.search(rf"= {re.escape(weights_shape)}[{{ ]", line)]
    return {"temp": int(memory.temp_size_in_bytes), "argument": int(memory.argument_size_in_bytes),
            "gate_up_bytes": 2 * local * d * f * 2, "weight_concatenates": len(concatenates),
            "compile_s": round(seconds, 1)}


def _worker(spec: str) -> None:
    chip, spec = spec.split(":", 1)
    if spec == "kernels":
        _kernel_verdicts(chip)
        return
    name, tokens, ep, split, mode = spec.split(":")
    print("RESULT " + json.dumps(_compile_case(chip, name, int(tokens), int(ep), split == "split", mode)),
          flush=True)


def _parts(rhs):
    """Abstract (gate, up) halves along n of abstract weights (a QArray's values and scales alike)."""
    import jax

    from moe_tune.core.quant import QArray

    half = lambda a, i: jax.ShapeDtypeStruct((*a.shape[:2], a.shape[2] // 2), a.dtype, sharding=a.sharding)
    if isinstance(rhs, QArray):
        return tuple(QArray(half(rhs.qvalue, i), half(rhs.scale, i)) for i in range(2))
    return tuple(half(rhs, i) for i in range(2))


def _kernel_verdicts(chip: str) -> None:
    """The dispatch's kernels alone at qwen3-30b-a3b 512 tokens (bf16; fp8 weights in 128-row blocks for the
    backward), on one array and on (gate, up): the default, the two configs the rules keep nearest the chip's
    budget and the two they refuse nearest it (`fused_moe_compile_probe.pick`), each compiled for `chip`; a
    verdict differing from the rules is a false accept / reject."""
    from fused_moe_compile_probe import pick, problems

    from moe_tune.kernels import get_op
    from moe_tune.targets import get_target
    from moe_tune.targets.calls import abstract_inputs, kernel_call
    from moe_tune.targets.compile import acting_as, compile_call, topology_device

    name = CHIPS[chip][0]
    target, backend = get_target(chip), get_op("fused_moe").backends.get(name)
    device = topology_device(target)
    fwd, bwd = (p for p in problems(512, "bfloat16") if p.stage == "dispatch")
    fp8_bwd = [p for p in problems(512, "bfloat16", "fp8") if p.stage == "dispatch"][1]
    cases = [fwd, dataclasses.replace(fwd, glu=None), bwd, fp8_bwd]  # glu, the training forward, dx
    for problem in cases:
        with acting_as(target):
            configs = pick(backend, problem, 2)
            rules = [backend.config_error(c, problem) for c in configs]
        for config, rule in zip(configs, rules):
            for split in (False, True):
                inputs = abstract_inputs("fused_moe", problem, device)
                if split:
                    inputs["rhs"] = _parts(inputs["rhs"])
                result = compile_call(target, kernel_call("fused_moe", name, problem, config), lambda _: inputs)
                print("KERNEL " + json.dumps({
                    "direction": f"{problem.direction} glu={problem.glu}" + (f" {problem.rhs_qdtype}"
                                                                             if problem.rhs_qdtype else ""),
                    "config": config.label(), "weights": "parts" if split else "one array",
                    "rules": "keep" if rule is None else "refuse", "compiler": result.status,
                    "message": result.message[:60]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chip", choices=sorted(CHIPS), default="h100")
    parser.add_argument("--cases", default=CASES, help="comma-separated preset:tokens:ep")
    parser.add_argument("--label", default="")
    parser.add_argument("--no-kernels", dest="kernels", action="store_false",
                        help="skip the kernels' compiles near the chip's budget")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    from tabulate import tabulate

    from moe_tune.targets import wheels

    backend, wheel, budget = CHIPS[args.chip]
    wheels.require(wheel)
    rows = []
    for case in args.cases.split(","):
        for mode in ("fwd", "fwd+bwd"):
            result = {}
            for variant in ("concat", "split"):  # before, after
                proc = subprocess.run([sys.executable, __file__, "--worker", f"{args.chip}:{case}:{variant}:{mode}"],
                                      env=wheels.worker_env(), capture_output=True, text=True, timeout=1800)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"{case} {variant} {mode} failed:\n{proc.stderr[-3000:]}")
                result[variant] = json.loads(line[len("RESULT "):])
                print(case, mode, variant, result[variant], flush=True)
            before, after = result["concat"], result["split"]
            mb = lambda b: f"{b / 1e6:.1f}"
            rows.append([case, mode, mb(before["temp"]), mb(after["temp"]), mb(before["temp"] - after["temp"]),
                         mb(after["gate_up_bytes"]), before["weight_concatenates"], after["weight_concatenates"],
                         f"{before['compile_s']} / {after['compile_s']}"])
    header = ["preset:tokens:ep", "mode", "temp MB concat (before)", "temp MB split (after)", "saved MB",
              "gate+up MB", "[g,d,2f] made before", "after", "compile s"]
    text = (f"moe_mlp(fused=True), fused_moe backend {backend}, bfloat16, compiled for {args.chip} (compile-only "
            f"{wheel} wheel, this CPU machine); temp = compiled.memory_analysis().temp_size_in_bytes\n\n"
            + tabulate(rows, header) + "\n")
    if args.kernels:
        proc = subprocess.run([sys.executable, __file__, "--worker", f"{args.chip}:kernels"], env=wheels.worker_env(),
                              capture_output=True, text=True, timeout=3600)
        verdicts = [json.loads(x[len("KERNEL "):]) for x in proc.stdout.splitlines() if x.startswith("KERNEL ")]
        if proc.returncode:
            raise SystemExit(f"kernel compiles failed:\n{proc.stderr[-3000:]}")
        for v in verdicts:
            wrong = (v["rules"] == "keep") != (v["compiler"] == "ok")
            v["verdict"] = ("false accept" if v["rules"] == "keep" else "false reject") if wrong else ""
        text += ("\nThe dispatch's kernels alone, qwen3-30b-a3b 512 tokens bf16 (fp8: float8_e4m3fn weights in "
                 f"128-row blocks), on one array and on (gate, up), for {args.chip} ({budget} budget):\n\n"
                 + tabulate([list(v.values()) for v in verdicts], list(verdicts[0]) if verdicts else []) + "\n"
                 + f"\nfalse accepts: {sum(v['verdict'] == 'false accept' for v in verdicts)}, false rejects: "
                 f"{sum(v['verdict'] == 'false reject' for v in verdicts)} of {len(verdicts)} compiles\n")
    print(text)
    out = RESULTS / f"fused_{backend}_weights_{args.chip}_compile_{time.strftime('%Y-%m-%d')}{'_' + args.label if args.label else ''}.txt"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
