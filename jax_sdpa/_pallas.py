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
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result
from jax_sdpa._indices import positions
from jax_sdpa._kernels.caches import Pages, cache_forward, key_value, plain
from jax_sdpa._kernels.calls import backward
from jax_sdpa._kernels.fitting import (
    backward_tiles,
    block_lists,
    fitted,
    for_inputs,
    heads_padded,
    on_mosaic_gpu,
    padded,
    padded_queries,
    reads_latent,
    widths,
)
from jax_sdpa._kernels.mosaic_gpu import MIN_WIDTH, PROGRAM_ROWS
from jax_sdpa._latent import LatentValues
from jax_sdpa._quantized import per_token
from jax_sdpa._row_rules import PackedRows
from jax_sdpa._tiles import Tiles, differentiable, masked_past, pad_keys
from jax_sdpa._tiles_backward import backward_rows, define_vjp, sinks_grad
from jax_sdpa._tunables import MIN_SIDE, Pallas

# The most rows ``T·G`` a call's grouped query heads are packed into (a Mosaic GPU program's:
# two consumers of one ``wgmma``'s 64; MLA's 128 heads): past it each head's own rows fill
# its tiles.
PACKED_ROWS = 128
# Keys per chunk where a few queries' keys are split (about: whole multiples of
# ``CHUNK_MULTIPLE``, the Mosaic GPU kernels' programs of keys).
SPLIT_KEYS, CHUNK_MULTIPLE = 4096, 128
# The most rows of a call not packed whose keys are split (one consumer's): more fill programs.
SPLIT_ROWS = 64


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(tiles: Tiles, tunables: Pallas, query, key, value, arrays: CallArrays, lists, at):
    return _fused_fwd(tiles, tunables, query, key, value, arrays, lists, at)[0]


def _offsets(at) -> tuple:
    """The kernels' offsets: the keys from position ``at`` (a chunk of them), or both from 0."""
    return (0, 0) if at is None else (0, at)


def _fused_fwd(tiles: Tiles, tunables: Pallas, query, key, value, arrays: CallArrays, lists, at):
    offsets = _offsets(at)
    out, lse, top = cache_forward(tiles, tunables, query, (key, value), arrays, offsets, lists)
    return (out, lse, top), (query, key, value, arrays, lists, at, out, lse)


def _fused_bwd(tiles: Tiles, tunables: Pallas, residuals: tuple, cotangents: tuple) -> tuple:
    query, key, value, arrays, lists, at, out, lse = residuals
    rows = backward_rows(out, lse, cotangents, tiles.formula.normalizer)
    offsets = _offsets(at)
    # (quantized or a latent's: the kernels' on them widened or sliced, then the widening's)
    caches = (key, value)
    key_b, value_b = plain(caches)
    width = query.shape[-1]
    # (the widths the Mosaic GPU kernels take, or the Triton kernel's: a latent's padded)
    tunables = for_inputs(tunables, query, key_b, value_b)
    wide = widths(query, value_b, MIN_SIDE)[0]
    query_b, key_b = (heads_padded(x, wide) for x in (query, key_b))
    tiles = backward_tiles(tiles, tunables, wide)
    grads = backward(tiles, tunables, query_b, key_b, value_b, arrays, rows, offsets, lists=lists)
    d_query, d_key, d_value, d_consts = grads
    d_query, d_key = (d[..., :width] for d in (d_query, d_key))
    d_query, d_consts = jax.tree.map(
        lambda d, x: d.astype(x.dtype),
        (d_query, d_consts),
        (query, differentiable(arrays)),
    )
    # (from the kernels' sums, in the dtype they accumulate in: a scale's sums its features')
    _, widened = jax.vjp(functools.partial(plain, accumulated=True), caches)
    ((d_key, d_value),) = widened((d_key, d_value))
    d_arrays = CallArrays(score_consts=d_consts, sinks=sinks_grad(arrays.sinks, lse, rows))
    return d_query, d_key, d_value, d_arrays, None, None


define_vjp(_fused, _fused_fwd, _fused_bwd)


def _on_pages(tiles: Tiles, tunables: Pallas, query, pages: Pages, arrays: CallArrays, at):
    """``(out, lse, top)`` of the kernels on ``pages``, differentiable.

    Their gradients are the kernels' on the gathered pages, given to the gather (read by the
    forward pass only when differentiated): its transpose adds them into each pool once,
    however many sequences and chunks the call maps over.
    """
    key, value = pages.gathered()
    return _fused_pages(tiles, tunables, query, key, value, pages, arrays, at)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_pages(tiles: Tiles, tunables: Pallas, query, key, value, pages: Pages, arrays, at):
    return _fused_pages_fwd(tiles, tunables, query, key, value, pages, arrays, at)[0]


def _fused_pages_fwd(tiles: Tiles, tunables: Pallas, query, key, value, pages, arrays, at):
    del key, value  # (the pages are read in the kernel: these carry the gradients)
    out, lse, top = cache_forward(tiles, tunables, query, pages, arrays, _offsets(at))
    return (out, lse, top), (query, pages, arrays, at, out, lse)


def _fused_pages_bwd(tiles: Tiles, tunables: Pallas, residuals: tuple, cotangents: tuple):
    """:func:`_fused_bwd` on the gathered pages."""
    query, pages, arrays, at, out, lse = residuals
    residuals = (query, *pages.gathered(), arrays, None, at, out, lse)
    d_query, d_key, d_value, d_arrays, _, _ = _fused_bwd(tiles, tunables, residuals, cotangents)
    return d_query, d_key, d_value, None, d_arrays, None


define_vjp(_fused_pages, _fused_pages_fwd, _fused_pages_bwd)


def pallas_sequence(
    formula: Formula, tunables: Pallas, query, key, value, arrays: CallArrays
) -> Result:
    """The fused kernels on one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values, either quantized
    (:class:`~jax_sdpa.Quantized`: read as they are by the Mosaic GPU kernel, widened first
    for the others; :func:`~jax_sdpa._kernels.caches.cache_forward`), or the values a shared
    latent's, the keys' first features (:class:`~jax_sdpa.LatentValues`: read with the keys by
    the Mosaic GPU kernel, sliced first for the others). Decoding (a few queries) is shaped for
    it: grouped query heads packed, each key/value head's ``G`` into one tile's rows
    (:func:`packed`: each key is read once for its group; their keys then split,
    :func:`_split`), or the keys split where the rows are at most :data:`SPLIT_ROWS`.
    """
    return _decoding(formula, tunables, query, (per_token(key), per_token(value)), arrays)


def pallas_paged_sequence(
    formula: Formula, tunables: Pallas, query, key_pages, value_pages, table, arrays: CallArrays
) -> Result:
    """:func:`pallas_sequence` of a sequence in pages: ``table`` ``(pages,)`` of the pools.

    Where the pages fit the kernels (:func:`_pages_fit`), the Mosaic GPU kernel copies each
    block of keys from its pages, and the other backends gather each chunk's pages (a copy of
    the chunk); any other call gathers the sequence's pages first (a copy of them all). A page
    number outside the pool reads the sequence's first page inside it, as if listed there (its
    keys past the length are masked): never another sequence's page, where any of its own is in
    the pool (with none, page 0; its length is then 0, and no key is read). The pools may be
    quantized, as :func:`pallas_sequence`'s caches. The gradients are the kernels', on the
    gathered pages.
    """
    count = key_pages.shape[0]
    inside = (table >= 0) & (table < count)
    first = jnp.clip(table[jnp.argmax(inside)], 0, count - 1)  # (the first inside)
    table = jnp.where(inside, table, first)
    pages = Pages(per_token(key_pages), per_token(value_pages), table)
    if not _pages_fit(tunables, query, pages):
        return pallas_sequence(formula, tunables, query, *pages.gathered(), arrays)
    return _decoding(formula, tunables, query, pages, arrays)


def whole_tiles(tunables: Pallas) -> int | None:
    """The positions whose whole multiples a call's bias and mask arrays are padded to, if any.

    A Mosaic GPU program's rows (and its keys', at tiles of up to as many): the kernel reads a
    tile inside a matrix in one load (:func:`~jax_sdpa._formula.read_by_mod`). The other
    kernels read any tile so: no copy.
    """
    return PROGRAM_ROWS if on_mosaic_gpu(tunables) else None


def _pages_fit(tunables: Pallas, query, pages: Pages) -> bool:
    """Whether the kernels read these pages as they are (the Mosaic GPU kernel's blocks of them).

    Pages of a power of two of at least 16 positions, heads 64, 128 or 256 wide, or a shared
    latent that the Mosaic GPU kernel reads (:func:`reads_latent_pools`).
    """
    key, value = pages.key, pages.value
    page = key.shape[1]
    whole = page >= 16 and page & (page - 1) == 0
    if isinstance(value, LatentValues):
        return whole and reads_latent_pools(tunables, query, key, value)
    return whole and {query.shape[-1], key.shape[-1], value.shape[-1]} <= {64, 128, 256}


def reads_latent_pools(tunables: Pallas, query, key_pages, value_pages) -> bool:
    """Whether ``value_pages`` is a shared latent's that the Mosaic GPU kernel reads as it is.

    (For these inputs' backend, :func:`~jax_sdpa._kernels.fitting.for_inputs`.) The paged
    path reads any other latent pool once for both products; the kernels would gather it.
    """
    tunables = for_inputs(tunables, query, key_pages, value_pages)
    return reads_latent(tunables, key_pages, value_pages)


def _decoding(formula: Formula, tunables: Pallas, query, keys, arrays: CallArrays) -> Result:
    """:func:`pallas_sequence` of ``keys``: ``(key, value)`` or :class:`Pages`."""
    (seq_q, heads, _), kv_heads = query.shape, key_value(keys)[0].shape[-2]
    group = heads // kv_heads
    if not packed(formula, arrays, seq_q, group):
        call = _split if seq_q <= SPLIT_ROWS else _sequence
        return call(formula, tunables, query, keys, arrays)

    def rows(x):  # (T, N, ·) → (T·G, K, ·): row t·G + g holds head k·G + g at position t
        x = x.reshape(seq_q, kv_heads, group, -1).swapaxes(1, 2)
        return x.reshape(seq_q * group, kv_heads, -1)

    def heads_of(x):  # its inverse, on (T·G, K, ·)
        x = x.reshape(seq_q, group, kv_heads, -1).swapaxes(1, 2)
        return x.reshape(seq_q, heads, -1)

    rule = None if arrays.rule is None else PackedRows(arrays.rule, group)
    # (the sinks, a logit per query head, met by the unpacked rows)
    packed_arrays = dataclasses.replace(arrays, rule=rule, head=None, sinks=None)
    out, *per_row = _split(formula, tunables, rows(query), keys, packed_arrays)
    result = Result(heads_of(out), *(None if x is None else heads_of(x)[..., 0] for x in per_row))
    if arrays.sinks is None:
        return result
    state = formula.normalizer.from_result(result.out, result.lse, result.max_scores)
    return _finished(formula, state, arrays.sinks, query, result.out.dtype)


def packed(formula: Formula, arrays: CallArrays, seq_q: int, group: int) -> bool:
    """Whether a call's query heads are packed by groups into rows (:func:`pallas_sequence`).

    Where ``T·G`` rows fit in :data:`PACKED_ROWS` and nothing differs from one query head to
    another but its queries (and its sink, met after the rows are unpacked, the rows' output
    then rounded once more to the values' dtype): no ``score_mod`` (the call's bias and mask
    arrays are one: :func:`~jax_sdpa._formula.read_by_mod`), sigmoid bias, or rule per head;
    nor an opaque rule, a block mask's included (it would read its arrays at ``row // G``, not
    at a run of positions, which is all a TPU or the Mosaic GPU kernel loads).
    """
    rule = arrays.rule
    return (
        1 < group
        and seq_q * group <= PACKED_ROWS
        and formula.score_mod is None
        and arrays.sigmoid_bias is None
        and not (rule is not None and (rule.per_head or rule.opaque))
    )


def _split(formula: Formula, tunables: Pallas, query, keys, arrays: CallArrays) -> Result:
    """Split keys ("flash-decoding"): chunks of about :data:`SPLIT_KEYS`, merged.

    Each chunk is attended on its own, all in one kernel (``jax.vmap``: a program per chunk
    too, so that a few sequences still fill the GPU), and their results merged as
    :func:`~jax_sdpa.merge_attention` merges two. Each chunk's output is rounded to the
    values' dtype before the merge; the sinks (one logit a row, not a chunk) are met once, in
    it. A chunk of pages is whole pages. Not split: an opaque rule, a block mask's included
    (classified and listed from position 0).
    """
    paged, rule = isinstance(keys, Pages), arrays.rule
    seq_kv = keys.length if paged else keys[0].shape[0]
    multiple = max(CHUNK_MULTIPLE, keys.key.shape[1]) if paged else CHUNK_MULTIPLE
    size = -(-seq_kv // -(-seq_kv // SPLIT_KEYS))  # (chunks of about equal lengths, then whole)
    size = -(-size // multiple) * multiple
    count = -(-seq_kv // size)
    if count == 1 or (rule is not None and rule.opaque):
        return _sequence(formula, tunables, query, keys, arrays)
    if paged:  # (the last page repeated, past the length: masked)
        chunks = keys.padded(count * size)
        chunks = dataclasses.replace(chunks, table=chunks.table.reshape(count, -1))
        axes = Pages(None, None, 0)
        arrays = arrays if count * size == seq_kv else masked_past(arrays, seq_kv)
    else:
        key, value, arrays = pad_keys(*keys, arrays, count * size)
        chunks, axes = jax.tree.map(lambda x: x.reshape(count, size, *x.shape[1:]), (key, value)), 0

    def chunk(keys, at):  # (the sinks met once, after)
        return _sequence(
            formula, tunables, query, keys, dataclasses.replace(arrays, sinks=None), at
        )

    out, lse, _, top = jax.vmap(chunk, in_axes=(axes, 0))(chunks, positions(0, count) * size)
    state = online_softmax.combine(formula.normalizer.from_result(out, lse, top))
    return _finished(formula, state, arrays.sinks, query, out.dtype)


def _finished(formula: Formula, state, sinks, query, dtype) -> Result:
    """The rows' result in ``dtype`` from their online-softmax ``state``, meeting the ``sinks``.

    ``sinks``: one logit a row (broadcast to its rows), or None.
    """
    if sinks is not None:
        met = online_softmax.init(query, state.denom.shape, state.acc.shape, sinks)
        state = online_softmax.merge(state, met)
    out, lse = formula.normalizer.finish(state, dtype)
    return Result(out, lse, None, online_softmax.max_scores(state))


def _rows_past(arrays: CallArrays, seq_q: int, rows: int) -> CallArrays:
    """``arrays`` with the padding rows past ``seq_q`` masked, where there are any.

    Not where the rule is opaque (a block mask's included): its classes, made once and read as
    lists, would be lost for those of the rules combined.
    """
    rule = arrays.rule
    if rows == seq_q or (rule is not None and rule.opaque):
        return arrays
    return masked_past(arrays, seq_q, queries=True)


def _sequence(
    formula: Formula, tunables: Pallas, query, keys, arrays: CallArrays, at=None
) -> Result:
    """:func:`pallas_sequence`'s call as it is, its keys from position ``at`` (0 if None).

    Padded to whole tiles (:func:`jax_sdpa._kernels.fitting.padded`), the padding rows masked
    (:func:`_rows_past`): a program, or a Mosaic GPU consumer, whose rows are all padding visits
    no block (a decoding call's few rows may fill one consumer's). An opaque
    rule is a block mask's classes, made once (or read,
    :func:`jax_sdpa._kernels.fitting.block_lists`), and listed: the kernels visit only the
    blocks it does not exclude. A sequence's pages are padded to whole programs and tiles.
    """
    key, value = key_value(keys)
    latent = isinstance(value, LatentValues)
    seq_q, value_width = query.shape[0], value.features if latent else value.shape[-1]
    tunables = for_inputs(tunables, query, key, value)
    if isinstance(keys, Pages):  # (whole programs and tiles: the last page repeated, masked)
        length = keys.length
        logical = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((length, *x.shape[2:]), x.dtype), key
        )  # (the sequence's keys: quantized, if the pool is)
        tiles = fitted(formula, tunables, query, logical, keys.value)
        # (sides, programs and pages are powers of two: the largest a multiple of all)
        multiple = max(PROGRAM_ROWS, tiles.block_kv, key.shape[1])
        whole = -(-length // multiple) * multiple
        if whole > length:
            keys = keys.padded(whole)
            arrays = masked_past(arrays, (0 if at is None else at) + length)
        rows = max(PROGRAM_ROWS, tiles.block_q)
        query, arrays = padded_queries(query, arrays, rows, widths(query, value, MIN_WIDTH)[0])
        arrays = _rows_past(arrays, seq_q, query.shape[0])
        out, lse, top = _on_pages(tiles, tunables, query, keys, arrays, at)
    else:
        tiles = fitted(formula, tunables, query, key, value)
        query, key, value, arrays = padded(
            tiles, tunables, query, key, value, arrays, 0 if at is None else at
        )
        arrays = _rows_past(arrays, seq_q, query.shape[0])
        arrays, lists = block_lists(tiles, tunables, arrays, seq_q, key.shape[0])
        out, lse, top = _fused(tiles, tunables, query, key, value, arrays, lists, at)
    return Result(out[:seq_q, :, :value_width], lse[:seq_q], None, top[:seq_q])
