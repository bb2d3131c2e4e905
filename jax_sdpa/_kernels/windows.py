"""Values of a 1-D part of a ref at a run of positions: one window of it where the run lies inside.

:class:`~jax_sdpa._kernels.positions.Window` reads its values here: one load of a contiguous
window (all a TPU loads), or at a run that leaves the part (a tile past the end of a
sequence) windows picked from, or with a backend's vectors (Mosaic GPU) one entry at a time.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import as_computed
from jax_sdpa._kernels.values import Unread, fill_value, in_bounds, placed


@dataclasses.dataclass(frozen=True)
class Vectors:
    """How a backend holds a vector along one axis of a tile, where it gives the axes layouts.

    ``load(part)``: a window of memory (an :class:`Unread`) as such a vector; ``iota(count)``:
    ``0 … count − 1`` as one.
    """

    load: Callable
    iota: Callable


def read_run(operand: Unread, run, params, vectors: Vectors | None = None):
    """``operand[run]`` of a 1-D part, a vector: one load of a window where the run lies inside.

    (``run``: a :class:`~jax_sdpa._kernels.positions.Run`.) That is what a TPU loads (it has no
    load at a vector of indices) and the common case: the positions of a tile. A run that leaves
    the part (a tile past the end of a sequence, or of a part shorter than a tile) is read by
    :func:`_windowed`, or with ``vectors`` one entry at a time (a tile's edge), equal to the
    gather's clamped or filled values.
    """
    (length,), count = operand.shape, run.size
    start = run.start
    if run.wrap is not None:  # (a run wholly below 0 wraps whole: a window too)
        start = jnp.where(start + count <= 0, start + run.wrap, start)

    def outside():
        if vectors is None:
            points = run.read().reshape(count)
            value = _windowed(operand, jnp.clip(points, 0, length - 1))
        else:
            iota = vectors.iota(count)
            points = run.at(iota)

            def load(n):  # (its point clamped into the part, as the other reads are)
                return operand.at_points([run.at(n.astype(run.base.dtype))])

            value = placed([iota], [(INDEX(0), INDEX(count))], load, operand.dtype)
        if params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
            fill = fill_value(params["fill_value"], value.dtype)
            value = jnp.where(in_bounds([points], operand.shape), value, fill)
        return value

    def window():  # (typed as computed values are, as the other branch's: a load keeps vma)
        part = operand.narrowed([start], [count])
        return part.read() if vectors is None else as_computed(vectors.load(part))

    if count > length:  # (no window of the run fits in the part)
        return outside()
    within = (start >= 0) & (start <= length - count)
    return lax.cond(within, window, outside)


def _windowed(operand: Unread, points):
    """``operand[points]`` of a 1-D part, points inside it: picked from windows of loads.

    Each point lies in one window: its entry is picked by a max over the window (the others at
    the dtype's least), which keeps every value as it is (−0, NaN, ∞).
    """
    (length,), count = operand.shape, points.size
    size = min(count, length)  # a window's (one window of a part shorter than the points)
    wide = jnp.int32 if operand.dtype == jnp.bool_ else operand.dtype
    floating = jnp.issubdtype(wide, jnp.floating)
    least = jnp.asarray(-jnp.inf if floating else jnp.iinfo(wide).min, wide)

    def window(c, value):
        lo = jnp.minimum(c * size, length - size)  # the last window overlaps the one before
        entries = operand.narrowed([lo], [size]).read().astype(wide)
        at = lo + lax.broadcasted_iota(points.dtype, (1, size), 1)
        hits = (points[:, None] == at) & (at >= c * size)
        picked = jnp.where(hits, entries[None, :], least).max(axis=1)
        found = hits.astype(jnp.int32).max(axis=1) > 0  # (Triton reduces no booleans)
        return jnp.where(found, picked, value)

    windows = INDEX(-(-length // size))  # int32 under x64 too: Mosaic has no int64
    value = lax.fori_loop(INDEX(0), windows, window, jnp.full(count, least))
    return value.astype(operand.dtype)
