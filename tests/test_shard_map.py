"""Every op inside a default `jax.shard_map` (check_vma=True) gives what it gives outside: `ragged_dot` on every
backend (expert-parallel group offsets, int8 operands, the VJP: fwd, dlhs, drhs), the three gathers, the fused
`gather_gmm` / `gmm_combine` and `moe_mlp` (fused and unfused) with `expert_offset`.

The checks need several devices, and JAX takes its host device count only before it starts, so they run in a
subprocess (this file as a script, on 4 host CPU devices) that prints one JSON line per case; the tests read
them; once per test run, xdist's workers splitting the cases (tests/run_once.py). Each case runs the op per
shard inside shard_map and on each shard's inputs outside, and compares. Operands are mixed as a sharded
layer mixes them: some vary over the mesh axis (a shard's rows, its experts' weights, ranges, group offsets),
some are the same on every device (replicated tokens or weights, indices, group sizes, router logits), so
kernels meet both kinds of value in one loop or Pallas call; the gradient of a replicated operand is the sum
of every device's (inside shard_map one array, outside the sum of the shards' own).

The fused Pallas TPU kernels run on a 2-device mesh: their interpreter simulates the DMAs of every device of
the mesh at once, and with 4 devices on a 2-core machine it stalls. Not here: `mosaic_gpu`, whose interpreter
(it also simulates the mesh's devices) fails its own barrier bookkeeping on 2 and 4 devices
("Barrier remains allocated"), and then waits forever."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from run_once import check_env, once_per_run

DEVICES = 4

RAGGED_DOT = {  # backend -> (dtype, configs per direction, devices)
    "xla": ("float32", None, DEVICES),
    "tiled": ("float32", None, DEVICES),
    "megablox": ("float32", {"fwd": {"tm": 32, "tk": 128, "tn": 128}, "dlhs": {"tm": 32, "tk": 128, "tn": 128},
                             "drhs": {"tm": 128, "tk": 128, "tn": 128}}, DEVICES),
    "triton": ("float32", {d: {"block_m": 16, "block_k": 32, "block_n": 32} for d in ("fwd", "dlhs", "drhs")},
               DEVICES),
}
GATHER_BACKENDS = ("jax", "tiled", "triton", "pallas_tpu", "sparsecore")
FUSED = {  # backend -> (config, devices)
    "jax": (None, DEVICES),
    "tiled": (None, DEVICES),
    "triton": ({"block_m": 16, "block_k": 32, "block_n": 32}, DEVICES),
    "pallas_tpu": ({"tm": 16, "tk": 128, "tn": 128, "dmas_in_flight": 4}, 2),  # the combine's tk: its k
}

CASES = [
    *(f"ragged_dot/{b}/{kind}" for b in RAGGED_DOT for kind in ("expert_parallel", "quantized")),
    *(f"{op}/{b}" for b in GATHER_BACKENDS for op in ("ragged_gather", "ragged_gather_reduce", "dense_gather_reduce")),
    *(f"{op}/{b}" for b in FUSED for op in ("gather_gmm", "gmm_combine")),
    *(f"moe_mlp/{kind}{tokens}" for kind in ("unfused", "fused") for tokens in ("", "/replicated_tokens")),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    def make(part: int, parts: int) -> dict:
        env = check_env(f"--xla_force_host_platform_device_count={DEVICES}")
        proc = subprocess.run([sys.executable, __file__, str(part), str(parts)], env=env, capture_output=True,
                              text=True, timeout=840)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert lines, (proc.returncode, proc.stderr[-3000:])
        return {line["case"]: line for line in lines}

    # once per test run, its cases split between the xdist workers (each worker otherwise runs them all)
    return once_per_run(tmp_path_factory, "shard_map_checks", make, split=True)


@pytest.mark.parametrize("case", CASES)
def test_inside_shard_map_as_outside(results, case):
    result = results.get(case)
    assert result is not None, f"{case}: no result (the script stopped before it)"
    assert result["error"] is None, f"{case}: {result['error']}"
    assert result["difference"] <= result["tolerance"], result


# ---- the script: run with $XLA_FLAGS giving at least DEVICES host devices; `PART PARTS` runs every PARTS-th
# case from the PART-th (0-based) on, none of the others


def _main(part: int = 0, parts: int = 1) -> None:  # noqa: C901 (one case table)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import moe_tune

    rng = np.random.default_rng(0)
    ran: list[str] = []  # every case met so far, this part's or not
    meshes = {d: jax.make_mesh((d,), ("x",), devices=jax.devices()[:d]) for d in (2, DEVICES)}

    def run(case: str, fn, args, vary, devices: int = DEVICES, summed=(), tolerance: float = 1e-5) -> None:
        """fn(*one shard's args) -> a tuple of arrays, inside shard_map (args[i] split over the devices where
        vary[i], else the same on all) and outside on each shard; outputs in `summed` (the cotangent of an
        operand the same on all devices) come out of shard_map as one array, outside as the shards' sum."""
        ran.append(case)
        if (len(ran) - 1) % parts != part:  # another part's case (its inputs drawn all the same)
            return
        mesh = meshes[devices]
        shard = lambda i: [a[i] if v else a for a, v in zip(args, vary)]
        try:
            count = len(jax.eval_shape(fn, *shard(0)))

            def inner(*blocks):
                outs = fn(*[b[0] if v else b for b, v in zip(blocks, vary)])
                return tuple(o if i in summed else o[None] for i, o in enumerate(outs))

            specs = tuple(P("x") if v else P() for v in vary)
            placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
            out_specs = tuple(P() if i in summed else P("x") for i in range(count))
            got = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=out_specs))(*placed)
            per_shard = [[np.asarray(o, np.float64) for o in jax.jit(fn)(*shard(i))] for i in range(devices)]
            difference, scale = 0.0, 1.0
            for i, o in enumerate(got):
                want = [s[i] for s in per_shard]
                want = np.sum(want, axis=0) if i in summed else np.stack(want)
                difference = max(difference, float(np.max(np.abs(np.asarray(o, np.float64) - want), initial=0.0)))
                scale = max(scale, float(np.max(np.abs(want), initial=0.0)))
            line = {"case": case, "error": None, "difference": difference / scale, "tolerance": tolerance}
        except Exception as e:  # noqa: BLE001 (each case reports its own failure)
            line = {"case": case, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}",
                    "difference": None, "tolerance": tolerance}
        print(json.dumps(line), flush=True)

    def stacked(shape, devices=DEVICES, scale=1.0):
        return (rng.standard_normal((devices, *shape)) * scale).astype(np.float32)

    # ---- ragged_dot: an expert-parallel shard (its rows and local experts' weights vary, the group sizes of all
    # experts are replicated, the offset varies), and int8 operands (weights replicated: data parallel)
    m, k, n, local = 32, 128, 128, 2
    for backend, (dtype, config, devices) in RAGGED_DOT.items():
        sizes = rng.multinomial(m - 3, np.ones(local * devices) / (local * devices)).astype(np.int32)
        offsets = (np.arange(devices) * local).astype(np.int32)

        def ep(lhs, rhs, offset, cot, *, sizes=sizes, backend=backend, dtype=dtype, config=config):
            call = lambda a, b: moe_tune.ragged_dot(a.astype(dtype), b.astype(dtype), jnp.asarray(sizes),
                                                    group_offset=offset, backend=backend, config=config)
            out, vjp = jax.vjp(call, lhs, rhs)
            return (out, *vjp(cot.astype(out.dtype)))

        run(f"ragged_dot/{backend}/expert_parallel", ep,
            (stacked((m, k)), stacked((local, k, n)), offsets, stacked((m, n))), (True, True, True, True),
            devices)
        group_sizes = np.stack([rng.multinomial(m - 5, np.ones(3) / 3) for _ in range(devices)]).astype(np.int32)

        def quantized(lhs, rhs, sizes, cot, *, backend=backend, config=config):
            q_rhs = moe_tune.quantize(rhs, "int8", axis=1)
            q_lhs = moe_tune.quantize(lhs, "int8", axis=1)
            out_w, vjp_w = jax.vjp(lambda a: moe_tune.ragged_dot(a, q_rhs, sizes, backend=backend, config=config), lhs)
            out_a, vjp_a = jax.vjp(lambda b: moe_tune.ragged_dot(q_lhs, b, sizes, backend=backend, config=config), rhs)
            return out_w, out_a, *vjp_w(cot), *vjp_a(cot)

        run(f"ragged_dot/{backend}/quantized", quantized,
            (stacked((m, k)), stacked((3, k, n))[0], group_sizes, stacked((m, n))), (True, False, True, True), devices,
            summed=(3,))  # data parallel: the weights replicated, their gradient summed

    # ---- the gathers: dispatch of replicated tokens into each shard's range, combines of each shard's rows
    tokens, hidden, r = 12, 128, 2
    entries = tokens * r
    indices = np.stack([rng.permutation(entries) % tokens for _ in range(DEVICES)]).astype(np.int32)
    bounds = np.stack([[i, entries - 2 * i] for i in range(DEVICES)]).astype(np.int32)
    valid = rng.random((DEVICES, entries)) > 0.3
    for backend in GATHER_BACKENDS:
        def dispatch(x, idx, se, w, cot, *, backend=backend):
            out, vjp = jax.vjp(lambda x, w: moe_tune.ragged_gather(x, idx, se[0], se[1], weights=w, backend=backend),
                               x, w)
            return (out, *vjp(cot))

        run(f"ragged_gather/{backend}", dispatch,
            (stacked((tokens, hidden))[0], indices[0], bounds, stacked((entries,)), stacked((entries, hidden))),
            (False, False, True, True, True), summed=(1,))  # replicated tokens: their gradient summed

        def combine(x, idx, w, ok, cot, *, backend=backend):
            out, vjp = jax.vjp(lambda x, w: moe_tune.ragged_gather_reduce(x, idx, w, ok, r, backend=backend), x, w)
            return (out, *vjp(cot))

        run(f"ragged_gather_reduce/{backend}", combine,
            (stacked((entries, hidden)), indices[0], stacked((entries,)), valid, stacked((tokens, hidden))),
            (True, False, True, True, True))

        def dense(x, idx, w, cot, *, backend=backend):
            out, vjp = jax.vjp(lambda x, w: moe_tune.dense_gather_reduce(x, idx, w, r, backend=backend), x, w)
            return (out, *vjp(cot))

        run(f"dense_gather_reduce/{backend}", dense,
            (stacked((entries, hidden)), indices, stacked((entries,)), stacked((tokens, hidden))), (True,) * 4)

    # ---- fused dispatch and combine of an expert-parallel shard: replicated tokens and routing, local weights
    tokens, hidden, width, top_k = 16, 128, 64, 2
    for backend, (config, devices) in FUSED.items():
        experts = local * devices
        chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).reshape(-1)
        rows = (np.argsort(chosen, kind="stable") // top_k).astype(np.int32)
        sizes = np.bincount(chosen, minlength=experts).astype(np.int32)
        offsets = (np.arange(devices) * local).astype(np.int32)
        configs = None if config is None else {"fwd": config, "bwd": config}
        # the combine contracts over the expert width, its backward's output has it: Pallas TPU tiles of all of it
        combine_configs = configs if backend != "pallas_tpu" else {"fwd": dict(config, tk=width),
                                                                         "bwd": dict(config, tn=width)}

        def gather_gmm(x, w, offset, cot, *, sizes=sizes, rows=rows, backend=backend, configs=configs):
            out, vjp = jax.vjp(lambda x, w: moe_tune.gather_gmm(x, rows, w, sizes, group_offset=offset, glu="silu",
                                                                 backend=backend, config=configs), x, w)
            return (out, *vjp(cot))

        run(f"gather_gmm/{backend}", gather_gmm,
            (stacked((tokens, hidden), devices), stacked((local, hidden, 2 * width), devices, 0.1), offsets,
             stacked((tokens * top_k, width), devices)), (True, True, True, True), devices)

        def gmm_combine(h, w, weights, offset, cot, *, sizes=sizes, rows=rows, backend=backend,
                        configs=combine_configs):
            out, vjp = jax.vjp(lambda h, w, weights: moe_tune.gmm_combine(
                h, w, sizes, rows, weights, tokens, group_offset=offset, backend=backend, config=configs),
                h, w, weights)
            return (out, *vjp(cot))

        run(f"gmm_combine/{backend}", gmm_combine,
            (stacked((tokens * top_k, width), devices), stacked((local, width, hidden), devices, 0.1),
             rng.random((devices, tokens * top_k)).astype(np.float32), offsets, stacked((tokens, hidden), devices)),
            (True, True, True, True, True), devices)

    # ---- moe_mlp on an expert-parallel shard: each device its tokens and its experts, the router's logits
    # replicated; the result is the shard's experts' part of the layer
    experts = local * DEVICES
    x = stacked((tokens, hidden))
    logits = stacked((tokens, experts))[0]
    w_gate, w_up = stacked((local, hidden, width), scale=0.1), stacked((local, hidden, width), scale=0.1)
    w_down = stacked((local, width, hidden), scale=0.1)
    offsets = (np.arange(DEVICES) * local).astype(np.int32)
    cot = stacked((tokens, hidden))
    for fused in (False, True):
        def layer(x, logits, gate, up, down, offset, cot, *, fused=fused):
            call = lambda x, gate, up, down: moe_tune.moe_mlp(x, logits, gate, up, down, top_k, expert_offset=offset,
                                                               fused=fused)
            out, vjp = jax.vjp(call, x, gate, up, down)
            return (out, *vjp(cot))

        run(f"moe_mlp/{'fused' if fused else 'unfused'}", layer, (x, logits, w_gate, w_up, w_down, offsets, cot),
            (True, False, True, True, True, True, True))
        # the tokens replicated too, as in README's example: their gradient is the sum of every shard's
        run(f"moe_mlp/{'fused' if fused else 'unfused'}/replicated_tokens", layer,
            (x[0], logits, w_gate, w_up, w_down, offsets, cot), (False, False, True, True, True, True, True),
            summed=(1,))


if __name__ == "__main__":
    _main(*map(int, sys.argv[1:3]))
