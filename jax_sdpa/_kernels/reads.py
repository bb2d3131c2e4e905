"""Reading the arrays a call closes over inside a kernel: each read at the indices it uses.

A mask rule, a block mask or a ``score_mod`` reads its arrays by value: ``slopes[h]``,
``doc[q_idx]``, ``classes[i, j]``. Traced into a kernel body, those are ``dynamic_slice`` and
``gather`` of whole arrays, which Triton and Mosaic do not lower (they load from memory at an
index, they do not slice registers). :func:`evaluate` runs a function of such arrays with each
array left in memory (a Pallas ref) until it is read: slices, dynamic slices and point gathers
of it become loads at those indices (``ref[pl.ds(h, 1)]``, ``ref[q_idx]``); anything else loads
it whole. Positions are followed from their ``iota`` (a
:class:`~jax_sdpa._kernels.positions.Run`): a read at a tile's positions is one load of a
contiguous window (``ref[pl.ds(q_offset, block_q)]``), which is all a TPU loads (Mosaic has no
load at a vector of indices). The gradients of a ``score_mod``'s arrays are the transposes of
those reads (``scatter-add`` into zeros, placed in a row of a table by
``dynamic_update_slice``), which the kernels do not lower either: they are kept as a
:class:`~jax_sdpa._kernels.scatters.Scatter` of points and updates until read, then spelled as
sums of one-hot products, ``d[m] = Σ_e g_e [idx_e = m]``, for arrays of up to ``ONE_HOT_MAX``
entries, or added into memory at their points by a kernel's ``atomic_add`` (and ``all``, ``any``
of booleans become ``min``, ``max`` of integers).

The function's values are unchanged (out-of-bounds reads are clamped, or filled, as ``lax``
defines them), but for a ``bfloat16`` array's gradient added into ``float32`` memory, which is
summed in ``float32``; only how its reads are spelled is. The interpreter runs the rewritten
program too, so the tests check the values of the program a GPU or TPU is given.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import live
from jax_sdpa._jaxpr import Rules, interpret, table
from jax_sdpa._kernels.positions import POSITIONS, Grid, Run, Uniform, as_window
from jax_sdpa._kernels.scatters import SCATTERS
from jax_sdpa._kernels.values import (
    Expanded,
    Joined,
    Lazy,
    Unread,
    filled,
    in_bounds,
    index_arrays,
    is_zero,
    placed,
    value,
)
from jax_sdpa._kernels.windows import Window, read_tile
from jax_sdpa._masks import all_of


def evaluate(fn, refs: list, *args, dtypes=None, rules=None):
    """``fn(*values of refs, *args)``, each ref read only where and as ``fn`` reads it.

    ``dtypes``: the dtype of each ref's values, where one holds booleans widened
    (:func:`~jax_sdpa._kernels.values.for_mosaic_gpu`); by default the refs'. ``rules``: a backend's
    own rules (:mod:`jax_sdpa._jaxpr`), tried before the others.
    """
    unread = [
        Unread(ref, tuple(pl.ds(0, n) for n in ref.shape), widened=ref.dtype != jnp.bool_ == dtype)
        for ref, dtype in zip(refs, dtypes or [ref.dtype for ref in refs], strict=True)
    ]
    avals = [jax.ShapeDtypeStruct(part.ref.shape, part.dtype) for part in unread]
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*avals, *args)
    rules = Rules(table=table(rules or {}, KERNEL_RULES), array=value)
    jaxpr, inputs = live(closed, [*unread, *jax.tree.leaves(args)])  # (a kernel lowers all)
    outs = interpret(jaxpr, [], inputs, rules)
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


# --- reads of a ref not yet read: loads at the indices they use --------------------------------


def _dynamic_slice(eqn, operands):
    first = operands[0]
    if isinstance(first, Unread):
        return first.narrowed(operands[1:], eqn.params["slice_sizes"])
    return None


def _whole_slice(eqn, operands):  # (JAX before 0.7 writes ``x[:, 0]`` of an (n, 1) array so)
    params = eqn.params
    starts, limits = params["start_indices"], tuple(params["limit_indices"])
    whole = params.get("strides") is None and not any(starts)
    return operands[0] if whole and limits == eqn.invars[0].aval.shape else None


def _slice(eqn, operands):
    first, params = operands[0], eqn.params
    if isinstance(first, Unread) and params.get("strides") is None:
        limits = zip(params["start_indices"], params["limit_indices"], strict=True)
        return first.narrowed(params["start_indices"], [b - a for a, b in limits])
    return None


def _squeeze(eqn, operands):
    first, dimensions = operands[0], eqn.params["dimensions"]
    if isinstance(first, Unread):
        return first.dropped(dimensions)
    if isinstance(first, Expanded):
        return _squeezed(first, dimensions)
    return None


def _reshape(eqn, operands):
    first, params = operands[0], eqn.params
    if isinstance(first, Unread) and _drops_leading_ones(first, params):
        return first.dropped(range(len(first.shape) - len(params["new_sizes"])))
    if isinstance(first, Expanded) and params.get("dimensions") is None:  # (its axes of 1 off)
        return first.value if tuple(params["new_sizes"]) == jnp.shape(first.value) else None
    return None


def _concatenate(eqn, operands):  # a gather's indices, kept apart until it reads them
    if eqn.params["dimension"] == eqn.outvars[0].aval.ndim - 1:
        return Joined(list(operands))
    return None


def _one_slice(eqn, operands):
    """A gather of one slice at one start: ``dynamic_slice`` as JAX 0.12.1 batches it, read so.

    (Its transpose: :func:`jax_sdpa._kernels.scatters._one_slice`.)
    """
    first, numbers = operands[0], eqn.params["dimension_numbers"]
    if not isinstance(first, Unread) or eqn.invars[1].aval.shape != (rank := len(first.shape),):
        return None
    whole = tuple(numbers.offset_dims) == tuple(numbers.start_index_map) == tuple(range(rank))
    clamped = eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP  # (as dynamic_slice)
    if whole and clamped and not (numbers.collapsed_slice_dims or numbers.operand_batching_dims):
        return first.narrowed(index_arrays(operands[1], rank), eqn.params["slice_sizes"])
    return None


def _point_gather_rule(eqn, operands, laid_out=None, tile_read=None):
    first = operands[0]
    if isinstance(first, Unread) and _point_gather(eqn, first):
        return _gather(first, operands[1], eqn.params, laid_out, tile_read)
    return None


READS = {
    "dynamic_slice": (_dynamic_slice,),
    "slice": (_whole_slice, _slice),
    "squeeze": (_squeeze,),
    "reshape": (_reshape,),
    "concatenate": (_concatenate,),
    "gather": (_point_gather_rule, _one_slice),
}


# --- values Triton and Mosaic take otherwise ------------------------------------------------------


def _copied(eqn, operands):  # (``jnp.array(x)``'s, ``jax.nn.gelu``'s: Mosaic GPU has none)
    return operands[0]


def _update_slice(eqn, operands):
    return _updated(*map(value, operands))


def _reduce_booleans(eqn, operands):  # Triton reduces numbers, not booleans
    reduce = lax.reduce_min if eqn.primitive.name == "reduce_and" else lax.reduce_max
    return reduce(value(operands[0]).astype(jnp.int32), eqn.params["axes"]) > 0


VALUES = {
    "copy": (_copied,),
    "dynamic_update_slice": (_update_slice,),
    "reduce_and": (_reduce_booleans,),
    "reduce_or": (_reduce_booleans,),
}

# A kernel's program: the reads of refs first, then positions (a run of them read as one
# window), scatters (kept until read or added into memory), and the values of the rest.
KERNEL_RULES = table(READS, POSITIONS, SCATTERS, VALUES)


def _drops_leading_ones(x: Unread, params) -> bool:
    """Whether a reshape only drops leading axes of size 1."""
    extra = len(x.shape) - len(params["new_sizes"])
    return (
        extra >= 0
        and params.get("dimensions") is None
        and x.shape[:extra] == (1,) * extra
        and x.shape[extra:] == tuple(params["new_sizes"])
    )


def _squeezed(x: Expanded, dimensions):
    trailing = set(range(x.value.ndim, x.value.ndim + x.ones))
    if set(dimensions) == trailing:
        return x.value
    return lax.squeeze(x.read(), dimensions)


def _point_gather(eqn, operand: Unread) -> bool:
    """Whether a gather reads single entries: ``operand[idx[..., 0], idx[..., 1], …]``.

    Its result has the entries' shape (``jnp`` indexing), or that and ``rank`` axes of 1 (a
    mapped index).
    """
    numbers, rank = eqn.params["dimension_numbers"], len(operand.shape)
    out_rank = eqn.outvars[0].aval.ndim
    kept = (not numbers.collapsed_slice_dims) and tuple(numbers.offset_dims) == tuple(
        range(out_rank - rank, out_rank)
    )
    collapsed = tuple(numbers.collapsed_slice_dims) == tuple(range(rank)) and not (
        numbers.offset_dims
    )
    return (
        tuple(eqn.params["slice_sizes"]) == (1,) * rank
        and tuple(numbers.start_index_map) == tuple(range(rank))
        and not numbers.operand_batching_dims
        and (kept or collapsed)
    )


def _gather(operand: Unread, indices, params, laid_out=None, tile_read=None):
    """A point gather: loads at the points (one contiguous load for a run of positions).

    ``laid_out``: a backend's placing of tiles, where it loads no vector of points
    (:func:`looped_gathers`): then a run's values stay a :class:`Window` until they meet a tile;
    ``tile_read``: its read of a 2-D part at a tile's own positions (:func:`_gathered`).
    """
    ones = 0 if params["dimension_numbers"].collapsed_slice_dims else len(operand.shape)
    operand, indices, inside = _indices_taken(operand, indices, any_points=laid_out is not None)
    value = _gathered(operand, indices, params, laid_out, tile_read)
    if inside is not None:
        if isinstance(value, Window):
            value = value.then(lambda x, vectors: filled(x, inside, params))
        else:
            value = filled(value, inside, params)
    if isinstance(value, Window):  # (kept unread: a backend may read it where it meets a tile)
        return value.reshaped(value.shape + (1,) * ones)
    return Expanded(value, ones)


def _indices_taken(operand: Unread, indices, *, any_points: bool = False):
    """A gather at one index along some axes (``t[h, kv_idx]``): a gather of the part there.

    The points along the other axes are positions (one :class:`Run`), or with ``any_points``
    any that are not one index (windows and tiles, on a backend that reads them so).
    ``(operand, indices, inside)``: the operand's part at the indices (clamped), the points,
    and whether the indices lie inside (None if nothing was taken). Any other gather is as given.
    """
    parts = indices.parts if isinstance(indices, Joined) else []
    scalars = {n: part.scalar for n, part in enumerate(parts) if isinstance(part, Uniform)}
    points = [part for part in parts if not isinstance(part, Uniform)]
    taken = any_points or (len(points) == 1 and isinstance(points[0], Run))
    if len(parts) != len(operand.shape) or not (scalars and points and taken):
        return operand, indices, None
    inside = in_bounds(list(scalars.values()), [operand.shape[n] for n in scalars])
    return operand.taken(scalars), points[0] if len(points) == 1 else Joined(points), inside


def _gathered(operand: Unread, indices, params, laid_out=None, tile_read=None):
    """The values of a point gather, before axes of 1 are added.

    ``laid_out``: as :func:`_gather` takes it; a part read at a vector of points (a
    :class:`Window`'s values) or at a tile of points along each axis is then read one entry at
    a time (:func:`_looped`), a 2-D part at the tile's own rows and columns (a bias matrix) by
    ``tile_read(part, runs, params)`` (:func:`~jax_sdpa._kernels.windows.read_tile`).
    """
    rank = len(operand.shape)
    if isinstance(indices, Run):
        run = indices.reshaped(indices.shape[:-1])  # (the indices' last axis, of 1, dropped)
        # (on a backend that loads no vector of points, a run longer than the array too)
        short = laid_out is not None or (run is not None and run.size <= operand.shape[0])
        if rank == 1 and run is not None and run.size > 0 and short:
            window = Window(operand, run, params)
            return window if laid_out is not None else window.read()
        indices = indices.read()  # a run longer than the array
    parts = indices.parts if isinstance(indices, Joined) else [indices]
    windows = [as_window(x) for x in parts] if laid_out is not None else []  # (vectors)
    if len(windows) == rank and all(isinstance(x, Window) for x in windows):
        first, *others = [x.reshaped(x.shape[:-1]) for x in windows]
        if first is not None and all(x is not None and x.shape == first.shape for x in others):
            return first.then(functools.partial(_looked_up, operand, params, others))
    tiles = all(isinstance(x, Expanded) and x.ones == 1 and jnp.ndim(x.value) == 2 for x in parts)
    if laid_out is not None and len(parts) == rank and tiles:
        grids = [part.positions for part in parts]  # (a tile's own positions, where they are)
        points = [part.value for part in parts]  # (tiles of points, as the program made them)
        if tile_read is not None and all(grids) and [grid.axis for grid in grids] == [0, 1]:
            value = tile_read(operand, [grid.run for grid in grids], params)
            return filled(value, in_bounds(points, operand.shape), params)
        if any(grids):  # (a loop over a whole tile's entries)
            _refuse(operand)
        value = _looped(operand, points, laid_out)
    else:
        points = index_arrays(indices, rank)
        if laid_out is not None and any(jnp.ndim(point) for point in points):
            _refuse(operand)
        value = operand.at_points(points)
    return filled(value, in_bounds(points, operand.shape), params)  # (read clamped, then filled)


def _refuse(operand: Unread):
    """The error of a read at points that a backend with no load at a vector of them cannot make."""
    raise NotImplementedError(
        "`Pallas(backend='mosaic_gpu')` reads an array at one index, at positions, at values "
        "computed from them or read at them, or at tiles of points (`slopes[h]`, "
        "`documents[q_idx]`, `bias[q_idx // 64]`, `table[ids[q_idx]]`, "
        "`blocks[q_idx // 64, kv_idx // 64]`, a matrix at the tile's own rows and columns, "
        "`bias[q_idx, kv_idx]`), and this call reads a "
        f"{operand.shape} {jnp.dtype(operand.dtype).name} array at other points (at a tile's "
        "own positions along one axis and at other points along another, as "
        "`table[q_idx // 64, kv_idx]`, or transposed, as `bias[kv_idx, q_idx]`, which would "
        "loop over every entry of the tile; at a vector made by an operation it does not "
        "follow, as `table[jax.lax.clz(q_idx)]`), which it has no load for: use "
        "`Pallas(backend='triton')`."
    )


def refuse_eight_bits(part: Unread) -> None:
    """Mosaic GPU's refusal of an 8-bit array read at a vector or a tile of points."""
    if jnp.dtype(part.ref.dtype).itemsize == 1:  # (booleans are widened: values.widened)
        raise NotImplementedError(
            "`Pallas(backend='mosaic_gpu')` reads no 8-bit array at a vector or a tile of points "
            "(Mosaic GPU computes nothing on a vector of 8-bit values, not even a conversion), "
            f"and this call reads an array of {jnp.dtype(part.ref.dtype).name} so: pass it as "
            "int32 (`ids.astype(jnp.int32)`, outside the function) or use "
            "`Pallas(backend='triton')`."
        )


def _looped(operand: Unread, points: list, laid_out=lambda x: x):
    """``operand[*points]``, a vector or tile of points per axis, each entry they span loaded once.

    ``Σ_e part[e] [clip(points) = e]`` over ``e`` in the box from the points' least to their
    greatest along each axis (``block_q + block_kv − 1`` entries of a table at
    ``q_idx − kv_idx``; one or two of a table at ``q_idx // 64``, or at ``q_idx // 64,
    kv_idx // 64``), as selects; ``laid_out`` places tiles in registers. A loop as long as the
    points' span: ids read from an array that spread widely cost a select per entry between.
    """
    refuse_eight_bits(operand)
    points = [
        laid_out(jnp.clip(part, 0, n - 1).astype(INDEX))
        for part, n in zip(points, operand.shape, strict=True)
    ]
    bounds = [_span(part) for part in points]
    return placed(points, bounds, lambda *e: operand.at_points(list(e)), operand.dtype, laid_out)


def _span(points) -> tuple:
    """``(least, greatest + 1)`` of a vector or a tile of points (a tile's by rows first)."""
    if points.ndim == 2:  # (Mosaic GPU reduces no whole tile)
        return points.min(axis=1).min(), points.max(axis=1).max() + 1
    return points.min(), points.max() + 1


def _looked_up(operand: Unread, params, others: list, points, vectors):
    """``operand[points, *others]`` at vectors of points, in their layout: a window's op.

    (``bias[q_idx // 64]``, ``doc_bias[ids[kv_idx]]``, ``table[q_idx // 64, q_idx % 64]``:
    ``points`` the first window's values, ``others`` the other windows: :func:`_looped`.)
    """
    points = [points, *(x.values(vectors) for x in others)]
    return filled(_looped(operand, points), in_bounds(points, operand.shape), params)


def looped_gathers(laid_out, along, load_tile) -> dict:
    """The rules of a backend that loads no vector of points (Mosaic GPU).

    A part read at a tile of points along each axis, or at a window's values, one entry at a
    time (:func:`_looped`), a 2-D part at a tile's own rows and columns as one window
    (``load_tile`` a 2-D ref's load, ``along(axis)`` the backend's vectors along a tile's axis:
    :func:`~jax_sdpa._kernels.windows.read_tile`); a tile (a tile's positions too) with axes of
    1 added after its own kept as it is (:class:`Expanded`): the points, given as the gather's
    ``(..., 1)`` indices, and a scatter's updates at them (no 3-D tile in a register layout on
    the way).
    """
    tile_read = functools.partial(read_tile, along=along, load=load_tile, laid_out=laid_out)

    def trailing_ones(eqn, operands):
        first, shape = operands[0], tuple(eqn.outvars[0].aval.shape)
        positions = first if isinstance(first, Grid) else None  # (a tile's positions)
        first = first.read() if positions else first
        if isinstance(first, Lazy):
            return None
        rank = jnp.ndim(first)
        ones = len(shape) - rank
        kept = tuple(eqn.params["broadcast_dimensions"]) == tuple(range(rank))
        tile = rank >= 2 and kept and ones and shape == jnp.shape(first) + (1,) * ones
        return Expanded(first, ones, positions) if tile else None

    return {
        "broadcast_in_dim": (_one_entry, trailing_ones),
        "reshape": (_one_entry,),
        "gather": (functools.partial(_point_gather_rule, laid_out=laid_out, tile_read=tile_read),),
    }


def _one_entry(eqn, operands):
    """A scalar made an array of one entry (a gradient's one update), kept a scalar until read.

    (Mosaic GPU holds no array of one entry: :class:`Expanded`.) Zeros are left to be
    :class:`~jax_sdpa._kernels.values.Zeros`.
    """
    first, shape = operands[0], tuple(eqn.outvars[0].aval.shape)
    if isinstance(first, Lazy) or jnp.ndim(first) or is_zero(first) or not shape:
        return None
    return Expanded(first, len(shape)) if all(n == 1 for n in shape) else None


def _updated(operand, update, *starts):
    """``dynamic_update_slice`` of a single entry, as a select against its position."""
    if update.size != 1:
        return lax.dynamic_update_slice(operand, update, starts)
    at = all_of(
        lax.broadcasted_iota(jnp.int32, operand.shape, axis)
        == jnp.clip(start, 0, operand.shape[axis] - 1).astype(jnp.int32)
        for axis, start in enumerate(starts)
    )
    return jnp.where(at, update.reshape(()), operand)
