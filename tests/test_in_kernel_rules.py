"""The `in_kernel` fused kernels' VMEM and SMEM rules (`layer/in_kernel_rules.py`) and the tiles they pick
(`in_kernel_gmm.tiles`, `gate_up_tiles`, `in_kernel_return.down_tiles`): their unit facts in-process, and a few
real libtpu compiles of each kernel alone (`targets/in_kernel_alone.py`) for a compile-only v5e slice: a tile
the rule accepts compiles, one it refuses is refused by the compiler too (skipped without libtpu).
benchmarks/results/in_kernel_rules_audit_v5e_v6e_2026-12-02.json holds the wide audit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_tune.core import devices
from moe_tune.core.chips import get_slice, get_target
from moe_tune.kernels.fused_moe.pallas_tpu_kernels import visit_schedule
from moe_tune.layer import in_kernel, in_kernel_gmm, in_kernel_return, in_kernel_rules
from moe_tune.targets import wheels
from moe_tune.targets.compile import acting_as
from moe_tune.targets.in_kernel_alone import KernelCase, compile_kernels, local_operands

needs_tpu = pytest.mark.skipif(not wheels.available("tpu"),
                               reason="libtpu is missing: pip install 'moe-tune[tpu-compile]'")
S = jax.ShapeDtypeStruct
# qwen3-30b-a3b over 4 devices of the expert axis, 256 tokens per device
QWEN = dict(slice="v5e:2x2", expert=4, tensor=1, tokens=256, hidden=2048, intermediate=768, experts=128, top_k=8)


def chosen_and_need(case: KernelCase):
    """The kernel's own tiles for `case` and the rule's bytes at them (judged for the caller's chip)."""
    ops = local_operands(case)
    if case.kernel == "gate_up":
        tile = in_kernel_gmm.gate_up_tiles(ops["x"], ops["w_gate"], case.rows_in())
        need = in_kernel_rules.gate_up_vmem_bytes(*tile, word_bytes=case.hidden * 2, x_dtype=ops["x"].dtype,
                                                  weights=in_kernel_rules.weight_format(ops["w_gate"]))
    else:
        tile = in_kernel_return.down_tiles(ops["rows"], ops["w_down"], ops["x"].dtype)
        need = in_kernel_rules.down_vmem_bytes(*tile, h_dtype=ops["x"].dtype,
                                               packed=in_kernel_return.packs(ops["x"].dtype, tile[2]),
                                               weights=in_kernel_rules.weight_format(ops["w_down"]))
    return tile, need


def test_the_budget_is_the_chips_scoped_vmem():
    for name in ("v5e", "v6e"):
        target = get_target(name)
        with acting_as(target):
            assert in_kernel_rules.vmem_budget() == target.scoped_vmem_bytes
    with devices.judging(devices.Device("cpu", "cpu")):  # interpret mode: the safe default
        assert in_kernel_rules.vmem_budget() == devices.TPU_SCOPED_VMEM_BYTES


@pytest.mark.parametrize("kernel", ["gate_up", "down"])
@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_the_kernels_take_the_largest_tiles_the_rule_accepts(kernel, weights, monkeypatch):
    """The search runs tm, then tn, then tk, each largest first, and stops at the first tile the rule accepts:
    every tile tried before it is refused; a bigger chip (v6e's 32 MiB) never gets a smaller row tile."""
    case = KernelCase(kernel, weights=weights, **QWEN)
    picked = {}
    search = in_kernel_gmm.tiles
    for name in ("v5e", "v6e"):
        tried = []

        def recording(*args, fits, **kwargs):
            def judged(*tile):
                tried.append((tile, fits(*tile)))
                return tried[-1][1]

            return search(*args, fits=judged, **kwargs)

        monkeypatch.setattr(in_kernel_gmm, "tiles", recording)
        with acting_as(get_target(name)):
            tile, need = chosen_and_need(case)
            assert need <= in_kernel_rules.vmem_budget()
        monkeypatch.setattr(in_kernel_gmm, "tiles", search)
        assert tried[-1] == (tile, True) and not any(ok for _, ok in tried[:-1])
        order = [(-tm, -tn, -tk) for (tm, tk, tn), _ in tried]
        assert order == sorted(order)
        picked[name] = tile
    assert picked["v6e"][0] >= picked["v5e"][0]


def test_row_tile_is_taken_and_capped_at_the_rows():
    x, w = S((8, 256), jnp.bfloat16), S((2, 256, 256), jnp.bfloat16)
    assert in_kernel_gmm.gate_up_tiles(x, w, 1000, row_tile=64)[0] == 64
    assert in_kernel_gmm.gate_up_tiles(x, w, 40, row_tile=256)[0] == 48  # 40 rows rounded up to 16
    assert in_kernel_gmm.gate_up_tiles(x, w, 40)[0] == 48


def test_a_layer_no_tile_fits_is_refused_in_one_line():
    """A row of 256K float32 words takes 16 MiB of row scratch at 16 rows: no gate/up tile fits, the layer
    takes the unfused path (`in_kernel.fused_refusal`), and the kernel called anyway says so in one line."""
    x, w_gate = S((8, 262144), jnp.float32), S((2, 262144, 128), jnp.float32)
    w_down = S((2, 128, 262144), jnp.float32)
    with acting_as(get_target("v5e")):
        assert in_kernel_gmm.gate_up_tiles(x, w_gate, 64) is None
        reason = in_kernel.fused_refusal(x, w_gate, w_down, "silu", 64, 2)
    assert reason.startswith("no tile of its gate/up kernel fits the chip's 16 MiB of VMEM") and "\n" not in reason


def test_a_return_row_tile_that_does_not_fit_is_named():
    x, w_gate = S((256, 2048), jnp.bfloat16), S((32, 2048, 768), jnp.bfloat16)
    w_down = S((32, 768, 2048), jnp.bfloat16)
    with acting_as(get_target("v5e")):
        assert in_kernel.fused_refusal(x, w_gate, w_down, "silu", 8192, 8) is None
        assert in_kernel_return.refusal(8192, w_down, jnp.bfloat16, row_tile=512) is None
    # the rule itself, per buffer: doubling tm never lowers the bytes
    form = in_kernel_rules.weight_format(w_down)
    sizes = [in_kernel_rules.down_vmem_bytes(tm, 768, 2048, h_dtype=jnp.bfloat16, packed=True, weights=form)
             for tm in (64, 128, 256, 512)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4


def test_packed_return_tiles_keep_whole_lanes_of_words(monkeypatch):
    """A bfloat16 output tile travels as tn / 2 uint32 words per row: Mosaic copies rows of whole 128-lane
    tiles only ("Source and target leading tiles have different trailing dimensions" at tn 128), so a compiled
    return refuses a packed n tile that is neither a multiple of 256 nor the whole width; interpret mode
    (the CPU) takes any."""
    for tn in range(128, 1024 + 1, 128):
        assert in_kernel_rules.words_aligned(tn, 1024, packed=True) == (tn % 256 == 0 or tn == 1024)
        assert in_kernel_rules.words_aligned(tn, 1024, packed=False)
    predicates = []
    monkeypatch.setattr(in_kernel_gmm, "tiles", lambda *args, fits, **kwargs: predicates.append(fits))
    w_down = S((4, 768, 1024), jnp.bfloat16)
    for device in (devices.Device("tpu", "tpu_v5_lite"), devices.Device("cpu", "cpu")):
        with devices.judging(device):
            in_kernel_return.down_tiles(64, w_down, jnp.bfloat16)
            assert predicates[-1](16, 128, 256)
            assert predicates[-1](16, 128, 128) == (device.platform == "cpu")


def test_the_smem_rules_count_the_tables_the_kernels_build():
    """`schedule_bytes` is the visit schedule's tables as traced, at every row tile."""
    sizes = jnp.array([5, 0, 40, 3], jnp.int32)
    for tm in in_kernel_rules.ROW_TILES:
        m_p = -(-100 // tm) * tm
        tables = jax.eval_shape(lambda s, tm=tm, m_p=m_p: visit_schedule(s, None, m_padded=m_p, tm=tm, groups=4),
                                sizes)
        assert in_kernel_rules.schedule_bytes(100, tm, 4) == 4 * sum(int(np.prod(t.shape)) for t in tables)
    assert in_kernel_rules.smem_error(in_kernel_rules.SMEM_METADATA_BYTES, "x") is None
    assert "exceed 512 KiB of SMEM" in in_kernel_rules.smem_error(in_kernel_rules.SMEM_METADATA_BYTES + 4, "x")
    # gate/up: three int32 per entry on top of the schedule and its counts
    assert (in_kernel_rules.gate_up_smem_bytes(1001, 100, 4, 16) - in_kernel_rules.gate_up_smem_bytes(1000, 100, 4, 16)
            == 12)


def _compile(cases: list[KernelCase]) -> list[dict]:
    results: list[dict | None] = [None] * len(cases)

    def arrived(index, status, value):
        results[index] = value if status == "ok" else {"status": "crashed", "message": str(value.message)}

    compile_kernels(cases, arrived)
    return results  # type: ignore[return-value]


@needs_tpu
def test_libtpu_compiles_what_the_rule_accepts_and_refuses_what_it_refuses():
    """For a v5e: each kernel at its own tiles (int8 weights for the return) compiles; gate/up at (512, 2048,
    768), over the rule's budget, is refused by the compiler for scoped VMEM."""
    over = KernelCase("gate_up", tile=(512, 2048, 768), **QWEN)
    with acting_as(get_slice(QWEN["slice"]).chip):
        ops = local_operands(over)
        need = in_kernel_rules.gate_up_vmem_bytes(*over.tile, word_bytes=over.hidden * 2, x_dtype=ops["x"].dtype,
                                                  weights=in_kernel_rules.weight_format(ops["w_gate"]))
        assert need > in_kernel_rules.vmem_budget()  # the rule refuses it
    accepted = [KernelCase("gate_up", **QWEN), KernelCase("down", weights="int8", **QWEN)]
    *fine, refused = _compile([*accepted, over])
    assert all(r["status"] == "ok" for r in fine), fine
    assert refused["status"] == "rejected" and "CompileTimeScopedVmemOom" in refused["message"], refused
