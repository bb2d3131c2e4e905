"""Values of a kernel's rewritten program (:mod:`jax_sdpa._kernels.reads`) not arrays yet.

A :class:`Lazy` value stands for an array the program has not needed whole: part of a ref not
yet read (:class:`Unread`), the parts of a gather's indices (:class:`Joined`), positions
(:mod:`jax_sdpa._kernels.positions`), a scatter not yet done (:mod:`jax_sdpa._kernels.scatters`).
:func:`value` reads one where an array is needed. Here too the helpers every rewrite shares.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jax_sdpa._masks import all_of


class Lazy:
    """A value kept unread until :meth:`read` is needed (:func:`value`)."""

    def read(self):
        raise NotImplementedError


class Pending(Lazy):
    """A lazy vector with elementwise operations (its dataclass field ``ops``) still to apply."""

    def then(self, op):
        """The value with the elementwise ``op`` applied after its ``ops``."""
        return dataclasses.replace(self, ops=(*self.ops, op))

    def applied(self, x):
        """``x`` (the vector) with ``ops`` applied."""
        for op in self.ops:
            x = op(x)
        return x


@dataclasses.dataclass(frozen=True)
class Expanded(Lazy):
    """``value`` with ``ones`` trailing axes of size 1 still to add.

    A point gather's result, a tile of points made a gather's indices, a scatter's one update
    (:func:`~jax_sdpa._kernels.reads.looped_gathers`: Mosaic GPU has no array of one entry).
    ``positions``: the value is a tile's own positions along one axis, as they are: their
    :class:`~jax_sdpa._kernels.positions.Grid`.
    """

    value: Any
    ones: int
    positions: Any = None

    def read(self):  # (``jnp``'s: a NumPy scalar's would be a constant the kernel captures)
        if not self.ones:
            return self.value
        return jnp.reshape(self.value, jnp.shape(self.value) + (1,) * self.ones)


@dataclasses.dataclass(frozen=True)
class Zeros(Lazy):
    """A broadcast zero, kept until read: a scatter into it needs no dense add (``scatters``)."""

    shape: tuple
    dtype: Any

    def read(self):
        return jnp.zeros(self.shape, self.dtype)


def for_mosaic_gpu(x):
    """``x`` as a Mosaic GPU kernel holds it: booleans as ``int32``, float64 as float32.

    Mosaic GPU loads no vector of bits (a ``widened`` :class:`Unread` reads them back) and
    computes no float64: its programs compute the user's functions' float64 as float32
    (:func:`~jax_sdpa._user_functions.float64_as_float32`).
    """
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32)
    return x.astype(jnp.float32) if x.dtype == jnp.float64 else x


def value(x):
    """``x`` as an array: read if it is :class:`Lazy`."""
    return x.read() if isinstance(x, Lazy) else x


@dataclasses.dataclass(frozen=True)
class Unread(Lazy):
    """Part of a ref not yet read: one index per axis, a ``pl.ds`` or a scalar (dropped axis).

    ``widened``: the program's values are booleans that the ref holds as ``int32`` (Mosaic GPU
    loads no vector of bits: :func:`for_mosaic_gpu`); each read gives them back (:meth:`loaded`).
    """

    ref: Any
    index: tuple
    widened: bool = False

    @property
    def shape(self) -> tuple:
        return tuple(i.size for i in self.index if isinstance(i, pl.Slice))

    @property
    def dtype(self):
        """The dtype of the values the program reads."""
        return jnp.dtype(jnp.bool_) if self.widened else self.ref.dtype

    def loaded(self, x):
        """``x``, loaded from the ref, as the program's values."""
        return x != 0 if self.widened else x

    def read(self):
        return self.loaded(self.ref[self.index])

    def kept(self) -> list[int]:
        """The ref's axes this part still has, in order."""
        return [n for n, i in enumerate(self.index) if isinstance(i, pl.Slice)]

    def narrowed(self, starts, sizes) -> "Unread":
        """The part ``[starts : starts + sizes]`` of this one, starts clamped as ``lax``'s."""
        index = list(self.index)
        for axis, start, size, length in zip(self.kept(), starts, sizes, self.shape, strict=True):
            start = jnp.clip(value(start), 0, length - size)
            index[axis] = pl.ds(index[axis].start + start, size)
        return dataclasses.replace(self, index=tuple(index))

    def dropped(self, dimensions) -> "Unread":
        """This part without its axes ``dimensions`` (each of size 1): they become scalars."""
        index = list(self.index)
        for position in dimensions:
            axis = self.kept()[position]
            index[axis] = index[axis].start
        return dataclasses.replace(self, index=tuple(index))

    def taken(self, scalars: dict):
        """This part with its kept axes ``scalars`` (positions among them) read at one index.

        Each index is clamped into the part (as a ``CLIP`` gather).
        """
        index, kept = list(self.index), self.kept()
        for position, scalar in scalars.items():
            axis, length = kept[position], self.shape[position]
            index[axis] = index[axis].start + jnp.clip(scalar, 0, length - 1)
        return dataclasses.replace(self, index=tuple(index))

    def at_points(self, points: list):
        """``part[points[0], points[1], …]`` of equal-shape index arrays, one per kept axis.

        Each is clamped into the part (as a ``CLIP`` gather): no read leaves it.
        """
        index = list(self.index)
        for axis, point, length in zip(self.kept(), points, self.shape, strict=True):
            index[axis] = index[axis].start + jnp.clip(point, 0, length - 1)
        return self.loaded(self.ref[tuple(index)])


@dataclasses.dataclass(frozen=True)
class Joined(Lazy):
    """``concatenate(parts, axis=-1)`` of gather indices, kept apart until the gather reads them.

    Each part stays as the program left it (positions, one index at every point), so that a
    gather can read along one axis at positions and along the others at one index.
    """

    parts: list

    def read(self):
        return jnp.concatenate([value(part) for part in self.parts], axis=-1)


def is_zero(x) -> bool:
    """Whether ``x`` is a known (not traced) scalar ``+0``: a literal or a constant."""
    if isinstance(x, (jax.core.Tracer, Lazy)):
        return False
    x = np.asarray(x)
    return x.ndim == 0 and bool(x == 0) and not np.signbit(x)


def in_bounds(points: list, shape: tuple):
    return all_of((p >= 0) & (p < n) for p, n in zip(points, shape, strict=True))


def filled(x, inside, params):
    """``x`` where ``inside``; elsewhere a gather's fill, where the gather (``params``) fills."""
    if params["mode"] != lax.GatherScatterMode.FILL_OR_DROP:
        return x
    return jnp.where(inside, x, fill_value(params["fill_value"], x.dtype))


def fill_value(fill, dtype):
    """``lax.gather``'s fill for out-of-bounds points: given, or its default for ``dtype``."""
    if fill is not None:
        return jnp.asarray(fill, dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.asarray(True)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if jnp.issubdtype(dtype, jnp.signedinteger) else info.max, dtype)


def index_arrays(indices, rank: int) -> list:
    """The ``rank`` index arrays of a point gather's ``(..., rank)`` indices.

    Where the program built them by concatenation, its parts: a kernel reshapes, it does not
    slice.
    """
    parts = indices.parts if isinstance(indices, Joined) else [indices]
    if len(parts) == rank and all(_one_index(part) for part in parts):  # (kept so: Expanded)
        return [part.value for part in parts]
    parts = [value(part) for part in parts]
    if len(parts) == rank and all(part.shape[-1] == 1 for part in parts):
        return [part.reshape(part.shape[:-1]) for part in parts]
    indices = value(indices)
    return [indices[..., n] for n in range(rank)]


def _one_index(part) -> bool:
    """Whether a part of a gather's indices is a scalar index with its axis of 1 still to add."""
    return isinstance(part, Expanded) and part.ones == 1 and not jnp.ndim(part.value)


def placed(selectors: list, bounds: list, load, dtype, laid_out=lambda x: x):
    """``load(*e)`` placed wherever ``selectors`` (one per axis) are ``e``; elsewhere 0.

    For each ``e`` in the box ``bounds`` (a ``(lo, hi)`` per axis): loops of scalar loads, each
    placed by a select, a read at a vector or tile of points on a backend that has no load at
    one (Mosaic GPU). ``laid_out`` places each step's tile.
    """

    def loop(axis: int, at: tuple, hit, x):
        def entry(e, x):
            here = selectors[axis] == e
            here = here if hit is None else hit & here
            if axis + 1 < len(selectors):
                return loop(axis + 1, (*at, e), here, x)
            return laid_out(jnp.where(here, load(*at, e), x))

        return lax.fori_loop(*bounds[axis], entry, x)

    return loop(0, (), None, laid_out(jnp.zeros(selectors[0].shape, dtype)))
