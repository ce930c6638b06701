"""The row-moving Pallas Mosaic TPU kernel of the `in_kernel` expert-parallel strategy (`in_kernel.py`) and the
pieces its fused kernels share (`enter_barrier`, `interpret_params`, `as_words`): rows sent to other devices by
remote DMA from inside the kernel, so no XLA all-to-all or all-gather of rows is left in the program. Off TPU it
runs in Pallas TPU interpret mode, which simulates the DMAs, semaphores and the devices of the surrounding
`jax.shard_map` on the host (slow: tests at small shapes only).

`scatter_rows` is the strategy's unfused path, used twice where the fused kernels (`in_kernel_gmm`,
`in_kernel_return`) refuse a layer: the dispatch (token rows to the devices holding their experts) and the
return (expert outputs back to their tokens' devices). Every device of the mesh axis runs it at
once (a collective kernel: a barrier semaphore makes sure every peer has entered it, so its output buffer exists,
before any row is written there). Each device walks its segments (consecutive rows of its send order bound for
consecutive rows of one device's output) and starts one DMA per row, from its source array to the output where XLA
placed them (memory space ANY: HBM, or VMEM where XLA's memory-space assignment puts a buffer there): a local copy
when the row stays on this device, a remote copy otherwise. At most `in_flight` DMAs of each kind are outstanding:
with that many, one is waited for before the next starts (every row has the same size, so one semaphore per kind
counts them). It then waits for the `expected` rows the other devices send it (the caller knows that count from the
exchanged metadata) and leaves; its output rows nobody wrote hold zeros (the output is aliased to a zeros buffer).
The metadata sits in SMEM (scalar prefetch): four int32 per segment, and for the dispatch the source row of each
sent row (int32 [t x top_k], `SMEM_METADATA_BYTES` at most); the kernel has no blocks or scratch buffers of its own,
so no tile of it can overflow VMEM.

Rows travel as 32-bit words (Mosaic copies single rows of 32-bit arrays only; a bfloat16 [n, d] is moved as
uint32 [n, d / 2], columns j and j + d / 2 in one word: `as_words` / `from_words`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_tune.core.errors import UsageError
from moe_tune.kernels.pallas_util import interpreted, out_struct, vma_unchecked

DEFAULT_IN_FLIGHT = 16  # row DMAs one device keeps outstanding (the gathers' default ring)
# The scalar-prefetch metadata's SMEM budget: half of the 1 MiB scoped SMEM up to v6e, the rest left to Mosaic's
# own scalars (the project's gathers keep the same margin).
SMEM_METADATA_BYTES = 512 * 1024
# The barrier semaphores' collective ids of the strategy's two kernels. Two kernels that run one after the other
# take different ids: a device already in the second signals its peers' semaphore of the second's id, never one a
# peer may still be waiting on in the first (a device enters the next kernel with an id only after every device
# has entered the kernel between, hence left the earlier one's wait).
DISPATCH_ID, RETURN_ID = 7, 8


def as_words(rows: jax.Array) -> jax.Array:
    """rows [n, d] as the 32-bit array the row DMAs copy: 32-bit dtypes as they are; 16-bit ones with d even as
    uint32 [n, d / 2], the bits of columns j and j + d / 2 in one word (elementwise on two halves: a bitcast to
    pairs would give XLA a minor dimension of 2, which the TPU pads to a whole tile); otherwise as float32
    (exact for bfloat16 and float16)."""
    if rows.dtype.itemsize == 4:
        return rows
    if rows.dtype.itemsize != 2 or rows.shape[1] % 2:
        return rows.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(rows, jnp.uint16)
    half = rows.shape[1] // 2
    return bits[:, :half].astype(jnp.uint32) | (bits[:, half:].astype(jnp.uint32) << 16)


def from_words(words: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_words` for rows of logical dtype `dtype`."""
    dtype = jnp.dtype(dtype)
    if words.dtype == dtype:
        return words
    if words.dtype != jnp.uint32 or dtype.itemsize != 2:
        return words.astype(dtype)
    halves = [(words & 0xFFFF).astype(jnp.uint16), (words >> 16).astype(jnp.uint16)]
    return jax.lax.bitcast_convert_type(jnp.concatenate(halves, axis=1), dtype)


def enter_barrier(axis: str, devices: int) -> None:
    """Inside a collective kernel (one with a `collective_id`): returns once every peer on mesh axis `axis`
    (`devices` devices) has entered the kernel, so its output buffers exist before any row is DMAed there. Each
    device signals every peer's barrier semaphore once and waits for `devices - 1` signals."""
    me = jax.lax.axis_index(axis)
    barrier = pltpu.get_barrier_semaphore()
    for step in range(1, devices):
        pl.semaphore_signal(barrier, 1, device_id={axis: jax.lax.rem(me + step, devices)},
                            device_id_type=pltpu.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, devices - 1)


def _kernel(*refs, axis: str, devices: int, in_flight: int, gathered: bool):
    """Scalar prefetch (SMEM): the segments' start, size, dev, dest (int32 [S] each), expected (int32 [1]: rows
    the other devices send here) and, when `gathered`, src_row (int32 [rows]). Then src_hbm [n_src, w] and
    out_hbm [n_out, w] (aliased to zeros_hbm) in HBM, and three DMA semaphores."""
    start_ref, size_ref, dev_ref, dest_ref, expected_ref = refs[:5]
    src_row_ref = refs[5] if gathered else None
    src_hbm, zeros_hbm, out_hbm, local_sem, send_sem, recv_sem = refs[5 + gathered:]
    del zeros_hbm  # the output's initial value: aliased, never read
    me = jax.lax.axis_index(axis)
    enter_barrier(axis, devices)

    def rows(i, dest):  # source row i of the send order, and its landing row
        row = src_row_ref[i] if gathered else i
        return src_hbm.at[pl.ds(row, 1)], out_hbm.at[pl.ds(dest, 1)]

    def local(i, dest):
        return pltpu.make_async_copy(*rows(i, dest), local_sem)

    def remote(i, dest, dev):
        return pltpu.make_async_remote_copy(*rows(i, dest), send_sem, recv_sem, device_id={axis: dev},
                                            device_id_type=pltpu.DeviceIdType.MESH)

    # any row's descriptor waits for one row of its kind: every row has the same size
    def wait_local():
        local(0, 0).wait()

    def wait_remote():
        remote(0, 0, me).wait_send()

    def segment(s, outstanding):
        first, dev, dest = start_ref[s], dev_ref[s], dest_ref[s]
        here = dev == me

        def row(j, outstanding):
            n_local, n_remote = outstanding
            full = jnp.where(here, n_local, n_remote) >= in_flight  # the ring is full: one must finish first
            pl.when(full & here)(wait_local)
            pl.when(full & ~here)(wait_remote)
            pl.when(here)(lambda: local(first + j, dest + j).start())
            pl.when(~here)(lambda: remote(first + j, dest + j, dev).start())
            grown = jnp.where(full, 0, 1)
            return (jnp.where(here, n_local + grown, n_local), jnp.where(here, n_remote, n_remote + grown))

        return jax.lax.fori_loop(0, size_ref[s], row, outstanding)

    zero = jnp.int32(0)
    n_local, n_remote = jax.lax.fori_loop(0, start_ref.shape[0], segment, (zero, zero))
    jax.lax.fori_loop(0, n_local, lambda i, c: (wait_local(), c)[1], 0)
    jax.lax.fori_loop(0, n_remote, lambda i, c: (wait_remote(), c)[1], 0)

    def arrive(i, carry):  # one row of another device's DMAs has landed here
        remote(0, 0, me).wait_recv()
        return carry

    jax.lax.fori_loop(0, expected_ref[0], arrive, 0)


def scatter_rows(src: jax.Array, segments: tuple[jax.Array, jax.Array, jax.Array, jax.Array], expected: jax.Array,
                 rows_out: int, *, src_row: jax.Array | None = None, axis: str, devices: int, collective_id: int,
                 in_flight: int = DEFAULT_IN_FLIGHT) -> jax.Array:
    """Inside `jax.shard_map` over mesh axis `axis` (`devices` devices), called by every device of it at once.

    src [n_src, d] (a 4- or 2-byte dtype); `segments` = (start, size, dev,
    dest), int32 [S] each: segment s is rows [start[s], start[s] + size[s]) of this device's send order, landing
    in rows [dest[s], dest[s] + size[s]) of device dev[s]'s result. Row i of the send order is src[src_row[i]]
    (int32 [rows]) where `src_row` is given, else src[i]. `expected` (int32 scalar): the rows the other devices
    send this one. -> [rows_out, d] in src.dtype: the rows every device (itself included) sent here, zeros
    elsewhere. Two rows landing in one place is the caller's error (undefined). `collective_id`: the barrier
    semaphore's (`DISPATCH_ID`, `RETURN_ID`)."""
    words = as_words(src)
    width = words.shape[1]
    scalars = [jnp.asarray(a, jnp.int32) for a in segments] + [jnp.reshape(expected, (1,)).astype(jnp.int32)]
    if src_row is not None:
        scalars.append(src_row.astype(jnp.int32))
    smem = 4 * sum(a.size for a in scalars)
    if smem > SMEM_METADATA_BYTES:
        raise UsageError(f"ep_strategy 'in_kernel': its exchange's int32 metadata ({smem / 1024:.0f} KiB, mostly the "
                         f"source row of each of the {0 if src_row is None else src_row.size} entries) exceed the "
                         f"{SMEM_METADATA_BYTES // 1024} KiB of SMEM its kernel allows: run the tokens in chunks "
                         "(ShardingConfig(strategy='in_kernel', token_chunks=C))")
    zeros = jnp.zeros((rows_out, width), words.dtype)
    interpret = interpret_params()
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, axis=axis, devices=devices, in_flight=max(1, in_flight),
                               gathered=src_row is not None)
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct((rows_out, width), words.dtype, words, *scalars, zeros),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=(1,), in_specs=[any_space, any_space], out_specs=any_space,
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA]),
        input_output_aliases={len(scalars) + 1: 0},  # zeros (after the scalars and src) is the output's buffer
        compiler_params=pltpu.CompilerParams(collective_id=collective_id, has_side_effects=True),
        interpret=interpret,
        name="moe_tune_scatter_rows",
    )
    # vma_unchecked: Mosaic's lowering has no rule for the varying casts that shard_map's type check would put
    # between the device index and the kernel's constants (and interpret mode needs it too: `pallas_util`)
    return from_words(vma_unchecked(call, *scalars, words, zeros), src.dtype)


# Interpret mode's options (tests turn race detection on: `race_detection`).
_interpret_options: dict = {}


def interpret_params() -> pltpu.InterpretParams | bool:
    """The strategy's kernels' `interpret=`: False on TPU (compiled); elsewhere Pallas TPU's interpreter with
    the options `race_detection` sets."""
    return pltpu.InterpretParams(**_interpret_options) if interpreted("tpu") else False


class race_detection:
    """Within the block (while kernels are traced), the interpreted kernel runs with the interpreter's
    happens-before race detector (`InterpretParams(detect_races=True)`), which prints any race it finds and
    flags it in the interpreter's race state."""

    def __enter__(self):
        self._saved = dict(_interpret_options)
        _interpret_options["detect_races"] = True
        return self

    def __exit__(self, *exc):
        _interpret_options.clear()
        _interpret_options.update(self._saved)

