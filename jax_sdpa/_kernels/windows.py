"""Values at a run of positions, kept as a :class:`Window` until read: a vector along one axis.

A 1-D part of a ref read at a run (``documents[q_idx]``) is one load of a contiguous window
(all a TPU loads), or at a run that leaves the part (a tile past the end of a sequence)
windows picked from, or with a backend's vectors (Mosaic GPU) one entry at a time; the run's
own positions are one too, where an operation keeps them no run (``q_idx // 64``).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import as_computed
from jax_sdpa._kernels.values import Pending, Unread, filled, in_bounds, placed
from jax_sdpa._masks import all_of


@dataclasses.dataclass(frozen=True)
class Vectors:
    """How a backend holds a vector along one axis of a tile, where it gives the axes layouts.

    ``load(part)``: a window of memory (an :class:`Unread`) as such a vector; ``iota(count)``:
    ``0 … count − 1`` as one; ``refuse(part)`` raises where the backend reads no vector of the
    part's dtype (asked of every part read so, one read entry by entry too).
    """

    load: Callable
    iota: Callable
    refuse: Callable = lambda part: None


@dataclasses.dataclass(frozen=True)
class Window(Pending):
    """``part[run]`` of a 1-D part of a ref, not read yet, then ``ops`` on it: values at positions.

    ``params``: the gather's (its mode and fill). Read whole where the program needs it; a
    backend whose tiles' axes have their own layouts reads it where it meets a tile, along the
    axis it lies on (:func:`~jax_sdpa._kernels.positions.tile_positions`), the elementwise
    ``ops`` (with scalars, or other windows of the same shape, each read at its own run, or an
    array read at the values: :mod:`~jax_sdpa._kernels.reads`) on the way kept until then.
    ``run``: a :class:`~jax_sdpa._kernels.positions.Run`. With no ``part``
    (:meth:`positions`), the values are the run's positions.
    """

    part: Unread | None
    run: Any
    params: Any = None
    ops: tuple = ()

    @classmethod
    def positions(cls, run) -> "Window":
        """A run's own positions as a window: a run an operation keeps no run (``q_idx // 64``)."""
        return cls(None, run)

    @property
    def shape(self) -> tuple:
        return self.run.shape

    def values(self, vectors: Vectors | None = None):
        """The values as a vector (in ``vectors``' layout if given), ``ops`` applied.

        (Each op is ``op(values, vectors)``: an op that reads other windows reads them so.)
        """
        if self.part is not None:
            return self.applied(read_run(self.part, self.run, self.params, vectors), vectors)
        count = self.run.size
        iota = lax.iota(self.run.base.dtype, count) if vectors is None else vectors.iota(count)
        return self.applied(self.run.at(iota.astype(self.run.base.dtype)), vectors)

    def applied(self, values, vectors: Vectors | None = None):
        """``values`` with ``ops`` applied, each ``op(values, vectors)``."""
        for op in self.ops:
            values = op(values, vectors)
        return values

    def read(self):
        return self.values().reshape(self.shape)

    def broadcast(self, shape: tuple, axis: int, vectors: Vectors):
        """The values (in ``vectors``' layout) along ``axis`` of ``shape``: over a whole tile."""
        return lax.broadcast_in_dim(self.values(vectors), shape, (axis,))

    def reshaped(self, shape: tuple) -> "Window | None":
        run = self.run.reshaped(shape)
        return None if run is None else dataclasses.replace(self, run=run)


def read_run(operand: Unread, run, params, vectors: Vectors | None = None):
    """``operand[run]`` of a 1-D part, a vector: one load of a window where the run lies inside.

    (``run``: a :class:`~jax_sdpa._kernels.positions.Run`.) That is what a TPU loads (it has no
    load at a vector of indices) and the common case: the positions of a tile. A run that leaves
    the part (a tile past the end of a sequence, or of a part shorter than a tile) is read by
    :func:`_windowed`, or with ``vectors`` one entry at a time (a tile's edge), equal to the
    gather's clamped or filled values.
    """
    (length,), count = operand.shape, run.size
    if vectors is not None:
        vectors.refuse(operand)
    start = _start(run)

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
        return filled(value, in_bounds([points], operand.shape), params)

    def window():  # (typed as computed values are, as the other branch's: a load keeps vma)
        part = operand.narrowed([start], [count])
        return part.read() if vectors is None else as_computed(vectors.load(part))

    if count > length:  # (no window of the run fits in the part)
        return outside()
    return lax.cond(_inside([start], [count], [length]), window, outside)


def read_tile(operand: Unread, runs: list, params, along: Callable, load: Callable, laid_out):
    """``operand[rows, columns]`` of a 2-D part at a tile's own positions (``bias[q_idx, kv_idx]``).

    (``runs``: the rows' and the columns' :class:`~jax_sdpa._kernels.positions.Run`.) One load
    of a 2-D window where both runs lie inside (``load``: a backend's, of a 2-D ref in its
    tiles' layout); a tile at an edge (past the end of a sequence, or of a part shorter than a
    tile) row by row, each row's values a vector along the columns (``along(1)``'s,
    :func:`read_run`) placed by a select (``laid_out``: the backend's placing of a tile), the
    rows clamped into the part, as the gather's. A part whose axes are not the ref's last two
    (``bias[q_idx, kv_idx, h]``: a window strided along its rows) is read row by row too.
    """
    along(1).refuse(operand)
    shape = tuple(run.size for run in runs)
    starts = [_start(run) for run in runs]

    def window():
        part = operand.narrowed(starts, shape)
        return as_computed(part.loaded(load(part.ref.at[part.index])))

    def by_rows():
        rows, columns = runs
        at_row = laid_out(lax.broadcasted_iota(INDEX, shape, 0))

        def row(r, tile):
            values = Window(operand.taken({0: rows.at(r.astype(rows.base.dtype))}), columns, params)
            return laid_out(jnp.where(at_row == r, values.broadcast(shape, 1, along(1)), tile))

        empty = laid_out(jnp.zeros(shape, operand.dtype))
        return lax.fori_loop(INDEX(0), INDEX(shape[0]), row, empty)

    last_two = operand.kept() == [len(operand.ref.shape) - 2, len(operand.ref.shape) - 1]
    if not last_two or any(n > length for n, length in zip(shape, operand.shape, strict=True)):
        return by_rows()
    return lax.cond(_inside(starts, shape, operand.shape), window, by_rows)


def _start(run):
    """Where a run's window starts: a run wholly below 0 wraps whole, a window too."""
    if run.wrap is None:
        return run.start
    return jnp.where(run.start + run.size <= 0, run.start + run.wrap, run.start)


def _inside(starts: list, counts: list, lengths: list):
    """Whether windows of ``counts`` at ``starts`` lie inside ``lengths``, along each axis."""
    return all_of(
        (start >= 0) & (start <= length - count)
        for start, count, length in zip(starts, counts, lengths, strict=True)
    )


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
