"""GPU profiler probe (one short call on a lent GPU): three rounds of a bf16 2048^3 matmul under
`jax.profiler.trace`; per round, the device-plane events the tuner times and the rows of xprof's `hlo_stats` and
`kernel_stats` (does CUPTI keep working after xprof has converted a trace?). The first xplane is copied to $OUT.

    PYTHONPATH=src python benchmarks/gpu_profiler_probe.py
"""
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_tune.tuner.timing import xplane_file, device_planes, plane_events
from moe_tune.commands.breakdown import xprof_tools
out = Path(os.environ.get("OUT", "."))
f = jax.jit(lambda a, b: (a @ b).sum())
a = jnp.ones((2048, 2048), jnp.bfloat16); b = jnp.ones((2048, 2048), jnp.bfloat16)
f(a, b).block_until_ready()
for round_ in range(3):
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(3):
            f(a, b).block_until_ready()
    x = xplane_file(Path(d))
    prof, planes = device_planes(Path(d), "gpu")
    n = 0
    mods = set()
    if prof is not None:
        pl = list(prof.planes)
        for p in planes:
            for line, name, start, dur, stats in plane_events(pl[p]):
                n += 1; mods.add(stats.get("hlo_module"))
    print(f"round {round_}: xplane {x}, device planes {planes}, events {n}, modules {mods}", flush=True)
    if round_ == 0 and x is not None:
        shutil.copy(x, out / "probe.xplane.pb")
    for tool in ("hlo_stats", "kernel_stats"):
        try:
            data = xprof_tools.tool_data(x, tool)
            rows = xprof_tools.datatable_rows(data)
            print(f"  {tool}: {len(rows)} rows; first {rows[:2]}", flush=True)
        except Exception as e:
            print(f"  {tool} FAILED {type(e).__name__}: {e}", flush=True)
