"""Ragged batches: sequences that bring different numbers of new queries, packed along one axis.

:func:`ragged_paged_attention` attends a prefill chunk beside decoding steps in one call, as vLLM,
FlashInfer and TPU ``ragged_paged_attention`` serve: the queries in tiles, each one sequence's
(:class:`_Tiles`), attended as a batch of sequences by :func:`jax_sdpa._paged.attend`, each
tile's first query at its sequence's position. (Its writer, ``update_ragged_paged_cache``, is
with the paged cache's in :mod:`jax_sdpa._paged`.)
"""

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer

from jax_sdpa import _checks
from jax_sdpa._block_mask import BlockMask
from jax_sdpa._indices import INDEX
from jax_sdpa._keywords import PagedKeywords
from jax_sdpa._latent import LatentValues
from jax_sdpa._masks import MaskRule
from jax_sdpa._paged import attend
from jax_sdpa._pallas import PACKED_ROWS
from jax_sdpa._quantized import Quantized
from jax_sdpa._row_rules import QueriesFrom
from jax_sdpa._user_functions import function_mask

if TYPE_CHECKING:  # Python 3.10's typing has no Unpack; typing_extensions is no dependency
    from typing_extensions import Unpack

__all__ = ["ragged_paged_attention"]


def ragged_paged_attention(
    query: Float[ArrayLike, "Q N H"],
    key_pages: Float[ArrayLike, "P page K H"] | Quantized,
    value_pages: Float[ArrayLike, "P page K V"] | Quantized | LatentValues,
    page_table: Integer[ArrayLike, "B pages"],
    lengths: Integer[ArrayLike, " B"],
    query_starts: Integer[ArrayLike, " B+1"],
    *,
    max_queries: int,
    score_mod=None,
    mask_mod=None,
    **keywords: "Unpack[PagedKeywords]",
):
    r""":func:`paged_attention` of sequences with different numbers of new queries, packed.

    Rows ``query_starts[b]`` to ``query_starts[b + 1] − 1`` of ``query`` are sequence ``b``'s
    new queries (as vLLM's ``query_start_loc``: ``query_starts[0] = 0``, non-decreasing), its
    last positions: a prefill chunk and decoding steps in one call. Row ``query_starts[b] + i``
    gives what :func:`paged_attention` gives sequence ``b``'s query ``i`` of its ``n_b``, the
    causal mask aligned to its last key; rows outside ``query_starts`` give zeros (their
    log-sum-exp and max scores too). The queries are attended in tiles of ``128 / G`` rows
    (``G`` query heads a key/value head: a kernel program's rows with the group packed, each
    key read once for them, where nothing differs between the heads but their queries; at most
    ``max_queries``), each tile one sequence's, so that a call
    attends about ``Q + B · 128 / G`` rows, not ``B · max_queries``: a prefill chunk beside
    decoding steps costs about what the two cost apart. ``max_queries`` (static) is at least
    every ``n_b``; under ``jit`` a longer sequence gets only its last ``max_queries`` rows, the
    others zeros.

    Args:
        query: ``(Q, N, H)``, the batch's new queries packed along one axis.
        key_pages: As in :func:`paged_attention` (the new keys already written, as
            :func:`update_ragged_paged_cache` writes them).
        value_pages: As in :func:`paged_attention`.
        page_table: ``(B, pages_per_sequence)``, as in :func:`paged_attention`.
        lengths: ``(B,)``: valid positions per sequence, the new ones included.
        query_starts: ``(B + 1,)`` integers: where each sequence's queries start, and the end.
        max_queries: The most new queries any sequence has.
        score_mod: As in :func:`paged_attention`, ``q_idx`` counting each sequence's own new
            queries from 0.
        mask_mod: As ``score_mod``: a function (a :class:`~jax_sdpa.MaskRule` or block mask
            knows no ragged rows).
        **keywords: :func:`paged_attention`'s others (``scale``, ``is_causal``,
            ``local_window_size``, ``logits_soft_cap``, ``sinks``, ``normalizer``,
            ``sigmoid_bias``, ``return_residual`` and ``return_max_scores``, whose arrays are
            then ``(Q, N)``, ``implementation``), as there.

    Returns:
        ``(Q, N, V)`` in the pages' dtype; with ``return_residual`` (and ``return_max_scores``),
        a tuple as :func:`paged_attention` gives.

    Raises:
        ValueError: As :func:`paged_attention`; on ``query_starts`` not of ``B + 1`` entries, or
            concrete counts above ``max_queries``.
        TypeError: As :func:`paged_attention`, and on non-integer ``query_starts``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> pages = jax.random.normal(jax.random.key(0), (2, 6, 4, 1, 8))  # 6 pages of 4
        >>> q = jax.random.normal(jax.random.key(1), (3, 2, 8))  # 1 query, then 2; 2 heads
        >>> table, lengths = jnp.array([[4, 1, 3], [0, 2, 5]]), jnp.array([10, 7])
        >>> starts = jnp.array([0, 1, 3])
        >>> out = ragged_paged_attention(q, *pages, table, lengths, starts, max_queries=2)
        >>> from jax_sdpa import paged_attention
        >>> second = paged_attention(q[None, 1:], *pages, table[1:], lengths[1:])
        >>> bool(jnp.abs(out[1:] - second[0]).max() < 1e-6)
        True
    """
    query, query_starts = jnp.asarray(query), jnp.asarray(query_starts)
    page_table, lengths = jnp.asarray(page_table), jnp.asarray(lengths)
    key_pages = key_pages if isinstance(key_pages, Quantized) else jnp.asarray(key_pages)
    _check_ragged(query, key_pages, page_table, lengths, query_starts, max_queries, mask_mod)
    _check_keywords(keywords)
    if page_table.shape[0] == 0:  # (no sequence: one with no keys and no queries, for the shapes)
        page_table = jnp.zeros((1, page_table.shape[1]), page_table.dtype)
        lengths, query_starts = (
            jnp.zeros((n,), x.dtype) for n, x in ((1, lengths), (2, query_starts))
        )
    group = max(1, query.shape[1] // max(1, key_pages.shape[2]))
    tiles = _Tiles.of(query_starts.astype(INDEX), max_queries, query.shape[0], group)
    real = tiles.real()
    rows = tiles.rows()
    padded = jnp.where(real[..., None, None], jnp.take(query, rows, axis=0, mode="clip"), 0)

    def own_queries(mod):  # (…, batch, head, q_idx, kv_idx): its sequence, and q_idx from its
        if mod is None:  # first new query
            return None

        def mod_of_tile(*args):
            *rest, tile, head, q_idx, kv_idx = args
            own = q_idx + tiles.own[tile]
            return mod(*rest, tiles.sequence[tile], head, own, kv_idx)

        return mod_of_tile

    # The padding rows see no key: a kernel skips their blocks, as the XLA paths do.
    rule = QueriesFrom(tiles.first)
    if mask_mod is not None:
        rule = rule & function_mask(own_queries(mask_mod))
    lengths = lengths[tiles.sequence]
    results = attend(
        padded,
        key_pages,
        value_pages,
        page_table[tiles.sequence],
        lengths,
        tiles.first_positions(lengths),
        score_mod=own_queries(score_mod),
        mask_mod=rule,
        **keywords,
    )
    at = jnp.where(real, rows, query.shape[0]).reshape(-1)  # (padding rows: dropped)

    def packed(x):  # (tiles, rows, ...) → (Q, ...), each real row at its place
        flat = x.reshape(-1, *x.shape[2:])
        return jnp.zeros((query.shape[0], *x.shape[2:]), x.dtype).at[at].set(flat, mode="drop")

    return jax.tree.map(packed, results)


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """A ragged batch's queries in tiles of ``size`` rows, each tile's rows one sequence's.

    Sequence ``b`` attends its last ``min(n_b, max_queries)`` queries (all of them, where
    ``max_queries`` holds) in as few tiles as hold them, padding rows first, so that its last
    query ends its last tile; the tiles past the batch's are padding. ``size`` is
    :data:`~jax_sdpa._pallas.PACKED_ROWS` over the ``group`` of query heads that share a
    key/value head (one tile is one kernel program's rows, the group packed: each key read
    once for the tile), at most ``max_queries``: a call attends about ``Q + B · size`` rows,
    not ``B · max_queries``.
    """

    size: int
    starts: Array  # (B + 1,): query_starts
    sequence: Array  # (tiles,): each tile's sequence
    new: Array  # (tiles,): its sequence's new queries, how many
    own: Array  # (tiles,): its first row's index among its sequence's new queries
    first: Array  # (tiles,): its first row that is a query (``size`` where none is)

    @classmethod
    def of(cls, starts, max_queries: int, packed: int, group: int) -> "_Tiles":
        """The tiles of ``packed`` rows of queries (``Q``), sequence ``b``'s from ``starts[b]``."""
        size = max(1, min(max_queries, PACKED_ROWS // group))
        batch = starts.shape[0] - 1
        new = starts[1:] - starts[:-1]
        counts = jnp.clip(new, 0, max_queries)
        tiles = -(-counts // size)
        ends = jnp.cumsum(tiles)
        # (at most as many as the batch's rows fill, and as its sequences pad to max_queries)
        most = min(batch * -(-max_queries // size), (packed + batch * (size - 1)) // size)
        tile = jnp.arange(max(1, most), dtype=INDEX)
        sequence = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), batch - 1)
        used = tile < ends[-1]
        own = new[sequence] - (ends[sequence] - tile) * size
        first = jnp.maximum(new[sequence] - counts[sequence] - own, 0)
        first = jnp.where(used, first, size)
        return cls(size, starts, sequence.astype(INDEX), new[sequence], own, first)

    def first_positions(self, lengths) -> Array:
        """``(tiles,)``: each tile's first row's position, given its sequence's ``lengths``.

        The sequence's new queries are its last positions: its length less their count, plus
        the row's index among them.
        """
        return lengths.astype(INDEX) - self.new + self.own

    def rows(self) -> Array:
        """``(tiles, size)``: each row's row of the packed queries."""
        return self.starts[self.sequence, None] + self.own[:, None] + self._row()

    def real(self) -> Array:
        """``(tiles, size)``: whether each row is a query."""
        return self._row() >= self.first[:, None]

    def _row(self) -> Array:
        return jnp.arange(self.size, dtype=INDEX)[None, :]


def _check_ragged(query, key_pages, page_table, lengths, query_starts, max_queries, mask_mod):
    _checks.check_ndim("query", query, (3,), "(Q, N, H), packed")
    _checks.check_ndim("key_pages", key_pages, (4,), "(num_pages, page_size, kv_heads, d_k)")
    _checks.check_ndim("page_table", page_table, (2,), "(B, pages_per_sequence)")
    _checks.check_shape("lengths", lengths, page_table.shape[:1], "(B,)")
    if isinstance(mask_mod, (MaskRule, BlockMask)):
        raise TypeError(
            "`mask_mod` of ragged_paged_attention must be a function (batch, head, q_idx, "
            f"kv_idx) -> bool, its q_idx each sequence's own; got {type(mask_mod).__name__}."
        )
    batch = jnp.shape(page_table)[0]
    _checks.check_shape("query_starts", query_starts, (batch + 1,), "(B + 1,)")
    _checks.check_integer("query_starts", query_starts)
    _checks.check_positive_int("max_queries", max_queries)
    try:
        most = int(jnp.max(query_starts[1:] - query_starts[:-1], initial=0))
    except jax.errors.ConcretizationTypeError:  # under jit: its last max_queries rows
        most = 0
    if most > max_queries:
        raise ValueError(
            f"`max_queries` must be at least each sequence's count of new queries; got "
            f"{max_queries}, and a sequence with {most}."
        )


def _check_keywords(keywords) -> None:
    """Only :func:`~jax_sdpa.paged_attention`'s keywords pass on (as its signature takes them)."""
    passed_on = PagedKeywords.__annotations__
    unknown = sorted(set(keywords) - set(passed_on))
    if unknown:
        raise TypeError(
            f"ragged_paged_attention() got an unexpected keyword argument {unknown[0]!r}; it "
            f"takes max_queries, score_mod, mask_mod and {', '.join(passed_on)}."
        )
