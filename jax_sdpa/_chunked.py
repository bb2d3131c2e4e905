r"""Memory-efficient exact attention: the tile engine on one device, with its own backward.

The dense composition materialises the ``(T, S)`` scores. This one never holds more than a
``(block_q, block_kv)`` tile per head: for each block of queries it sweeps the key/value blocks
with the online softmax (:func:`jax_sdpa._tiles.sweep_keys`) from a fresh state and finishes it
in place::

    state    = init()
    for j:  s, allowed = formula.scores(q_i, k_j, arrays_ij)   # the dense path's score steps
            state = update(state, s, allowed, v_j)             # running max, denominator, output
    out, lse = finish(state)                                  # and max_scores(state)

The backward pass is the engine's (:func:`jax_sdpa._tiles_backward.backward`): each tile's
weights are recomputed from the saved log-sum-exp.
"""

import dataclasses
import functools

import jax
from jax import lax

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._block_mask import blocked
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result
from jax_sdpa._online_softmax import zeros_from
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._sweeps import loop
from jax_sdpa._tiles import Tiles, flat, pad_keys, pad_to, rows_first, sweep_keys
from jax_sdpa._tiles_backward import backward, define_vjp
from jax_sdpa._tunables import Chunked


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(tiles: Tiles, query, key, value, arrays: CallArrays):
    return _flash_fwd(tiles, query, key, value, arrays)[0]


def _flash_fwd(tiles: Tiles, query, key, value, arrays: CallArrays):
    """Sweeps each query block from a fresh state and finishes it in place.

    No whole-sequence state to zero, slice and write back (the ring needs one: it meets the keys
    shard by shard), and each block is normalised heads first, in the same pass as its last
    products.
    """
    queries, keys, values = flat(query), flat(key), flat(value)
    block = (*tiles.groups, tiles.block_q)

    def query_block(i, outputs):
        q_i = tiles.queries(queries, i)
        # From the rows, not the block: the block's only use is then its scores, as in the
        # backward pass, and XLA builds both passes' products alike, so that where one tile
        # covers the sequences it computes them once (BENCHMARKS.md).
        sink = None if arrays.sinks is None else arrays.sinks.reshape(*tiles.groups, 1)
        state = online_softmax.init(queries, block, (*block, value.shape[-1]), sink)
        state = sweep_keys(tiles, q_i, keys, values, arrays, state, i, 0, 0)
        parts = (
            *tiles.formula.normalizer.finish(state, value.dtype),
            online_softmax.max_scores(state),
        )
        return tuple(
            lax.dynamic_update_slice_in_dim(
                x, rows_first(part, 2).reshape(-1, *x.shape[1:]), i * tiles.block_q, axis=0
            )
            for x, part in zip(outputs, parts, strict=True)
        )

    rows = zeros_from(queries, accumulation_dtype(query.dtype), query.shape[:2])
    outputs = (zeros_from(queries, value.dtype, (*query.shape[:2], value.shape[-1])), rows, rows)
    out, lse, top = loop(0, query.shape[0] // tiles.block_q, query_block, outputs)
    return (out, lse, top), (query, key, value, arrays, out, lse)


define_vjp(_flash, _flash_fwd, backward)


def chunked_sequence(
    formula: Formula, tunables: Chunked, query, key, value, arrays: CallArrays
) -> Result:
    """Blocked attention of one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values; per head the same results as
    :func:`jax_sdpa._attention.attention_head` (the weights are never formed). Sequences are
    padded up to whole blocks; padded keys are masked by a length rule and padded queries
    dropped.
    """
    (seq_q, heads, _), (seq_kv, kv_heads, _) = query.shape, key.shape
    block_q, block_kv = min(tunables.block_q, seq_q), min(tunables.block_kv, seq_kv)
    tiles = Tiles(formula, block_q, block_kv, (kv_heads, heads // kv_heads))
    key, value, arrays = pad_keys(key, value, arrays, block_kv)
    arrays = dataclasses.replace(
        arrays, bias=pad_to(arrays.bias, -2, block_q), mask=pad_to(arrays.mask, -2, block_q, False)
    )
    query = pad_to(query, 0, block_q)
    arrays = blocked(tiles, arrays, seq_q, key.shape[0])
    out, lse, top = _flash(tiles, query, key, value, arrays)
    return Result(out[:seq_q], lse[:seq_q], None, top[:seq_q])
