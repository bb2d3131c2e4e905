r"""The engine's kernels as functions of arrays: layouts, block specs, padding.

:func:`forward` and :func:`backward` call the kernels of :mod:`jax_sdpa._kernels` on
``(T, N, ·)`` queries and ``(S, K, ·)`` keys and values (heads first in_bounds, one program per
head and block), for queries and keys at any global position; :func:`fitted` and
:func:`padded` fit the tiles to the sequences and the sequences to the tiles.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import shaped_like
from jax_sdpa._kernel_scatters import ONE_HOT_MAX
from jax_sdpa._kernels import (
    BlockLists,
    Kernel,
    dkv_kernel,
    dq_kernel,
    forward_kernel,
    shared_arrays,
)
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._tiles import BackwardRows, Tiles, differentiable, pad_keys
from jax_sdpa._tunables import MIN_SIDE, Pallas


def _whole(x):
    """A spec reading all of ``x`` in every program."""
    return pl.BlockSpec(x.shape, lambda n, m: (0,) * x.ndim)


def _block(rows: int, width: int):
    """A spec of ``(heads, rows, width)`` reading program ``(n, m)``'s block ``m`` of head ``n``."""
    return pl.BlockSpec((None, rows, width), lambda n, m: (n, m, 0))


def _head(rows: int, width: int, groups: int = 1, block: bool = False):
    """A spec of ``(heads, rows, width)``: all rows of head ``n // groups``, or block ``m``."""
    return pl.BlockSpec((None, rows, width), lambda n, m: (n // groups, m if block else 0, 0))


def _lse(rows: int, block: bool = True):
    """A spec of ``(heads, T, 1)`` row statistics: block ``m`` of head ``n``, or all of it.

    A column, not a row: TPU blocks end in (a multiple of 8, whole).
    """
    return pl.BlockSpec((None, rows, 1), lambda n, m: (n, m if block else 0, 0))


def _gradient(shape: tuple, shared: bool):
    """A spec of ``(programs…, 1, 1, *shape)`` gradients: program ``(n, m)``'s, or the one shared.

    Two axes of 1 before the array's: TPU blocks end in two whole axes.
    """
    return pl.BlockSpec(
        (None, None, 1, 1, *shape),
        lambda n, m: ((0, 0) if shared else (n, m)) + (0,) * (2 + len(shape)),
    )


def _heads_leading(x):
    """``(T, heads, d)`` → ``(heads, T, d)``; ``(T, heads)`` → ``(heads, T, 1)``."""
    return jnp.swapaxes(x, 0, 1) if x.ndim == 3 else x.T[:, :, None]


def forward(
    tiles: Tiles,
    tunables: Pallas,
    query,
    key,
    value,
    arrays: CallArrays,
    offsets=(0, 0),
    out_dtype=None,
    lists: "BlockLists | None" = None,
):
    """``(out, lse, max_scores)`` of ``(T, N, ·)`` queries against ``(S, K, ·)`` keys.

    The arrays come from :func:`padded`.

    ``offsets``: the global positions of the first query and the first key. With sinks in
    ``arrays``, the rows start from them. ``out`` is in ``out_dtype`` (the values' by default).
    ``lists``: those of the call's block mask (its tiles the kernel's), to visit only its blocks.
    """
    kernel = _kernel(tiles, tunables, query, key, arrays, lists)
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    groups = kernel.group
    inputs = kernel.inputs(arrays, offsets, lists)
    result = functools.partial(shaped_like, like=query)
    call = kernel.call(
        forward_kernel,
        grid=(heads, seq_q // kernel.tiles.block_q),
        in_specs=[
            _block(tiles.block_q, width),
            _head(kernel.seq_kv, width, groups),
            _head(kernel.seq_kv, value_width, groups),
            *map(_whole, inputs),
        ],
        out_specs=[_block(tiles.block_q, value_width), _lse(tiles.block_q), _lse(tiles.block_q)],
        out_shape=[
            result((heads, seq_q, value_width), out_dtype or value.dtype),
            *[result((heads, seq_q, 1), accumulation_dtype(query.dtype))] * 2,
        ],
        name="jax_sdpa_forward",
    )
    out, lse, top = call(*map(_heads_leading, (query, key, value)), *inputs)
    return jnp.swapaxes(out, 0, 1), lse[:, :, 0].T, top[:, :, 0].T


def backward(
    tiles: Tiles,
    tunables: Pallas,
    query,
    key,
    value,
    arrays: CallArrays,
    rows: BackwardRows,
    offsets=(0, 0),
    lists: "BlockLists | None" = None,
) -> tuple:
    """``(dq, dk, dv, d_consts)`` of :func:`forward`'s call, from the rows' backward terms.

    ``rows`` are the queries' :class:`~jax_sdpa._tiles.BackwardRows` (over all the keys the
    rows meet, wherever they are); ``d_consts`` the ``score_mod``'s floating-point arrays'
    gradients (None for the others). All in the accumulation dtype; the sinks' gradient is the
    caller's.
    """
    kernel = _kernel(tiles, tunables, query, key, arrays, lists)
    (seq_q, heads, _), value_width = query.shape, value.shape[-1]
    # (in the values' dtype, which the products cast it to: half the bytes of 16-bit values)
    d_out = rows.d_out.reshape(seq_q, heads, value_width).astype(value.dtype)
    operands = [*map(_heads_leading, (query, key, value, d_out, rows.delta, rows.shift))]
    inputs = kernel.inputs(arrays, offsets, lists)
    consts = [c for c in differentiable(arrays.score_consts) if c is not None]
    dq = _query_gradients(kernel, operands, inputs)
    dk, dv, d_consts = _key_gradients(kernel, operands, inputs, consts)
    groups = kernel.group

    def per_kv_head(d):  # (N, S, d) → (S, K, d), summed over the heads that share one
        return jnp.swapaxes(d.reshape(heads // groups, groups, *d.shape[1:]).sum(1), 0, 1)

    sums = iter(d.sum(axis=(0, 1, 2, 3)) for d in d_consts)
    d_consts = tuple(None if c is None else next(sums) for c in differentiable(arrays.score_consts))
    return jnp.swapaxes(dq, 0, 1), per_kv_head(dk), per_kv_head(dv), d_consts


def _query_gradients(kernel: Kernel, operands: list, inputs: list):
    """The queries' gradients, ``(N, T, H)``: a program per head and query block."""
    query, key, value = operands[:3]
    (heads, seq_q, width), value_width = query.shape, value.shape[-1]
    tiles, groups = kernel.tiles, kernel.group
    (dq,) = kernel.call(
        dq_kernel,
        grid=(heads, seq_q // tiles.block_q),
        in_specs=[
            _block(tiles.block_q, width),
            _head(kernel.seq_kv, width, groups),
            _head(kernel.seq_kv, value_width, groups),
            _block(tiles.block_q, value_width),
            _lse(tiles.block_q),
            _lse(tiles.block_q),
            *map(_whole, inputs),
        ],
        out_specs=[_block(tiles.block_q, width)],
        out_shape=[shaped_like((heads, seq_q, width), accumulation_dtype(query.dtype), query)],
        name="jax_sdpa_backward_queries",
    )(*operands, *inputs)
    return dq


def _key_gradients(kernel: Kernel, operands: list, inputs: list, consts: list):
    """Each query head's key and value gradients ``(N, S, ·)``; per program, ``consts``'.

    ``consts`` are the ``score_mod``'s arrays with gradients; a program per query head and key
    block.
    """
    query, key, value = operands[:3]
    (heads, seq_q, width), value_width = query.shape, value.shape[-1]
    tiles, groups = kernel.tiles, kernel.group
    kv_blocks = kernel.seq_kv // tiles.block_kv
    result = functools.partial(shaped_like, like=query)
    # A gradient per program, or one that all programs add to where it is summed in memory
    # (starting as zeros: an output aliased to an input).
    in_memory = kernel.in_memory
    summed = [n for n, one in enumerate(in_memory) if one]
    d_specs = [_gradient(c.shape, one) for c, one in zip(consts, in_memory, strict=True)]
    d_shapes = [
        result(
            ((1, 1) if one else (heads, kv_blocks)) + (1, 1, *c.shape), accumulation_dtype(c.dtype)
        )
        for c, one in zip(consts, in_memory, strict=True)
    ]
    zeros = [jnp.zeros(d_shapes[n].shape, d_shapes[n].dtype) for n in summed]
    zeros_at = len(operands) + len(inputs)  # the first aliased zeros input
    dk, dv, *d_consts = kernel.call(
        dkv_kernel,
        grid=(heads, kv_blocks),
        in_specs=[
            _head(seq_q, width),
            _head(tiles.block_kv, width, groups, block=True),
            _head(tiles.block_kv, value_width, groups, block=True),
            _head(seq_q, value_width),
            _lse(seq_q, block=False),
            _lse(seq_q, block=False),
            *map(_whole, inputs),
            *(d_specs[n] for n in summed),
        ],
        out_specs=[_block(tiles.block_kv, width), _block(tiles.block_kv, value_width), *d_specs],
        out_shape=[
            result((heads, kernel.seq_kv, width), accumulation_dtype(key.dtype)),
            result((heads, kernel.seq_kv, value_width), accumulation_dtype(value.dtype)),
            *d_shapes,
        ],
        aliases={zeros_at + k: 2 + n for k, n in enumerate(summed)},
        name="jax_sdpa_backward_keys",
    )(*operands, *inputs, *zeros)
    return dk, dv, d_consts


def _kernel(tiles: Tiles, tunables: Pallas, query, key, arrays: CallArrays, lists) -> Kernel:
    leaves, shared = jax.tree.flatten(shared_arrays(arrays, (0, 0), lists))
    return Kernel(
        tiles,
        tunables,
        query.shape[0],
        key.shape[0],
        shared,
        tuple(jnp.shape(x) for x in leaves),
        arrays.sinks is not None,
        tuple(c.size > ONE_HOT_MAX for c in differentiable(arrays.score_consts) if c is not None),
    )


def fitted(formula: Formula, tunables: Pallas, query, key) -> Tiles:
    """The tiles for ``(T, N, H)`` queries and ``(S, K, H)`` keys.

    ``tunables``' sides, or for a short sequence the power of two ≥ 16 at or above its length.
    """
    (seq_q, heads, _), (seq_kv, kv_heads, _) = query.shape, key.shape
    block_q, block_kv = _side(seq_q, tunables.block_q), _side(seq_kv, tunables.block_kv)
    return Tiles(formula, block_q, block_kv, (kv_heads, heads // kv_heads), fused=True)


def padded(tiles: Tiles, query, key, value, arrays: CallArrays, kv_offset=0) -> tuple:
    """``(query, key, value, arrays)`` padded to whole tiles and heads of a power of two ≥ 16.

    The padded keys are masked by a length rule (at global positions from ``kv_offset``); the
    padded queries are the caller's to drop; the heads' zeros change no product.
    """
    rows_q = -(-query.shape[0] // tiles.block_q) * tiles.block_q
    rows_kv = -(-key.shape[0] // tiles.block_kv) * tiles.block_kv
    _, _, arrays = pad_keys(key, value, arrays, tiles.block_kv, kv_offset)
    if arrays.head is None:
        heads = jnp.arange(query.shape[1], dtype=INDEX)
        arrays = dataclasses.replace(arrays, head=heads)
    width = _power_of_two(query.shape[-1])
    return (
        _pad(query, rows_q, width),
        _pad(key, rows_kv, width),
        _pad(value, rows_kv, _power_of_two(value.shape[-1])),
        arrays,
    )


def padded_rows(rows: BackwardRows, count: int, heads: int, width: int) -> BackwardRows:
    """The queries' backward terms for :func:`padded`'s ``count`` rows and ``width`` values.

    The padded rows get no cotangent and a shift no score reaches (their weights are 0, not
    ``e^{s − 0}``, which a large score would take to ∞ and ∞ · 0 to NaN).
    """
    extra = count - rows.delta.shape[0]
    d_out = rows.d_out.reshape(rows.d_out.shape[0], heads, -1)
    d_out = _pad(d_out, count, width).reshape(count, -1)
    delta = jnp.pad(rows.delta, ((0, extra), (0, 0)))
    far = jnp.finfo(rows.shift.dtype).max
    return BackwardRows(
        d_out, delta, jnp.pad(rows.shift, ((0, extra), (0, 0)), constant_values=far)
    )


def _pad(x, rows: int, width: int):
    """``(r, heads, d)`` zero-padded to ``(rows, heads, width)``."""
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, width - x.shape[2])))


def _side(length: int, block: int) -> int:
    """The tile side for ``length`` positions: ``block``, or the power of two ≥ a short one."""
    return min(block, _power_of_two(length))


def _power_of_two(size: int) -> int:
    """The least power of two ≥ ``size`` and ≥ 16 (Triton's tiles and heads)."""
    return max(MIN_SIDE, 1 << (size - 1).bit_length())
