"""The fused MoE layer's forward at decode (256 tokens) with the dispatch's weights read per tile, one part
after the other (the installed rule, `tiled.sequenced_weights`), against the same layer with them read once
per group (the rule patched off while that variant is traced), and the unfused layer: timed interleaved,
medians and minima, temp memory of each compiled program.

    env PYTHONPATH=src .venv/bin/python benchmarks/fused_decode_weights_cpu.py \\
        qwen3-30b-a3b float32 1 15     # preset dtype ep samples
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
import fused_cpu  # noqa: E402

from moe_tune.core import devices  # noqa: E402
from moe_tune.kernels.fused_moe import tiled  # noqa: E402
from moe_tune.layer.models import get_preset  # noqa: E402
from moe_tune.tuner.timing import time_candidates  # noqa: E402


def main() -> None:
    preset, dtype, ep, samples = get_preset(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    inputs = fused_cpu.layer_inputs(preset, 256, ep, dtype)
    fns = fused_cpu.variants(preset, ep)["fwd"]
    rule = tiled.sequenced_weights
    compiled = {"unfused": jax.jit(fns["unfused"]).lower(inputs).compile(),
                "fused_pertile": jax.jit(fns["fused"]).lower(inputs).compile()}
    tiled.sequenced_weights = lambda *a: False
    try:
        compiled["fused_pergroup"] = jax.jit(lambda a: fns["fused"](a)).lower(inputs).compile()
    finally:
        tiled.sequenced_weights = rule
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(uptime())
    for c in compiled.values():
        jax.block_until_ready(c(inputs))
    t, _ = time_candidates({k: (lambda c=c: c(inputs)) for k, c in compiled.items()}, samples=samples,
                           platform=devices.platform(), warmup=0)
    for k, c in compiled.items():
        print(f"{k:<15} median {t[k].median_s * 1e3:7.1f} ms  min {t[k].min_s * 1e3:7.1f} ms  spread "
              f"{t[k].spread:.0%}  temp {c.memory_analysis().temp_size_in_bytes / 2**20:.1f} MiB")
    print(uptime())


if __name__ == "__main__":
    sys.exit(main())
