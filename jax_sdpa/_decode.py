r"""Decoding: a few queries against a long cache of keys and values, at the speed of reading it.

One new token attends to ``S`` cached keys with :math:`4 N S H` flops while reading
:math:`2 K S H` numbers: there is about one flop per number read, so the limit is the memory
bandwidth, not the matrix units. Two things then decide the speed:

* **The layout of the products.** The cache is ``(S, K, H)``: each key row holds every
  key/value head. A matrix product per head wants its keys ``(K, S, H)``, so XLA would first
  copy the whole cache into that layout, which costs more than the attention. Here the two
  products are written as a broadcast multiply and a sum (:func:`_scores`, :func:`_blend`),
  which XLA fuses into one pass over the cache as it lies, each key read once for the ``G``
  query heads that share it (GQA).
* **Split keys** ("flash-decoding", Dao et al. 2023). The keys are cut into chunks that are
  attended independently, each to an online-softmax state (:mod:`jax_sdpa._online_softmax`),
  and the states are then combined: the chunks are independent work for every core, even for
  one sequence.

Everything else is the formula's own code: :meth:`~jax_sdpa._formula.Formula.logits` (scale,
soft cap, bias, ``score_mod``, mask rules at global positions) and the online softmax's
``update``, ``combine`` and ``finish``. The pass has no backward of its own: differentiating
it differentiates the chunked implementation at the same point.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._chunked import Tiling, chunked_sequence, pad_to
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result, over_heads
from jax_sdpa._masks import LengthMask
from jax_sdpa._steps import accumulation_dtype


def _scores(query, key, *, precision=None):
    """``q · k`` for every query and key, ``(T, H) × (L, H) → (T, L)``: a multiply and a sum."""
    dtype = accumulation_dtype(query.dtype)
    return jnp.sum(query.astype(dtype)[:, None, :] * key.astype(dtype)[None, :, :], axis=-1)


def _blend(weights, value, *, precision=None):
    """``Σ_j w_ij v_j``, ``(T, L) × (L, V) → (T, V)``: :func:`~jax_sdpa.weighted_sum`'s sum.

    As there, the weights are cast to the value dtype and the sum is accumulated in float32.
    """
    dtype = accumulation_dtype(value.dtype)
    weights = weights.astype(value.dtype).astype(dtype)
    return jnp.sum(weights[:, :, None] * value.astype(dtype)[None, :, :], axis=1)


def _chunk_state(
    formula: Formula, query, key, value, arrays: CallArrays, start
) -> online_softmax.State:
    """One head's online-softmax state after one chunk of keys that starts at ``start``."""
    raw = _scores(query, key)
    scores, allowed = formula.logits(raw, arrays, 0, start)
    rows = query.shape[:1]
    state = online_softmax.init(query, rows, (*rows, value.shape[-1]))
    return online_softmax.update(
        state, scores, allowed, value, precision=formula.precision, product=_blend
    )


class Chunks(NamedTuple):
    """Where a sequence's keys come from: ``count`` chunks of ``size``, ``fetch(n) -> (k, v)``.

    ``fetch`` gives chunk ``n``'s keys ``(size, K, H)`` and values ``(size, K, V)``: a slice of
    a contiguous cache or the pages of a paged one.
    """

    count: int
    size: int
    fetch: Callable


def split_keys(formula: Formula, query, chunks: Chunks, arrays: CallArrays) -> Result:
    """Attention of ``(T, N, H)`` queries to keys in chunks, all heads, in jax.nn's layout.

    ``arrays`` cover ``chunks.count · chunks.size`` keys: positions past the sequence must be
    masked by its rule.
    """
    seq_q, heads, _ = query.shape
    keys, values = jax.eval_shape(chunks.fetch, 0)
    heads_kv = (keys.shape[1], heads // keys.shape[1])
    query, formula = formula.scaled_queries(query)
    per_query = jnp.moveaxis(query.reshape(seq_q, *heads_kv, -1), 0, 2)  # (K, G, T, H)

    def one_chunk(n):
        start = n * chunks.size
        tile = arrays.window((0, seq_q), (start, chunks.size)).by_head(heads_kv)

        def head(per_query, per_kv):
            q, tile = per_query
            return _chunk_state(formula, q, *per_kv, tile, start)

        per_kv = tuple(jnp.moveaxis(x, 1, 0) for x in chunks.fetch(n))  # (K, size, ·)
        return over_heads(head, heads_kv, (per_query, tile), per_kv)

    state = online_softmax.combine(jax.vmap(one_chunk)(jnp.arange(chunks.count)))
    if arrays.sinks is not None:
        sink = arrays.sinks.reshape(*heads_kv, 1)
        state = online_softmax.merge(
            state, online_softmax.init(per_query, state.denom.shape, state.acc.shape, sink)
        )
    out, lse = online_softmax.finish(state, values.dtype)  # (K, G, T, V), (K, G, T)
    out = jnp.moveaxis(out, 2, 0).reshape(seq_q, heads, -1)
    return Result(out, jnp.moveaxis(lse, 2, 0).reshape(seq_q, heads), None)


def _contiguous(chunk: int, key, value, arrays: CallArrays) -> tuple[Chunks, CallArrays]:
    """A contiguous ``(S, K, ·)`` cache in chunks, padded to whole ones (the padding masked)."""
    seq_kv = key.shape[0]
    if seq_kv % chunk:
        padding = LengthMask(None, jnp.asarray(seq_kv))
        arrays = dataclasses.replace(
            arrays,
            rule=padding if arrays.rule is None else arrays.rule & padding,
            bias=pad_to(arrays.bias, -1, chunk),
            mask=pad_to(arrays.mask, -1, chunk, False),
        )
        key, value = (pad_to(x, 0, chunk) for x in (key, value))

    def fetch(n):
        return tuple(lax.dynamic_slice_in_dim(x, n * chunk, chunk, axis=0) for x in (key, value))

    return Chunks(key.shape[0] // chunk, chunk, fetch), arrays


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _decode(formula: Formula, tiling: Tiling, query, key, value, arrays: CallArrays):
    chunks, arrays = _contiguous(min(tiling.block_kv, key.shape[0]), key, value, arrays)
    return split_keys(formula, query, chunks, arrays)[:2]


def _decode_fwd(formula, tiling, query, key, value, arrays):
    return _decode(formula, tiling, query, key, value, arrays), (query, key, value, arrays)


def _decode_bwd(formula, tiling, residuals, cotangents):
    def chunked(*args):
        return chunked_sequence(formula, tiling, *args)[:2]

    return jax.vjp(chunked, *residuals)[1](cotangents)


_decode.defvjp(_decode_fwd, _decode_bwd)


def decode_sequence(
    formula: Formula, tiling: Tiling, query, key, value, arrays: CallArrays
) -> Result:
    """Split-key attention of one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    Chunks of ``tiling.block_kv`` keys. The same results as
    :func:`jax_sdpa._chunked.chunked_sequence`; its gradient is that path's.
    """
    return Result(*_decode(formula, tiling, query, key, value, arrays), None)
