"""One program compiled for a whole slice of compile-only chips, in a compile worker process.

`compile_program(job)` builds the slice's topology (`get_topology_desc`), a `Mesh` of its devices shaped
(expert, tensor), the program's arguments as `ShapeDtypeStruct`s sharded over it, and runs
`jax.jit(...).lower(...).compile()` with moe-tune judging every rule for the slice's chip (`acting_as`), so the
kernels take their compiled paths. The program is the MoE layer across devices (`layer.sharded.
sharded_moe_mlp`, one `ep_strategy`), or one of two small exchanges with known collectives (`PROBES`: tokens
gathered and outputs reduce-scattered; rows sent with a ragged all-to-all) that show what the collective
reading finds. A layer whose kernels the chip's compiler rejects is compiled again on the ops' XLA backends,
and the result says so. The result carries per-chip memory (`memory_analysis`), the collectives of the
compiled HLO (`collectives.py`) and the compiler's own cost estimate where it gives one (TPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
from typing import Any

from moe_tune.core.chips import Slice, get_slice
from moe_tune.targets import collectives
from moe_tune.targets.compile import OK, REJECTED, acting_as, first_line
from moe_tune.targets.gpu_config import target_config_text

LAYER = "layer"
# the backends a layer compiles with, in turn, while the chip's compiler refuses the kernels
FALLBACKS = {None: [None, "xla"], "sparsecore": ["sparsecore", None, "xla"]}
PROBES = ("probe_all_gather", "probe_all_to_all")
# memory_analysis() fields (bytes per chip); what a chip holds = arguments + outputs + temporaries + code - aliased
_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                  "generated_code_size_in_bytes", "alias_size_in_bytes")
_COST_FIELDS = {"flops": "flops", "bytes accessed": "bytes_accessed", "optimal_seconds": "optimal_seconds"}
# the compiler refusing a program for HBM (TPU: "Ran out of memory on HBM ... required for HLO temporaries
# (32.44G) exceeds available HBM (15.75G)", or "CompileTimeHbmOom ... Used 16.83G of 15.75G hbm"): the program
# does not fit; the first size is what it needed
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED.*(?:HBM|out of memory)", re.IGNORECASE)
_NEEDED = re.compile(r"\(([\d.]+)([KMGT])\)|Used ([\d.]+)([KMGT]) of")
_CUSTOM_CALL = re.compile(r"^\s*(?:ROOT )?%([\w-]+?)(?:\.\d+)? = [^\n]*? custom-call\(", re.MULTILINE)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# a rejection that names a kernel (its lowering, its VMEM / shared memory), which the XLA backends may avoid
_KERNEL_VERDICT = re.compile(r"Mosaic|Pallas|Triton|ptxas|vmem|shared memory|custom[_ ]call|SparseCore",
                             re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class SliceJob:
    """What to compile: a slice, the layer's sizes (tokens per expert-axis shard), the mesh's (expert, tensor)
    sizes, the program (`layer` or one of PROBES), its way (`slice_plan.STRATEGIES`: an ep_strategy name, or
    `all_to_all:fixed`) and capacity factor, and the kernels' backend
    (None: the chip's own kernels, with the XLA backends as the fallback; `xla`: those only; `sparsecore`: the
    SparseCore gathers beside the chip's other kernels, falling back as None does: `FALLBACKS`)."""

    slice: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int
    expert: int
    tensor: int = 1
    dtype: str = "bfloat16"
    program: str = LAYER
    strategy: str = "all_gather"
    capacity_factor: float | None = None
    backend: str | None = None
    weights: str | None = None  # a stored quantized dtype (`quant_format.QDTYPES`) for the expert weights
    weights_block: int | None = None  # its scale block along the contracting axis (None: one scale per column)


@dataclasses.dataclass(frozen=True)
class SliceCompile:
    """How one program fared: status (`ok` / `rejected`, `compile.py`'s), the compiler's line when rejected,
    the backend the kernels compiled with (`platform`, `xla` or `sparsecore`) and why the platform's kernels did not
    (`fallback_reason`), seconds of lower + compile (all attempts), memory per chip, the collectives found and
    the compiler's cost estimate (flops, bytes_accessed, optimal_seconds; empty where none is given).
    out_of_memory: the compiler refused the program for HBM; required_bytes: what it said it needed (the
    temporaries alone: a lower bound of what a chip would hold). kernels: the names of the compiled program's
    custom calls (its Pallas kernels: `moe_tune_sparsecore_gather`, `gmm`...), each once."""

    status: str
    message: str = ""
    backend: str = ""
    fallback_reason: str = ""
    compile_s: float = 0.0
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    cost: dict[str, float] = dataclasses.field(default_factory=dict)
    out_of_memory: bool = False
    required_bytes: int = 0
    kernels: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def chip_bytes(self) -> int:
        m = self.memory
        return (m.get("argument_size_in_bytes", 0) + m.get("output_size_in_bytes", 0) + m.get("temp_size_in_bytes", 0)
                + m.get("generated_code_size_in_bytes", 0) - m.get("alias_size_in_bytes", 0))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SliceCompile:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@functools.cache
def slice_devices(name: str) -> tuple[Any, ...]:
    """The compile-only devices of a slice (its topology built once per process)."""
    from jax.experimental import topologies

    piece = get_slice(name)
    if piece.chip.platform == "tpu":
        topology = topologies.get_topology_desc(piece.topology, "tpu")
    else:
        topology = topologies.get_topology_desc(platform="cuda", topology=piece.topology,
                                                target_config=target_config_text(piece.chip))
    return tuple(topology.devices)


def slice_mesh(piece: Slice, expert: int, tensor: int) -> Any:
    """A Mesh of the slice's devices with axes (`expert`, `tensor`) of those sizes (TPU: laid out on the
    torus by `mesh_utils`)."""
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    devices = slice_devices(piece.name)
    if expert * tensor != len(devices):
        raise ValueError(f"a {expert}x{tensor} mesh on {len(devices)} chips")
    try:
        grid = mesh_utils.create_device_mesh((expert, tensor), devices=list(devices))
    except Exception:  # noqa: BLE001 - no physical layout known for these devices: their order
        grid = np.array(devices).reshape(expert, tensor)
    return Mesh(grid, ("expert", "tensor"))


def _arguments(job: SliceJob, mesh: Any) -> tuple[Any, ...]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    dtype = jnp.dtype(job.dtype)
    tokens = job.tokens * job.expert  # the global batch: `tokens` per expert-axis shard
    tensor = "tensor" if job.tensor > 1 else None
    spec = {"x": ((tokens, job.hidden), P("expert", None)), "logits": ((tokens, job.experts), P("expert", None)),
            "w_gate": ((job.experts, job.hidden, job.intermediate), P("expert", None, tensor)),
            "w_up": ((job.experts, job.hidden, job.intermediate), P("expert", None, tensor)),
            "w_down": ((job.experts, job.intermediate, job.hidden), P("expert", tensor, None))}
    arguments = []
    for name, (shape, parts) in spec.items():
        struct = jax.ShapeDtypeStruct(shape, jnp.float32 if name == "logits" else dtype)
        if name.startswith("w_") and job.weights is not None:  # a QArray of placeholders, scaled along axis 1
            from moe_tune.core.quant import quantize
            from moe_tune.layer.moe import weight_spec

            struct = jax.eval_shape(lambda w: quantize(w, job.weights, axis=1, block_size=job.weights_block),
                                    struct)
            specs = weight_spec(struct, name, tuple(parts), mesh)
            arguments.append(jax.tree.map(lambda leaf, part: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, part)), struct, specs))
            continue
        arguments.append(jax.ShapeDtypeStruct(shape, struct.dtype, sharding=NamedSharding(mesh, parts)))
    return tuple(arguments)


def _probe(job: SliceJob, mesh: Any) -> Any:
    """A small exchange over the expert axis with the layer's arguments, its collectives known in advance:
    `probe_all_gather` gathers x, multiplies by the first local expert's up and down projections and
    reduce-scatters the result; `probe_all_to_all` sends each chip's rows to the chips in equal parts with a
    ragged all-to-all into a buffer of the same rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = job.expert

    def gathered(x, logits, w_gate, w_up, w_down):
        full = jax.lax.all_gather(x, "expert", tiled=True)
        y = (full @ w_up[0]) @ w_down[0]
        return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)

    def exchanged(x, logits, w_gate, w_up, w_down):
        rows = x.shape[0] // n
        sizes = jnp.full((n,), rows, jnp.int32)
        offsets = jnp.arange(n, dtype=jnp.int32) * rows
        mine = jax.lax.axis_index("expert").astype(jnp.int32) * rows
        return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets, sizes, jnp.full((n,), mine, jnp.int32),
                                         sizes, axis_name="expert")

    body = gathered if job.program == "probe_all_gather" else exchanged
    specs = (P("expert"), P("expert"), P("expert"), P("expert"), P("expert"))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("expert"), check_vma=False)


def _layer(job: SliceJob, mesh: Any) -> Any:
    from moe_tune.layer.moe import sharded_moe_mlp
    from moe_tune.layer.sharding_choice import ShardingConfig

    # `all_to_all:fixed` (slice_plan.FIXED_ALL_TO_ALL): all_to_all over the fixed-capacity exchange
    strategy, _, exchange = job.strategy.partition(":")
    ep_strategy = ShardingConfig(strategy=strategy, exchange=exchange) if exchange else strategy

    def call(x, logits, w_gate, w_up, w_down):
        return sharded_moe_mlp(x, logits, w_gate, w_up, w_down, job.top_k, mesh=mesh, expert_axis="expert",
                               tensor_axis="tensor" if job.tensor > 1 else None, ep_strategy=ep_strategy,
                               capacity_factor=job.capacity_factor)

    return call


@contextlib.contextmanager
def named_backends(backend: str):
    """Inside, every op that has a backend of that name runs on it (`xla`: the kernels' plain-XLA forms;
    `sparsecore`: the gathers on the SparseCores); the others on their defaults."""
    from moe_tune.kernels import get_op, op_names, use_backend

    with contextlib.ExitStack() as stack:
        for name in op_names():
            if backend in get_op(name).backends.names():
                stack.enter_context(use_backend(name, backend))
        yield


def xla_backends() -> contextlib.AbstractContextManager[None]:
    """Inside, every op that has an `xla` backend runs on it (the kernels' plain-XLA forms)."""
    return named_backends("xla")


def _compile_once(job: SliceJob, piece: Slice, backend: str | None) -> tuple[Any, str]:
    """(the compiled program, '') or (None, the compiler's line)."""
    import jax

    mesh = slice_mesh(piece, job.expert, job.tensor)
    program = _layer(job, mesh) if job.program == LAYER else _probe(job, mesh)
    args = _arguments(job, mesh)
    # a SparseCore kernel reads its chip from the default device (`pltpu.get_tpu_info`): the slice's, here
    default = jax.default_device(slice_devices(piece.name)[0]) if piece.chip.platform == "tpu" else None
    with (acting_as(piece.chip), named_backends(backend) if backend else contextlib.nullcontext(),
          default or contextlib.nullcontext()):
        try:
            return jax.jit(program).lower(*args).compile(), ""
        except (ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
            return None, first_line(f"{type(e).__name__}: {e}")
        except Exception as e:
            if "Mosaic" in type(e).__name__:
                return None, first_line(f"{type(e).__name__}: {e}")
            raise


def compile_program(job: SliceJob) -> dict[str, Any]:
    """In a compile worker: compile `job` for its slice; the `SliceCompile` as a dict. The layer on the chip's
    own kernels first (with the `sparsecore` backend: the SparseCore gathers before them), then (rejected) on
    the XLA backends; a probe has no kernels."""
    piece = get_slice(job.slice)
    start = time.perf_counter()
    tries = FALLBACKS.get(job.backend, [job.backend]) if job.program == LAYER else [job.backend]
    compiled, reasons, used = None, [], "platform"
    for backend in tries:
        used = backend or "platform"
        if backend == "sparsecore" and piece.chip.sparse_core is None:
            reasons.append(f"{piece.chip.name} has no SparseCores")  # its kernels would run the TensorCore ones
            continue
        compiled, reason = _compile_once(job, piece, backend)
        if compiled is not None:
            break
        reasons.append(reason)
        if not _KERNEL_VERDICT.search(reason):  # not the kernels' verdict: the XLA backends would meet it too
            break
    seconds = time.perf_counter() - start
    if compiled is None:
        return rejected(reasons, used, seconds).to_dict()
    text = compiled.as_text()
    found = collectives.collectives(text, piece.chips)
    return SliceCompile(OK, "", used, reasons[0] if reasons else "", seconds, _memory(compiled),
                        [c.to_dict() for c in found], _cost(compiled),
                        kernels=sorted(set(_CUSTOM_CALL.findall(text)))).to_dict()


def rejected(reasons: list[str], backend: str, seconds: float) -> SliceCompile:
    """The result of a program the compiler refused; `reasons`: its line per attempt, the last one kept (with
    the first as the fallback's reason when the kernels were refused first)."""
    last = reasons[-1]
    oom = bool(_OUT_OF_MEMORY.search(last))
    needed = _NEEDED.search(last) if oom else None
    size, unit = (needed.group(1, 2) if needed.group(1) else needed.group(3, 4)) if needed else (None, None)
    required = int(float(size) * _UNITS[unit]) if needed else 0
    return SliceCompile(REJECTED, last, backend, reasons[0] if len(reasons) > 1 else "", seconds,
                        out_of_memory=oom, required_bytes=required)


def _memory(compiled: Any) -> dict[str, int]:
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without it: the compile itself succeeded
        return {}
    return {} if analysis is None else {f: int(getattr(analysis, f)) for f in _MEMORY_FIELDS if hasattr(analysis, f)}


def _cost(compiled: Any) -> dict[str, float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without one
        return {}
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    return {} if not cost else {ours: float(cost[theirs]) for theirs, ours in _COST_FIELDS.items() if theirs in cost}
