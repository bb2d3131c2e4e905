r"""The fused implementation: one sequence's attention as the engine's Pallas kernels.

``implementation="pallas"`` (or :class:`~jax_sdpa.Pallas` with its tunables): the chunked
implementation's computation, tile for tile, with each pass one kernel
(:mod:`jax_sdpa._kernels`): Triton on GPUs, Mosaic on TPUs, chosen by the platform the program is
lowered for; elsewhere (a CPU) the Pallas interpreter runs it, exact and slow. Its backward pass
is the kernels' (``jax.custom_vjp``): the queries' gradients, then the keys', values' and the
``score_mod``'s arrays'; the sinks' from the rows, as on every tiled path.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._block_mask import BlockMask
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result
from jax_sdpa._indices import positions
from jax_sdpa._kernels.calls import backward, forward, paged_forward
from jax_sdpa._kernels.fitting import (
    block_lists,
    fitted,
    for_inputs,
    on_mosaic_gpu,
    padded,
    padded_queries,
)
from jax_sdpa._kernels.mosaic_gpu import MIN_WIDTH, PROGRAM_ROWS
from jax_sdpa._masks import PackedRows
from jax_sdpa._tiles import Tiles, differentiable, masked_past, pad_keys
from jax_sdpa._tiles_backward import backward_rows, sinks_grad
from jax_sdpa._tunables import Pallas

# The most rows ``T·G`` a call's grouped query heads are packed into (a Mosaic GPU consumer's,
# one ``wgmma``'s): past it each head's own rows fill its tiles.
PACKED_ROWS = 64
# Keys per chunk where a few queries' keys are split (about: whole multiples of
# ``CHUNK_MULTIPLE``, the Mosaic GPU kernels' programs of keys).
SPLIT_KEYS, CHUNK_MULTIPLE = 4096, 128


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(tiles: Tiles, tunables: Pallas, query, key, value, arrays: CallArrays, lists, at):
    return _fused_fwd(tiles, tunables, query, key, value, arrays, lists, at)[0]


def _offsets(at) -> tuple:
    """The kernels' offsets: the keys from position ``at`` (a chunk of them), or both from 0."""
    return (0, 0) if at is None else (0, at)


def _fused_fwd(tiles: Tiles, tunables: Pallas, query, key, value, arrays: CallArrays, lists, at):
    offsets = _offsets(at)
    out, lse, top = forward(tiles, tunables, query, key, value, arrays, offsets, lists=lists)
    return (out, lse, top), (query, key, value, arrays, lists, at, out, lse)


def _fused_bwd(tiles: Tiles, tunables: Pallas, residuals: tuple, cotangents: tuple) -> tuple:
    query, key, value, arrays, lists, at, out, lse = residuals
    rows = backward_rows(out, lse, cotangents, tiles.formula.normalizer)
    offsets = _offsets(at)
    grads = backward(tiles, tunables, query, key, value, arrays, rows, offsets, lists=lists)
    operands = (query, key, value, differentiable(arrays.score_consts))
    d_query, d_key, d_value, d_consts = jax.tree.map(
        lambda d, x: d.astype(x.dtype), grads, operands
    )
    d_arrays = CallArrays(score_consts=d_consts, sinks=sinks_grad(arrays.sinks, lse, rows))
    return d_query, d_key, d_value, d_arrays, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Pages:
    """A sequence's keys and values in pages: ``table`` ``(pages,)`` of ``(P, page, K, ·)``."""

    key: jax.Array
    value: jax.Array
    table: jax.Array

    @property
    def length(self) -> int:
        return self.table.shape[0] * self.key.shape[1]

    def gathered(self) -> tuple:
        """The sequence's keys and values, ``(S, K, ·)``: a copy of its pages."""
        return tuple(x[self.table].reshape(-1, *x.shape[2:]) for x in (self.key, self.value))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_pages(tiles: Tiles, tunables: Pallas, query, pages: _Pages, arrays: CallArrays, at):
    return _fused_pages_fwd(tiles, tunables, query, pages, arrays, at)[0]


def _fused_pages_fwd(tiles: Tiles, tunables: Pallas, query, pages: _Pages, arrays, at):
    args = (query, pages.key, pages.value, pages.table, arrays, _offsets(at))
    out, lse, top = paged_forward(tiles, tunables, *args)
    return (out, lse, top), (query, pages, arrays, at, out, lse)


def _fused_pages_bwd(tiles: Tiles, tunables: Pallas, residuals: tuple, cotangents: tuple):
    """:func:`_fused_bwd` on the gathered pages, the keys' and values' gradients added to theirs."""
    query, pages, arrays, at, out, lse = residuals
    key, value = pages.gathered()
    residuals = (query, key, value, arrays, None, at, out, lse)
    d_query, d_key, d_value, d_arrays, _, _ = _fused_bwd(tiles, tunables, residuals, cotangents)

    def added(pool, d):
        d = d.reshape(pages.table.shape[0], *pool.shape[1:])
        return jnp.zeros_like(pool).at[pages.table].add(d)

    d_pages = _Pages(added(pages.key, d_key), added(pages.value, d_value), None)
    return d_query, d_pages, d_arrays, None


_fused_pages.defvjp(_fused_pages_fwd, _fused_pages_bwd)


def pallas_sequence(
    formula: Formula, tunables: Pallas, query, key, value, arrays: CallArrays
) -> Result:
    """The fused kernels on one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values. Decoding (a few queries) is
    shaped for it: grouped query heads packed, each key/value head's ``G`` into one tile's rows
    (:func:`packed`: each key is read once for its group), and the keys split (:func:`_split`)
    where the rows then fit :data:`PACKED_ROWS`.
    """
    return _decoding(formula, tunables, query, (key, value), arrays)


def pallas_paged_sequence(
    formula: Formula, tunables: Pallas, query, key_pages, value_pages, table, arrays: CallArrays
) -> Result:
    """:func:`pallas_sequence` of a sequence in pages: ``table`` ``(pages,)`` of the pools.

    The Mosaic GPU kernel copies each block of keys from its pages, where it takes them
    (:func:`_pages_fit`); any other call gathers the sequence's pages first (a copy). A page
    number outside the pool reads the sequence's first page inside it, as if listed there (its
    keys past the length are masked): never another sequence's page. The gradients are the
    kernels', on the gathered pages.
    """
    inside = (table >= 0) & (table < key_pages.shape[0])
    table = jnp.where(inside, table, table[jnp.argmax(inside)])  # (the first inside)
    pages = _Pages(key_pages, value_pages, table)
    if not _pages_fit(tunables, query, pages):
        return pallas_sequence(formula, tunables, query, *pages.gathered(), arrays)
    return _decoding(formula, tunables, query, pages, arrays)


def _pages_fit(tunables: Pallas, query, pages: _Pages) -> bool:
    """Whether the Mosaic GPU kernel reads these pages.

    Pages of a power of two of at least 16 positions, heads 64, 128 or 256 wide, one 16-bit
    dtype.
    """
    key, value = pages.key, pages.value
    page = key.shape[1]
    return (
        on_mosaic_gpu(for_inputs(tunables, query, key, value))
        and page >= 16
        and page & (page - 1) == 0
        and {query.shape[-1], key.shape[-1], value.shape[-1]} <= {64, 128, 256}
    )


def _decoding(formula: Formula, tunables: Pallas, query, keys, arrays: CallArrays) -> Result:
    """:func:`pallas_sequence` of ``keys``: ``(key, value)`` or :class:`_Pages`."""
    (seq_q, heads, _), kv_heads = query.shape, _keys(keys)[0].shape[-2]
    group = heads // kv_heads
    if not packed(formula, arrays, seq_q, group):
        call = _split if seq_q <= PACKED_ROWS else _sequence
        return call(formula, tunables, query, keys, arrays)

    def rows(x):  # (T, N, ·) → (T·G, K, ·): row t·G + g holds head k·G + g at position t
        x = x.reshape(seq_q, kv_heads, group, -1).swapaxes(1, 2)
        return x.reshape(seq_q * group, kv_heads, -1)

    def heads_of(x):  # its inverse, on (T·G, K, ·)
        x = x.reshape(seq_q, group, kv_heads, -1).swapaxes(1, 2)
        return x.reshape(seq_q, heads, -1)

    rule = None if arrays.rule is None else PackedRows(arrays.rule, group)
    arrays = dataclasses.replace(arrays, rule=rule, head=None)
    out, *per_row = _split(formula, tunables, rows(query), keys, arrays)
    return Result(heads_of(out), *(None if x is None else heads_of(x)[..., 0] for x in per_row))


def _keys(keys) -> tuple:
    """``(key, value)`` of ``keys``, pools of pages for :class:`_Pages`."""
    return (keys.key, keys.value) if isinstance(keys, _Pages) else keys


def packed(formula: Formula, arrays: CallArrays, seq_q: int, group: int) -> bool:
    """Whether a call's query heads are packed by groups into rows (:func:`pallas_sequence`).

    Where ``T·G`` rows fit in :data:`PACKED_ROWS` and nothing differs from one query head to
    another but its queries: no ``score_mod``, sinks, bias, mask array, dropout, sigmoid bias,
    or rule per head (nor a block mask, whose blocks are of positions).
    """
    rule = arrays.rule
    per_head = (formula.score_mod, arrays.sinks, arrays.bias, arrays.mask, arrays.dropout_rng)
    return (
        1 < group
        and seq_q * group <= PACKED_ROWS
        and all(x is None for x in (*per_head, arrays.sigmoid_bias))
        and not (rule is not None and (rule.per_head or isinstance(rule, BlockMask)))
    )


def _split(formula: Formula, tunables: Pallas, query, keys, arrays: CallArrays) -> Result:
    """Split keys ("flash-decoding"): chunks of about :data:`SPLIT_KEYS`, merged.

    Each chunk is attended on its own, all in one kernel (``jax.vmap``: a program per chunk
    too, so that a few sequences still fill the GPU), and their results merged as
    :func:`~jax_sdpa.merge_attention` merges two. Each chunk's output is rounded to the
    values' dtype before the merge. A chunk of pages is whole pages. Not split: sinks (one
    logit per row, not per chunk), a bias or mask array (of all the keys), an opaque rule or a
    block mask (classified and listed from position 0).
    """
    paged, rule = isinstance(keys, _Pages), arrays.rule
    seq_kv = keys.length if paged else keys[0].shape[0]
    multiple = max(CHUNK_MULTIPLE, keys.key.shape[1]) if paged else CHUNK_MULTIPLE
    size = -(-seq_kv // -(-seq_kv // SPLIT_KEYS))  # (chunks of about equal lengths, then whole)
    size = -(-size // multiple) * multiple
    count = -(-seq_kv // size)
    whole = any(x is not None for x in (arrays.sinks, arrays.bias, arrays.mask)) or (
        rule is not None and (rule.opaque or isinstance(rule, BlockMask))
    )
    if count == 1 or whole:
        return _sequence(formula, tunables, query, keys, arrays)
    if paged:  # (the last page repeated, past the length: masked)
        per_chunk = size // keys.key.shape[1]
        table = jnp.pad(keys.table, (0, count * per_chunk - keys.table.shape[0]), mode="edge")
        chunks = dataclasses.replace(keys, table=table.reshape(count, per_chunk))
        axes = _Pages(None, None, 0)
        arrays = arrays if count * size == seq_kv else masked_past(arrays, seq_kv)
    else:
        key, value, arrays = pad_keys(*keys, arrays, count * size)
        chunks, axes = tuple(x.reshape(count, size, *x.shape[1:]) for x in (key, value)), 0

    def chunk(keys, at):
        return _sequence(formula, tunables, query, keys, arrays, at)

    out, lse, _, top = jax.vmap(chunk, in_axes=(axes, 0))(chunks, positions(0, count) * size)
    normalizer = formula.normalizer
    state = online_softmax.combine(normalizer.from_result(out, lse, top))
    out, lse = normalizer.finish(state, out.dtype)
    return Result(out, lse, None, online_softmax.max_scores(state))


def _sequence(
    formula: Formula, tunables: Pallas, query, keys, arrays: CallArrays, at=None
) -> Result:
    """:func:`pallas_sequence`'s call as it is, its keys from position ``at`` (0 if None).

    Padded to whole tiles (:func:`jax_sdpa._kernels.fitting.padded`). An opaque rule is a
    block mask's classes, made once (or read, :func:`jax_sdpa._kernels.fitting.block_lists`),
    and listed: the kernels visit only the blocks it does not exclude. Pages are whole tiles.
    """
    key, value = _keys(keys)
    (seq_q, _, _), value_width = query.shape, value.shape[-1]
    tunables = for_inputs(tunables, query, key, value)
    if isinstance(keys, _Pages):
        logical = jax.ShapeDtypeStruct((keys.length, *key.shape[2:]), key.dtype)
        tiles = fitted(formula, tunables, query, logical)
        query, arrays = padded_queries(query, arrays, PROGRAM_ROWS, MIN_WIDTH)
        out, lse, top = _fused_pages(tiles, tunables, query, keys, arrays, at)
    else:
        tiles = fitted(formula, tunables, query, key)
        query, key, value, arrays = padded(
            tiles, tunables, query, key, value, arrays, 0 if at is None else at
        )
        arrays, lists = block_lists(tiles, tunables, arrays, seq_q, key.shape[0])
        out, lse, top = _fused(tiles, tunables, query, key, value, arrays, lists, at)
    return Result(out[:seq_q, :, :value_width], lse[:seq_q], None, top[:seq_q])
