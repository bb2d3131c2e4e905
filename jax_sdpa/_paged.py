r"""Paged KV caches: attention over keys kept in fixed-size pages, and writing new tokens.

A paged cache (vLLM, Kwon et al. 2023) keeps keys and values in a pool of pages,
``(num_pages, page_size, K, H)``; sequence ``b`` owns the pages ``page_table[b]``, in order, and
its first ``lengths[b]`` positions are valid. Pages are allocated as sequences grow, so no
sequence reserves room it does not use. :func:`paged_attention` attends over those pages chunk
by chunk (:func:`jax_sdpa._decode.split_keys`), gathering a few pages at a time: the cache is
never copied into a contiguous array (:mod:`jax_sdpa._ragged` attends a batch whose sequences
bring different numbers of new queries with it).

:func:`update_cache`, :func:`update_paged_cache` and :func:`update_ragged_paged_cache` write a
step's new keys and values into a contiguous or a paged cache: pure functions of the cache, to
``jax.jit`` with the cache donated (``donate_argnums``), so that XLA writes in place.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer

from jax_sdpa._arguments import bind
from jax_sdpa._implementations import check_implementation, run
from jax_sdpa._indices import INDEX, indices
from jax_sdpa._keywords import Normalizer
from jax_sdpa._latent import LatentValues
from jax_sdpa._quantized import Quantized, quantize_like
from jax_sdpa._tunables import Paged

__all__ = [
    "paged_attention",
    "update_cache",
    "update_paged_cache",
    "update_ragged_paged_cache",
]


def paged_attention(
    query: Float[ArrayLike, "B T N H"],
    key_pages: Float[ArrayLike, "P page K H"] | Quantized,
    value_pages: Float[ArrayLike, "P page K V"] | Quantized | LatentValues,
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
    normalizer: Normalizer = "softmax",
    sigmoid_bias: ArrayLike | float | None = None,
    return_residual: bool = False,
    return_max_scores: bool = False,
    implementation: Paged | None = None,
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
        key_pages: The pool of key pages, ``(P, page_size, K, H)``, an array or quantized
            (:func:`~jax_sdpa.quantize`).
        value_pages: The pool of value pages, ``(P, page_size, K, V)``, the same dtype
            (quantized as ``key_pages`` is), or :class:`~jax_sdpa.LatentValues` ``(V)``: the
            values are ``key_pages[..., :V]``, read once with the keys.
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
        normalizer: As in :func:`dot_product_attention` (``S`` is each sequence's ``lengths``).
        sigmoid_bias: As in :func:`dot_product_attention`.
        return_residual: Also return the log-sum-exp ``(B, T, N)``.
        return_max_scores: Also return each row's largest logit ``(B, T, N)``, as in
            :func:`dot_product_attention`.
        implementation: :class:`~jax_sdpa.Paged` (its chunk of keys), or None for its defaults.

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
    return attend(
        query,
        key_pages,
        value_pages,
        page_table,
        lengths,
        scale=scale,
        is_causal=is_causal,
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap,
        score_mod=score_mod,
        mask_mod=mask_mod,
        sinks=sinks,
        normalizer=normalizer,
        sigmoid_bias=sigmoid_bias,
        return_residual=return_residual,
        return_max_scores=return_max_scores,
        implementation=implementation,
    )


def attend(
    query,
    key_pages,
    value_pages,
    page_table,
    lengths,
    first_positions=None,
    *,
    is_causal=True,
    implementation=None,
    **keywords,
):
    """:func:`paged_attention`, each sequence's first query at ``first_positions`` if given.

    (:func:`~jax_sdpa.ragged_paged_attention`'s tiles: :mod:`jax_sdpa._ragged`.)
    """
    check_implementation(implementation, ("paged",), by_name=False)
    inputs, config = bind(
        query,
        key_pages,
        value_pages,
        output="attention",
        implementation=implementation or "paged",
        page_table=page_table,
        key_value_seq_lengths=lengths,
        first_positions=first_positions,
        is_causal=is_causal,
        **keywords,
    )
    returned = (keywords.get(f"return_{x}", False) for x in ("residual", "max_scores"))
    return run(inputs, config=config).returned(*returned)


def update_cache(
    key_cache: Float[Array, "B S K H"] | Quantized,
    value_cache: Float[Array, "B S K V"] | Quantized | LatentValues,
    key: Float[ArrayLike, "B T K H"],
    value: Float[ArrayLike, "B T K V"] | None,
    positions: Integer[ArrayLike, " B"],
) -> tuple[Array | Quantized, Array | Quantized | LatentValues]:
    """Writes each sequence's ``T`` new keys and values at ``positions[b]`` of a contiguous cache.

    Pure: it returns the new caches. Under ``jax.jit(..., donate_argnums=(0, 1))`` XLA updates
    the donated caches in place. Positions are clamped so that the ``T`` rows fit (as
    ``lax.dynamic_update_slice`` does). A quantized cache (:func:`~jax_sdpa.quantize`) gets the
    new rows quantized in its format: int8 with their own scales, float8 with the cache's. A
    shared-latent cache (``value_cache`` a :class:`~jax_sdpa.LatentValues`, ``value`` None)
    has only its keys written.

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
        return jax.lax.dynamic_update_slice(cache, new, start)

    positions = jnp.asarray(positions)
    return tuple(
        _written(cache, new, lambda cache, new: jax.vmap(write)(cache, new, positions))
        for cache, new in ((key_cache, key), (value_cache, value))
    )


def update_paged_cache(
    key_pages: Float[Array, "P page K H"] | Quantized,
    value_pages: Float[Array, "P page K V"] | Quantized | LatentValues,
    key: Float[ArrayLike, "B T K H"],
    value: Float[ArrayLike, "B T K V"] | None,
    page_table: Integer[ArrayLike, "B pages"],
    positions: Integer[ArrayLike, " B"],
) -> tuple[Array | Quantized, Array | Quantized | LatentValues]:
    """Writes each sequence's ``T`` new keys and values at ``positions[b]`` onwards, in its pages.

    Position ``p`` of sequence ``b`` is slot ``p % page_size`` of page
    ``page_table[b, p // page_size]``; positions past the sequence's pages, and page numbers
    outside the pool, are not written. Pure, like :func:`update_cache`: donate the pages to
    ``jax.jit`` to write in place. Quantized pools are written as in :func:`update_cache`.

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
    page_table, positions = jnp.asarray(page_table), jnp.asarray(positions)
    key = jnp.asarray(key)
    batch, count = key.shape[:2]
    at = positions[:, None] + jnp.arange(count, dtype=positions.dtype)[None, :]  # (B, T)
    sequences = jnp.broadcast_to(jnp.arange(batch)[:, None], at.shape)
    where = (sequences.reshape(-1), at.reshape(-1))
    return _written_at(key_pages, value_pages, key, value, page_table, where)


def update_ragged_paged_cache(
    key_pages: Float[Array, "P page K H"] | Quantized,
    value_pages: Float[Array, "P page K V"] | Quantized | LatentValues,
    key: Float[ArrayLike, "Q K H"],
    value: Float[ArrayLike, "Q K V"] | None,
    page_table: Integer[ArrayLike, "B pages"],
    positions: Integer[ArrayLike, " B"],
    query_starts: Integer[ArrayLike, " B+1"],
) -> tuple[Array | Quantized, Array | Quantized | LatentValues]:
    """Writes new keys and values packed along one axis, sequence by sequence, in their pages.

    Rows ``query_starts[b]`` to ``query_starts[b + 1] − 1`` of ``key`` and ``value`` are
    sequence ``b``'s new tokens, written at ``positions[b]`` onwards as
    :func:`update_paged_cache` writes them (rows past ``query_starts[-1]`` are not written): the
    writer for :func:`ragged_paged_attention`.

    Examples:
        >>> import jax.numpy as jnp
        >>> pages = jnp.zeros((2, 2, 1, 1))  # 2 pages of 2 slots
        >>> new = jnp.array([1.0, 2.0, 3.0]).reshape(3, 1, 1)  # 1 token, then 2 tokens
        >>> table, starts = jnp.array([[1], [0]]), jnp.array([0, 1, 3])
        >>> positions = jnp.array([1, 0])  # where each sequence's new tokens go
        >>> keys, _ = update_ragged_paged_cache(pages, pages, new, new, table, positions, starts)
        >>> keys[:, :, 0, 0]
        Array([[2., 3.],
               [0., 1.]], dtype=float32)
    """
    page_table, positions = jnp.asarray(page_table), jnp.asarray(positions).astype(INDEX)
    key = jnp.asarray(key)
    sequences, offsets = _packed(jnp.asarray(query_starts).astype(INDEX), key.shape[0])
    at = jnp.take(positions, sequences, mode="clip") + offsets
    value = None if value is None else jnp.asarray(value)[None]
    return _written_at(key_pages, value_pages, key[None], value, page_table, (sequences, at))


def _packed(query_starts: Array, rows: int) -> tuple[Array, Array]:
    """Each of ``rows`` packed rows' sequence (``B`` if outside them all) and offset in it."""
    row = jnp.arange(rows, dtype=query_starts.dtype)
    sequences = jnp.searchsorted(query_starts, row, side="right") - 1
    inside = (row >= query_starts[0]) & (row < query_starts[-1])
    sequences = jnp.where(inside, sequences, query_starts.shape[0] - 1)
    offsets = row - jnp.take(query_starts, sequences, mode="clip")
    return sequences, offsets


def _written_at(key_pages, value_pages, key, value, page_table: Array, where: tuple):
    """``key`` and ``value`` ``(B, T, ·, ·)`` written in their pages, row by row, at ``where``.

    ``where``: the sequence and the position of each of the ``B·T`` rows.

    Position ``p`` of sequence ``b`` is slot ``p % page_size`` of page ``page_table[b, p //
    page_size]``. A position past the sequence's pages, a sequence past the table, or a page
    number outside the pool (say −1 for "none") is not written: it would land on another
    position or another sequence's page.
    """
    sequences, at = where
    page_size = key_pages.shape[1]
    rows = jnp.take(page_table, sequences, axis=0, mode="fill", fill_value=-1)
    pages = jnp.take_along_axis(
        rows, (at // page_size)[:, None], axis=1, mode="fill", fill_value=-1
    )
    pages = jnp.where((pages[:, 0] >= 0) & (at >= 0), pages[:, 0], key_pages.shape[0])
    slots = (pages, at % page_size)

    def write(cache, new):
        return cache.at[slots].set(new.reshape(-1, *new.shape[2:]), mode="drop")

    return tuple(
        _written(cache, new, write) for cache, new in ((key_pages, key), (value_pages, value))
    )


def _written(cache, new, write):
    """``write(cache, new)``, ``new`` cast to the cache's dtype or quantized in its format.

    A quantized cache's values and (one per token) scales are written alike; a scale per head
    was fixed when the cache was made (:func:`~jax_sdpa.quantize`).
    """
    if isinstance(cache, LatentValues):  # the values are the keys': written with them
        return cache
    if not isinstance(cache, Quantized):
        return write(cache, jnp.asarray(new).astype(cache.dtype))
    new = quantize_like(cache, new)
    scale = write(cache.scale, new.scale) if cache.per_token_scale else cache.scale
    return Quantized(write(cache.values, new.values), scale)
