"""The fused dispatch's dx on CPU: the fused scatter-add (`gmm_combine` with the gate/up weights transposed,
row weights 1: what `gather_gmm`'s VJP runs) against the existing kernels (the tuned ragged_dot dlhs of gate
and of up, summed into [tokens x top_k, hidden], then the tuned gather-reduce of `ragged_gather`'s VJP), timed
interleaved in one run (`bench.time_variants`), with each program's temp memory.

    PYTHONPATH=src .venv/bin/python benchmarks/fused_dx_cpu.py [--preset qwen3-30b-a3b] [--tokens 256,4096]
        [--ep 4] [--dtypes float32,bfloat16] [--samples 3]

Nothing is asserted: the machine is shared and noisy; only the ratios of one run count.
"""

from __future__ import annotations

import argparse
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

from moe_tune import ragged_dot, ragged_gather

from moe_tune.commands import bench
from moe_tune.kernels.fused_moe.op import _Call, _problem
from moe_tune.layer.models import get_preset
from moe_tune.kernels.fused_moe.definition import routed_tokens


def case(preset, tokens: int, ep: int, dtype: str, samples: int) -> str:
    rng = np.random.default_rng(0)
    local, d, f, k = preset.experts // ep, preset.hidden, preset.expert_intermediate, preset.top_k
    m = tokens * k
    sizes = np.full(preset.experts, m // preset.experts, np.int32)
    sizes[: m - int(sizes.sum())] += 1
    rows = jnp.asarray(routed_tokens(sizes, m, tokens, rng))
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.05, dtype)
    inputs = {"x": normal(tokens, d), "dh": normal(m, 2 * f), "gate": normal(local, d, f), "up": normal(local, d, f),
              "sizes": jnp.asarray(sizes)}
    offset = 0 if ep > 1 else None
    end = int(sizes[:local].sum())

    def fused(a):  # what gather_gmm's VJP runs for dx
        problem = _problem(a["x"], rows, (a["gate"], a["up"]), a["sizes"], offset, stage="dispatch", tokens=tokens,
                           glu="silu")
        call = _Call("tiled", problem)
        return call.gmm_combine("bwd", a["dh"], (a["gate"], a["up"]), a["sizes"], rows, jnp.ones((m,), jnp.float32),
                                None if offset is None else jnp.int32(offset))

    def existing(a):  # the unfused layer's dx: two dlhs, their sum, the gather's VJP (a gather-reduce)
        def forward(x):
            gathered = ragged_gather(x, rows, 0, end)
            return (ragged_dot(gathered, a["gate"], a["sizes"], group_offset=offset),
                    ragged_dot(gathered, a["up"], a["sizes"], group_offset=offset))
        _, pullback = jax.vjp(forward, a["x"])
        return pullback((a["dh"][:, :f], a["dh"][:, f:]))[0]

    variants = {"existing": existing, "fused": fused}
    timed = bench.time_variants(variants, inputs, samples=samples)
    temp = {n: jax.jit(v).lower(inputs).compile().memory_analysis().temp_size_in_bytes / 2**20 for n, v in variants.items()}
    t = timed["times_s"]
    return (f"{preset.name} tokens={tokens} ep={ep} {dtype}: existing {t['existing'] * 1e3:.1f} ms, fused "
            f"{t['fused'] * 1e3:.1f} ms, existing/fused {t['existing'] / t['fused']:.2f} (spread "
            f"{max(timed['spread'].values()):.0%}); temp MiB {temp['existing']:.1f} -> {temp['fused']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="256,4096")
    parser.add_argument("--ep", default="4")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for ep in (int(e) for e in args.ep.split(",")):
            for dtype in args.dtypes.split(","):
                print(case(get_preset(args.preset), tokens, ep, dtype, args.samples), flush=True)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
