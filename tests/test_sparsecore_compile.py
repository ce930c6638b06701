"""The `sparsecore` gathers compiled by libtpu for compile-only v5p and v6e chips: one seeded config the rules
keep for each of qwen3-30b-a3b's dispatch, combines and combine gradient (tokens 512, hidden 2048, top-8,
bfloat16) must compile (no false accept). Small shapes, float32 and the whole grid, refused configs included,
are benchmarks/sparsecore_compile_audit.py's."""

from __future__ import annotations

import pytest
from sparsecore_compile_cases import TARGETS, TOKENS, jobs

from moe_tune.targets import wheels
from moe_tune.targets.jobs import CompilePool

pytestmark = pytest.mark.skipif(not wheels.available("tpu"),
                                reason="libtpu is missing: pip install 'moe-tune[tpu-compile]'")


@pytest.fixture(scope="module")
def pool():
    with CompilePool(workers=1, timeout=300) as compile_pool:
        yield compile_pool


@pytest.mark.parametrize("target", TARGETS)
def test_kept_configs_compile(pool, target):
    sampled = [j for j in jobs(target, per_problem=1, seed=0, dtypes=("bfloat16",)) if j.problem.tokens == TOKENS]
    assert {j.op for j in sampled} == {"ragged_gather", "ragged_gather_reduce", "dense_gather_reduce"}
    results = pool.compile(sampled)
    failed = [f"{j.op} {j.problem.key_fields()} {j.config.label()}: {r.status} {r.message}"
              for j, r in zip(sampled, results) if not r.ok]
    assert not failed, "\n".join(failed)


def test_the_chip_table_is_what_pallas_reports():
    """`core/chips.py`'s SparseCore facts are `pltpu.get_tpu_info().sparse_core` of each TPU target's compile-only
    device (none on v4 and v5e)."""
    import json
    import subprocess
    import sys

    from moe_tune.core.chips import TPU_TARGETS

    script = (
        "import json, jax\n"
        "from jax.experimental import topologies\n"
        "from jax.experimental.pallas import tpu as pltpu\n"
        "found = {}\n"
        f"for name, topology in {[(t.name, t.topology) for t in TPU_TARGETS]!r}:\n"
        "    with jax.default_device(topologies.get_topology_desc(topology, 'tpu').devices[0]):\n"
        "        sc = pltpu.get_tpu_info().sparse_core\n"
        "    found[name] = None if sc is None else [sc.num_cores, sc.num_subcores, sc.num_lanes,\n"
        "                                           sc.vmem_capacity_bytes]\n"
        "print(json.dumps(found))\n")
    done = subprocess.run([sys.executable, "-c", script], env=wheels.worker_env(), capture_output=True, text=True,
                          timeout=300, check=True)
    reported = json.loads(done.stdout.strip().splitlines()[-1])
    table = {t.name: None if t.sparse_core is None else [t.sparse_core.cores, t.sparse_core.subcores,
                                                         t.sparse_core.lanes, t.sparse_core.vmem_bytes]
             for t in TPU_TARGETS}
    assert reported == table


def test_the_lowered_kernels_carry_their_cost_estimate():
    """XLA's scheduler reads each kernel's cost from its custom call: lowered for a compile-only v6e, a weighted
    dispatch of 96 bfloat16 rows of 256 and a top-4 combine of them into 24 tokens say their flops (one product
    an element; 4 products and 3 adds an output element) and at least the bytes of the rows they move."""
    import json
    import subprocess
    import sys

    script = (
        "import json, re, jax, jax.numpy as jnp\n"
        "from moe_tune.targets import get_target\n"
        "from moe_tune.targets.compile import acting_as, topology_device\n"
        "from moe_tune.kernels.gather.sparsecore import sparsecore_gather, sparsecore_gather_reduce\n"
        "target = get_target('v6e'); device = topology_device(target)\n"
        "on = jax.sharding.SingleDeviceSharding(device)\n"
        "arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on)\n"
        "i, w = arg((96,), jnp.int32), arg((96,), jnp.float32)\n"
        "calls = {'gather': (lambda x, i, w: sparsecore_gather(x, i, 0, 90, w, rows_per_step=32, subcores=16),\n"
        "                    arg((24, 256), jnp.bfloat16)),\n"
        "         'reduce': (lambda x, i, w: sparsecore_gather_reduce(x, i, w, None, 4, tokens_per_step=4,\n"
        "                                                             subcores=16), arg((96, 256), jnp.bfloat16))}\n"
        "found = {}\n"
        "with acting_as(target), jax.default_device(device):\n"
        "    for name, (fn, x) in calls.items():\n"
        "        text = jax.jit(fn).lower(x, i, w).as_text()\n"
        "        costs = re.findall(r'cost_estimate\\\\22: (\\{.*?\\})', text)\n"
        "        found[name] = [json.loads(c.replace('\\\\0A', '').replace('\\\\22', '\"')) for c in costs]\n"
        "print(json.dumps(found))\n")
    done = subprocess.run([sys.executable, "-c", script], env=wheels.worker_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    row = 256 * 2
    [gather], [reduce] = found["gather"], found["reduce"]
    assert gather["flops"] == 96 * 256 and gather["transcendentals"] == 0
    assert gather["bytes_accessed"] >= (96 + 96) * row
    assert reduce["flops"] == 24 * 256 * (4 + 3) and reduce["transcendentals"] == 0
    assert reduce["bytes_accessed"] >= (96 + 24) * row


def test_sweep_target_compiles_the_sparsecore_candidates_and_refuses_a_chip_without_sparsecores(tmp_path):
    """`moe-tune sweep --target v6e --backend sparsecore` compiles the candidates and records them under the
    chip's kind; v5e has no SparseCores, and asking for them there is one line, exit 2."""
    import json

    from click.testing import CliRunner

    from moe_tune.cli import cli

    args = ["sweep", "--op", "ragged_gather", "--tokens", "24", "--top-k", "4", "--hidden", "256", "--dtype",
            "bfloat16", "--backend", "sparsecore", "--profile-dir", str(tmp_path), "--workers", "1",
            "--max-candidates", "2"]
    done = CliRunner().invoke(cli, [*args, "--target", "v6e"])
    assert done.exit_code == 0, done.output
    assert "[sparsecore]: 2 of 2 compile" in done.output
    records = [json.loads(line) for line in
               (tmp_path / "tpu_v6_lite" / "ragged_gather.compile-records.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["key"].endswith("|backend=sparsecore") for r in records)
    assert all(r["result"]["status"] == "ok" and r["result"]["target"] == "v6e" for r in records)
    assert len({json.dumps(r["config"], sort_keys=True) for r in records}) == 2
    refused = CliRunner().invoke(cli, [*args, "--target", "v5e"])
    assert refused.exit_code == 2
    assert refused.output.strip().splitlines() == [
        "error: --backend sparsecore cannot run on v5e: tpu_v5_lite has no SparseCores"]
