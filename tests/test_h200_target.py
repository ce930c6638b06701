"""The H200 as its own target: its device kind resolves to it (not to the H100 it shares SMs with), its
published facts, its slice, its compile-only target config, and tables tuned on it kept apart from an H100's.
The compile-only check that the CUDA plugin compiles triton for it is in tests/test_real_compilers.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import moe_tune.profiles
from moe_tune.core import devices
from moe_tune.core.chips import CHIP_FACTS, GB, for_device_kind, get_slice, get_target
from moe_tune.kernels import get_op
from moe_tune.kernels.ragged_dot.mosaic_gpu_kernels import sm_count
from moe_tune.profiles.lookup import device_of_kind
from moe_tune.targets.gpu_config import target_config_text

H100_KIND = "nvidia_h100_80gb_hbm3"


def test_an_h200_reports_its_own_kind_and_target():
    kind = devices.normalize_device_kind("NVIDIA H200")  # jax.devices()[0].device_kind on an H200
    assert kind == "nvidia_h200" == get_target("h200").device_kind
    assert for_device_kind(kind).name == "h200"
    assert for_device_kind(H100_KIND).name == "h100"
    assert device_of_kind(kind) == devices.Device("gpu", kind)
    assert devices.gpu_compute_capability(kind) == (9, 0) == devices.gpu_compute_capability("nvidia_h800")
    assert devices.gpu_shared_memory_bytes(kind) == 227 * 1024 == get_target("h200").shared_memory_per_block
    with devices.judging_kind(kind) as judged:
        assert judged == devices.Device("gpu", kind)
        assert sm_count() == 132


def test_the_h200_facts_are_its_datasheets_and_its_sms_the_h100s():
    h100, h200 = get_target("h100"), get_target("h200")
    assert h200.gpu.memory_bytes == 141 * GB and h200.gpu.memory_bandwidth == 4_800_000_000_000
    shared = ("compute_capability", "sm_count", "shared_memory_per_block_optin", "shared_memory_per_sm",
              "l2_cache_bytes", "clock_ghz")
    assert [getattr(h200.gpu, f) for f in shared] == [getattr(h100.gpu, f) for f in shared]
    facts = CHIP_FACTS["h200"]
    assert (facts.hbm_bytes, facts.hbm_bandwidth, facts.interconnect_bandwidth) == (141 * GB, 4800 * GB, 900 * GB)
    assert facts.peak_bf16_flops == CHIP_FACTS["h100"].peak_bf16_flops == 989.4e12
    assert "H200 datasheet" in facts.source
    assert facts.hbm_bandwidth / CHIP_FACTS["h100"].hbm_bandwidth == pytest.approx(1.43, abs=0.01)


def test_the_h200_slice_and_target_config():
    piece = get_slice("H200x8")
    assert (piece.target, piece.topology, piece.chips) == ("h200", "1x8x1", 8)
    assert piece.facts == CHIP_FACTS["h200"] and piece.chip.device_kind == "nvidia_h200"
    text = target_config_text(get_target("h200"))
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text and "core_count: 132" in text
    assert "memory_bandwidth: 4800000000000" in text and f"device_memory_size: {141 * GB}" in text
    assert 'device_description_str: "NVIDIA H200"' in text


@pytest.mark.filterwarnings("ignore:moe-tune.*tuned with jax")  # the shipped entries' jax
def test_tables_tuned_on_an_h100_do_not_answer_for_an_h200(isolated_profiles: Path):
    shipped = Path(moe_tune.profiles.__file__).parent / "data" / H100_KIND / "ragged_dot.json"
    (isolated_profiles / H100_KIND).mkdir(parents=True)
    shutil.copy(shipped, isolated_profiles / H100_KIND)
    op = get_op("ragged_dot")
    problem = op.problem(m=4096, k=7168, n=2048, groups=32, dtype="bfloat16")
    on_h100 = op.lookup(problem, device_kind=H100_KIND)
    on_h200 = op.lookup(problem, device_kind="nvidia_h200")
    assert on_h100.source == "exact"
    assert on_h200.source == "default"
