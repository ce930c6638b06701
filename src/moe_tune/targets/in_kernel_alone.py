"""One of the `in_kernel` strategy's fused kernels compiled alone for a slice of compile-only TPU chips, in a
compile worker process (`moe_tune.workers`, the compile-only wheels on its path): `in_kernel_gmm.dispatch_gate_up`
or `in_kernel_return.down_return` inside a `jax.shard_map` over the slice's (expert, tensor) mesh
(`slice_compile.slice_mesh`), its routing from an int32 [t, top_k] input (`exchange.route`), at tiles given
or the rules' choice. What the VMEM rules (`layer/in_kernel_rules.py`) are held to:
benchmarks/in_kernel_rules_audit.py, tests/test_in_kernel_rules.py.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from moe_tune.core.chips import get_slice
from moe_tune.targets.compile import OK, REJECTED, acting_as, first_line

KERNELS = ("gate_up", "down")


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel to compile: `kernel` (`gate_up` or `down`), the slice, the mesh's expert and tensor sizes,
    this device's tokens and the layer's hidden size, one expert's whole width `intermediate` (split over
    `tensor`), experts, top_k, the activations' dtype, the weights' (`int8`: a QArray with one float32 scale per
    output column) and `tile` (tm, tk, tn; None: the kernel's own choice)."""

    kernel: str
    slice: str
    expert: int
    tensor: int
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    dtype: str = "bfloat16"
    weights: str = "bfloat16"
    tile: tuple[int, int, int] | None = None

    @property
    def local(self) -> int:
        return self.experts // self.expert

    @property
    def width(self) -> int:
        """One device's slice of an expert's width."""
        return self.intermediate // self.tensor

    def rows_in(self) -> int:
        from moe_tune.layer import exchange

        return exchange.receive_rows(self.tokens, self.top_k, self.expert, self.local, None)


def weight_struct(case: KernelCase, shape: tuple[int, int, int], mesh=None, spec=None) -> Any:
    """A ShapeDtypeStruct of weights [groups, k, n] in the case's format (int8: a QArray of int8 values and a
    float32 [groups, 1, n] scale), sharded by `spec` over `mesh` when given (the scale's one row whole)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_tune.core.quant import QArray

    values = None if mesh is None else NamedSharding(mesh, spec)
    if case.weights != "int8":
        return jax.ShapeDtypeStruct(shape, jnp.dtype(case.weights), sharding=values)
    scale = None if mesh is None else NamedSharding(mesh, P(spec[0], None, spec[2]))
    return QArray(jax.ShapeDtypeStruct(shape, jnp.int8, sharding=values),
                  jax.ShapeDtypeStruct((shape[0], 1, shape[2]), jnp.float32, sharding=scale))


def weight_spec(case: KernelCase, spec) -> Any:
    """The shard_map in_spec of weights sharded by `spec`: a QArray's scale keeps its one row whole."""
    from jax.sharding import PartitionSpec as P

    from moe_tune.core.quant import QArray

    if case.weights != "int8":
        return spec
    return QArray(spec, P(spec[0], None, spec[2]))


def local_operands(case: KernelCase) -> dict[str, Any]:
    """One device's operands as shape stand-ins: x [t, d], w_gate [local, d, f / tp], w_down [local, f / tp, d],
    and the h rows the down kernel reads (`rows`)."""
    import jax
    import jax.numpy as jnp

    from moe_tune.kernels.pallas_util import round_up

    dtype = jnp.dtype(case.dtype)
    return {"x": jax.ShapeDtypeStruct((case.tokens, case.hidden), dtype),
            "w_gate": weight_struct(case, (case.local, case.hidden, case.width)),
            "w_down": weight_struct(case, (case.local, case.width, case.hidden)),
            "rows": round_up(case.rows_in(), 16)}


def _program(case: KernelCase, mesh: Any):
    """(the jitted shard_map program, its global argument stand-ins)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_tune.layer import exchange
    from moe_tune.layer.in_kernel_gmm import dispatch_gate_up
    from moe_tune.layer.in_kernel_return import down_return

    tensor = "tensor" if case.tensor > 1 else None
    ep, experts, rows = case.expert, case.experts, local_operands(case)["rows"]
    dtype = jnp.dtype(case.dtype)

    def sharded(shape, spec, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    chosen = sharded((ep * case.tokens, case.top_k), P("expert", None), jnp.int32)
    f = case.intermediate

    def routed(chosen):
        me = jax.lax.axis_index("expert")
        return me, exchange.route(chosen, axis="expert", devices=ep, me=me, cap=None, local=case.local)

    if case.kernel == "gate_up":
        x = sharded((ep * case.tokens, case.hidden), P("expert", None), dtype)
        spec = P("expert", None, tensor)
        w = weight_struct(case, (experts, case.hidden, f), mesh, spec)

        def body(chosen, x, w_gate, w_up):
            me, route = routed(chosen)
            return dispatch_gate_up(x, route, w_gate, w_up, rows_in=case.rows_in(), top_k=case.top_k,
                                    activation="silu", axis="expert", devices=ep, me=me, tile=case.tile)

        specs = (P("expert", None), P("expert", None), weight_spec(case, spec), weight_spec(case, spec))
        args, out = (chosen, x, w, w), P("expert", tensor)
    else:
        h = sharded((ep * rows, f), P("expert", tensor), dtype)
        spec = P("expert", tensor, None)
        w = weight_struct(case, (experts, f, case.hidden), mesh, spec)

        def body(chosen, h, w_down):
            _, route = routed(chosen)
            return down_return(h, w_down, route, entries=case.tokens * case.top_k, axis="expert", devices=ep,
                               out_dtype=dtype, tile=case.tile)

        specs = (P("expert", None), P("expert", tensor), weight_spec(case, spec))
        args, out = (chosen, h, w), P("expert", None)
    program = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False)
    return jax.jit(program), args


def compile_kernel(case: KernelCase) -> dict[str, Any]:
    """In a compile worker: lower and compile `case` for its slice's chip. {"status": `ok` / `rejected`,
    "message": the compiler's (or the lowering's) first line, "compile_s", "memory": the program's
    temporaries and arguments in bytes per chip}."""
    import jax

    from moe_tune.core.errors import UsageError
    from moe_tune.targets.slice_compile import slice_devices, slice_mesh

    piece = get_slice(case.slice)
    start = time.perf_counter()
    with acting_as(piece.chip), jax.default_device(slice_devices(piece.name)[0]):
        try:
            program, args = _program(case, slice_mesh(piece, case.expert, case.tensor))
            compiled = program.lower(*args).compile()
        except (ValueError, NotImplementedError, UsageError, jax.errors.JaxRuntimeError) as e:
            return {"status": REJECTED, "message": first_line(f"{type(e).__name__}: {e}"),
                    "compile_s": time.perf_counter() - start, "memory": {}}
        except Exception as e:
            if "Mosaic" not in type(e).__name__:
                raise
            return {"status": REJECTED, "message": first_line(f"{type(e).__name__}: {e}"),
                    "compile_s": time.perf_counter() - start, "memory": {}}
    analysis = compiled.memory_analysis()
    memory = {} if analysis is None else {name: int(getattr(analysis, name)) for name in
                                          ("temp_size_in_bytes", "argument_size_in_bytes") if hasattr(analysis, name)}
    return {"status": OK, "message": "", "compile_s": time.perf_counter() - start, "memory": memory}


def compile_kernels(cases: list[KernelCase], arrived, *, timeout: float = 300) -> None:
    """Compile each case in one compile worker (the compile-only wheels on its path), one after the other;
    `arrived(index, status, value)` as each ends: status "ok" with `compile_kernel`'s dict, else the worker's
    failure (`value.kind`, `value.message`)."""
    from moe_tune.targets import wheels
    from moe_tune.workers import WorkerPool

    pool = WorkerPool(1, env=wheels.worker_env)
    try:
        pool.map("moe_tune.targets.in_kernel_alone:compile_kernel", [(i, (c,)) for i, c in enumerate(cases)],
                 arrived, timeout=timeout)
    finally:
        pool.close()
