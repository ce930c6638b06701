"""The CLI through click's CliRunner: real sweeps on tiny spaces, reports, lookups, and user mistakes."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from plot_checks import check_plot, drawn  # noqa: F401 (a fixture)

from moe_tune.cli import cli
from moe_tune.core import settings

TINY = ["--m", "256", "--k", "128", "--n", "128", "--groups", "4", "--samples", "2", "--max-candidates", "3"]


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, list(args), catch_exceptions=False)

    return invoke


def test_ops_lists_backends_and_tunables(run):
    result = run("ops")
    assert result.exit_code == 0
    for name in ("xla", "tiled", "megablox", "tm, tk, tn", "ragged_gather_reduce", "pallas_tpu", "rows_per_chunk",
                 "dmas_in_flight"):
        assert name in result.output



def test_the_cli_and_its_workers_leave_gpu_memory_unclaimed_unless_the_user_chose(run, monkeypatch):
    """JAX takes 75% of a GPU's memory when its backend starts; the CLI process and its workers must not, or
    the workers (and a training job beside them) get a quarter of the chip."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert run("ops").exit_code == 0
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    child = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}  # the user's choice stands, here and in a worker's env
    settings.no_gpu_preallocation(child)
    assert child == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    assert run("ops").exit_code == 0 and os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"

def test_sweep_report_lookup_round_trip(run, tmp_path, isolated_profiles, monkeypatch):
    result = run("sweep", *TINY)
    assert result.exit_code == 0, result.output
    assert "winner" in result.output and "speedup" in result.output and "3 tried" in result.output
    table = isolated_profiles / "cpu" / "ragged_dot.json"
    assert table.exists()

    csv = run("report", "--format", "csv")
    assert csv.exit_code == 0
    header, row = csv.output.strip().splitlines()[:2]
    assert header.startswith("device_kind,op,direction,backend,shape,dtype")
    assert row.startswith("cpu,ragged_dot,fwd,tiled,m=256 k=128 n=128 groups=4,float32")

    records = json.loads(run("report", "--format", "json").output)
    assert len(records) == 1 and records[0]["tried"] == 3 and records[0]["time_ms"] > 0

    markdown = run("report", "--format", "markdown").output
    assert markdown.splitlines()[0].startswith("| device_kind") and "ragged_dot" in markdown

    assert "ragged_dot" in run("report").output

    found = run("lookup", "--m", "256", "--k", "128", "--n", "128", "--groups", "4")
    assert found.exit_code == 0 and "source: exact" in found.output
    near = run("lookup", "--m", "300", "--k", "128", "--n", "128", "--groups", "4")
    assert "source: nearest" in near.output
    none = run("lookup", "--m", "300", "--k", "64", "--n", "128", "--groups", "4")
    assert "source: default" in none.output
    # lookup answers for the distribution the runtime assumes: $MOE_TUNE_DISTRIBUTION unless --distribution
    monkeypatch.setenv("MOE_TUNE_DISTRIBUTION", "skewed")
    assert "source: nearest" in run("lookup", "--m", "256", "--k", "128", "--n", "128", "--groups", "4").output
    assert "source: exact" in run("lookup", "--m", "256", "--k", "128", "--n", "128", "--groups", "4",
                                  "--distribution", "balanced").output


@pytest.mark.parametrize("op", ["ragged_gather", "ragged_gather_reduce", "dense_gather_reduce"])
def test_gather_op_sweep_then_lookup_is_exact(run, op, isolated_profiles):
    shape = ["--tokens", "64", "--hidden", "128", "--top-k", "4", "--experts", "8"]
    if op != "dense_gather_reduce":
        shape += ["--ep", "2"]
    result = run("sweep", "--op", op, *shape, "--samples", "2", "--max-candidates", "2", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert f"{op} tokens=64 top_k=4 hidden=128" in result.output and "2 tried" in result.output
    assert (isolated_profiles / "cpu" / f"{op}.json").exists()
    found = run("lookup", "--op", op, *shape)
    assert found.exit_code == 0 and "source: exact" in found.output, found.output
    near = run("lookup", "--op", op, "--tokens", "80", "--hidden", "128", "--top-k", "4")
    assert "source: nearest" in near.output and "tokens=64 rows=256" in near.output
    assert "tokens=64 rows=256 hidden=128" in run("report", "--op", op, "--format", "csv").output


def test_models_lists_presets_and_one_layers_kernels(run):
    listing = run("models")
    assert listing.exit_code == 0 and "deepseek-v3" in listing.output and "mixtral-8x7b" in listing.output
    layer = run("models", "qwen3-30b-a3b", "--tokens", "512", "--ep", "4", "--dtype", "bfloat16")
    assert layer.exit_code == 0, layer.output
    assert "ragged_dot drhs m=4096 k=2048 n=768 g=32 bfloat16" in layer.output
    assert "ragged_gather_reduce tokens=512 top_k=8 hidden=2048 bfloat16 (ep=4)" in layer.output
    quantized = run("models", "qwen3-30b-a3b", "--tokens", "512", "--ep", "4", "--rhs-quant", "int8",
                    "--quant-block", "128", "--dtype", "bfloat16")
    assert quantized.exit_code == 0, quantized.output
    assert "ragged_dot dlhs m=4096 k=2048 n=768 g=32 bfloat16 rhs int8/128" in quantized.output
    # the shard layer on the device's tokens (the first rows, their roles unprefixed): fwd and dlhs of both
    # matmuls (int8 weights are constants: no drhs runs), the fused kernels the layer runs with them (the
    # gate/up forward with and without its glu, its backward, the down forward and backward) and both
    # fused-or-not choices keyed by the weights' quantization; the gathers are not quantized
    rows = [line for line in quantized.output.splitlines() if "int8/128" in line]
    across = ("all_gather", "all_to_all", "ep strategy", "chunks:")
    assert len([r for r in rows if not any(s in r for s in across)]) == 4 + 5 + 2 and "drhs" not in quantized.output
    # the layer across 4 devices: the same calls of the all_gather strategy on 4 x the tokens, and the strategy's
    whole = [r for r in rows if "chunks:" not in r]
    assert len([r for r in whole if "all_gather" in r]) == 4 + 5 + 2 and "ep strategy" in quantized.output
    # the strategy's token chunks: the same calls again on 256 tokens (2 chunks) and on 128 (4 chunks; its
    # all_gather calls, on 4 x 128, are the one-chunk shard layer's)
    assert len([r for r in rows if "2 chunks:" in r]) == 2 * (4 + 5 + 2)
    assert len([r for r in rows if "4 chunks:" in r]) == 4 + 5 + 2
    assert "ragged_dot dlhs m=16384 k=2048 n=768 g=32 bfloat16 rhs int8/128" in quantized.output
    bad_block = run("models", "qwen3-30b-a3b", "--rhs-quant", "int8", "--quant-block", "100")
    assert bad_block.exit_code == 2 and "quant_block 100 does not divide its length 2048" in bad_block.output
    typo = run("models", "qwen3-30b")
    assert typo.exit_code == 2 and "did you mean" in typo.output and "Traceback" not in typo.output


def test_sweep_to_explicit_profile_dir(run, tmp_path):
    result = run("sweep", *TINY, "--backend", "xla", "--profile-dir", str(tmp_path / "p"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "p" / "cpu" / "ragged_dot.json").exists()
    assert "xla" in run("report", "--profile-dir", str(tmp_path / "p"), "--format", "csv").output


def test_a_model_sweep_with_op_plans_that_ops_kernels_alone(run):
    """`sweep --model M --op OP`: the layer's OP kernels (e.g. one op's shipped entries re-measured after its
    backend's revision bump), and a one-line error when the layer runs none; `--target` compiles a layer's
    kernels, not its fused/unfused choice."""
    result = run("sweep", "--model", "deepseek-v2-lite", "--op", "ragged_gather", "--tokens", "256", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "2 kernel cases" in result.output and "dispatch tokens=256" in result.output
    assert "ragged_dot" not in result.output and "gather_reduce" not in result.output
    none = run("sweep", "--model", "deepseek-v2-lite", "--op", "dense_gather_reduce", "--ep", "8", "--dry-run")
    assert none.exit_code == 2 and "runs no dense_gather_reduce kernel" in none.output
    # for a chip, the layer's kernels are compiled and its fused/unfused choice (moe_fusion) is left out
    chip = run("sweep", "--model", "deepseek-v2-lite", "--tokens", "256", "--target", "v5e", "--dry-run")
    assert chip.exit_code == 0, chip.output
    assert "note: moe_fusion left out" in chip.output and "ragged_dot fwd" in chip.output
    assert "moe_fusion fwd" not in chip.output
    # across devices: the kernels of every strategy (all_gather's on 8 x the tokens), not the choice of strategy
    mesh = run("sweep", "--model", "deepseek-v2-lite", "--tokens", "256", "--ep", "8", "--target", "v5e", "--dry-run")
    assert mesh.exit_code == 0, mesh.output
    assert "note: moe_fusion, moe_sharding left out" in mesh.output and "ragged_gather tokens=2048" in mesh.output


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["sweep", "--op", "nope"], 2, "nope"),
        (["sweep", "--m", "0"], 2, "0"),
        (["sweep", "--k", "-5"], 2, "-5"),
        (["sweep", "--dtype", "float7"], 2, "float7"),
        (["sweep", "--backend", "cuda_magic", *TINY], 2, "unknown backend 'cuda_magic'"),
        (["sweep", "--distribution", "lopsided"], 2, "lopsided"),
        (["lookup", "--backend", "nope"], 2, "unknown backend"),
        (["sweep", "--samples", "0"], 2, "0"),
        (["sweep", "--op", "ragged_gather", "--m", "64"], 2, "--m does not apply to ragged_gather"),
        (["lookup", "--tokens", "64"], 2, "--tokens does not apply to ragged_dot"),
        (["sweep", "--op", "dense_gather_reduce", "--ep", "2"], 2, "--ep does not apply"),
        (["sweep", "--op", "ragged_gather", "--experts", "6", "--ep", "4"], 2, "multiple of the expert-parallel"),
        (["sweep", "--op", "ragged_gather", "--direction", "dlhs"], 2, "has no direction 'dlhs'"),
        (["sweep", "--op", "moe_fusion", "--target", "v5e", "--dry-run"], 2, "moe_fusion chooses between layers"),
        (["sweep", "--backend", "triton", "--target", "v5e", "--dry-run"], 2,
         "--backend triton is not a TPU kernel; --target v5e compiles what the chip runs natively: xla, tiled, "
         "megablox"),
        (["sweep", "--op", "ragged_gather", "--backend", "pallas_tpu", "--target", "h100", "--dry-run"], 2,
         "--backend pallas_tpu is not a GPU kernel"),
    ],
)
def test_user_mistakes_get_one_line_and_exit_code(run, args, code, message):
    result = run(*args)
    assert result.exit_code == code
    assert message in result.output
    assert "Traceback" not in result.output


def test_unreadable_table_names_the_file_and_exits_1(run, isolated_profiles):
    path = isolated_profiles / "cpu" / "ragged_dot.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"schema_version": 1, "entries": ')
    for args in (["report"], ["lookup"]):
        result = run(*args)
        assert result.exit_code == 1
        assert str(path) in result.output and "not valid JSON" in result.output
        assert "Traceback" not in result.output


def test_empty_report_says_how_to_start(run):
    result = run("report")
    assert result.exit_code == 0 and "moe-tune sweep" in result.output


def test_report_filters_plot_and_sweep_log(run, tmp_path, isolated_profiles, drawn):
    assert run("sweep", *TINY).exit_code == 0
    assert run("sweep", *TINY, "--direction", "drhs").exit_code == 0
    drhs = run("report", "--direction", "drhs", "--format", "csv").output.strip().splitlines()
    assert len(drhs) == 2 and ",drhs," in drhs[1]
    assert "No tuned entries match" in run("report", "--backend", "xla").output
    assert len(json.loads(run("report", "--dtype", "float32", "--format", "json").output)) == 2
    assert "No tuned entries match" in run("report", "--dtype", "bfloat16").output

    def records(*args):
        return json.loads(run("report", "--format", "json", *args).output)

    slowest_first = records("--sort", "time_ms", "--desc")
    times = [r["time_ms"] for r in slowest_first]
    assert len(times) == 2 and times[0] > times[1]
    assert [r["key"] for r in records("--sort", "time_ms")] == [r["key"] for r in slowest_first][::-1]

    plot = run("report", "--plot", str(tmp_path / "r.png"), "--sort", "time_ms", "--desc")
    assert plot.exit_code == 0 and (tmp_path / "r.png").stat().st_size > 1000
    (fig,) = drawn  # the plot shows the entries in the report's order: the slowest's candidates on the left
    table = json.loads((isolated_profiles / "cpu" / "ragged_dot.json").read_text())["entries"]
    check_plot(fig, [table[r["key"]] for r in slowest_first])
    logs = {log.name.split("_")[0]: log for log in isolated_profiles.glob("cpu/sweeps/ragged_dot/*.jsonl")}
    assert sorted(logs) == ["drhs", "fwd"]
    # the fwd sweep ran cold (nothing tuned yet): its grid's first --max-candidates 3. The drhs sweep starts
    # warm from the fwd entry when that one's winner is not the default, and its local search stops after
    # as many candidates as their timings take: the report counts what its log holds.
    drhs = [json.loads(line) for line in logs["drhs"].read_text().splitlines()]
    for direction, count in (("fwd", 3), ("drhs", sum(line["type"] == "candidate" for line in drhs))):
        shown = run("report", "--sweep", str(logs[direction]))
        assert shown.exit_code == 0 and f"{count} candidates" in shown.output and "winner" in shown.output, (
            direction, shown.output)
    assert run("report", "--sweep", str(tmp_path / "nope.jsonl")).exit_code == 2
    assert run("report", "--sort", "colour").exit_code == 2


def test_validate_and_merge_commands(run, tmp_path, isolated_profiles):
    assert run("sweep", *TINY).exit_code == 0
    table = isolated_profiles / "cpu" / "ragged_dot.json"
    ok = run("validate", str(table))
    assert ok.exit_code == 0, ok.output
    merged = tmp_path / "merged" / "cpu" / "ragged_dot.json"
    result = run("merge", str(merged), str(table))
    assert result.exit_code == 0 and merged.exists()
    assert run("validate", str(merged)).exit_code == 0

    data = json.loads(table.read_text())
    entry = next(iter(data["entries"].values()))
    entry["config"] = {"tm": 0, "tk": 128, "tn": 128}
    table.write_text(json.dumps(data))
    bad = run("validate", str(table))
    assert bad.exit_code == 1 and str(table) in bad.output and entry["key"] in bad.output


def test_bench_command_prints_ratios(run, isolated_profiles):
    assert run("sweep", *TINY).exit_code == 0
    result = run("bench", "--m", "256", "--k", "128", "--n", "128", "--groups", "4", "--samples", "1")
    assert result.exit_code == 0, result.output
    assert "(exact)" in result.output and "xla/tuned" in result.output and "tuned/roofline" in result.output
    gather = run("bench", "--op", "ragged_gather_reduce", "--tokens", "32", "--hidden", "128", "--top-k", "4",
                 "--experts", "8", "--ep", "2", "--samples", "1")
    assert gather.exit_code == 0 and "fallback/tuned" in gather.output and "(default)" in gather.output


def test_sweep_model_runs_every_kernel_of_a_layer(run, isolated_profiles):
    """The layer across 16 devices runs its kernels at several token counts (the device's 8 tokens, the
    all_gather strategy's 8 x 16, the all_to_all strategy's receive buffer): each count's every kernel is swept
    and stored under its own key."""
    from moe_tune.layer.exchange import worst_rows

    result = run("sweep", "--model", "deepseek-v2-lite", "--tokens", "8", "--ep", "16", "--dtype", "float32",
                 "--max-candidates", "1", "--samples", "1", "--workers", "1")
    assert result.exit_code == 0, result.output
    # per count of the shard layer (8 and 128 tokens): 6 matmuls, dispatch, combine, the backward's weighted
    # gather (training, the default; the dispatch's gradient is the combine's own kernel at ep=16), 5 fused
    # kernels (each stage's forward and backward, and the dispatch's forward with its activation, which the
    # evaluation runs) and the fused-or-not choice for the forward and for forward+backward; all_to_all's 6
    # matmuls on its receive buffer; the strategy's own sweep is left out (it needs 16 devices)
    assert "deepseek-v2-lite: 38 kernel sweeps" in result.output and "needs 16 devices" in result.output
    for op, count in (("fused_moe", 10), ("moe_fusion", 4)):  # 2 counts x 5 fused kernels; 2 choices each
        assert len(json.loads((isolated_profiles / "cpu" / f"{op}.json").read_text())["entries"]) == count
    entries = {op: json.loads((isolated_profiles / "cpu" / f"{op}.json").read_text())["entries"].values()
               for op in ("ragged_dot", "ragged_gather", "ragged_gather_reduce")}
    assert sorted((e["fields"]["tokens"], e["fields"]["weighted"]) for e in entries["ragged_gather"]) == [
        (8, False), (8, True), (128, False), (128, True)]
    assert sorted(e["fields"]["tokens"] for e in entries["ragged_gather_reduce"]) == [8, 128]
    dot_rows = sorted({e["fields"]["m"] for e in entries["ragged_dot"]})
    assert dot_rows == sorted({8 * 6, 128 * 6, worst_rows(8, 6, 16, 4)})
    assert len(entries["ragged_dot"]) == 18  # 3 row counts x 2 matmuls x 3 directions
    assert run("sweep", "--model", "deepseek-v2-lite", "--m", "64").exit_code == 2
    assert "did you mean" in run("sweep", "--model", "deepseek").output
    assert run("lookup", "--op", "ragged_gather", "--tokens", "8,16").exit_code == 2  # one shape (sweep: a campaign)
    bad_race = run("sweep", "--m", "64", "--k", "32", "--n", "32", "--groups", "2", "--race", "0.5")
    assert bad_race.exit_code == 2 and "Traceback" not in bad_race.output
    assert "0.5 is not 0 (no racing) or a factor > 1" in bad_race.output  # the rule the help states


def test_sweep_options_reach_the_sweep(run, tmp_path, isolated_profiles):
    """`--direction all` with `--strategy random --budget 2 --race 0 --distribution skewed --keep-trace DIR`:
    three entries (fwd, dlhs, drhs), each tried 2 candidates at random, with skewed groups, no racing (the
    sweep logs' header), traces kept; `lookup` finds them exactly only for --distribution skewed. Then
    `--strategy coordinate --time-budget 300`."""
    shape = ["--m", "256", "--k", "128", "--n", "128", "--groups", "4"]
    traces = tmp_path / "traces"
    result = run("sweep", *shape, "--samples", "1", "--workers", "1", "--direction", "all", "--strategy", "random",
                 "--budget", "2", "--race", "0", "--distribution", "skewed", "--keep-trace", str(traces))
    assert result.exit_code == 0, result.output
    entries = list(json.loads((isolated_profiles / "cpu" / "ragged_dot.json").read_text())["entries"].values())
    assert sorted(e["fields"]["direction"] for e in entries) == ["dlhs", "drhs", "fwd"]
    for entry in entries:
        assert entry["fields"]["distribution"] == "skewed" and entry["distribution"]["name"] == "skewed", entry["key"]
        assert entry["search"]["strategy"] == "random" and entry["search"]["budget"] == 2
        assert entry["candidates"]["tried"] == 2
    logs = sorted(isolated_profiles.glob("cpu/sweeps/ragged_dot/*.jsonl"))
    headers = [json.loads(log.read_text().splitlines()[0]) for log in logs]
    assert len(headers) == 3 and all(h["type"] == "header" and h["spec"]["race"] is None for h in headers)
    assert list(traces.glob("**/*.xplane.pb"))

    assert "source: nearest" in run("lookup", *shape).output  # balanced assumed: the skewed entry is only near
    assert "source: exact" in run("lookup", *shape, "--distribution", "skewed").output

    result = run("sweep", *shape, "--samples", "1", "--workers", "1", "--max-candidates", "3",
                 "--strategy", "coordinate", "--time-budget", "300")
    assert result.exit_code == 0, result.output
    table = json.loads((isolated_profiles / "cpu" / "ragged_dot.json").read_text())["entries"]
    (entry,) = [e for e in table.values() if e["fields"]["distribution"] == "balanced"]
    assert entry["search"]["strategy"] == "coordinate" and entry["search"]["time_budget_s"] == 300
    assert entry["search"]["stopped"] in ("converged", "exhausted")


def test_persistent_compile_cache_makes_a_rerun_compile_nothing(tmp_path):
    """Two real processes: the second sweep of the same shape (--fresh, so every candidate runs again) loads
    every executable from the cache: its entry counts zero XLA compilations. The first trims the cache back
    under its size: an old entry that would overflow it goes."""
    import subprocess
    import sys

    (tmp_path / "cache").mkdir()
    stale = tmp_path / "cache" / "jit_old-0123-cache"
    stale.write_bytes(b"x" * (2**21 + 1))
    os.utime(stale, (1, 1))
    env = {**os.environ, "MOE_TUNE_COMPILE_CACHE_DIR": str(tmp_path / "cache"),
           "MOE_TUNE_PROFILE_DIR": str(tmp_path / "p"), "MOE_TUNE_COMPILE_CACHE_MAX_BYTES": str(2**21)}
    args = [sys.executable, "-m", "moe_tune.cli", "sweep", *TINY, "--workers", "1", "--fresh"]
    compiles = []
    for _ in range(2):
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        entry = next(iter(json.loads((tmp_path / "p" / "cpu" / "ragged_dot.json").read_text())["entries"].values()))
        compiles.append(entry["candidates"]["compiles"])
    assert compiles[0] >= 3 and compiles[1] == 0
    assert not stale.exists() and any((tmp_path / "cache").iterdir())


def test_bench_model_covers_every_kernel_of_a_layer(run):
    result = run("bench", "--model", "deepseek-v2-lite", "--tokens", "8", "--ep", "16", "--dtype", "float32",
                 "--direction", "fwd", "--samples", "1")
    assert result.exit_code == 0, result.output
    # what serving runs on one of 16 devices, once per key, for the device's 8 tokens and the all_gather
    # strategy's 8 x 16: the 2 matmuls, the dispatch and the combine, the 2 fused kernels, each against its
    # plain-JAX fallback, and the layer fused vs unfused; and the all_to_all strategy's 2 matmuls on its
    # receive buffer (the strategy itself needs 16 devices: left out)
    assert result.output.count("xla/tuned") == 2 * 3 and result.output.count("fallback/tuned") == (2 + 2) * 2
    assert result.output.count("unfused/tuned") == 2


def test_a_profile_dir_that_cannot_be_written_is_one_line_and_exit_1(run, tmp_path):
    """Checked before the sweep starts, for one sweep and for a model's (one error, not one per kernel)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for args in (["sweep", *TINY, "--profile-dir", str(blocker / "tables")],
                 ["sweep", "--model", "deepseek-v2-lite", "--tokens", "8", "--profile-dir", str(blocker / "t")]):
        result = run(*args)
        assert result.exit_code == 1, result.output
        assert result.output.strip().splitlines() == [result.output.strip()]
        assert "cannot create or write the profile dir" in result.output and str(blocker) in result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["sweep", "bench"])
def test_a_problem_too_big_for_memory_is_refused_before_allocating(run, command, isolated_profiles):
    result = run(command, "--m", "100000000", "--k", "100000", "--n", "100000")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert "TiB of memory" in result.output and "available" in result.output and "Traceback" not in result.output
    assert not (isolated_profiles / "cpu").exists()  # refused before the sweep log was opened


def test_available_memory_and_the_check(monkeypatch):
    from moe_tune.core.errors import UsageError
    from moe_tune.kernels import get_op
    from moe_tune.tuner import request

    assert request.available_bytes() > 0
    op = get_op("ragged_dot")
    problem = op.problem(m=256, k=128, n=128, groups=4)
    monkeypatch.setattr(request, "available_bytes", lambda: op.memory_estimate(problem) - 1)
    with pytest.raises(UsageError, match="needs about"):
        request.check_fits(op, problem)
    monkeypatch.setattr(request, "available_bytes", lambda: op.memory_estimate(problem))
    request.check_fits(op, problem)
