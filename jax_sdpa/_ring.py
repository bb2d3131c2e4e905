r"""Ring attention: one sequence sharded over devices, keys and values passed round a ring.

Inside ``jax.shard_map``, device :math:`p` of :math:`P` holds a shard of the queries, keys and
values of one long sequence. It keeps its queries; at step :math:`s` it holds the key/value shard
of device :math:`(p - s) \bmod P`, folds it into its online-softmax state with the chunked
path's block sweep (the same tile arithmetic, masks evaluated at *global* positions), and passes
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
from typing import Literal

import jax
from jax import lax

from jax_sdpa._attention import by_head
from jax_sdpa._chunked import (
    _Blocks,
    backward_inputs,
    backward_sweep,
    finish,
    flat,
    forward_sweep,
    grads_like,
    initial_state,
    window,
    zeros_like_grads,
)

Layout = Literal["contiguous", "striped"]


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static part of a ring call (a ``nondiff_argnum``)."""

    blocks: _Blocks
    axis_name: str
    shards: int
    layout: Layout

    def pieces(self, shard, length: int):
        """The contiguous runs of a shard of ``length``: ``(local start, global start, size)``."""
        if self.layout == "contiguous":
            return [(0, shard * length, length)]
        half = length // 2
        return [(0, shard * half, half), (half, (2 * self.shards - 1 - shard) * half, half)]

    def rotate(self, xs):
        """Passes ``xs`` to the next device of the ring."""
        perm = [(i, (i + 1) % self.shards) for i in range(self.shards)]
        return lax.ppermute(xs, self.axis_name, perm)


def _window(x, q_run, kv_run, seq_kv: int, src):
    """Start and size of a query run's rows and a key run's columns in a ``(K, G, t, S)`` array.

    Bias and mask columns follow the sharded key order: shard ``src`` starts at ``src · seq_kv``.
    """
    return window(x.shape, q_run, (src * seq_kv + kv_run[0], kv_run[1]))


def _piece(x, q_run, kv_run, seq_kv: int, src):
    return None if x is None else lax.dynamic_slice(x, *_window(x, q_run, kv_run, seq_kv, src))


def _slice(x, run, axis: int):
    return lax.slice_in_dim(x, run[0], run[0] + run[1], axis=axis)


def _runs(ring: _Ring, me, src, seq_q: int, seq_kv: int):
    """Every (query run, key run) pair of this step: ``((start, size), global start)`` each."""
    for q_start, q_at, q_size in ring.pieces(me, seq_q):
        for kv_start, kv_at, kv_size in ring.pieces(src, seq_kv):
            yield ((q_start, q_size), q_at), ((kv_start, kv_size), kv_at)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, query, key, value, bias, mask, rule):
    return _ring_fwd(ring, query, key, value, bias, mask, rule)[0]


def _ring_fwd(ring: _Ring, query, key, value, bias, mask, rule):
    me = lax.axis_index(ring.axis_name)
    seq_q, seq_kv = query.shape[0], key.shape[0]
    queries = flat(query)

    def visit(step, state, key, value):
        src = (me - step) % ring.shards
        for (q_run, q_at), (kv_run, kv_at) in _runs(ring, me, src, seq_q, seq_kv):
            rows = functools.partial(_slice, run=q_run, axis=0)
            part = forward_sweep(
                ring.blocks, rows(queries), _slice(key, kv_run, 0), _slice(value, kv_run, 0),
                _piece(bias, q_run, kv_run, seq_kv, src), _piece(mask, q_run, kv_run, seq_kv, src),
                rule, None, jax.tree.map(rows, state), q_at, kv_at,
            )  # fmt: skip
            put = functools.partial(lax.dynamic_update_slice_in_dim, start_index=q_run[0], axis=0)
            state = jax.tree.map(put, state, part)
        return state

    def step(s, carry):
        state, key, value = carry
        # The shard travels on while this step computes with it; the last pass only brings it
        # home, but one loop shape for every step keeps the buffers the same for any ring size.
        passed = ring.rotate((key, value))
        return (visit(s, state, key, value), *passed)

    rows = query.shape[:2]  # (T, N)
    state = initial_state(queries, rows, (rows[0], rows[1] * value.shape[-1]))
    state, _, _ = lax.fori_loop(0, ring.shards, step, (state, flat(key), flat(value)))
    out, lse = finish(state, value.dtype)
    return (out, lse), (query, key, value, bias, mask, rule, out, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    query, key, value, bias, mask, rule, out, lse = residuals
    d_out, delta, shift = backward_inputs(out, lse, cotangents[0])
    me = lax.axis_index(ring.axis_name)
    seq_q, seq_kv = query.shape[0], key.shape[0]
    queries, keys, values = flat(query), flat(key), flat(value)

    def step(s, carry):
        d_query, d_bias, key, value, d_key, d_value = carry
        src = (me - s) % ring.shards
        for (q_run, q_at), (kv_run, kv_at) in _runs(ring, me, src, seq_q, seq_kv):
            rows, cols = (
                functools.partial(_slice, run=q_run, axis=0),
                functools.partial(_slice, run=kv_run, axis=0),
            )
            piece = functools.partial(_piece, q_run=q_run, kv_run=kv_run, seq_kv=seq_kv, src=src)
            d_q, d_k, d_v, d_b = backward_sweep(
                ring.blocks, rows(queries), cols(key), cols(value), piece(bias), piece(mask), rule,
                None, rows(d_out), rows(delta), rows(shift),
                (rows(d_query), cols(d_key), cols(d_value), piece(d_bias)), q_at, kv_at,
            )  # fmt: skip
            d_query = lax.dynamic_update_slice_in_dim(d_query, d_q, q_run[0], 0)
            d_key = lax.dynamic_update_slice_in_dim(d_key, d_k, kv_run[0], 0)
            d_value = lax.dynamic_update_slice_in_dim(d_value, d_v, kv_run[0], 0)
            if d_bias is not None:
                d_bias = lax.dynamic_update_slice(
                    d_bias, d_b, _window(d_bias, q_run, kv_run, seq_kv, src)[0]
                )
        # Keys, values and their gradients travel on together; after a full turn they are home.
        return (d_query, d_bias, *ring.rotate((key, value, d_key, d_value)))

    d_query, d_key, d_value, d_bias = zeros_like_grads(queries, keys, values, bias)
    carry = (d_query, d_bias, keys, values, d_key, d_value)
    d_query, d_bias, _, _, d_key, d_value = lax.fori_loop(0, ring.shards, step, carry)
    grads = (d_query, d_key, d_value, d_bias)
    return (*grads_like(grads, (query, key, value, bias)), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_sequence(
    query,
    key,
    value,
    bias,
    mask,
    rule,
    dropout_rngs,
    *,
    scale,
    soft_cap,
    dropout_rate,
    precision,
    block_q,
    block_kv,
    axis_name,
    shards,
    layout,
):
    """Ring attention for this device's queries ``(T/P, N, H)``, all heads.

    The signature of :func:`jax_sdpa._chunked.chunked_attention_sequence`, plus the ring's axis
    name, size and layout: ``(out, lse, None)`` for this device's queries, in jax.nn's layout.
    """
    del dropout_rngs, dropout_rate  # ring attention has no dropout
    (seq_q, heads, _), (seq_kv, kv_heads, _) = query.shape, key.shape
    pieces_q = seq_q // (2 if layout == "striped" else 1)
    pieces_kv = seq_kv // (2 if layout == "striped" else 1)
    blocks = _Blocks(
        scale=scale, soft_cap=soft_cap, dropout_rate=0.0, precision=precision,
        block_q=_largest_divisor(pieces_q, block_q), block_kv=_largest_divisor(pieces_kv, block_kv),
        heads=(kv_heads, heads // kv_heads),
    )  # fmt: skip
    ring = _Ring(blocks=blocks, axis_name=axis_name, shards=shards, layout=layout)
    out, lse = _ring(
        ring, query, key, value, by_head(bias, blocks.heads), by_head(mask, blocks.heads), rule
    )
    return out, lse, None


def _largest_divisor(n: int, cap: int) -> int:
    """The largest block size ``≤ cap`` that divides ``n``: shards are never padded."""
    return max(b for b in range(1, min(n, cap) + 1) if n % b == 0)
