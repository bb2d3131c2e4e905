r"""Paged KV caches: attention over keys kept in fixed-size pages, and writing new tokens.

A paged cache (vLLM, Kwon et al. 2023) keeps keys and values in a pool of pages,
``(num_pages, page_size, K, H)``; sequence ``b`` owns the pages ``page_table[b]``, in order, and
its first ``lengths[b]`` positions are valid. Pages are allocated as sequences grow, so no
sequence reserves room it does not use. :func:`paged_attention` attends over those pages chunk
by chunk (:func:`jax_sdpa._decode.split_keys`), gathering a few pages at a time: the cache is
never copied into a contiguous array.

:func:`update_cache` and :func:`update_paged_cache` write a step's new keys and values into a
contiguous or a paged cache: pure functions of the cache, to ``jax.jit`` with the cache donated
(``donate_argnums``), so that XLA writes in place.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer

from jax_sdpa import _checks
from jax_sdpa._arguments import (
    _formula,
    _index,
    _mask_mod,
    _mask_rule,
    _score_mod,
    _Shapes,
    _sinks,
    _window,
)
from jax_sdpa._decode import split_keys
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import over_batch
from jax_sdpa._implementations import Inputs, without_positions
from jax_sdpa._indices import INDEX, indices
from jax_sdpa._tiles import DEFAULT_BLOCK_KV
from jax_sdpa._user_functions import FunctionMask, function_mask

__all__ = ["paged_attention", "update_cache", "update_paged_cache"]


def _last_queries(lengths: Array, seq_q: int, is_causal: bool, local_window_size) -> FunctionMask:
    """The mask of queries that are the last ``T`` positions of each sequence's keys.

    Query ``i`` of sequence ``b`` sits at position ``lengths[b] − T + i``: it sees the keys
    before ``lengths[b]``, up to its own position if causal, within the window if one is given.
    """
    window = None if local_window_size is None else _window(local_window_size)

    def mask_mod(batch, head, q_idx, kv_idx):
        length = lengths[batch]
        position = q_idx + length - seq_q
        allowed = kv_idx < length
        if is_causal:
            allowed = allowed & (kv_idx <= position)
        if window is not None:
            allowed = allowed & (kv_idx >= position - window[0]) & (kv_idx <= position + window[1])
        return allowed

    return function_mask(mask_mod)


def _check_pages(query, key_pages, value_pages, page_table, lengths) -> _Shapes:
    """The sizes of a paged call, with every array checked against the others."""
    layouts = {
        "query": "(batch, q_seq, heads, d_k)",
        "key_pages": "(num_pages, page_size, kv_heads, d_k)",
        "value_pages": "(num_pages, page_size, kv_heads, d_v)",
    }
    for (name, layout), x in zip(layouts.items(), (query, key_pages, value_pages), strict=True):
        _checks.check_ndim(name, x, (4,), layout)
        _checks.check_float(name, x)
    _checks.check_same_dtype(("query", "key_pages", "value_pages"), (query, key_pages, value_pages))
    batch, seq_q, heads, d_k = query.shape
    num_pages, page_size, kv_heads, _ = key_pages.shape
    _checks.check_equal("feature size d_k", ("query", "key_pages"), (d_k, key_pages.shape[-1]))
    _checks.check_equal(
        "pages (num_pages, page_size, kv_heads)",
        ("key_pages", "value_pages"),
        (key_pages.shape[:3], value_pages.shape[:3]),
    )
    if heads % kv_heads:
        raise ValueError(
            f"The number of query heads must be a multiple of the key/value heads; got {heads} "
            f"query heads and {kv_heads} key/value heads."
        )
    _checks.check_ndim("page_table", page_table, (2,), "(batch, pages_per_sequence)")
    _checks.check_integer("page_table", page_table)
    _checks.check_shape("page_table", page_table, (batch, page_table.shape[1]), "(batch, pages)")
    _checks.check_shape("lengths", lengths, (batch,), "(batch,)")
    _checks.check_integer("lengths", lengths)
    capacity = page_table.shape[1] * page_size
    try:
        longest = int(jnp.max(lengths, initial=0))
        pages = (int(jnp.min(page_table, initial=0)), int(jnp.max(page_table, initial=0)))
    except jax.errors.ConcretizationTypeError:  # under jit: clamped, see paged_attention
        longest, pages = 0, (0, 0)
    if longest > capacity:
        raise ValueError(
            f"`lengths` must be at most pages_per_sequence · page_size = {capacity}; got {longest}."
        )
    if pages[0] < 0 or pages[1] >= num_pages:
        raise ValueError(
            f"`page_table` must hold page numbers in [0, {num_pages}); "
            f"got {pages[0]} to {pages[1]}."
        )
    return _Shapes((batch,), seq_q, heads, capacity, kv_heads, 1)


def paged_attention(
    query: Float[ArrayLike, "B T N H"],
    key_pages: Float[ArrayLike, "P page K H"],
    value_pages: Float[ArrayLike, "P page K V"],
    page_table: Integer[ArrayLike, "B pages"],
    lengths: Integer[ArrayLike, " B"],
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    score_mod=None,
    mask_mod=None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    block_kv: int = DEFAULT_BLOCK_KV,
):
    r"""Attention of new queries to the keys and values of a paged cache.

    Sequence ``b``'s keys are its pages ``key_pages[page_table[b]]`` laid end to end, of which
    the first ``lengths[b]`` are valid; its ``T`` queries are its last ``T`` positions,
    ``lengths[b] − T`` to ``lengths[b] − 1`` (the new tokens, already written to the cache with
    :func:`update_paged_cache`). The result equals :func:`dot_product_attention` over the
    gathered keys with ``key_value_seq_lengths=lengths`` and, per sequence, the causal mask
    aligned to its last key; the pages are gathered one sequence at a time, never all at once.

    Args:
        query: ``(B, T, N, H)``.
        key_pages: The pool of key pages, ``(P, page_size, K, H)``.
        value_pages: The pool of value pages, ``(P, page_size, K, V)``, the same dtype.
        page_table: ``(B, pages_per_sequence)`` int32: sequence ``b``'s pages, in order.
        lengths: ``(B,)``: valid positions per sequence, at most ``pages_per_sequence ·
            page_size``. Under ``jit`` (not checked) larger lengths are clamped to that, and
            page numbers outside the pool read zeros: a sequence never reads a page that is
            not in its own row of ``page_table``.
        scale: Factor on the scores (``1/√H`` by default).
        is_causal: Whether query ``i`` sees only keys up to its own position (for ``T = 1``
            the lengths alone decide).
        local_window_size: ``(left, right)`` (or one int for both) around each query's position.
        logits_soft_cap: If set, scores become ``cap · tanh(scores / cap)``.
        score_mod: As in :func:`dot_product_attention`; ``q_idx`` counts the ``T`` queries from
            0 and ``kv_idx`` the cache positions.
        mask_mod: As in :func:`dot_product_attention`, ANDed with the rest.
        sinks: ``(N,)``: one logit per query head for a key without a value.
        return_residual: Also return the log-sum-exp ``(B, T, N)``.
        block_kv: Keys per chunk (a whole number of pages, at least one).

    Returns:
        ``(B, T, N, V)`` in the pages' dtype; with ``return_residual``, ``(out, lse)``.

    Raises:
        ValueError: On shapes that do not fit together, or concrete lengths beyond the pages.
        TypeError: On non-float pages or queries, or non-integer page tables and lengths.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> pages = jax.random.normal(jax.random.key(0), (2, 6, 4, 1, 8))  # 6 pages of 4
        >>> q = jax.random.normal(jax.random.key(1), (1, 1, 2, 8))  # one new token, 2 heads
        >>> table, lengths = jnp.array([[4, 1, 3]]), jnp.array([10])  # 10 keys on 3 pages
        >>> out = paged_attention(q, pages[0], pages[1], table, lengths)
        >>> keys, values = (p[table[0]].reshape(1, 12, 1, 8) for p in pages)
        >>> from jax_sdpa import dot_product_attention
        >>> dense = dot_product_attention(q, keys, values, key_value_seq_lengths=lengths)
        >>> bool(jnp.abs(out - dense).max() < 1e-6)
        True
    """
    query, key_pages, value_pages = map(jnp.asarray, (query, key_pages, value_pages))
    page_table, lengths = jnp.asarray(page_table), jnp.asarray(lengths)
    shapes = _check_pages(query, key_pages, value_pages, page_table, lengths)
    _checks.check_positive_int("block_kv", block_kv)
    score_mod, score_consts = _score_mod(shapes, query.dtype, score_mod=score_mod)
    formula = dataclasses.replace(
        _formula(query.shape[-1], scale=scale, logits_soft_cap=logits_soft_cap),
        score_mod=score_mod,
    )
    lengths = jnp.minimum(lengths, shapes.seq_kv).astype(INDEX)
    positions = _last_queries(lengths, shapes.seq_q, is_causal, local_window_size)
    mask_mod = positions if mask_mod is None else _mask_mod(shapes, mask_mod) & positions
    rule = _mask_rule(shapes, mask_mod=mask_mod)
    arrays = CallArrays(
        rule=rule,
        batch=_index(shapes.batch),
        head=_index((1, shapes.heads)),
        score_consts=score_consts,
        sinks=_sinks(shapes, sinks=sinks),
    )
    if 0 in (shapes.seq_q, shapes.seq_kv):  # no query, or no key
        empty = (*shapes.batch, 0, shapes.kv_heads)
        keys, values = (jnp.zeros((*empty, x.shape[-1]), x.dtype) for x in (key_pages, value_pages))
        out, lse, _ = without_positions(Inputs(query, keys, values, arrays))
        return (out, lse) if return_residual else out
    pages_per_chunk = max(1, block_kv // key_pages.shape[1])
    out, lse = _paged(formula, pages_per_chunk, query, key_pages, value_pages, page_table, arrays)
    return (out, lse) if return_residual else out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _paged(formula: Formula, pages_per_chunk: int, query, key_pages, value_pages, table, arrays):
    pages = table.shape[1]
    pages_per_chunk = min(pages_per_chunk, pages)
    count = -(-pages // pages_per_chunk)
    # Whole chunks: repeat each sequence's last page (past its length, so masked), so that it
    # never reads a page that is not its own.
    table = jnp.pad(table, ((0, 0), (0, count * pages_per_chunk - pages)), mode="edge")
    size = pages_per_chunk * key_pages.shape[1]

    def sequence(query, table, arrays):
        # One sequence's pages at a time (the batch is mapped sequentially): a copy of them,
        # never of the whole cache, is what the matrix products read.
        chunks = table.reshape(count, pages_per_chunk)
        # A page number outside the pool (−1 included: take would count it from the end)
        # reads zeros, never another sequence's page.
        chunks = jnp.where(chunks >= 0, chunks, key_pages.shape[0])
        keys, values = (
            jnp.take(x, chunks, axis=0, mode="fill", fill_value=0) for x in (key_pages, value_pages)
        )
        keys, values = (x.reshape(count, size, *x.shape[3:]) for x in (keys, values))
        return split_keys(formula, query, keys, values, arrays)[:2]

    return over_batch(sequence, query.shape[:1], query, table, arrays, sequential=True)


def update_cache(
    key_cache: Float[Array, "B S K H"],
    value_cache: Float[Array, "B S K V"],
    key: Float[ArrayLike, "B T K H"],
    value: Float[ArrayLike, "B T K V"],
    positions: Integer[ArrayLike, " B"],
) -> tuple[Array, Array]:
    """Writes each sequence's ``T`` new keys and values at ``positions[b]`` of a contiguous cache.

    Pure: it returns the new caches. Under ``jax.jit(..., donate_argnums=(0, 1))`` XLA updates
    the donated caches in place. Positions are clamped so that the ``T`` rows fit (as
    ``lax.dynamic_update_slice`` does).

    Examples:
        >>> import jax.numpy as jnp
        >>> cache = jnp.zeros((1, 4, 1, 2))
        >>> keys, _ = update_cache(cache, cache, jnp.ones((1, 1, 1, 2)), jnp.ones((1, 1, 1, 2)),
        ...                        jnp.array([2]))
        >>> keys[0, :, 0, 0]
        Array([0., 0., 1., 0.], dtype=float32)
    """

    def write(cache, new, position):
        start = indices(position, *(0,) * (cache.ndim - 1))
        return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)

    positions = jnp.asarray(positions)
    return tuple(
        jax.vmap(write)(cache, jnp.asarray(new), positions)
        for cache, new in ((key_cache, key), (value_cache, value))
    )


def update_paged_cache(
    key_pages: Float[Array, "P page K H"],
    value_pages: Float[Array, "P page K V"],
    key: Float[ArrayLike, "B T K H"],
    value: Float[ArrayLike, "B T K V"],
    page_table: Integer[ArrayLike, "B pages"],
    positions: Integer[ArrayLike, " B"],
) -> tuple[Array, Array]:
    """Writes each sequence's ``T`` new keys and values at ``positions[b]`` onwards, in its pages.

    Position ``p`` of sequence ``b`` is slot ``p % page_size`` of page
    ``page_table[b, p // page_size]``; positions past the sequence's pages, and page numbers
    outside the pool, are not written. Pure, like :func:`update_cache`: donate the pages to
    ``jax.jit`` to write in place.

    Examples:
        >>> import jax.numpy as jnp
        >>> pages = jnp.zeros((3, 2, 1, 1))  # 3 pages of 2 slots
        >>> new = jnp.ones((1, 2, 1, 1))  # two new tokens
        >>> table, positions = jnp.array([[2, 0]]), jnp.array([1])
        >>> keys, _ = update_paged_cache(pages, pages, new, new, table, positions)
        >>> keys[:, :, 0, 0]  # positions 1 and 2: page 2 slot 1, page 0 slot 0
        Array([[1., 0.],
               [0., 0.],
               [0., 1.]], dtype=float32)
    """
    page_size = key_pages.shape[1]
    page_table, positions = jnp.asarray(page_table), jnp.asarray(positions)
    key, value = jnp.asarray(key), jnp.asarray(value)
    seq = positions[:, None] + jnp.arange(key.shape[1], dtype=positions.dtype)[None, :]  # (B, T)
    pages = jnp.take_along_axis(page_table, seq // page_size, axis=1, mode="fill", fill_value=-1)
    # A position past the sequence's pages, or on a page number outside the pool (say −1 for
    # "none"), is not written: it would land on another position or another sequence's page.
    pages = jnp.where((pages >= 0) & (seq >= 0), pages, key_pages.shape[0])
    rows = math.prod(seq.shape)
    return tuple(
        cache.at[pages.reshape(rows), (seq % page_size).reshape(rows)].set(
            new.reshape(rows, *new.shape[2:]).astype(cache.dtype), mode="drop"
        )
        for cache, new in ((key_pages, key), (value_pages, value))
    )
