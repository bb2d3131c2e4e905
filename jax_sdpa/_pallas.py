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

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._block_mask import BlockMask
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result
from jax_sdpa._indices import positions
from jax_sdpa._kernels.calls import backward, forward
from jax_sdpa._kernels.fitting import block_lists, fitted, for_inputs, padded
from jax_sdpa._masks import PackedRows
from jax_sdpa._tiles import Tiles, differentiable, pad_keys
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


def pallas_sequence(
    formula: Formula, tunables: Pallas, query, key, value, arrays: CallArrays
) -> Result:
    """The fused kernels on one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values. Decoding (a few queries) is
    shaped for it: grouped query heads packed, each key/value head's ``G`` into one tile's rows
    (:func:`packed`: each key is read once for its group), and the keys split (:func:`_split`)
    where the rows then fit :data:`PACKED_ROWS`.
    """
    (seq_q, heads, _), kv_heads = query.shape, key.shape[1]
    group = heads // kv_heads
    if not packed(formula, arrays, seq_q, group):
        call = _split if seq_q <= PACKED_ROWS else _sequence
        return call(formula, tunables, query, key, value, arrays)

    def rows(x):  # (T, N, ·) → (T·G, K, ·): row t·G + g holds head k·G + g at position t
        x = x.reshape(seq_q, kv_heads, group, -1).swapaxes(1, 2)
        return x.reshape(seq_q * group, kv_heads, -1)

    def heads_of(x):  # its inverse, on (T·G, K, ·)
        x = x.reshape(seq_q, group, kv_heads, -1).swapaxes(1, 2)
        return x.reshape(seq_q, heads, -1)

    rule = None if arrays.rule is None else PackedRows(arrays.rule, group)
    arrays = dataclasses.replace(arrays, rule=rule, head=None)
    out, *per_row = _split(formula, tunables, rows(query), key, value, arrays)
    return Result(heads_of(out), *(None if x is None else heads_of(x)[..., 0] for x in per_row))


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


def _split(formula: Formula, tunables: Pallas, query, key, value, arrays: CallArrays):
    """Split keys ("flash-decoding"): chunks of about :data:`SPLIT_KEYS`, merged.

    Each chunk is attended on its own, all in one kernel (``jax.vmap``: a program per chunk
    too, so that a few sequences still fill the GPU), and their results merged as
    :func:`~jax_sdpa.merge_attention` merges two. Each chunk's output is rounded to the
    values' dtype before the merge. Not split: sinks (one logit per row, not per chunk), a
    bias or mask array (of all the keys), an opaque rule or a block mask (classified and listed
    from position 0).
    """
    seq_kv, rule = key.shape[0], arrays.rule
    size = -(-seq_kv // -(-seq_kv // SPLIT_KEYS))  # (chunks of about equal lengths, then whole)
    size = -(-size // CHUNK_MULTIPLE) * CHUNK_MULTIPLE
    count = -(-seq_kv // size)
    whole = any(x is not None for x in (arrays.sinks, arrays.bias, arrays.mask)) or (
        rule is not None and (rule.opaque or isinstance(rule, BlockMask))
    )
    if count == 1 or whole:
        return _sequence(formula, tunables, query, key, value, arrays)
    key, value, arrays = pad_keys(key, value, arrays, count * size)

    def chunk(key, value, at):
        return _sequence(formula, tunables, query, key, value, arrays, at)

    chunks = (x.reshape(count, size, *x.shape[1:]) for x in (key, value))
    out, lse, _, top = jax.vmap(chunk)(*chunks, positions(0, count) * size)
    normalizer = formula.normalizer
    state = online_softmax.combine(normalizer.from_result(out, lse, top))
    out, lse = normalizer.finish(state, out.dtype)
    return Result(out, lse, None, online_softmax.max_scores(state))


def _sequence(
    formula: Formula, tunables: Pallas, query, key, value, arrays: CallArrays, at=None
) -> Result:
    """:func:`pallas_sequence`'s call as it is, its keys from position ``at`` (0 if None).

    Padded to whole tiles (:func:`jax_sdpa._kernels.fitting.padded`). An opaque rule is a
    block mask's classes, made once (or read, :func:`jax_sdpa._kernels.fitting.block_lists`),
    and listed: the kernels visit only the blocks it does not exclude.
    """
    (seq_q, _, _), value_width = query.shape, value.shape[-1]
    tunables = for_inputs(tunables, query, key, value)
    tiles = fitted(formula, tunables, query, key)
    query, key, value, arrays = padded(
        tiles, tunables, query, key, value, arrays, 0 if at is None else at
    )
    arrays, lists = block_lists(tiles, tunables, arrays, seq_q, key.shape[0])
    out, lse, top = _fused(tiles, tunables, query, key, value, arrays, lists, at)
    return Result(out[:seq_q, :, :value_width], lse[:seq_q], None, top[:seq_q])
