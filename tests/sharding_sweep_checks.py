"""The sharded layer's tuning on 4 of 8 host devices, run as one process (the device count is fixed when JAX
starts): `python tests/sharding_sweep_checks.py DIR` sweeps the tiny preset's layer across devices
(`sweep --model tiny --tokens 8 --ep 4 --direction fwd`, tables under $MOE_TUNE_PROFILE_DIR), runs the layer
under each strategy and with the strategy asked of the tables, and prints one JSON object: the sweep's exit
code and output's tail, every kernel lookup the layer logged (`KernelOp.resolve_config`'s INFO line), and
`coverage --format json` of the same layer. tests/test_sharding_choice.py asserts on it.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from tiny_layer import TINY  # noqa: E402

import moe_tune  # noqa: E402
from moe_tune.cli import cli  # noqa: E402
from moe_tune.layer import models  # noqa: E402
from moe_tune.profiles import table as dirs  # noqa: E402

TOKENS, EP = 8, 4
LAYER = ["--model", "tiny", "--tokens", str(TOKENS), "--ep", str(EP), "--dtype", "float32",
         "--direction", "fwd"]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_layer() -> list[str]:
    """Every kernel lookup of the layer's forward on a 4-device mesh, tokens split (each strategy, and the
    tables' choice) and replicated."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((TOKENS * EP, TINY.hidden)).astype(np.float32)
    logits = rng.standard_normal((TOKENS * EP, TINY.experts)).astype(np.float32)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    weights = (w(TINY.experts, TINY.hidden, TINY.expert_intermediate), w(TINY.experts, TINY.hidden,
               TINY.expert_intermediate), w(TINY.experts, TINY.expert_intermediate, TINY.hidden))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:EP]), ("expert",))
    handler = Lines()
    logger = logging.getLogger("moe_tune")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for strategy in (None, "all_gather", "all_to_all"):
        jax.jit(lambda x, logits, s=strategy: moe_tune.sharded_moe_mlp(
            x, logits, *weights, TINY.top_k, mesh=mesh, ep_strategy=s))(x, logits).block_until_ready()
    jax.jit(lambda x, logits: moe_tune.sharded_moe_mlp(x[:TOKENS], logits[:TOKENS], *weights, TINY.top_k, mesh=mesh,
                                                       tokens_replicated=True))(x, logits).block_until_ready()
    logger.removeHandler(handler)
    return [line for line in handler.lines if ": backend " in line]


def main(scratch: Path) -> dict:
    # the test's preset, beside the shipped ones; no shipped or user tables answer (only what the sweep wrote)
    known = dict(models.presets())
    models.presets = lambda: {**known, TINY.name: TINY}
    dirs.user_dir = lambda: scratch / "user_profiles"
    dirs.shipped_dir = lambda: scratch / "shipped_profiles"
    runner = CliRunner()
    swept = runner.invoke(cli, ["sweep", *LAYER, "--samples", "1", "--max-candidates", "2", "--workers", "1",
                                "--cold"])
    covered = runner.invoke(cli, ["coverage", *LAYER, "--format", "json"])
    return {"sweep_exit": swept.exit_code, "sweep_tail": swept.output[-3000:] + repr(swept.exception),
            "looked_up": run_layer(), "coverage_exit": covered.exit_code,
            "coverage": json.loads(covered.output) if covered.exit_code == 0 else covered.output}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
