r"""Decoding: a few queries against a long cache of keys and values, at the speed of reading it.

One new token attends to ``S`` cached keys with :math:`4 N S H` flops while reading
:math:`2 K S H` numbers: there is about one flop per number read, so the limit is the memory
bandwidth, not the matrix units. Two things then decide the speed:

* **The layout of the products.** The cache is ``(S, K, H)``: each key row holds every
  key/value head. A matrix product per head wants its keys ``(K, S, H)``, so XLA would first
  copy the whole cache into that layout, which costs more than the attention. Here the scores
  are one matrix product of the keys as they lie, ``(L, K·H)``, with a block-diagonal matrix of
  the queries (:func:`_scores`), and the blend is a multiply and a sum that XLA fuses into one
  pass over the values (:func:`_blend`): each key and value row is read once, for the ``G``
  query heads that share it (GQA). On a GPU, where XLA's sum came after a copy of the whole
  cache (issue 44's profile: the keys' product reads them as they lie, so the values, most
  likely), the blend is one product of the values as they lie too, every head's
  weights against every head's values, the diagonal blocks kept. With many query rows
  (``N·T > 64``) the block-diagonal product wastes too much; there each chunk is copied
  heads-first and multiplied head by head.
* **Split keys** ("flash-decoding", Dao et al. 2023). The keys are cut into chunks that are
  attended independently, each to an online-softmax state (:mod:`jax_sdpa._online_softmax`),
  and the states are then combined: the chunks are independent work for every core, even for
  one sequence.

Everything else is the formula's own code: :meth:`~jax_sdpa._formula.Formula.logits` (scale,
soft cap, bias, ``score_mod``, mask rules at global positions) and the online softmax's
``update``, ``combine`` and ``finish``. The backward pass is the tile engine's
(:func:`jax_sdpa._tiles_backward.backward`), from the log-sum-exp this pass saves: one tile of
all the queries against each chunk of keys.

**Selected keys** (:func:`selected_sequence`; DeepSeek Sparse Attention, DeepSeek-AI 2025, picks
each query's top-k keys with a cheap indexer): each query's listed keys and values are gathered
and attended as one chunk, at the positions they came from, so the call's mask rules,
``score_mod``, sinks and normaliser apply to them as to any key, and the cost is that of the keys
listed, where a mask would still read and score them all. Repeats of an index and indices out of
range (refused when concrete) count as masked: the result is the call with the dense mask "key
``j`` is listed for query ``i``". Its gradients are JAX's, through the gather; queries are
attended a block at a time, each block recomputed in the backward pass (``jax.checkpoint``), so
no ``(T, k)`` copy of the keys is kept.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result, over_heads
from jax_sdpa._indices import positions
from jax_sdpa._latent import LatentValues
from jax_sdpa._quantized import Quantized, keys_product, per_token, values_product
from jax_sdpa._steps import accumulation_dtype, raw_scores, weighted_sum
from jax_sdpa._sweeps import loop
from jax_sdpa._tiles import Tiles, listed_blocks, pad_keys
from jax_sdpa._tiles_backward import backward, define_vjp
from jax_sdpa._tunables import Decode, Paged, Selected

# Up to this many columns (K·G·T: every query row of every head), the scores are one matrix
# product of the keys as they lie, ``(L, K·H)``, with a block-diagonal matrix of the queries:
# K times the useful flops, but a product that streams the keys at memory speed. Past it the
# wasted flops cost more than the reading (BENCHMARKS.md).
BLOCK_DIAGONAL_COLUMNS = 64


def _per_key(scale, dtype):
    """A quantized chunk's scales ``(L, K, 1)`` as ``(K, 1, 1, L)`` in ``dtype``, for the scores."""
    return jnp.moveaxis(scale, 0, -1)[:, None].astype(dtype)


def _scores(query, key, precision=None):
    """``q · k`` for every head, query and key: ``(K, G, T, H) × (L, K, H) → (K, G, T, L)``."""
    if isinstance(key, Quantized):  # the 8-bit keys in the product
        return keys_product(
            lambda q, k: _scores(q, k.astype(q.dtype), precision),
            query,
            key,
            lambda scale: _per_key(scale, accumulation_dtype(query.dtype)),
        )
    dtype = accumulation_dtype(query.dtype)
    kv_heads, _, _, features = query.shape
    query_rows = query[0].size // features  # G·T rows per key/value head
    if kv_heads * query_rows <= BLOCK_DIAGONAL_COLUMNS:
        # Column block k holds head k's queries in rows k·H … (k+1)·H − 1, zeros elsewhere.
        blocks = jnp.eye(kv_heads, dtype=query.dtype)
        diagonal = jnp.einsum("kxh,kj->khjx", query.reshape(kv_heads, query_rows, features), blocks)
        raw = jnp.matmul(
            key.reshape(key.shape[0], -1),
            diagonal.reshape(kv_heads * features, kv_heads * query_rows),
            precision=precision,
            preferred_element_type=dtype,
        )
        return jnp.moveaxis(raw.reshape(key.shape[0], *query.shape[:3]), 0, -1)
    # Enough rows per key to pay for copying the chunk heads-first: the step, head by head.
    per_head = query.reshape(kv_heads, query_rows, features)
    heads_first = jnp.moveaxis(key, 1, 0)  # (K, L, H)
    raw = jax.vmap(functools.partial(raw_scores, precision=precision))(per_head, heads_first)
    return raw.reshape(*query.shape[:3], key.shape[0])


def _blend(weights, value, *, precision=None):
    """``Σ_j w_ij v_j`` for every head: ``(K, G, T, L) × (L, K, V) → (K, G, T, V)``.

    :func:`~jax_sdpa.weighted_sum`'s sum, formed as :func:`_scores` forms its products; as
    there, the weights are cast to the value dtype and the sum is accumulated in float32 (on a
    GPU a matrix product's, at the call's ``precision``: float32 values at the default may
    take TF32's, as the scores' product does).
    """
    if isinstance(value, Quantized):  # the 8-bit values in the sum
        return values_product(
            lambda w, v: _blend(w, v.astype(value.dtype), precision=precision),
            weights,
            value,
            lambda scale: _per_key(scale, weights.dtype),
        )
    dtype = accumulation_dtype(value.dtype)
    weights = weights.astype(value.dtype)
    kv_heads, group, seq_q, size = weights.shape
    if kv_heads * group * seq_q <= BLOCK_DIAGONAL_COLUMNS:

        def by_sum(weights, value):  # a multiply and a sum, one pass over the values
            weights = jnp.moveaxis(weights.astype(dtype), -1, 0)  # (L, K, G, T)
            return jnp.sum(weights[..., None] * value.astype(dtype)[:, :, None, None, :], axis=0)

        # On a GPU, XLA first copies the values to sum them so (issue 44's profile): there,
        # one product of the values as they lie, its diagonal blocks kept (as in _scores).
        by_product = functools.partial(_block_diagonal_blend, precision=precision)
        return lax.platform_dependent(
            weights, value, cuda=by_product, rocm=by_product, default=by_sum
        )
    per_head = weights.reshape(kv_heads, group * seq_q, size)
    heads_first = jnp.moveaxis(value, 1, 0)  # (K, L, V)
    out = jax.vmap(functools.partial(weighted_sum, precision=precision))(per_head, heads_first)
    return out.reshape(kv_heads, group, seq_q, -1)


def _block_diagonal_blend(weights, value, precision=None):
    """:func:`_blend` as one product of the values as they lie, ``(L, K·V)``.

    Every head's weights ``(K·G·T, L)`` times every head's values: head ``k``'s rows against
    head ``k``'s columns are kept (``K`` times the useful flops, the values read once).
    """
    kv_heads, group, seq_q, size = weights.shape
    every = jnp.matmul(
        weights.reshape(-1, size),
        value.reshape(size, -1),
        precision=precision,
        preferred_element_type=accumulation_dtype(value.dtype),
    ).reshape(kv_heads, group * seq_q, kv_heads, -1)
    # (selected, not multiplied: a head's NaN stays in its own output, as in the sum)
    own = jnp.eye(kv_heads, dtype=bool)[:, None, :, None]
    return jnp.sum(jnp.where(own, every, 0), axis=2).reshape(kv_heads, group, seq_q, -1)


def _chunk_state(formula: Formula, query, keys, values, arrays: CallArrays, q_offset, at):
    """All heads' online-softmax state after one chunk of keys.

    ``query`` is ``(K, G, T, H)``, its first row at position ``q_offset``; ``at`` is the
    chunk's first key position, or each key's ``(L,)``; ``arrays`` are the chunk's, per head.
    The formula's logits are taken head by head, on the ``(T, L)`` products.
    """

    def head(per_query, _):
        raw, arrays = per_query
        return formula.logits(raw, arrays, q_offset, at)

    raw = _scores(query, keys, formula.precision)
    scores, allowed = over_heads(head, raw.shape[:2], (raw, arrays))
    shape = raw.shape[:-1]
    state = online_softmax.init(query, shape, (*shape, values.shape[-1]))
    return formula.normalizer.update(
        state,
        scores,
        allowed,
        values,
        precision=formula.precision,
        product=_blend,
        bias=None if arrays.sigmoid_bias is None else arrays.sigmoid_bias[..., None],
    )


def split_keys(
    formula: Formula,
    query,
    keys,
    values,
    arrays: CallArrays,
    *,
    q_offset=0,
    key_positions=None,
    lists=None,
) -> Result:
    """Attention of ``(T, N, H)`` queries to keys in chunks, all heads, in jax.nn's layout.

    ``keys`` ``(C, L, K, H)`` and ``values`` ``(C, L, K, V)``: ``C`` chunks of ``L`` keys, each
    attended on its own (``jax.vmap``) and the ``C`` states combined. ``arrays`` cover the
    ``C·L`` keys: positions past the sequence must be masked by its rule. ``values`` may be
    :class:`~jax_sdpa.LatentValues`: the keys' leading features, read with the keys. The
    queries sit at positions ``q_offset`` onwards; the keys at ``key_positions`` ``(C, L)``,
    if given (keys gathered from the sequence), else ``0 … C·L − 1``. With ``lists``, a block
    mask's list of the chunks (:func:`~jax_sdpa._tiles.listed_blocks`), only the chunks it
    lists are attended, one after the other (a loop: forward only, for a custom backward).
    """
    seq_q, heads, _ = query.shape
    count, size, kv_heads, _ = keys.shape
    groups = (kv_heads, heads // kv_heads)
    features = None
    if isinstance(values, LatentValues):  # blend the whole latent rows, keep the first features
        values, features = keys, values.features
    query, formula = formula.scaled_queries(query)
    per_query = jnp.moveaxis(query.reshape(seq_q, *groups, -1), 0, 2)  # (K, G, T, H)

    def one_chunk(n, keys, values):
        start = n * size
        tile = arrays.block((0, seq_q), (start, size)).by_head(groups)
        at = start if key_positions is None else key_positions[n]
        return _chunk_state(formula, per_query, keys, values, tile, q_offset, at)

    if lists is None:
        state = online_softmax.combine(jax.vmap(one_chunk)(positions(0, count), keys, values))
    else:
        rows, (listed, order) = (*groups, seq_q), lists
        empty = online_softmax.init(per_query, rows, (*rows, values.shape[-1]))

        def merged(m, state):
            n = order[m]
            return online_softmax.merge(state, one_chunk(n, keys[n], values[n]))

        state = loop(0, listed, merged, empty)
    if arrays.sinks is not None:
        sink = arrays.sinks.reshape(*groups, 1)
        state = online_softmax.merge(
            state, online_softmax.init(per_query, state.denom.shape, state.acc.shape, sink)
        )
    out, lse = formula.normalizer.finish(state, values.dtype)  # (K, G, T, ·)
    out = jnp.moveaxis(out[..., :features], 2, 0).reshape(seq_q, heads, -1)
    rows = [
        jnp.moveaxis(x, 2, 0).reshape(seq_q, heads) for x in (lse, online_softmax.max_scores(state))
    ]
    return Result(out, rows[0], None, rows[1])


def _chunks(size: int, *caches) -> list:
    """Each cache ``(C·size, K, ·)``, an array or :class:`~jax_sdpa.Quantized`, in ``C`` chunks."""
    return [jax.tree.map(lambda x: x.reshape(-1, size, *x.shape[1:]), c) for c in caches]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _split_attention(tiles: Tiles, query, key, value, arrays: CallArrays):
    return _split_attention_fwd(tiles, query, key, value, arrays)[0]


def _split_attention_fwd(tiles: Tiles, query, key, value, arrays: CallArrays):
    """The keys and values, whole chunks of ``tiles.block_kv``, split and their states merged."""
    keys, values = _chunks(tiles.block_kv, key, value)
    lists = listed_blocks(tiles, arrays, "kv", 0, (0, 0), keys.shape[0])
    out, lse, _, top = split_keys(tiles.formula, query, keys, values, arrays, lists=lists)
    return (out, lse, top), (query, key, value, arrays, out, lse)


define_vjp(_split_attention, _split_attention_fwd, backward)


def decode_sequence(
    formula: Formula, tunables: Decode, query, key, value, arrays: CallArrays
) -> Result:
    """Split-key attention of one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    Chunks of ``tunables.block_kv`` keys (the last padded, its padding masked); every query in
    one tile. The same results as :func:`jax_sdpa._chunked.chunked_sequence`.
    """
    (seq_q, heads, _), (seq_kv, kv_heads, _) = query.shape, key.shape
    tiles = Tiles(formula, seq_q, min(tunables.block_kv, seq_kv), (kv_heads, heads // kv_heads))
    if isinstance(key, Quantized) or isinstance(value, LatentValues):  # JAX's own gradient
        key, value = per_token(key), per_token(value)
        key, value, arrays = pad_keys(key, value, arrays, tiles.block_kv)
        return split_keys(formula, query, *_chunks(tiles.block_kv, key, value), arrays)
    key, value, arrays = pad_keys(key, value, arrays, tiles.block_kv)
    out, lse, top = _split_attention(tiles, query, key, value, arrays)
    return Result(out, lse, None, top)


def paged_sequence(
    formula: Formula, tunables: Paged, query, key_pages, value_pages, table, arrays: CallArrays
) -> Result:
    """Split-key attention of one sequence whose keys are pages of a pool, in chunks of pages.

    ``table`` ``(pages,)`` names the sequence's pages of ``key_pages`` ``(P, page_size, K, H)``
    and ``value_pages``, in order; chunks hold ``tunables.block_kv // page_size`` pages (at least
    one). Only this sequence's pages are copied, never the whole pool: a copy of them is what
    the matrix products read. Its gradient is JAX's, through the same functions.
    """
    pages, page_size = table.shape[0], key_pages.shape[1]
    per_chunk = min(max(1, tunables.block_kv // page_size), pages)
    count = -(-pages // per_chunk)
    # Whole chunks: repeat the sequence's last page (past its length, so masked), so that it
    # never reads a page that is not its own; a page number outside the pool (−1 included:
    # take would count it from the end) reads zeros, never another sequence's page.
    chunks = jnp.pad(table, (0, count * per_chunk - pages), mode="edge").reshape(count, per_chunk)
    chunks = jnp.where(chunks >= 0, chunks, key_pages.shape[0])

    def gather(x):
        pages = jnp.take(x, chunks, axis=0, mode="fill", fill_value=0)
        return pages.reshape(count, per_chunk * page_size, *x.shape[2:])

    keys, values = (jax.tree.map(gather, per_token(x)) for x in (key_pages, value_pages))
    return split_keys(formula, query, keys, values, arrays)


def listed(indices: jax.Array, seq_kv: int) -> tuple[jax.Array, jax.Array]:
    """``(indices, valid)`` of one query's ``(k,)`` indices: sorted, repeats and strays invalid.

    The order of a query's keys does not change its attention; sorted, a repeat sits right
    after its first occurrence.
    """
    indices = jnp.sort(indices)
    repeat = jnp.concatenate([jnp.zeros((1,), bool), indices[1:] == indices[:-1]])
    valid = (indices >= 0) & (indices < seq_kv) & ~repeat
    return jnp.clip(indices, 0, seq_kv - 1), valid


def selected_sequence(
    formula: Formula, tunables: Selected, query, key, value, arrays: CallArrays, indices
) -> Result:
    """One sequence's queries ``(T, N, H)``, each attending to its ``indices[t]`` ``(k,)``."""
    seq_kv = key.shape[0]
    key, value = per_token(key), per_token(value)

    def one_query(t, query, indices):
        indices, valid = listed(indices, seq_kv)
        keys, values = (
            jax.tree.map(lambda x: jnp.take(x, indices, axis=0)[None], x) for x in (key, value)
        )
        # The listed keys' mask, in the place of the call's per-logit mask (refused with these).
        tile = dataclasses.replace(arrays, mask=valid[None, None, :])
        return split_keys(
            formula, query[None], keys, values, tile, q_offset=t, key_positions=indices[None]
        )

    seq_q = query.shape[0]
    args = (jnp.arange(seq_q, dtype=indices.dtype), query, indices)
    one = jax.checkpoint(lambda args: one_query(*args))
    result = lax.map(one, args, batch_size=min(tunables.block_q, seq_q))
    return jax.tree.map(lambda x: x[:, 0], result)
