"""Checks of the MoE layer's `in_kernel` strategy (rows moved by remote DMA inside a Pallas TPU kernel, run in
interpret mode) on host devices, as one process: `python tests/in_kernel_checks.py` prints one JSON object, case
name -> result. The layer cases are `sharded_layer_checks.run_case`'s (the float64 reference, relative errors,
dropped counts) on meshes of 4 (and 8) of the 8 host devices; tests/test_in_kernel.py asserts on them.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import sharded_layer_checks as checks  # first: it sets the host device count before JAX starts

# isort: split
import jax
import jax.numpy as jnp
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
from jax.sharding import PartitionSpec as P

from moe_tune.core.errors import UsageError
from moe_tune.layer import in_kernel, in_kernel_gmm, in_kernel_return, in_kernel_tpu

CASES = {
    "ep4_f32": dict(strategy="in_kernel", ep=4, collectives=True),
    # every token's top_k on experts 0-1: device 0 receives every row, devices 1-3 none
    "ep4_skew": dict(strategy="in_kernel", ep=4, skew_to=0),
    "ep4_skew_capacity": dict(strategy="in_kernel", ep=4, skew_to=4, capacity_factor=1.5),
    "ep4_int8": dict(strategy="in_kernel", ep=4, dtype="int8", quant_block=4),
    "ep4_tp2_bf16": dict(strategy="in_kernel", ep=4, tp=2, dtype="bfloat16"),
    "ep2_tp2_f32": dict(strategy="in_kernel", ep=2, tp=2, grads=False, collectives=True),
    # two token chunks (a ShardingConfig): each its own two kernels and capacity, one after the other
    "ep4_chunks2_skew_capacity": dict(strategy="in_kernel", ep=4, token_chunks=2, skew_to=4, capacity_factor=1.3),
}
RACE_CASE = ("ep8_f32_races", dict(strategy="in_kernel", ep=8, skew_to=2))
# receive tiles of 16 rows (two per device, each shared by several experts): visits of one tile load their own
# group's rows, which land at different times; the return in two n tiles of 4 columns (bfloat16: 2 words)
SMALL_TILES = ("ep4_bf16_tiles16", dict(strategy="in_kernel", ep=4, dtype="bfloat16", grads=False))
# the unfused path (`in_kernel_gmm.refusal` says why: an activation the fused kernels do not know by name, or
# metadata past SMEM): scatter_rows both ways, the grouped matmuls between them
UNFUSED = ("ep4_skew_unfused", dict(strategy="in_kernel", ep=4, skew_to=0))
SAME_CAPACITY = ("ep4_skew_capacity_all_to_all", dict(CASES["ep4_skew_capacity"], strategy="all_to_all",
                                                      grads=False))


class RaceStates:
    """Every race-detection state the interpreter creates (one per interpreted kernel run) while the block
    runs, so that a race in any kernel of a program is seen, not only in the last one."""

    def __enter__(self):
        self.states = []
        self.saved = interpreter.RaceDetectionState
        outer = self

        class Recorded(self.saved):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                outer.states.append(self)

        interpreter.RaceDetectionState = Recorded
        return self

    def __exit__(self, *exc):
        interpreter.RaceDetectionState = self.saved

    def found(self) -> bool:
        return any(state.races_found for state in self.states)


class KernelCalls:
    """How often each of the strategy's kernels is traced while the block runs (a case's "kernels"): the fused
    dispatch (`dispatch_gate_up`), the fused return (`down_return`) and the unfused `scatter_rows`."""

    NAMES = ("dispatch_gate_up", "down_return", "scatter_rows")

    def __enter__(self):
        self.calls = dict.fromkeys(self.NAMES, 0)
        self.saved = {name: self._home(name).__dict__[name] for name in self.NAMES}
        for name, real in self.saved.items():
            setattr(self._home(name), name, self._counted(name, real))
        return self

    def __exit__(self, *exc):
        for name, real in self.saved.items():
            setattr(self._home(name), name, real)

    @staticmethod
    def _home(name: str):  # the module whose attribute in_kernel's forward calls
        return in_kernel_gmm if name == "dispatch_gate_up" else in_kernel

    def _counted(self, name: str, real):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return real(*args, **kwargs)

        return counted


def run_counted(case: dict) -> dict:
    """`checks.run_case` with the strategy's kernel calls counted ("kernels")."""
    with KernelCalls() as kernels:
        result = checks.run_case(**case)
    return dict(result, kernels=kernels.calls)


def row_collectives(text: str) -> list[str]:
    """The element types of every all-to-all, all-gather and collective-permute in a lowered program's
    StableHLO (one entry per op): token rows would travel as float ones."""
    found = []
    for line in text.splitlines():
        if re.search(r"\bstablehlo\.(all_to_all|all_gather|collective_permute)\b", line):
            types = re.findall(r"tensor<[0-9x]*x?([a-z0-9]+)>", line.split("->")[-1])
            found.extend(types or ["?"])
    return found


def with_races(name: str, case: dict) -> dict:
    with RaceStates() as races, in_kernel_tpu.race_detection():
        result = run_counted(case)
    result["races"] = races.found()
    result["race_states"] = len(races.states)
    return result


def with_small_tiles(case: dict) -> dict:
    """A case with the fused kernels' row tile cut to 16 and the return's output columns to 4 (two n tiles);
    "tm": the row tiles its kernels were traced with, "return_tn": the return's column tiles."""
    saved_tm, saved_tiles, saved_tn = in_kernel_gmm.TM, in_kernel_gmm.tiles, in_kernel_return.TN_MAX
    used, columns = set(), set()

    def tiles(*args, **kwargs):
        chosen = saved_tiles(*args, **kwargs)
        used.add(chosen[0])
        if "tn_max" in kwargs:
            columns.add(chosen[2])
        return chosen

    in_kernel_gmm.TM, in_kernel_gmm.tiles, in_kernel_return.TN_MAX = 16, tiles, 4
    try:
        return dict(run_counted(case), tm=sorted(used), return_tn=sorted(columns))
    finally:
        in_kernel_gmm.TM, in_kernel_gmm.tiles, in_kernel_return.TN_MAX = saved_tm, saved_tiles, saved_tn


def unfused(case: dict) -> dict:
    """A case run with the fused dispatch refused (the fallback's two `scatter_rows`)."""
    saved = in_kernel_gmm.refusal
    in_kernel_gmm.refusal = lambda *args: "refused by the check"
    try:
        return run_counted(case)
    finally:
        in_kernel_gmm.refusal = saved


def colliding_scatter() -> dict:
    """The race detector's control: every device of 4 DMAs its row into row 0 of device 0 (two rows landing in
    one place), which it must report."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("expert",))

    def body(x):
        zero, one = jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32)
        expected = jnp.where(jax.lax.axis_index("expert") == 0, 3, 0).astype(jnp.int32)
        return in_kernel_tpu.scatter_rows(x, (zero, one, zero, zero), expected, 2, axis="expert", devices=4,
                                          collective_id=in_kernel_tpu.DISPATCH_ID)

    x = jnp.arange(4 * 128, dtype=jnp.float32).reshape(4, 128)
    with RaceStates() as races, in_kernel_tpu.race_detection():
        jax.block_until_ready(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"),
                                                    out_specs=P("expert")))(x))
    return {"races": races.found()}


def refusals() -> dict:
    """in_kernel's one-line refusals: fused=True (the experts' gathers run on other devices)."""
    found = {}
    try:
        checks.run_case(strategy="in_kernel", ep=4, fused=True, grads=False)
        found["fused"] = None
    except UsageError as error:
        found["fused"] = str(error)
    return found


def main() -> None:
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = run_counted(case)
            if case.get("collectives"):
                results[name]["row_collectives"] = row_collectives(lowered(case))
        except Exception as error:  # reported, so one failing case does not hide the others
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"}
    runners = {RACE_CASE[0]: lambda case: with_races(RACE_CASE[0], case), SMALL_TILES[0]: with_small_tiles,
               UNFUSED[0]: unfused}
    for name, case in (RACE_CASE, SMALL_TILES, UNFUSED, SAME_CAPACITY):
        try:
            results[name] = runners.get(name, run_counted)(case)
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"}
    results["colliding_scatter"] = colliding_scatter()
    results["refusals"] = refusals()
    print(json.dumps(results))


def lowered(case: dict) -> str:
    """The StableHLO of a case's forward (the layer through `sharded_moe_mlp`)."""
    import moe_tune

    ep, tp = case["ep"], case.get("tp", 1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:ep * tp]).reshape(ep, tp), ("expert", "tensor"))
    x, logits, w_gate, w_up, w_down, _ = checks.inputs(4 * ep)
    arrays = [jnp.asarray(a, jnp.float32) for a in (x, logits, w_gate, w_up, w_down)]
    with checks.plain_backends():
        return jax.jit(lambda *a: moe_tune.sharded_moe_mlp(
            *a, checks.TOP_K, mesh=mesh, tensor_axis="tensor" if tp > 1 else None,
            ep_strategy="in_kernel")).lower(*arrays).as_text()


if __name__ == "__main__":
    main()
