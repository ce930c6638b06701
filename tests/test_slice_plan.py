"""Planning the MoE layer for slices this machine does not have (`targets/slice_plan.py`, `moe-tune plan`).

The collective reader and the floor are checked on their own (HLO text written here, the chips' published
facts); then programs are compiled for 4 compile-only TPU v5e chips (`v5e:2x2`) and 4 H100s (`h100x4`) with
the real compilers: two small exchanges whose collectives are known in advance (the reader must find them with
their bytes), and the sharded layer with each strategy. All compiles of the module share one pool of compile
workers. The CLI's user mistakes are one line, and a layer that does not fit says so.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moe_tune.cli import cli
from moe_tune.commands.slice_plan_view import lines
from moe_tune.core.chips import CHIP_FACTS, SLICES, get_slice
from moe_tune.core.errors import UsageError
from moe_tune.layer.models import ModelPreset, get_preset
from moe_tune.targets import collectives, wheels
from moe_tune.targets.compile import OK
from moe_tune.targets.slice_compile import SliceCompile, SliceJob, rejected
from moe_tune.targets.slice_plan import (
    PlanPool,
    PlanRequest,
    Work,
    floor,
    layer_work,
    mesh_shape,
    plan,
    plans,
    recommend,
    strategy_plan,
)

needs_tpu = pytest.mark.skipif(not wheels.available("tpu"),
                               reason="libtpu is missing: pip install 'moe-tune[tpu-compile]'")
needs_gpu = pytest.mark.skipif(not wheels.available("gpu"),
                               reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")

# a small layer: 8 experts over 4 chips, 256 tokens per chip
SMALL = ModelPreset("small", hidden=512, expert_intermediate=256, experts=8, top_k=2, shared_experts=0)
TOKENS = 256

HLO = """\
HloModule m, entry_computation_layout={(bf16[256,512]{1,0})->bf16[256,512]{1,0}}

ENTRY %main (param.2: bf16[256,512], param.3: s32[4]) -> bf16[256,512] {
  %param.2 = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(0)
  %param.3 = s32[4]{0} parameter(1)
  %all-gather-start = (bf16[256,512]{1,0}, bf16[1024,512]{1,0}) all-gather-start(%param.2), channel_id=1, \
replica_groups=[1,4]<=[4], dimensions={0}
  %all-gather-done = bf16[1024,512]{1,0} all-gather-done(%all-gather-start)
  %zeros = bf16[1024,512]{1,0} broadcast(%c), dimensions={}
  %ragged = bf16[1024,512]{1,0} ragged-all-to-all(%param.2, %zeros, %param.3, %param.3, %param.3, \
/*index=5*/%param.3), channel_id=2, replica_groups={{0,1,2,3}}
  %sum = f32[128]{0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
  %x = f32[128]{0} parameter(2)
  ROOT %reduce_scatter.7 = bf16[256,512]{1,0} reduce-scatter(%all-gather-done), channel_id=3, \
replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%region_0.0
}
"""


def test_the_collective_reader_sizes_each_collective_from_its_operands():
    found = {c.kind: c for c in collectives.collectives(HLO, chips=4)}
    rows = 256 * 512 * 2  # one chip's bf16[256,512]
    assert found["all-gather"].group_size == 4 and found["all-gather"].sent_bytes == rows * 3
    assert found["reduce-scatter"].operand_bytes == 4 * rows and found["reduce-scatter"].sent_bytes == 3 * rows
    # the output buffer (4x the input) is sized for the worst case: the input bounds what is sent
    assert found["ragged-all-to-all"].sent_bytes == rows * 3 // 4
    # an operand defined after its use still sizes it; groups of 2
    assert found["all-reduce"].group_size == 2 and found["all-reduce"].sent_bytes == 2 * 128 * 4 // 2
    assert len(collectives.collectives(HLO, chips=4)) == 4  # the -done is not counted again
    assert collectives.summary(found.values())["all-gather"] == {"count": 1, "sent_bytes": rows * 3}


def test_shapes_and_element_types():
    assert collectives.shape_bytes("(f8e4m3fn[4,8]{1,0}, s4[16]{0}, s32[])") == 32 + 8 + 4
    assert collectives.shape_bytes("token[]") == 0


def test_the_floor_is_the_slowest_of_compute_hbm_and_interconnect_at_the_published_figures():
    piece = get_slice("v5e:8x8")
    facts = CHIP_FACTS["v5e"]
    work = Work(flops=197e12 * 1e-3, hbm_bytes=819e9 * 2e-3)  # 1 ms of compute, 2 ms of HBM traffic
    assert floor(work, 0, piece) == pytest.approx((2e-3, "hbm"))
    sent = int(facts.interconnect_bandwidth / 2 * 3e-3)  # 3 ms at the half of the bandwidth one direction has
    assert floor(work, sent, piece) == pytest.approx((3e-3, "interconnect"))


def test_the_layer_work_per_chip():
    preset = get_preset("mixtral-8x22b")
    work = layer_work(preset, 1024, expert=8, tensor=8, dtype_bytes=2)
    rows, f = 1024 * 2, 16384 // 8
    assert work.flops == 6 * rows * 6144 * f
    assert work.hbm_bytes == 3 * 1 * 6144 * f * 2 + rows * (2 * 6144 + 3 * f) * 2 + 2 * 1024 * 6144 * 2


def test_the_mesh_splits_the_experts_over_every_chip_where_it_can():
    assert mesh_shape(get_preset("deepseek-v3"), get_slice("v5e:8x8")) == (64, 1)
    assert mesh_shape(get_preset("mixtral-8x22b"), get_slice("v5e:8x8")) == (8, 8)
    assert mesh_shape(get_preset("qwen3-235b-a22b"), get_slice("h100x8"), tensor=2) == (4, 2)
    with pytest.raises(UsageError, match="does not divide"):
        mesh_shape(get_preset("deepseek-v3"), get_slice("h100x8"), tensor=3)
    with pytest.raises(UsageError, match="do not split"):
        mesh_shape(get_preset("mixtral-8x22b"), get_slice("v5e:8x8"), tensor=2)


def test_every_slice_is_a_known_chip_with_its_facts():
    for piece in SLICES.values():
        assert piece.facts.hbm_bytes > 0 and piece.facts.source
        assert piece.chip.platform in ("tpu", "gpu")
    with pytest.raises(UsageError, match="unknown slice 'v9:2x2'; known slices: v5e:2x2"):
        get_slice("v9:2x2")


def _compiled(sent: int, held: int, estimate: float | None = None) -> SliceCompile:
    """A compiled strategy as a worker reports it: `held` bytes per chip, one all-to-all sending `sent`."""
    operand = sent * 4 // 3  # 3/4 of it leaves the chip in a group of 4
    return SliceCompile(OK, memory={"argument_size_in_bytes": held}, collectives=[
        collectives.Collective("all-to-all", "a2a", 4, operand, sent).to_dict()],
        cost={} if estimate is None else {"optimal_seconds": estimate})


def test_the_recommendation_takes_the_lowest_floor_and_breaks_ties_by_estimate_then_bytes_sent_then_held():
    piece = get_slice("v5e:2x2")
    work = Work(flops=197e12 * 1e-3, hbm_bytes=0)  # 1 ms of compute
    second = int(piece.facts.interconnect_bandwidth / 2 * 1e-3)  # 1 ms on the interconnect

    def best(*compiled):
        plans = [strategy_plan(name, c, work, piece) for name, c in zip(("all_gather", "all_to_all"), compiled)]
        return recommend(plans, piece)

    assert best(_compiled(3 * second, 10), _compiled(second // 2, 10))[0] == "all_to_all"  # 3 ms against 1 ms
    assert best(_compiled(0, 10, 2e-3), _compiled(0, 10, 1e-3))[0] == "all_to_all"  # compute-bound alike
    assert best(_compiled(second // 2, 10), _compiled(second // 4, 20))[0] == "all_to_all"  # sends half
    chosen, why = best(_compiled(second // 2, 10), _compiled(second // 2, 20))
    assert chosen == "all_gather" and "holds the fewest bytes" in why


def test_a_negative_compiler_estimate_is_no_estimate():
    piece = get_slice("v5e:2x2")
    found = strategy_plan("all_to_all", _compiled(0, 10, -3.7), Work(1.0, 1.0), piece)
    assert found.compiler_estimate_s is None and found.compiled.cost["optimal_seconds"] == -3.7


def test_a_program_the_compiler_refuses_for_hbm_does_not_fit():
    message = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
               "temporaries (28.44G) exceeds available HBM (15.75G).")
    refused = rejected([message], "platform", 1.0)
    assert refused.out_of_memory and refused.required_bytes == int(28.44 * (1 << 30))
    found = strategy_plan("all_to_all", refused, Work(1.0, 1.0), get_slice("v5e:8x8"))
    assert found.fits is False and found.chip_bytes == refused.required_bytes
    # libtpu's other wording of the same refusal (seen for the fixed-capacity all_to_all on v5e:8x8)
    used = rejected(["JaxRuntimeError: RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent "
                     "error. Ran out of memory in memory space hbm. Used 16.83G of 15.75G hbm. Exceeded hbm capacity "
                     "by 1.08G."], "platform", 1.0)
    assert used.out_of_memory and used.required_bytes == int(16.83 * (1 << 30))
    other = rejected(["JaxRuntimeError: INTERNAL: RET_CHECK failure Ragged all-to-all is currently not supported"],
                     "platform", 1.0)
    assert not other.out_of_memory
    assert strategy_plan("all_to_all", other, Work(1.0, 1.0), get_slice("v5e:8x8")).fits is None


@pytest.fixture(scope="module")
def pool():
    with PlanPool(workers=2, timeout=300) as plan_pool:
        yield plan_pool


def _probe(slice_name: str, program: str) -> SliceJob:
    return SliceJob(slice_name, SMALL.hidden, SMALL.expert_intermediate, SMALL.experts, SMALL.top_k, TOKENS,
                    expert=4, program=program)


def _probes_find_their_collectives(pool: PlanPool, slice_name: str) -> None:
    gathered, exchanged = pool.compile([_probe(slice_name, "probe_all_gather"), _probe(slice_name, "probe_all_to_all")])
    assert gathered.ok and exchanged.ok, (gathered.message, exchanged.message)
    rows = TOKENS * SMALL.hidden * 2  # one chip's bf16 tokens
    kinds = collectives.summary(collectives.Collective(**c) for c in gathered.collectives)
    assert kinds == {"all-gather": {"count": 1, "sent_bytes": 3 * rows},  # its tokens to the 3 others
                     "reduce-scatter": {"count": 1, "sent_bytes": 3 * rows}}  # 3/4 of the 4 chips' rows
    kinds = collectives.summary(collectives.Collective(**c) for c in exchanged.collectives)
    assert kinds == {"ragged-all-to-all": {"count": 1, "sent_bytes": rows * 3 // 4}}
    assert gathered.chip_bytes > 0 and gathered.compile_s > 0


@needs_tpu
def test_the_tpu_compiler_programs_collectives_as_read(pool):
    _probes_find_their_collectives(pool, "v5e:2x2")


@needs_gpu
def test_the_gpu_compiler_programs_collectives_as_read(pool):
    _probes_find_their_collectives(pool, "h100x4")


def _check_layer_plan(found, piece_name: str) -> None:
    piece = get_slice(piece_name)
    assert found.expert == 4 and found.tensor == 1
    by = {p.strategy: p for p in found.strategies}
    for p in found.strategies:
        assert p.compiled.ok, f"{p.strategy}: {p.compiled.message}"
        assert p.fits and 0 < p.chip_bytes < piece.facts.hbm_bytes
        assert p.floor_s == pytest.approx(floor(found.work, p.collective_bytes, piece)[0])
    assert {"all-gather", "reduce-scatter"} <= set(by["all_gather"].collectives)
    assert "ragged-all-to-all" in by["all_to_all"].collectives
    # the fixed-capacity exchange: XLA's all-to-all of [devices, chunk, hidden] buffers, no ragged one
    fixed = by["all_to_all:fixed"].collectives
    assert "all-to-all" in fixed and "ragged-all-to-all" not in fixed
    # the tokens gathered: at least each chip's tokens to the 3 others
    assert by["all_gather"].collectives["all-gather"]["sent_bytes"] >= 3 * TOKENS * SMALL.hidden * 2
    assert found.recommended in by and found.reason


@needs_tpu
def test_the_layer_plans_on_four_tpu_chips(pool):
    found = plan(SMALL, TOKENS, "v5e:2x2", pool=pool)
    _check_layer_plan(found, "v5e:2x2")
    assert all(p.compiler_estimate_s > 0 for p in found.strategies)  # libtpu's own estimate
    # in_kernel: the rows move by remote DMA inside its kernels; the program's only collective gathers the int32
    # counts [4 chips, 8 experts] (XLA writes that small all-gather as an all-reduce), less than one token row
    # (hidden x 2 bytes), and its sent bytes count the kernels' rows
    in_kernel = next(p for p in found.strategies if p.strategy == "in_kernel")
    assert len(in_kernel.compiled.collectives) == 1 and set(in_kernel.collectives) <= {"all-gather", "all-reduce"}
    assert in_kernel.compiled.collectives[0]["operand_bytes"] <= 4 * SMALL.experts * 4 < SMALL.hidden * 2
    kind, = in_kernel.collectives
    # its two collective kernels (dispatch in the gate/up matmul, return in the down projection), by Mosaic
    assert {"moe_tune_dispatch_gate_up", "moe_tune_down_return"} <= set(in_kernel.compiled.kernels)
    assert in_kernel.collective_bytes == int(found.work.dma_bytes) + in_kernel.collectives[kind]["sent_bytes"]


@needs_tpu
def test_in_kernel_compiles_with_quantized_expert_weights(pool):
    """A SliceJob's `weights` compiles the layer on QArray weights (placeholders scaled along the contraction,
    sharded like their values): in_kernel's two kernels serve int8 and float8_e4m3fn in 128-row blocks, with
    no collective of token rows."""
    jobs = [SliceJob("v5e:2x2", SMALL.hidden, SMALL.expert_intermediate, SMALL.experts, SMALL.top_k, TOKENS,
                     expert=4, strategy="in_kernel", weights=weights, weights_block=block)
            for weights, block in (("int8", None), ("float8_e4m3fn", 128))]
    for done in pool.compile(jobs):
        assert done.ok, done.message
        assert {"moe_tune_dispatch_gate_up", "moe_tune_down_return"} <= set(done.kernels)
        assert all(c["operand_bytes"] < SMALL.hidden * 2 for c in done.collectives)


@needs_tpu
def test_the_layer_plans_with_sparsecore_gathers_and_falls_back_where_a_chip_has_none(pool):
    """On v6e:2x2 the all_to_all layer compiles with its dispatch and combine on the SparseCores; v5e has no
    SparseCores, and the plan says its layer compiled on the chip's own kernels instead, and why."""
    on_v6e, on_v5e = plans([PlanRequest(SMALL, TOKENS, name, ("all_to_all",), backend="sparsecore")
                            for name in ("v6e:2x2", "v5e:2x2")], pool)
    [sparse], [tensor] = on_v6e.strategies, on_v5e.strategies
    assert sparse.compiled.ok and sparse.compiled.backend == "sparsecore", sparse.compiled.message
    assert not sparse.compiled.fallback_reason and sparse.fits
    assert {"moe_tune_sparsecore_gather", "moe_tune_sparsecore_gather_reduce"} <= set(sparse.compiled.kernels)
    assert not [k for k in tensor.compiled.kernels if "sparsecore" in k] and tensor.compiled.kernels
    assert tensor.compiled.ok and tensor.compiled.backend == "platform", tensor.compiled.message
    assert tensor.compiled.fallback_reason == "v5e has no SparseCores"
    assert "refused first: v5e has no SparseCores" in "\n".join(lines(on_v5e))


@needs_gpu
def test_the_layer_plans_on_four_h100s(pool):
    found = plan(SMALL, TOKENS, "h100x4", pool=pool)
    _check_layer_plan(found, "h100x4")
    assert all(p.compiler_estimate_s is None for p in found.strategies)  # XLA:GPU gives none


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(cli, list(args), catch_exceptions=False)


def test_the_cli_refuses_an_unknown_slice_or_model_in_one_line(run):
    result = run("plan", "--model", "deepseek-v3", "--target", "v9:2x2")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: unknown slice 'v9:2x2'; known slices: " + ", ".join(SLICES)]
    result = run("plan", "--model", "deepseek-v4", "--target", "v5e:2x2")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    result = run("plan", "--model", "mixtral-8x22b", "--target", "v5e:8x8", "--tensor", "2")
    assert result.exit_code == 2 and "do not split over an expert axis of 32" in result.output


@needs_tpu
def test_the_cli_says_when_the_layer_does_not_fit(run):
    """kimi-k2 (384 experts, hidden 7168) at 16384 tokens per chip on 4 v5e chips: gathering every chip's tokens
    and their entries needs more than the chip's 16 GB, and libtpu refuses the program for HBM."""
    result = run("plan", "--model", "kimi-k2", "--tokens", "16384", "--target", "v5e:2x2", "--strategy",
                 "all_gather", "--format", "json")
    assert result.exit_code == 1
    found = json.loads(result.stdout)
    assert found["recommended"] is None and found["reason"].startswith("does not fit")
    assert found["strategies"][0]["fits"] is False
    assert "estimates, not times" in found["note"]
