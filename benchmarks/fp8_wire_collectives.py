"""What the MoE layer's collectives carry with the native and the fp8 dispatch wire, as the real compilers
compile them for compile-only slices (8 H100s `h100x8`, 4 v5e chips `v5e:2x2`).

For each strategy and exchange (all_gather; all_to_all over the ragged and the fixed exchange) and each wire,
the layer (`sharded_moe_mlp`, bfloat16, hidden 1024, intermediate 512, 16 experts, top_k 2, 128 tokens a chip,
every chip on the expert axis) is compiled in a compile worker's environment (`targets.wheels.worker_env`,
one process per slice), and the compiled HLO's collectives are read: per collective op and element type, the
bytes of its results per chip (the shapes' elements x itemsize; a tuple's parts summed). XLA:CPU widens 8- and
16-bit collectives (fp8 to f16, bf16 to f32: tests/fp8_wire_checks.py reads the lowered module for that
reason); these compilers are what chips run. `python benchmarks/fp8_wire_collectives.py` writes
benchmarks/results/fp8_wire_collectives_h100x8_2026-12-02.json (both slices).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

RESULT = Path(__file__).with_name("results") / "fp8_wire_collectives_h100x8_2026-12-02.json"
SLICES = ("h100x8", "v5e:2x2")
WAYS = (("all_gather", "ragged"), ("all_to_all", "ragged"), ("all_to_all", "fixed"))
SHAPE = dict(hidden=1024, intermediate=512, experts=16, top_k=2, tokens=128)
ITEMSIZE = {"f8e4m3fn": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-to-all|ragged-all-to-all)(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


def collective_bytes(text: str) -> dict[str, int]:
    """`op:dtype` -> bytes of the results of the compiled module's collectives of that op and dtype (an
    async start's result tuple holds its operand too: only the last half of its arrays is counted)."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        arrays = _ARRAY.findall(match.group(1))
        if "-start(" in line[match.start():]:
            arrays = arrays[len(arrays) // 2:]
        for dtype, dims in arrays:
            if dtype in ITEMSIZE:
                elements = 1
                for d in filter(None, dims.split(",")):
                    elements *= int(d)
                key = f"{match.group(2)}:{dtype}"
                found[key] = found.get(key, 0) + elements * ITEMSIZE[dtype]
    return found


def worker(name: str) -> None:
    import jax

    from moe_tune.core.chips import get_slice
    from moe_tune.layer.moe import sharded_moe_mlp
    from moe_tune.layer.sharding_choice import ShardingConfig
    from moe_tune.targets.compile import acting_as
    from moe_tune.targets.slice_compile import SliceJob, _arguments, slice_mesh

    piece = get_slice(name)
    mesh = slice_mesh(piece, piece.chips, 1)
    args = _arguments(SliceJob(slice=name, expert=piece.chips, **SHAPE), mesh)
    found = {}
    for strategy, exchange in WAYS:
        for wire in ("native", "fp8"):
            config = ShardingConfig(strategy=strategy, exchange=exchange, wire=wire)
            fn = jax.jit(lambda *a, c=config: sharded_moe_mlp(*a, SHAPE["top_k"], mesh=mesh, ep_strategy=c))
            key = f"{strategy}:{exchange}:{wire}"
            try:
                with acting_as(piece.chip):
                    found[key] = collective_bytes(fn.lower(*args).compile().as_text())
            except Exception as error:  # noqa: BLE001 (recorded)
                found[key] = {"error": str(error).splitlines()[0][:300]}
    print(json.dumps(found))


def main() -> None:
    from moe_tune.targets import wheels

    record = {"shape": SHAPE, "dtype": "bfloat16", "slices": {}}
    for name in SLICES:
        done = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True, text=True,
                              timeout=900, env=wheels.worker_env(), check=False)
        if done.returncode == 0:
            record["slices"][name] = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            record["slices"][name] = {"error": done.stderr.strip().splitlines()[-1:]}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["slices"], indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        main()
