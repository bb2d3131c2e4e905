r"""Fitting a call to the kernels: their tiles, their inputs' padding, a block mask's lists.

:func:`fitted` fits the tiles to the sequences and :func:`padded` the sequences to the tiles
(whole programs, heads of a width the products take); :func:`for_inputs` picks the kernel the
inputs' dtypes allow; :func:`block_lists` makes an opaque rule a block mask's classes, once, and
the Triton programs' lists of them. :func:`on_mosaic_gpu` says whether the Mosaic GPU kernels
run.
"""

import dataclasses

import jax.numpy as jnp

from jax_sdpa._block_mask import BlockMask, blocked
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import GPU_SIMULATOR
from jax_sdpa._kernels import mosaic_gpu
from jax_sdpa._kernels.programs import BlockLists
from jax_sdpa._latent import LatentValues
from jax_sdpa._quantized import Quantized
from jax_sdpa._tiles import BackwardRows, Tiles, pad_keys
from jax_sdpa._tunables import MIN_SIDE, Pallas


def block_lists(
    tiles: Tiles, tunables: Pallas, arrays: CallArrays, seq_q: int, seq_kv: int
) -> tuple:
    """``(arrays, lists)``: an opaque rule classified once, and the Triton programs' block lists.

    The rule becomes a block mask (:func:`~jax_sdpa._block_mask.blocked`); its lists
    (:class:`BlockLists`) are the Triton programs' where its classes are at ``tiles``. The
    Mosaic GPU kernels list the blocks at their own tiles from classes at any blocks: there a
    :class:`~jax_sdpa.BlockMask` made for these lengths is read as it is, not classified again.
    """
    arrays = blocked(tiles, arrays, seq_q, seq_kv, any_blocks=on_mosaic_gpu(tunables))
    rule = arrays.rule
    at_tiles = isinstance(rule, BlockMask) and (rule.block_q, rule.block_kv) == (
        tiles.block_q,
        tiles.block_kv,
    )
    return arrays, BlockLists.of(rule) if at_tiles else None


def fitted(formula: Formula, tunables: Pallas, query, key, value) -> Tiles:
    """The tiles for ``(T, N, H)`` queries and ``(S, K, H)`` keys (and values).

    ``tunables``' sides, or for a short sequence the power of two ≥ 16 at or above its length;
    the Mosaic GPU kernel's own (:func:`jax_sdpa._kernels.mosaic_gpu.sides`) where it runs, for
    the wider of the queries' and the values' heads.
    """
    (seq_q, heads, width), (seq_kv, kv_heads, _) = query.shape, key.shape
    if on_mosaic_gpu(tunables):
        in_place = mosaic_gpu.reads_in_place(key, value)
        quantized = in_place and any(isinstance(x, Quantized) for x in (key, value))
        latent = in_place and isinstance(value, LatentValues)
        width = max(width, value.features if isinstance(value, LatentValues) else value.shape[-1])
        block_q, block_kv = mosaic_gpu.sides(width, quantized, latent)
        block_kv = _power_of_two(min(block_kv, seq_kv), mosaic_gpu.MIN_WIDTH)
    else:
        block_q, block_kv = _side(seq_q, tunables.block_q), _side(seq_kv, tunables.block_kv)
    return Tiles(formula, block_q, block_kv, (kv_heads, heads // kv_heads), fused=True)


# A side times a head's width of the Triton backward kernels' tiles, at most: their blocks'
# shared memory (compiled for sm_90, whose block has 232,448 bytes: 98,816 at 16 · 1024 and
# 100,352 at 32 · 512, where 32 · 1024 took 198,656 and 64 · 512 294,912).
TRITON_BACKWARD_AREA = 16 * 1024


def backward_tiles(tiles: Tiles, tunables: Pallas, width: int) -> Tiles:
    """The backward kernels' tiles for heads ``width`` wide: the forward's, or narrower.

    Narrower for the Triton kernel's on heads so wide that its blocks would not fit shared
    memory (a shared latent's, 576 padded to 1024: 16 a side).
    """
    side = max(MIN_SIDE, TRITON_BACKWARD_AREA // width)
    if on_mosaic_gpu(tunables) or side >= max(tiles.block_q, tiles.block_kv):
        return tiles
    return dataclasses.replace(
        tiles, block_q=min(tiles.block_q, side), block_kv=min(tiles.block_kv, side)
    )


def for_inputs(tunables: Pallas, query, key, value) -> Pallas:
    """The tunables for these inputs: the Mosaic GPU kernel's products take one 16-bit dtype.

    And heads up to :data:`~jax_sdpa._kernels.mosaic_gpu.MAX_WIDTH` wide, or a shared latent it
    reads in place (:func:`~jax_sdpa._kernels.mosaic_gpu.reads_in_place`). Others (float32,
    wider heads) run the Triton kernel on a GPU, the interpreter in the simulator's place.
    """
    latent_read = reads_latent(tunables, key, value)
    caches = (key,) if isinstance(value, LatentValues) else (key, value)
    dtypes = {jnp.dtype(x.dtype) for x in (query, *caches)}
    sixteen_bits = len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
    narrow = max(x.shape[-1] for x in (query, *caches)) <= mosaic_gpu.MAX_WIDTH
    if not on_mosaic_gpu(tunables) or (sixteen_bits and (narrow or latent_read)):
        return tunables
    return on_triton(tunables)


def on_triton(tunables: Pallas) -> Pallas:
    """``tunables`` for the Triton kernel on a GPU (the interpreter in the simulator's place)."""
    return dataclasses.replace(tunables, backend="triton", interpret=bool(tunables.interpret))


def on_mosaic_gpu(tunables: Pallas) -> bool:
    """Whether the Mosaic GPU kernel runs (on its simulator, or on ``cuda``)."""
    return tunables.backend == "mosaic_gpu" or isinstance(tunables.interpret, GPU_SIMULATOR)


def padded(tiles: Tiles, tunables: Pallas, query, key, value, arrays: CallArrays, kv_offset=0):
    """``(query, key, value, arrays)`` padded to whole tiles, heads to a power of two ≥ 16.

    The padded keys are masked by a length rule (at global positions from ``kv_offset``); the
    padded queries are the caller's to drop; the heads' zeros change no product. For the Mosaic
    GPU kernel, whole programs of queries and of keys (its backward kernels') and heads of a
    power of two ≥ 64, or a shared latent's as they are (:func:`widths`). ``value`` may be a
    :class:`~jax_sdpa.LatentValues`: the keys' first features, whatever their padding.
    """
    multiples, least = (tiles.block_q, tiles.block_kv), MIN_SIDE
    if on_mosaic_gpu(tunables):
        program = mosaic_gpu.PROGRAM_ROWS
        multiples, least = (program, max(program, tiles.block_kv)), mosaic_gpu.MIN_WIDTH
    if isinstance(value, LatentValues) and not reads_latent(tunables, key, value):
        value = value.of(key)  # (a copy: the Mosaic GPU kernel alone reads a latent as it is)
    rows_kv = -(-key.shape[0] // multiples[1]) * multiples[1]
    _, _, arrays = pad_keys(key, value, arrays, multiples[1], kv_offset)
    width, value_width = widths(query, value, least)
    query, arrays = padded_queries(query, arrays, multiples[0], width)
    if not isinstance(value, LatentValues):
        value = _padded_cache(value, rows_kv, value_width)
    return query, _padded_cache(key, rows_kv, width), value, arrays


def widths(query, value, least: int) -> tuple[int, int]:
    """The widths of the kernels' queries and keys, and of their values: their heads padded.

    To a power of two ≥ ``least``; a shared latent's, which the Mosaic GPU kernel reads in place
    (:func:`reads_latent`: whole 64s), as they are.
    """
    if isinstance(value, LatentValues):
        return query.shape[-1], value.features
    return _power_of_two(query.shape[-1], least), _power_of_two(value.shape[-1], least)


def reads_latent(tunables: Pallas, key, value) -> bool:
    """Whether the Mosaic GPU kernel runs and reads ``value``, a shared latent, as it is.

    (:func:`~jax_sdpa._kernels.mosaic_gpu.reads_in_place`.)
    """
    return (
        isinstance(value, LatentValues)
        and on_mosaic_gpu(tunables)
        and mosaic_gpu.reads_in_place(key, value)
    )


def _padded_cache(x, rows: int, width: int):
    """:func:`_pad` of keys or values, quantized (their scale a column: its rows) or not."""
    if isinstance(x, Quantized):
        return Quantized(_pad(x.values, rows, width), _pad(x.scale, rows, 1))
    return _pad(x, rows, width)


def padded_queries(query, arrays: CallArrays, multiple: int, width: int) -> tuple:
    """``(query, arrays)``: whole ``multiple``s of rows, heads ``width`` wide.

    (:func:`padded`'s queries; ``arrays`` with each head's index.)
    """
    if arrays.head is None:
        arrays = dataclasses.replace(arrays, head=jnp.arange(query.shape[1], dtype=INDEX))
    rows = -(-query.shape[0] // multiple) * multiple
    return _pad(query, rows, width), arrays


def padded_rows(rows: BackwardRows, count: int, heads: int, width: int) -> BackwardRows:
    """The queries' backward terms for :func:`padded`'s ``count`` rows and ``width`` values.

    The padded rows get no cotangent and a shift no score reaches (their weights are 0, not
    ``e^{s − 0}``, which a large score would take to ∞ and ∞ · 0 to NaN).
    """
    extra = count - rows.delta.shape[0]
    d_out = rows.d_out.reshape(rows.d_out.shape[0], heads, -1)
    d_out = _pad(d_out, count, width).reshape(count, -1)
    if not extra:
        return BackwardRows(d_out, rows.delta, rows.shift)
    delta = jnp.pad(rows.delta, ((0, extra), (0, 0)))
    far = jnp.finfo(rows.shift.dtype).max
    return BackwardRows(
        d_out, delta, jnp.pad(rows.shift, ((0, extra), (0, 0)), constant_values=far)
    )


def heads_padded(x, width: int):
    """``(r, heads, d)`` with each head zero-padded to ``width``."""
    return _pad(x, x.shape[0], width)


def _pad(x, rows: int, width: int):
    """``(r, heads, d)`` zero-padded to ``(rows, heads, width)`` (as it is, if it is that)."""
    if x.shape[0] == rows and x.shape[2] == width:
        return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, width - x.shape[2])))


def _side(length: int, block: int) -> int:
    """The tile side for ``length`` positions: ``block``, or the power of two ≥ a short one."""
    return min(block, _power_of_two(length))


def _power_of_two(size: int, least: int = MIN_SIDE) -> int:
    """The least power of two ≥ ``size`` and ≥ ``least`` (16: Triton's tiles and heads)."""
    return max(least, 1 << (size - 1).bit_length())
