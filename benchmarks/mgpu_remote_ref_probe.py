"""Does a Mosaic GPU Pallas kernel with peer memory compile for 8 compile-only H100s on this CPU machine?

The smallest such kernel: inside `jax.shard_map` over the 8 devices of the CUDA plugin's compile-only
topology `1x8x1` (the `h100x8` slice, `targets.slice_compile.slice_devices`: `get_topology_desc(platform=
"cuda", topology="1x8x1", target_config=TEXT)`), each device copies its [128, 128] bf16 block into its right
neighbour's output through `plgpu.remote_ref(out_ref, device_id)` (a `PeerMemRef`), then signals the
neighbour's semaphore (`pl.semaphore_signal(sem, device_id=...)`) and waits for its own. Three variants:

- `remote_copy`: the copy and the semaphore (what a GPU in-kernel exchange needs);
- `signal_only`: the semaphore alone (no peer ref);
- `local_copy`: the same kernel writing its own output (no peer memory at all: the control).

Each is lowered and compiled (`jax.jit(...).lower(...).compile()`) in a compile worker's environment (a fresh
process with the compile-only wheels on its path, `targets.wheels.worker_env`), and the exact outcome is
recorded: `python benchmarks/mgpu_remote_ref_probe.py` writes
benchmarks/results/mgpu_remote_ref_probe_h100x8_2026-12-02.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

RESULT = Path(__file__).with_name("results") / "mgpu_remote_ref_probe_h100x8_2026-12-02.json"
SLICE = "h100x8"
VARIANTS = ("local_copy", "signal_only", "remote_copy")
ROWS, COLS = 128, 128


def kernel_call(variant: str, devices: int):
    """The per-device function (inside shard_map over axis `x`): x [ROWS, COLS] bf16 -> out [ROWS, COLS]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, out_ref):
        me = jax.lax.axis_index("x")
        right = jax.lax.rem(me + 1, jnp.int32(devices))
        if variant != "local_copy":
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        target = plgpu.remote_ref(out_ref, right) if variant == "remote_copy" else out_ref
        if variant != "signal_only":
            target[...] = x_ref[...]
        if variant != "local_copy":
            pl.semaphore_signal(sem, device_id=right)
            pl.semaphore_wait(sem, 1)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((ROWS, COLS), jnp.bfloat16), num_threads=1,
                        thread_name="wg")


def compile_variant(variant: str) -> dict:
    """Lower and compile one variant for the slice (run in the compile worker's process)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_tune.core.chips import get_slice
    from moe_tune.targets.compile import acting_as
    from moe_tune.targets.slice_compile import slice_devices

    piece = get_slice(SLICE)
    chips = slice_devices(SLICE)
    mesh = jax.sharding.Mesh(np.array(chips), ("x",))
    fn = jax.jit(jax.shard_map(kernel_call(variant, len(chips)), mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                               check_vma=False))
    arg = jax.ShapeDtypeStruct((ROWS * len(chips), COLS), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    result = {"variant": variant, "devices": len(chips), "device_kind": chips[0].device_kind}
    start = time.perf_counter()
    stage = "lower"
    try:
        with acting_as(piece.chip):
            lowered = fn.lower(arg)
            stage = "compile"
            compiled = lowered.compile()
        text = compiled.as_text()
        result.update(status="compiled", custom_calls=sorted(set(
            line.split("custom_call_target=\"")[1].split("\"")[0] for line in text.splitlines()
            if "custom_call_target=\"" in line)))
    except Exception as error:  # noqa: BLE001 (the outcome is the finding)
        lines = [line for line in str(error).splitlines() if line.strip()]
        result.update(status=f"{stage} failed", error_type=type(error).__name__,
                      error=lines[0][:600] if lines else "", error_lines=[line[:300] for line in lines[:12]])
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def worker(variants: list[str]) -> None:
    import jax

    found = {"jax": jax.__version__, "variants": [compile_variant(v) for v in variants]}
    try:
        import jax_cuda12_plugin  # noqa: F401
        from importlib.metadata import version
        found["cuda_plugin"] = version("jax-cuda12-plugin")
    except Exception:  # noqa: BLE001
        found["cuda_plugin"] = None
    print(json.dumps(found))


def ptx_facts(text: str) -> dict:
    """What the dumped PTX of the kernel shows: its target, its parameters (buffers, and for peer memory the
    table of peer addresses the runtime passes), and the system-scope memory operations (the semaphore signal
    and wait across devices)."""
    lines = [line.strip() for line in text.splitlines()]
    return {"target": next((line.split()[1] for line in lines if line.startswith(".target ")), None),
            "params": sum(line.startswith(".param ") for line in lines),
            "system_scope_ops": sorted({op for op in map(_opcode, lines) if op and ".sys" in op})}


def _opcode(line: str) -> str | None:
    """The instruction of one PTX line (its guard `@%p1` left out), None for a comment or a blank."""
    words = line.replace(";", " ").split()
    if not words or words[0].startswith("//"):
        return None
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def main() -> None:
    from moe_tune.targets import wheels

    if not wheels.available("gpu"):
        raise SystemExit("the CUDA plugin's compile-only wheels are missing: pip install 'moe-tune[gpu-compile]'")
    results = []
    # Mosaic GPU prints the PTX it generates for each kernel it compiles (LLVM's NVPTX back end, in-process)
    env = dict(wheels.worker_env(), MOSAIC_GPU_DUMP_PTX="1")
    for variant in VARIANTS:  # one fresh worker process each: a compiler abort loses only its variant
        done = subprocess.run([sys.executable, __file__, "--worker", variant], capture_output=True, text=True,
                              timeout=900, env=env, check=False)
        if done.returncode == 0:
            found = json.loads(done.stdout.strip().splitlines()[-1])
            results.extend(found.pop("variants"))
            results[-1]["ptx"] = ptx_facts(done.stdout + done.stderr)
            versions = found
        else:
            tail = [line for line in done.stderr.splitlines() if line.strip()][-6:]
            results.append({"variant": variant, "status": f"worker exited {done.returncode}", "error_lines": tail})
    record = {"probe": "Mosaic GPU kernel with a peer-memory ref (plgpu.remote_ref) and a device_id semaphore "
                       "signal, in shard_map over compile-only H100s", "slice": SLICE, "topology": "1x8x1",
              "shape": [ROWS, COLS], "dtype": "bfloat16", **locals().get("versions", {}), "results": results}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(record, indent=2) + "\n")
    for r in results:
        print(f"{r['variant']}: {r['status']}" + (f" -- {r.get('error', '')}" if "error" in r else ""))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        main()
