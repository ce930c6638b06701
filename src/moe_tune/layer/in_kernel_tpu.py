"""The Pallas Mosaic TPU kernel of the `in_kernel` expert-parallel strategy (`in_kernel.py`): rows sent to
other devices by remote DMA from inside the kernel, so no XLA all-to-all or all-gather of rows is left in the
program. Off TPU it runs in Pallas TPU interpret mode, which simulates the DMAs, semaphores and the devices of
the surrounding `jax.shard_map` on the host (slow: tests at small shapes only).

`scatter_rows` is the one kernel, used twice by the strategy: the dispatch (token rows to the devices holding
their experts) and the return (expert outputs back to their tokens' devices). Every device of the mesh axis
runs it at once (a collective kernel: a barrier semaphore makes sure every peer has entered it, so its output
buffer exists, before any row is written there). Each device walks its `send` rows in order and starts one DMA
per row, HBM to HBM: a local copy when the row stays on this device, a remote copy otherwise, into row
`dest_row[i]` of device `dest_dev[i]`'s output. At most `in_flight` row DMAs of a device are outstanding: issuing
row i first waits for the completion of row i - in_flight (all rows have the same size, so one semaphore per
kind counts them). It then waits for the `expected` rows the other devices send it (the caller knows that
count from the exchanged metadata) and leaves; its output rows nobody wrote hold zeros (the output is aliased
to a zeros buffer).

Rows travel as 32-bit words (Mosaic copies single rows of 32-bit arrays only; a bfloat16 [n, d] is moved as
uint32 [n, d / 2], two values a word: `as_words` / `from_words`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moe_tune.kernels.pallas_util import interpreted, out_struct, pallas_run

DEFAULT_IN_FLIGHT = 16  # row DMAs one device keeps outstanding (the gathers' default ring)
COLLECTIVE_ID = 7  # the barrier semaphore's collective id; any fixed id serves (one collective kernel at a time)


def as_words(rows: jax.Array) -> jax.Array:
    """rows [n, d] as the 32-bit array the row DMAs copy: 32-bit dtypes as they are, 16-bit ones as uint32
    [n, d / 2] (adjacent pairs in one word; d must be even), 8-bit ones as uint32 [n, d / 4]."""
    size = rows.dtype.itemsize
    if size == 4:
        return rows
    per = 4 // size
    return jax.lax.bitcast_convert_type(rows.reshape(rows.shape[0], rows.shape[1] // per, per), jnp.uint32)


def from_words(words: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_words` for rows of logical dtype `dtype`."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 4:
        return words if words.dtype == dtype else jax.lax.bitcast_convert_type(words, dtype)
    out = jax.lax.bitcast_convert_type(words, dtype)  # [n, w, per]
    return out.reshape(words.shape[0], -1)


def _kernel(src_row_ref, dest_dev_ref, dest_row_ref, counts_ref, src_hbm, zeros_hbm, out_hbm, local_sem,
            send_sem, recv_sem, *, axis: str, devices: int, in_flight: int):
    """Scalar prefetch (SMEM): src_row, dest_dev, dest_row int32 [rows], counts int32 [2] = (rows to send,
    rows to receive from other devices). src_hbm [n_src, w], out_hbm [n_out, w] (aliased to zeros_hbm) in
    HBM."""
    del zeros_hbm  # the output's initial value: aliased, never read
    me = jax.lax.axis_index(axis)
    barrier = pltpu.get_barrier_semaphore()
    for step in range(1, devices):  # every peer has entered the kernel before any row is written to it
        pl.semaphore_signal(barrier, 1, device_id={axis: jax.lax.rem(me + step, devices)},
                            device_id_type=pltpu.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, devices - 1)
    sent, expected = counts_ref[0], counts_ref[1]

    def local(i):
        return pltpu.make_async_copy(src_hbm.at[pl.ds(src_row_ref[i], 1)], out_hbm.at[pl.ds(dest_row_ref[i], 1)],
                                     local_sem)

    def remote(i, dev):
        return pltpu.make_async_remote_copy(src_hbm.at[pl.ds(src_row_ref[i], 1)],
                                            out_hbm.at[pl.ds(dest_row_ref[i], 1)], send_sem, recv_sem,
                                            device_id={axis: dev}, device_id_type=pltpu.DeviceIdType.MESH)

    def start(i):
        dev = dest_dev_ref[i]
        pl.when(dev == me)(lambda: local(i).start())
        pl.when(dev != me)(lambda: remote(i, dev).start())

    def finish(i):  # wait for row i's DMA (by size: any row of its kind counts the same)
        dev = dest_dev_ref[i]
        pl.when(dev == me)(lambda: local(i).wait())
        pl.when(dev != me)(lambda: remote(i, dev).wait_send())

    def issue(i, carry):
        @pl.when(i >= in_flight)
        def _():
            finish(i - in_flight)

        start(i)
        return carry

    jax.lax.fori_loop(0, sent, issue, 0)
    jax.lax.fori_loop(jnp.maximum(sent - in_flight, 0), sent, lambda i, c: (finish(i), c)[1], 0)

    def arrive(i, carry):  # one row of another device's DMAs has landed here
        remote(0, me).wait_recv()
        return carry

    jax.lax.fori_loop(0, expected, arrive, 0)


def scatter_rows(src: jax.Array, src_row: jax.Array, dest_dev: jax.Array, dest_row: jax.Array, sent: jax.Array,
                 expected: jax.Array, rows_out: int, *, axis: str, devices: int,
                 in_flight: int = DEFAULT_IN_FLIGHT) -> jax.Array:
    """Inside `jax.shard_map` over mesh axis `axis` (`devices` devices), called by every device of it at once:
    src [n_src, d] (any dtype of 1, 2 or 4 bytes; d x itemsize a multiple of 4), src_row / dest_dev / dest_row
    int32 [rows]: this device's row i < `sent` (int32 scalar) is src[src_row[i]] and lands in row dest_row[i]
    of device dest_dev[i]'s result; `expected` (int32 scalar): the rows the other devices send this one.
    -> [rows_out, d] in src.dtype: the rows every device (itself included) sent here, zeros elsewhere.
    Rows past `sent` are not read; two rows landing in one place is the caller's error (undefined)."""
    words = as_words(src)
    width = words.shape[1]
    counts = jnp.stack([sent, expected]).astype(jnp.int32)
    zeros = jnp.zeros((rows_out, width), words.dtype)
    interpret = pltpu.InterpretParams(**_interpret_options) if interpreted("tpu") else False
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_kernel, axis=axis, devices=devices, in_flight=max(1, in_flight))
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct((rows_out, width), words.dtype, words, src_row, dest_row, zeros),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(1,), in_specs=[any_space, any_space], out_specs=any_space,
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA]),
        input_output_aliases={5: 0},  # zeros (after the 4 scalar operands and src) is the output's buffer
        compiler_params=pltpu.CompilerParams(collective_id=COLLECTIVE_ID, has_side_effects=True),
        interpret=interpret,
    )
    out = pallas_run(call, src_row.astype(jnp.int32), dest_dev.astype(jnp.int32), dest_row.astype(jnp.int32),
                     counts, words, zeros, interpret=bool(interpret))
    return from_words(out, src.dtype)


# Interpret mode's options (tests turn race detection on: `race_detection`).
_interpret_options: dict = {}


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

