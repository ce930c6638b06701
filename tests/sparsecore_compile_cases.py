"""The problems and configs the `sparsecore` gathers are compiled for, shared by tests/test_sparsecore_compile.py
(a seeded sample) and benchmarks/sparsecore_compile_audit.py (the whole grid): small shapes, and the dispatch
and combines of one qwen3-30b-a3b layer at 512 tokens (hidden 2048, top-8), masked (ep 4) and dense (ep 1)."""

from __future__ import annotations

import dataclasses
import itertools
import random

from moe_tune.kernels import get_op
from moe_tune.kernels.gather.problem import GatherProblem
from moe_tune.layer.models import get_preset, kernel_problems
from moe_tune.targets import get_target
from moe_tune.targets.jobs import CompileJob, config_error

TARGETS = ("v5p", "v6e")
BACKEND = "sparsecore"
PRESET, TOKENS = "qwen3-30b-a3b", 512
GATHERS = ("ragged_gather", "ragged_gather_reduce", "dense_gather_reduce")


def problems(dtypes=("float32", "bfloat16")) -> list[tuple[str, str, GatherProblem]]:
    """(label, op, problem): a small dispatch (weighted and not) and combine per op, then the preset's layer."""
    found = []
    for dtype in dtypes:
        small = {"tokens": 24, "rows": 96, "hidden": 256, "dtype": dtype}
        found += [("small", "ragged_gather", GatherProblem(**small, weighted=False)),
                  ("small", "ragged_gather", GatherProblem(**small)),
                  ("small", "ragged_gather_reduce", GatherProblem(**small)),
                  ("small", "dense_gather_reduce", GatherProblem(**small))]
        for ep in (4, 1):
            for case in kernel_problems(get_preset(PRESET), TOKENS, ep=ep, dtype=dtype):
                if case.op in GATHERS and not (ep == 1 and case.op == "ragged_gather"):  # one dispatch is enough
                    found.append((f"{PRESET} {case.role} ep={ep}", case.op, case.problem))
        # the combine's gradient: a weighted dispatch of d(out) rows
        found.append((f"{PRESET} combine bwd", "ragged_gather",
                      dataclasses.replace(found[-1][2], weighted=True, experts=None, ep=1)))
    return found


def grid(op: str, problem: GatherProblem) -> list:
    """Every config of the backend's unpruned grid (`candidate_values`), kept or refused, judged off TPU."""
    impl = get_op(op).backends.get(BACKEND)
    values = impl.candidate_values(problem)
    return [impl.config_cls(**dict(zip(values, combo))) for combo in itertools.product(*values.values())]


def split(target: str, op: str, problem: GatherProblem, configs: list) -> tuple[list, list]:
    """(kept, refused) by the backend's rules on the target chip."""
    chip = get_target(target)
    kept = [c for c in configs if config_error(chip, op, BACKEND, c, problem) is None]
    return kept, [c for c in configs if c not in kept]


def jobs(target: str, per_problem: int | None, seed: int = 0, dtypes=("float32", "bfloat16")) -> list[CompileJob]:
    """The kept configs of every problem on `target` (a seeded sample of `per_problem` each; None: all)."""
    found = []
    for _, op, problem in problems(dtypes):
        kept, _ = split(target, op, problem, grid(op, problem))
        if per_problem is not None and len(kept) > per_problem:
            kept = random.Random(f"{seed} {target} {op} {problem}").sample(kept, per_problem)
        found += [CompileJob(target, op, BACKEND, problem, config) for config in kept]
    return found
