r"""Ring attention: one sequence sharded over devices, keys and values passed round a ring.

Inside ``jax.shard_map``, device :math:`p` of :math:`P` holds a shard of the queries, keys and
values of one long sequence. It keeps its queries; at step :math:`s` it holds the key/value shard
of device :math:`(p - s) \bmod P`, folds it into its online-softmax state with the tile
engine's block sweep (:mod:`jax_sdpa._tiles`: masks evaluated at *global* positions), and passes
it on with ``lax.ppermute`` while the next step computes (Liu, Zaharia & Abbeel 2023). After
:math:`P` steps every query has met every key, and no device ever holds more than one shard of
keys and values: there is no all-gather.

The backward pass rotates the keys and values again, together with their gradient accumulators;
after a full turn those are back on the device that owns the shard.

Layouts: ``"contiguous"`` gives device :math:`p` positions :math:`[pL, (p+1)L)`. With a causal
mask that leaves device 0 almost idle and the last device with all the work; ``"striped"``
(zig-zag) splits the sequence into :math:`2P` chunks and gives device :math:`p` chunks
:math:`p` and :math:`2P - 1 - p`, so every device does about the same work.
"""

import dataclasses
import functools
import math

import jax
from jax import lax

from jax_sdpa._formula import CallArrays, Formula, block_of
from jax_sdpa._heads import Result
from jax_sdpa._kernels import calls as kernels
from jax_sdpa._kernels import fitting
from jax_sdpa._online_softmax import init, max_scores, merge
from jax_sdpa._ring_spec import RingSpec
from jax_sdpa._sweeps import loop
from jax_sdpa._tiles import Tiles, flat, forward_sweep
from jax_sdpa._tiles_backward import (
    backward_rows,
    backward_sweep,
    define_vjp,
    grads_like,
    sinks_grad,
    zeros_like_grads,
)
from jax_sdpa._tunables import Pallas, Ring


def _slice(x, run, axis: int = 0):
    return lax.dynamic_slice_in_dim(x, run[0], run[1], axis=axis)


def _heads(x, heads: int):
    """``(r, heads·d)`` rows → ``(r, heads, d)``."""
    return x.reshape(x.shape[0], heads, -1)


def _on_kernel(kernel: Pallas, tiles: Tiles, queries, key, value, arrays, kv_offset) -> tuple:
    """``(kernel, tiles, (q, k, v), padded)``: a run's rows ``(r, heads·d)`` for the kernel.

    ``kernel`` is the one for these inputs (:func:`jax_sdpa._kernels.fitting.for_inputs`);
    ``(q, k, v)`` are ``(r, heads, d)``; ``padded`` is :func:`jax_sdpa._kernels.fitting.padded`'s
    ``(q, k, v, arrays)``, without the sinks (the ring's state met them from the start).
    """
    heads, kv_heads = math.prod(tiles.groups), tiles.groups[0]
    q, k, v = _heads(queries, heads), _heads(key, kv_heads), _heads(value, kv_heads)
    kernel = fitting.for_inputs(kernel, q, k, v)
    fitted = fitting.fitted(tiles.formula, kernel, q, k, v)
    arrays = dataclasses.replace(arrays, sinks=None)
    return kernel, fitted, (q, k, v), fitting.padded(fitted, kernel, q, k, v, arrays, kv_offset)


def _kernel_forward(kernel: Pallas, tiles: Tiles, queries, key, value, arrays, state, offsets):
    """:func:`~jax_sdpa._tiles.forward_sweep`, the tiles computed by the fused kernel.

    The kernel gives ``(out, lse)`` of these queries over these keys, merged into ``state``.
    """
    on_kernel = _on_kernel(kernel, tiles, queries, key, value, arrays, offsets[1])
    kernel, fitted, (q, _, v), padded = on_kernel
    out, lse, top = kernels.forward(fitted, kernel, *padded, offsets, out_dtype=state.acc.dtype)
    rows, heads, width = q.shape[0], q.shape[1], v.shape[-1]
    part = tiles.formula.normalizer.from_result(out[:rows, :, :width], lse[:rows], top[:rows])
    merged = merge(state._replace(acc=_heads(state.acc, heads)), part)
    return merged._replace(acc=merged.acc.reshape(rows, -1))


def _kernel_backward(
    kernel: Pallas, tiles: Tiles, queries, key, value, arrays, rows, grads, offsets
):
    """:func:`~jax_sdpa._tiles_backward.backward_sweep`, the tiles computed by the fused kernel."""
    on_kernel = _on_kernel(kernel, tiles, queries, key, value, arrays, offsets[1])
    kernel, fitted, runs, padded = on_kernel
    rows = fitting.padded_rows(rows, padded[0].shape[0], runs[0].shape[1], padded[2].shape[-1])
    *d_runs, d_consts = kernels.backward(fitted, kernel, *padded, rows, offsets)
    *totals, d_bias, consts = grads
    totals = [  # each run's gradient, its padding dropped, added to its accumulator
        total + d[: x.shape[0], :, : x.shape[-1]].reshape(x.shape[0], -1)
        for total, d, x in zip(totals, d_runs, runs, strict=True)
    ]
    consts = jax.tree.map(lambda total, d: total + d.astype(total.dtype), consts, d_consts)
    return (*totals, d_bias, consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _around_ring(
    tiles: Tiles, ring: RingSpec, kernel: Pallas | None, query, key, value, arrays: CallArrays
):
    return _around_ring_fwd(tiles, ring, kernel, query, key, value, arrays)[0]


def _around_ring_fwd(
    tiles: Tiles, ring: RingSpec, kernel: Pallas | None, query, key, value, arrays: CallArrays
):
    me = lax.axis_index(ring.axis_name)
    seq_q, seq_kv = query.shape[0], key.shape[0]
    queries = flat(query)

    def visit(step, state, key, value):
        src = (me - step) % ring.shards

        def pair(n, state):
            (q_run, q_offset), (kv_run, kv_offset), kv_columns = ring.run(n, me, src, seq_q, seq_kv)
            q_part = functools.partial(_slice, run=q_run)
            args = (
                q_part(queries),
                _slice(key, kv_run),
                _slice(value, kv_run),
                arrays.block(q_run, kv_columns),
                jax.tree.map(q_part, state),
            )
            if kernel is None:
                part = forward_sweep(tiles, *args, q_offset, kv_offset)
            else:
                part = _kernel_forward(kernel, tiles, *args, (q_offset, kv_offset))
            put = functools.partial(lax.dynamic_update_slice_in_dim, start_index=q_run[0], axis=0)
            return jax.tree.map(put, state, part)

        return loop(0, ring.pieces**2, pair, state)

    def step(s, carry):
        state, key, value = carry
        # The shard travels on while this step computes with it; the last pass only brings it
        # home, but one loop shape for every step keeps the buffers the same for any ring size.
        passed = ring.rotate((key, value))
        return (visit(s, state, key, value), *passed)

    shape = query.shape[:2]  # (T, N)
    state = init(queries, shape, (shape[0], shape[1] * value.shape[-1]), arrays.sinks)
    state, _, _ = loop(0, ring.shards, step, (state, flat(key), flat(value)))
    state = state._replace(acc=state.acc.reshape(*shape, -1))
    out, lse = tiles.formula.normalizer.finish(state, value.dtype)
    return (out, lse, max_scores(state)), (query, key, value, arrays, out, lse)


def _around_ring_bwd(tiles: Tiles, ring: RingSpec, kernel: Pallas | None, residuals, cotangents):
    query, key, value, arrays, out, lse = residuals
    row_terms = backward_rows(out, lse, cotangents, tiles.formula.normalizer)
    me = lax.axis_index(ring.axis_name)
    seq_q, seq_kv = query.shape[0], key.shape[0]
    queries, keys, values = flat(query), flat(key), flat(value)

    def step(s, carry):
        d_query, d_bias, d_consts, key, value, d_key, d_value = carry
        src = (me - s) % ring.shards

        def pair(n, grads):
            d_query, d_key, d_value, d_bias, d_consts = grads
            (q_run, q_offset), (kv_run, kv_offset), kv_columns = ring.run(n, me, src, seq_q, seq_kv)
            q_part = functools.partial(_slice, run=q_run)
            kv_part = functools.partial(_slice, run=kv_run)
            bias_at = None if d_bias is None else block_of(d_bias.shape, q_run, kv_columns)
            d_bias_run = None if d_bias is None else lax.dynamic_slice(d_bias, *bias_at)
            grads = (q_part(d_query), kv_part(d_key), kv_part(d_value), d_bias_run, d_consts)
            args = (
                q_part(queries),
                kv_part(key),
                kv_part(value),
                arrays.block(q_run, kv_columns),
                jax.tree.map(q_part, row_terms),
                grads,
            )
            if kernel is None:
                d_q, d_k, d_v, d_b, d_consts = backward_sweep(tiles, *args, q_offset, kv_offset)
            else:
                d_q, d_k, d_v, d_b, d_consts = _kernel_backward(
                    kernel, tiles, *args, (q_offset, kv_offset)
                )
            d_query = lax.dynamic_update_slice_in_dim(d_query, d_q, q_run[0], 0)
            d_key = lax.dynamic_update_slice_in_dim(d_key, d_k, kv_run[0], 0)
            d_value = lax.dynamic_update_slice_in_dim(d_value, d_v, kv_run[0], 0)
            if d_bias is not None:
                d_bias = lax.dynamic_update_slice(d_bias, d_b, bias_at[0])
            return d_query, d_key, d_value, d_bias, d_consts

        grads = (d_query, d_key, d_value, d_bias, d_consts)
        d_query, d_key, d_value, d_bias, d_consts = loop(0, ring.pieces**2, pair, grads)
        # Keys, values and their gradients travel on together; after a full turn they are home.
        return (d_query, d_bias, d_consts, *ring.rotate((key, value, d_key, d_value)))

    d_query, d_key, d_value, d_bias, d_consts = zeros_like_grads(queries, keys, values, arrays)
    carry = (d_query, d_bias, d_consts, keys, values, d_key, d_value)
    d_query, d_bias, d_consts, _, _, d_key, d_value = loop(0, ring.shards, step, carry)
    grads = (d_query, d_key, d_value, d_bias, d_consts)
    d_query, d_key, d_value, d_arrays = grads_like(grads, query, key, value, arrays)
    d_sinks = sinks_grad(arrays.sinks, lse, row_terms)
    return d_query, d_key, d_value, dataclasses.replace(d_arrays, sinks=d_sinks)


define_vjp(_around_ring, _around_ring_fwd, _around_ring_bwd)


def ring_sequence(
    formula: Formula, tunables: Ring, ring: RingSpec, query, key, value, arrays: CallArrays
) -> Result:
    """Ring attention for this device's queries ``(T/P, N, H)``, all heads.

    :func:`jax_sdpa._chunked.chunked_sequence` on a ring: ``(out, lse, None)`` for this device's
    queries, in jax.nn's layout. Shards are never padded: each tile is the largest divisor of a
    run's length not above the tunables' (with ``tunables.kernel``, each run is padded to the
    kernel's tiles instead).
    """
    (seq_q, heads, _), (seq_kv, kv_heads, _) = query.shape, key.shape
    runs = ring.pieces
    tiles = Tiles(
        formula,
        _largest_divisor(seq_q // runs, tunables.block_q),
        _largest_divisor(seq_kv // runs, tunables.block_kv),
        (kv_heads, heads // kv_heads),
    )
    out, lse, top = _around_ring(tiles, ring, tunables.kernel, query, key, value, arrays)
    return Result(out, lse, None, top)


def _largest_divisor(n: int, cap: int) -> int:
    """The largest block size ``≤ cap`` that divides ``n``."""
    return max(b for b in range(1, min(n, cap) + 1) if n % b == 0)
