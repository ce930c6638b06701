"""The search spaces held to the real compilers (FINDINGS.md: search spaces vs compilers): for each Pallas
backend and compile-only target, the kernels of four model presets at two token counts are compiled for configs the rules keep and configs
they refuse, and the verdicts compared.

    PYTHONPATH=src .venv/bin/python benchmarks/compile_check.py [--targets v5e,h100,...] [--workers 2]
        [--label before] [--cache /tmp/compile_check.jsonl]
    PYTHONPATH=src .venv/bin/python benchmarks/compile_check.py --print OUT.json
    PYTHONPATH=src .venv/bin/python benchmarks/compile_check.py --targets h100,b200 --ragged-backend mosaic_gpu \
        --label mosaic_gpu   # JAX's Mosaic GPU ragged kernels: bf16 ragged_dot only (the rest is refused)

Per problem (preset x tokens x kernel x direction x mode) it considers: the default config, the largest config
the rules keep (the one nearest the chip's limits), `--grid` configs drawn (seeded) from the backend's
unpruned grid (`candidate_values`), each of them a candidate or a config `config_error` refuses, and the
smallest grid config the rules refuse (the nearest refused one). Per backend and target it compiles every
problem's largest kept config, a seeded sample of the other kept ones up to `--kept` and `--refused` refused
ones. The grid draw does not depend on the rules, so a run after a rule change mostly compiles the same
configs (verdicts come from `--cache`, which holds every compile by target, problem and config).

- false accept: the rules keep it, the compiler rejects it (or dies compiling it);
- false reject: the rules refuse it, the compiler takes it.

Writes benchmarks/results/compile_check_cpu_2core_<date>_<label>.{json,txt}. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import sys
import time
from pathlib import Path

from tabulate import tabulate

from moe_tune.kernels import get_op
from moe_tune.layer.models import get_preset, kernel_problems
from moe_tune.targets import get_target
from moe_tune.targets.jobs import CompileJob, CompilePool, config_error, search_space

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "qwen3-235b-a22b")  # k, n: multiples of 128
TOKENS = (512, 4096)
QUANT_MODES = {"bf16": None, "int8": {"rhs_quant": "int8"},
               "fp8/128": {"rhs_quant": "float8_e4m3fn", "quant_block": 128},
               # 4-bit weights, activations quantized in the kernel (`--modes` picks some)
               "int4/128": {"rhs_quant": "int4", "quant_block": 128}, "mxfp4": {"rhs_quant": "mxfp4"},
               "w8a8 dynamic": {"rhs_quant": "int8", "quant_block": 128, "lhs_quant": "int8", "lhs_dynamic": True}}
GATHER_DTYPES = ("float32", "bfloat16")
BACKENDS = {"tpu": {"ragged_dot": "megablox", "gather": "pallas_tpu"},
            "gpu": {"ragged_dot": "triton", "gather": "triton"}}
TARGETS = ("v5e", "h100", "v4", "a100", "v6e", "v5p", "b200")
RESULTS = Path(__file__).parent / "results"


# Backends that serve only the float ragged_dot (their config_error refuses quantized problems, and they have no
# gather kernels): bf16 ragged_dot problems only.
RAGGED_ONLY = ("mosaic_gpu",)
SELECTED_MODES: tuple[str, ...] = ()  # --modes: only these ragged_dot modes (and no gathers); empty: all


def problems(platform: str, presets=PRESETS, token_counts=TOKENS) -> list[tuple[str, str, str, object]]:
    """(op, backend, mode, problem) for every kernel of the presets at the token counts."""
    out = []
    ragged_only = BACKENDS[platform]["ragged_dot"] in RAGGED_ONLY
    for preset, tokens in itertools.product(presets, token_counts):
        for mode, quant in QUANT_MODES.items():
            if (ragged_only and quant is not None) or (SELECTED_MODES and mode not in SELECTED_MODES):
                continue
            for case in kernel_problems(get_preset(preset), tokens, quant=quant):
                if case.op == "ragged_dot":
                    out.append((case.op, BACKENDS[platform]["ragged_dot"], mode, case.problem))
        for dtype in () if ragged_only or SELECTED_MODES else GATHER_DTYPES:
            cases = kernel_problems(get_preset(preset), tokens, ep=2, dtype=dtype)
            cases += [c for c in kernel_problems(get_preset(preset), tokens, dtype=dtype) if c.role == "combine"]
            out += [(c.op, BACKENDS[platform]["gather"], dtype, c.problem) for c in cases if c.op != "ragged_dot"]
    return out


def grid_draw(op: str, backend: str, problem, count: int, seed: int) -> list:
    """`count` configs drawn from the unpruned grid, seeded by the problem (independent of the rules)."""
    impl = get_op(op).backends.get(backend)
    values = impl.candidate_values(problem)
    grid = [impl.config_cls(**dict(zip(values, combo))) for combo in itertools.product(*values.values())]
    rng = random.Random(f"{seed}:{op}:{backend}:{sorted(problem.key_fields().items())}")
    return rng.sample(grid, min(count, len(grid)))


def refused_draw(target, op: str, backend: str, problem, seed: int) -> list:
    """One grid config the rules refuse on the target, the smallest of them by the sum of its fields (the
    nearest to the kept ones), ties broken by a seeded draw; none when the rules keep the whole grid."""
    impl = get_op(op).backends.get(backend)
    values = impl.candidate_values(problem)
    grid = [impl.config_cls(**dict(zip(values, combo))) for combo in itertools.product(*values.values())]
    refused = [c for c in grid if config_error(target, op, backend, c, problem) is not None]
    if not refused:
        return []
    rng = random.Random(f"{seed}:refused:{op}:{backend}:{sorted(problem.key_fields().items())}")
    smallest = min(sum(c.to_dict().values()) for c in refused)
    return [rng.choice([c for c in refused if sum(c.to_dict().values()) == smallest])]


def cache_key(job: CompileJob) -> str:
    return json.dumps([job.target, job.op, job.backend, job.problem.key_fields(), job.config.to_dict()])


def plan(target_name: str, grid: int, seed: int, kept_sample: int, refused_sample: int, presets=PRESETS,
         token_counts=TOKENS) -> list[dict]:
    """The configs to judge for one target: per backend, every problem's largest kept config (the boundary),
    then defaults and grid draws (seeded) up to `kept_sample` kept configs, and `refused_sample` refused
    ones; each with its job, what the rules say, and its table row's labels."""
    rows = _all_rows(get_target(target_name), grid, seed, presets, token_counts)
    rng = random.Random(seed)
    chosen = []
    family = lambda r: (r["job"].backend, r["job"].op == "ragged_dot")  # triton serves both op families
    for key in dict.fromkeys(family(r) for r in rows):
        mine = [r for r in rows if family(r) == key]
        largest = [r for r in mine if r["largest"]]
        rest = [r for r in mine if r["kept"] and not r["largest"]]
        refused = [r for r in mine if not r["kept"]]
        # the gathers' kernels are small and their spaces too: a quarter of the sample
        kept_n, refused_n = (kept_sample, refused_sample) if key[1] else (kept_sample // 4, refused_sample // 4)
        take = max(0, kept_n - len(largest))
        chosen += largest + rng.sample(rest, min(take, len(rest))) + rng.sample(refused, min(refused_n, len(refused)))
    return chosen


def _all_rows(target, grid: int, seed: int, presets, token_counts) -> list[dict]:
    rows = []
    for op, backend, mode, problem in problems(target.platform, presets, token_counts):
        space = search_space(target, op, backend, problem)
        largest = max(space[1:] or space, key=lambda c: (sum(v for v in c.to_dict().values()), str(c)))
        for config in dict.fromkeys([space[0], largest, *grid_draw(op, backend, problem, grid, seed),
                                      *refused_draw(target, op, backend, problem, seed)]):
            # what the rules say is `config_error` (a space whose problem no config can serve still lists the
            # default first; the runtime checks it and goes to the fallback)
            reason = config_error(target, op, backend, config, problem)
            keeps = reason is None
            rows.append({"job": CompileJob(target.name, op, backend, problem, config), "kept": keeps,
                         "reason": reason, "mode": mode, "direction": problem.direction,
                         "largest": keeps and config == largest})
    return rows


def run(targets: list[str], workers: int, grid: int, seed: int, cache_path: Path, kept_sample: int,
        refused_sample: int, presets=PRESETS, token_counts=TOKENS) -> list[dict]:
    cache = {}
    if cache_path.exists():
        for line in cache_path.read_text().splitlines():
            entry = json.loads(line)
            cache[entry["key"]] = entry["result"]
    judged = []
    with cache_path.open("a") as out:
        for name in targets:
            # one pool per target: a process that compiled Mosaic GPU for sm_90 fails ptxas for sm_100
            pool = CompilePool(workers=workers, timeout=300)
            rows = plan(name, grid, seed, kept_sample, refused_sample, presets, token_counts)
            todo = [r for r in rows if cache_key(r["job"]) not in cache]
            start = time.time()
            print(f"{name}: {len(rows)} configs, {len(todo)} to compile", file=sys.stderr, flush=True)

            def done(index, job, result):
                cache[cache_key(job)] = result.to_dict()
                out.write(json.dumps({"key": cache_key(job), "result": result.to_dict()}) + "\n")
                out.flush()

            try:
                pool.compile([r["job"] for r in todo], on_result=done)
            finally:
                pool.close()
            print(f"{name}: compiled in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
            for r in rows:
                job, result = r["job"], cache[cache_key(r["job"])]
                judged.append({"target": name, "op": job.op, "backend": job.backend, "mode": r["mode"],
                               "direction": r["direction"], "problem": job.problem.key_fields(),
                               "config": job.config.to_dict(), "kept": r["kept"], "rule": r["reason"],
                               "status": result["status"], "message": result["message"],
                               "compile_s": result["compile_s"], "memory": result["memory"]})
    return judged


def rejudge(judged: list[dict]) -> list[dict]:
    """The same compiled configs judged by the rules as they are now (a rule change needs no new compile to be
    checked against the verdicts already recorded; the boundary configs of the new rules may be missing)."""
    out = []
    for j in judged:
        impl = get_op(j["op"]).backends.get(j["backend"])
        problem = impl_problem(j["op"], j["problem"])
        reason = config_error(get_target(j["target"]), j["op"], j["backend"], impl.config_cls(**j["config"]), problem)
        out.append({**j, "kept": reason is None, "rule": reason})
    return out


def impl_problem(op: str, fields: dict):
    """A problem back from its key fields."""
    return get_op(op).problem_class(**fields)


def table(judged: list[dict]) -> list[dict]:
    """One row per (target, backend, op, direction, mode): configs kept / refused, false accepts / rejects."""
    groups = collections.defaultdict(list)
    for j in judged:
        groups[(j["target"], j["backend"], j["op"], j["direction"], j["mode"])].append(j)
    rows = []
    for (target, backend, op, direction, mode), items in groups.items():
        kept = [j for j in items if j["kept"]]
        refused = [j for j in items if not j["kept"]]
        rows.append({"target": target, "backend": backend, "op": op, "direction": direction, "mode": mode,
                     "candidates": len(kept), "refused": len(refused),
                     "false_accepts": sum(j["status"] != "ok" for j in kept),
                     "false_rejects": sum(j["status"] == "ok" for j in refused),
                     "errors": sum(j["status"] == "error" for j in items)})
    return rows


def render(judged: list[dict]) -> str:
    rows = table(judged)
    text = tabulate(rows, headers="keys", tablefmt="simple")
    totals = collections.Counter()
    for r in rows:
        for key in ("candidates", "refused", "false_accepts", "false_rejects", "errors"):
            totals[(r["target"], r["backend"], key)] += r[key]
    per_target = [{"target": t, "backend": b, **{k: totals[(t, b, k)] for k in
                   ("candidates", "refused", "false_accepts", "false_rejects", "errors")}}
                  for t, b in dict.fromkeys((r["target"], r["backend"]) for r in rows)]
    examples = [f"  {j['target']} {j['backend']} {j['problem']} {j['config']}: {j['status']} {j['message'][:160]}"
                for j in judged if j["kept"] and j["status"] != "ok"][:40]
    return "\n\n".join([text, tabulate(per_target, headers="keys", tablefmt="simple"),
                        "false accepts (first 40):\n" + ("\n".join(examples) or "  none")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--grid", type=int, default=1, help="grid configs drawn per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kept", type=int, default=200, help="kept configs per backend and target (at least the "
                        "largest of every problem)")
    parser.add_argument("--refused", type=int, default=40, help="refused configs per backend and target")
    parser.add_argument("--label", default="before")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/moe_tune_compile_check.jsonl"))
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--print", dest="print_path", type=Path)
    parser.add_argument("--ragged-backend", default="triton", choices=["triton", "mosaic_gpu"],
                        help="the GPU ragged_dot backend to check (mosaic_gpu: bf16 ragged_dot only)")
    parser.add_argument("--modes", default="", help=f"comma-separated ragged_dot modes of {list(QUANT_MODES)} "
                        "to check, without the gathers (default: all, and the gathers)")
    parser.add_argument("--rejudge", type=Path, help="a saved run's configs judged by the rules as they are now "
                        "(written under --label)")
    args = parser.parse_args()
    if args.print_path:
        print(render(json.loads(args.print_path.read_text())["judged"]))
        return
    presets, tokens = args.presets.split(","), [int(t) for t in args.tokens.split(",")]
    BACKENDS["gpu"]["ragged_dot"] = args.ragged_backend
    global SELECTED_MODES
    SELECTED_MODES = tuple(m for m in args.modes.split(",") if m)
    if unknown := [m for m in SELECTED_MODES if m not in QUANT_MODES]:
        parser.error(f"unknown modes {unknown}; choose from {list(QUANT_MODES)}")
    if args.rejudge:
        saved = json.loads(args.rejudge.read_text())
        judged = rejudge(saved["judged"])
        args.targets, presets, tokens = saved["targets"], saved.get("presets", presets), saved.get("tokens", tokens)
    else:
        judged = run(args.targets.split(","), args.workers, args.grid, args.seed, args.cache, args.kept,
                     args.refused, presets, tokens)
    stem = RESULTS / f"compile_check_cpu_2core_{time.strftime('%Y-%m-%d')}_{args.label}"
    stem.with_suffix(".json").write_text(json.dumps({"targets": args.targets, "presets": presets, "tokens": tokens,
                                                     "kept": args.kept, "refused": args.refused,
                                                     "grid": args.grid, "seed": args.seed,
                                                     "table": table(judged), "judged": judged}, indent=1))
    text = render(judged)
    stem.with_suffix(".txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
