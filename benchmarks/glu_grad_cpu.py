"""The fused dispatch's gated-epilogue gradient, two ways, in the fused layer's training step (FINDINGS.md:
gated gradient per half): `slice` = the VJP of `activations.apply` through its two slices (a zero-padded [m, 2f] pair summed),
`half` = `op._glu_grad` (each half on its own, concatenated, bf16 through its bits, behind an optimization
barrier), `half_nobarrier` (the `_glu_grad` of commit 040b874: a float32 concatenate, no barrier). Each variant is
`fused_cpu.py`'s forward+backward program with `op._glu_grad` replaced while it is traced; compiled once, timed interleaved in the same trace rounds (`fused_cpu.timed`: A B C A B C ...),
with its temp memory from that compile.

    env PYTHONPATH=src .venv/bin/python benchmarks/glu_grad_cpu.py
        [--preset deepseek-v2-lite] [--tokens 4096] [--ep 4] [--dtypes bfloat16,float32] [--samples 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_tune.kernels.fused_moe import op
from moe_tune.kernels.fused_moe.activations import ACTIVATIONS, apply
from moe_tune.layer.models import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_cpu import layer_inputs, timed, variants  # noqa: E402


def glu_grad_nobarrier(glu: str, h: jax.Array, dout: jax.Array) -> jax.Array:
    """The `_glu_grad` of commit 040b874, for the comparison: halves concatenated in float32."""
    f = h.shape[1] // 2
    gate, up, d = h[:, :f].astype(jnp.float32), h[:, f:].astype(jnp.float32), dout.astype(jnp.float32)
    act, act_pullback = jax.vjp(ACTIVATIONS[glu][0], gate)
    return jnp.concatenate([act_pullback(d * up)[0], d * act], axis=1).astype(h.dtype)


def glu_grad_slices(glu: str, h: jax.Array, dout: jax.Array) -> jax.Array:
    """The VJP of `apply` through its slices (the bf16 / f16 path of commit 040b874)."""
    _, pullback = jax.vjp(lambda v: apply(glu, v), h.astype(jnp.float32))
    return pullback(dout.astype(jnp.float32))[0].astype(h.dtype)


def traced_with(fn, glu_grad):
    """fn, with `op._glu_grad` replaced while it is traced."""
    def run(inputs):
        saved, op._glu_grad = op._glu_grad, glu_grad
        try:
            return fn(inputs)
        finally:
            op._glu_grad = saved
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v2-lite")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print("load before:", uptime(), flush=True)
    preset = get_preset(args.preset)
    for dtype in args.dtypes.split(","):
        inputs = layer_inputs(preset, args.tokens, args.ep, dtype)
        step = variants(preset, args.ep)["fwd+bwd"]["fused"]
        fns = {"slice": traced_with(step, glu_grad_slices), "half": traced_with(step, op._glu_grad),
               "half_nobarrier": traced_with(step, glu_grad_nobarrier)}
        result = timed(fns, inputs, args.samples)
        t, temp = result["times_s"], {name: b / 2**20 for name, b in result["temp_bytes"].items()}
        print(f"{args.preset} tokens={args.tokens} ep={args.ep} {dtype} fused fwd+bwd: " + "  ".join(
            f"{name} {t[name] * 1e3:.0f} ms temp {temp[name]:.1f} MiB" for name in fns)
              + f"  slice/half {t['slice'] / t['half']:.3f}x  spread {max(result['spread'].values()):.0%}", flush=True)
    print("load after:", uptime())


if __name__ == "__main__":
    sys.exit(main())
