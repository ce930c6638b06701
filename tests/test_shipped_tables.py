"""The CPU tables shipped inside the package: valid, tuned with the current kernels, and used by a fresh
install (a real process with an empty user cache and no $MOE_TUNE_PROFILE_DIR) for the presets they cover."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from moe_tune.kernels import get_op
from moe_tune.profiles import table
from moe_tune.profiles import table as dirs
from moe_tune.profiles.table import LOCK_DIR
from moe_tune.profiles.validate import table_files, validate_table
from moe_tune.profiles.entry import staleness
# Captured at import, before the autouse fixture points `dirs.shipped_dir` at an empty temporary dir.
SHIPPED = dirs.shipped_dir()

# (preset, tokens per shard, expert-parallel size) whose MoE layer the shipped CPU tables cover, in the
# presets' dtype (bfloat16): every kernel of the layer, forward and both gradients (see
# src/moe_tune/profiles/data/README.md for how they were measured).
COVERED = [
    ("deepseek-v2-lite", 256, 8),
    ("deepseek-v2-lite", 1024, 8),
    ("qwen3-30b-a3b", 256, 8),
    ("qwen3-30b-a3b", 1024, 8),
    ("gpt-oss-20b", 256, 4),
    ("deepseek-v3", 256, 64),
]


def cpu_tables():
    return table_files(SHIPPED / "cpu")


def shipped_tables():
    """Every device kind's tables (cpu, and what a lent GPU tuned: nvidia_h100_80gb_hbm3)."""
    return [path for kind in sorted(SHIPPED.iterdir()) if kind.is_dir() for path in table_files(kind)]


def test_shipped_tables_exist_and_validate():
    """Each judged as on its own device (an H100's tiles against its shared memory); a GPU table's only warning
    may be that it was tuned with another JAX minor version than this machine's (the GPU machine's 0.11)."""
    assert {f.stem for f in cpu_tables()} >= {"ragged_dot", "ragged_gather", "ragged_gather_reduce"}
    assert {f.parent.name for f in shipped_tables()} == {"cpu", "nvidia_h100_80gb_hbm3"}
    for path in shipped_tables():
        problems = validate_table(path, get_op=get_op, on_its_device=True)
        if path.parent.name != "cpu":
            problems = [p for p in problems if not (p.severity == "warning" and "tuned with jax" in p.message)]
        assert problems == [], path


def test_shipped_entries_were_tuned_with_the_current_kernels():
    """Bumping a backend's revision makes its shipped entries stale: re-sweep them (see the data README)."""
    for path in shipped_tables():
        spec = get_op(path.stem)
        for key, entry in table.read_table(path)["entries"].items():
            impl = spec.backends.get(entry["fields"]["backend"])
            assert staleness(entry, impl, jax_version=entry["versions"]["jax"]) == [], (path, key)


def test_fresh_install_uses_the_shipped_tables(tmp_path):
    code = """
import json, sys
from moe_tune.layer import models
from moe_tune.kernels import get_op
out = []
for name, tokens, ep in json.loads(sys.argv[1]):
    for case in models.kernel_problems(models.get_preset(name), tokens, ep=ep, dtype="bfloat16"):
        found = get_op(case.op).lookup(case.problem)
        out.append([name, case.op, found.source, str(found.path)])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != dirs.ENV_PROFILE_DIR}
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))  # an empty user cache
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(COVERED)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == 8 * len(COVERED)  # 6 ragged_dot cases, dispatch and combine per layer
    for name, op, source, path in found:
        assert source == "exact", (name, op, source)
        assert path.startswith(str(SHIPPED / "cpu")), (name, op, path)


def test_shipped_dir_holds_only_tables():
    """A sweep's logs stay out of the package: only `<device_kind>/<op>.json` and the README. (A `moe-tune
    merge` into this dir leaves its lock files in `.locks/`, which git ignores and package data leaves out.)"""
    extra = [p for p in SHIPPED.rglob("*") if p.is_file() and p.suffix != ".json" and p.name != "README.md"
             and LOCK_DIR not in p.relative_to(SHIPPED).parts]
    assert extra == []
