"""`python -m moe_tune.commands.demo_check`: the last step of `make demo`, in a fresh process.

Calls `moe_tune.ragged_dot` under jit at the default sweep shape and shows which config it traced with
(an exact tuned entry after the demo's sweep) and that the result matches the float64 reference.
"""

from __future__ import annotations

import logging
import sys

import jax
import numpy as np

import moe_tune
from moe_tune.core import distributions
from moe_tune.kernels import get_op


def main() -> int:
    spec = get_op("ragged_dot")
    problem = spec.problem(**spec.default_problem_options())
    inputs = spec.make_inputs(problem, distributions.DEFAULT, seed=1)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("moe_tune")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = jax.jit(moe_tune.ragged_dot)(inputs["a"], inputs["b"], inputs["group_sizes"])  # lhs, rhs
    error = float(np.max(np.abs(np.asarray(out, np.float64) - spec.reference(problem, inputs))))
    result = spec.lookup(problem)  # what the runtime used: the platform default backend's config
    print(f"fresh process: moe_tune.ragged_dot({spec.describe(problem)}) traced with:")
    for line in records:
        print(f"  {line}")
    print(f"  lookup says: {result.source}; max abs error vs float64 reference: {error:.2e}")
    return 0 if result.source == "exact" else 1


if __name__ == "__main__":
    sys.exit(main())
