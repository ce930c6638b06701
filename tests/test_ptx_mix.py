"""`targets.ptx_mix`: the instruction mix of a kernel's k loop, on small PTX snippets written as the CUDA
plugin's Triton output spells them (guards, inline assembly several to a line or in a scope whose `}` starts
a line, `$L__BB` labels)."""

from __future__ import annotations

import pytest

from moe_tune.targets.ptx_mix import loop_mixes

TENSOR_CORE_LOOP = """
.visible .entry loop_fusion(
	.param .u64 loop_fusion_param_0
)
{
	ld.global.nc.v4.b32 	{%r1, %r2, %r3, %r4}, [%rd1];
$L__BB0_1:
	add.s32 	%r5, %r5, 1;
	@%p1 bra 	$L__BB0_1;
	ret;
}
.visible .entry moe_tune_gmm(
	.param .u64 moe_tune_gmm_param_0
)
{
	mov.u32 %r11, 0x0; ld.global.b32 { %r11 }, [ %rd10 + 0 ];
	cvt.u64.u32 	%rd2, %r11;
	// begin inline asm
	{
	.reg .b32 %tmp;
	mov.b32 %tmp, 0;
}
	// end inline asm
$L__BB0_2:
	cp.async.wait_group 	2;
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r229,%r230}, %rd70, %rd71, %p2, 1, 1, 0, 1;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r229,%r230}, %rd72, %rd73, %p2, 1, 1, 0, 1;
	wgmma.commit_group.sync.aligned;
	cvt.s64.s32 	%rd80, %r80;
	@%p7 cp.async.cg.shared.global [ %r87 + 0 ], [ %rd80 + 0 ], 0x10, %r88;
	cp.async.cg.shared.global [ %r89 + 0 ], [ %rd81 + 0 ], 0x10, %r88;
	cp.async.commit_group;
	@%p6 bra 	$L__BB0_2;
	st.shared.v4.b32 	[%rd123], {%r185, %r186, %r187, %r188};
	ret;
}
"""

DEQUANTIZING_LOOP = """
.visible .entry moe_tune_gmm(
	.param .u64 moe_tune_gmm_param_0
)
{
$L__BB0_2:
	// begin inline asm
	{ .reg .pred %p; mov.u32 %r1, 0x0; @%p3 ld.global.b8 { %r1 }, [ %rd1 + 0 ]; }
	// end inline asm
	ld.global.v2.b32 	{%r2, %r3}, [%rd2];
	shr.u32 	%r4, %r1, 4;
	and.b32 	%r5, %r4, 15;
	cvt.rn.bf16.s16 	%rs1, %rs2;
	prmt.b32 	%r6, %r5, %r4, 0x5410U;
	mul.rn.f32 	%f1, %f2, %f3;
	fma.rn.f32 	%f4, %f5, %f6, %f4;
	fma.rn.f32 	%f7, %f5, %f6, %f7;
	st.shared.b16 	[%r7], %rs1;
	ld.shared.v4.b32 	{%r8, %r9, %r10, %r11}, [%r12];
	ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r13, %r14, %r15, %r16}, [%rd3];
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f8, %f9, %f10, %f11}, {%r13, %r14, %r15, %r16}, {%r17, %r18}, {%f8, %f9, %f10, %f11};
	setp.lt.s32 	%p9, %r20, %r21;
	@%p9 bra 	$L__BB0_2;
	ret;
}
"""


def test_the_k_loop_of_each_kernel_holds_its_tensor_core_instructions():
    mixes = loop_mixes(TENSOR_CORE_LOOP)
    assert set(mixes) == {"loop_fusion", "moe_tune_gmm"}
    gmm = mixes["moe_tune_gmm"]
    assert gmm.loop_found and gmm.wgmma == 2 and gmm.mma_sync == 0 and gmm.tensor_core == 2
    # the loads and the store outside the loop are not its; address conversions are no conversion
    assert gmm.global_loads == {"cp.async.16B": 2}
    assert gmm.convert == {} and gmm.float_math == {} and gmm.fma_f32 == 0
    assert gmm.shared_stores == 0 and not gmm.round_trip
    # label to branch: wait, fence, 2 wgmma, commit, cvt, 2 cp.async, commit, bra
    assert gmm.instructions == 10
    assert gmm.dequant_share == 0.0
    assert mixes["loop_fusion"].global_loads == {} and mixes["loop_fusion"].instructions == 2


def test_a_dequantizing_loop_counts_its_conversions_loads_and_round_trip():
    gmm = loop_mixes(DEQUANTIZING_LOOP)["moe_tune_gmm"]
    assert gmm.mma_sync == 1 and gmm.wgmma == 0
    assert gmm.global_loads == {"ld.global.8b": 1, "ld.global.64b": 1}
    assert gmm.convert == {"cvt": 1, "prmt": 1}
    assert gmm.float_math == {"mul.rn.f32": 1, "fma.rn.f32": 2} and gmm.fma_f32 == 2
    assert gmm.int_bits == 2
    assert gmm.shared_stores == 1 and gmm.shared_loads == 2 and gmm.round_trip
    assert gmm.shared_store_widths == {"16b": 1}
    # mov, ld.b8, ld.v2, shr, and, cvt, prmt, mul, 2 fma, st, ld.shared, ldmatrix, mma, setp, bra
    assert gmm.instructions == 16
    assert gmm.dequant_share == pytest.approx(3 / 16)  # cvt, prmt, mul (the FMAs apart)
    row = gmm.to_dict()
    assert row["round_trip"] is True and row["tensor_core"] == 1 and row["dequant_share"] == 0.1875


def test_a_kernel_without_a_loop_is_counted_whole_and_nested_loops_as_the_outer_one():
    straight = loop_mixes(".entry k(\n)\n{\n\tld.global.v4.b32 {%r1,%r2,%r3,%r4}, [%rd1];\n\tret;\n}\n")["k"]
    assert not straight.loop_found and straight.global_loads == {"ld.global.128b": 1}
    nested = """
.visible .entry k(
)
{
$L__BB0_1:
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, %p1, 1, 1, 0, 1;
$L__BB0_2:
	cvt.rn.bf16x2.f32 	%r3, %f1, %f2;
	@%p2 bra 	$L__BB0_2;
	@%p3 bra 	$L__BB0_1;
	ret;
}
"""
    mix = loop_mixes(nested)["k"]
    assert mix.wgmma == 1 and mix.convert == {"cvt": 1} and mix.instructions == 4


@pytest.mark.skipif(not __import__("moe_tune.targets.wheels", fromlist=["available"]).available("gpu"),
                    reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")
def test_the_dumped_ptx_of_a_compiled_triton_ragged_dot_holds_its_k_loop():
    """`targets.ptx_dump`: a bf16 forward compiled for an H100 keeps the tensor cores in its k loop (block_m 64:
    one warpgroup's wgmma, k 16 each: block_k / 16 of them a step); a config the compiler refuses has no PTX."""
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
    from moe_tune.kernels.ragged_dot.triton import TritonConfig
    from moe_tune.targets.jobs import CompileJob
    from moe_tune.targets.ptx_dump import PtxPool

    problem = RaggedDotProblem(512, 512, 512, 4, lhs_dtype="bfloat16", rhs_dtype="bfloat16", out_dtype="bfloat16")
    jobs = [CompileJob("h100", "ragged_dot", "triton", problem, TritonConfig(64, 64, 64, 4, 2)),
            CompileJob("h100", "ragged_dot", "triton", problem, TritonConfig(256, 256, 256, 4, 4))]
    with PtxPool(1) as pool:
        (ok, ptx), (refused, nothing) = pool.compile(jobs)
    assert ok.ok and not refused.ok and nothing == ""
    mix = loop_mixes(ptx)["moe_tune_gmm"]
    assert mix.loop_found and mix.wgmma == 64 // 16 and not mix.round_trip
    assert "cp.async.16B" in mix.global_loads


@pytest.mark.skipif(not __import__("moe_tune.targets.wheels", fromlist=["available"]).available("gpu"),
                    reason="the CUDA plugin is missing: pip install 'moe-tune[gpu-compile]'")
def test_the_dumped_ptx_of_a_mosaic_gpu_kernel_holds_its_k_loop():
    """`targets.ptx_dump` also reads the PTX the Mosaic GPU compiler dumps apart from XLA's: the int8 swap-AB
    forward (`mosaic_gpu_quant`) compiled for an H100 has wgmma in its k loop (block_n 128: two 64-row wgmma
    per 16 of block_k, each fed from registers: no shared-memory store in the loop) and TMA loads."""
    from moe_tune.kernels.ragged_dot.mosaic_gpu_quant import MosaicGpuQuantConfig
    from moe_tune.kernels.ragged_dot.mosaic_gpu_quant_kernel import KERNEL_ENTRY
    from moe_tune.kernels.ragged_dot.problem import RaggedDotProblem
    from moe_tune.targets.jobs import CompileJob
    from moe_tune.targets.ptx_dump import PtxPool

    problem = RaggedDotProblem(256, 512, 256, 4, lhs_dtype="bfloat16", rhs_dtype="float32", out_dtype="bfloat16",
                               rhs_qdtype="int8", rhs_qblock=512)
    config = MosaicGpuQuantConfig(block_m=16, block_n=128, block_k=128, max_concurrent_steps=2)
    with PtxPool(1) as pool:
        ((result, ptx),) = pool.compile([CompileJob("h100", "ragged_dot", "mosaic_gpu_quant", problem, config)])
    assert result.ok, result.message
    mix = loop_mixes(ptx)[KERNEL_ENTRY]
    assert mix.loop_found and mix.wgmma == 2 * 128 // 16 and not mix.round_trip
    assert mix.global_loads == {"bulk": 2}  # the tokens' and the weights' tiles of the step
