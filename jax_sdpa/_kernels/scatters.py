"""Scatters in a kernel's rewritten program: the gradients of the arrays a ``score_mod`` reads.

A point ``scatter-add`` (a point gather's transpose) is kept as a :class:`Scatter` of points
and updates until it is read (one-hot sums, or a scatter-add only the interpreter runs) or
added into memory by a kernel's ``atomic_add`` at its points (:mod:`jax_sdpa._kernels.reads`).
"""

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import atomic_kind, bind
from jax_sdpa._kernels.triton import atomic_add
from jax_sdpa._kernels.values import (
    Expanded,
    Lazy,
    Zeros,
    in_bounds,
    index_arrays,
    is_zero,
    value,
)
from jax_sdpa._masks import all_of

# The most entries a scatter is read as one-hot products for: they hold this many per entry of
# the tile. A larger array (a table per position) is read as a scatter, which only the
# interpreter runs; a kernel adds it into memory instead (``Plan.in_memory``).
ONE_HOT_MAX = 256


@dataclasses.dataclass(frozen=True)
class Scatter(Lazy):
    """``base`` (zeros if None) plus point scatter-adds not yet done: ``((points, updates), …)``.

    Points are inside the array (clamped, or their updates 0 where the scatter drops them).
    Added to memory by ``atomic_add``, each part is an atomic add at its points; read, a sum of
    one-hot products (up to :data:`ONE_HOT_MAX` entries) or a scatter-add.
    """

    shape: tuple
    dtype: Any
    base: Any
    parts: tuple

    def read(self):
        value = jnp.zeros(self.shape, self.dtype) if self.base is None else self.base
        for points, updates in self.parts:
            if math.prod(self.shape) <= ONE_HOT_MAX:
                value = value + _one_hot_sum(points, updates, self.shape).astype(self.dtype)
            else:
                value = value.at[tuple(points)].add(updates, mode="promise_in_bounds")
        return value

    def widened(self, dtype) -> "Scatter | None":
        """The scatter cast to a float ``dtype`` at least as wide (its sums then in ``dtype``)."""
        if (
            not jnp.issubdtype(dtype, jnp.floating)
            or jnp.finfo(dtype).bits < jnp.finfo(self.dtype).bits
        ):
            return None
        cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
        parts = tuple((points, cast(updates)) for points, updates in self.parts)
        return Scatter(self.shape, jnp.dtype(dtype), cast(self.base), parts)

    def expanded(self, shape: tuple, dimensions: tuple) -> "Scatter | None":
        """The scatter with axes of 1 added (a ``broadcast_in_dim`` that copies nothing)."""
        if math.prod(shape) != math.prod(self.shape) or any(
            shape[d] != n for d, n in zip(dimensions, self.shape, strict=True)
        ):
            return None
        zero = jnp.zeros((), INDEX)

        def points_of(points):
            at = dict(zip(dimensions, points, strict=True))
            return [at.get(axis, zero) + jnp.zeros_like(points[0]) for axis in range(len(shape))]

        parts = tuple((points_of(points), updates) for points, updates in self.parts)
        base = None if self.base is None else lax.broadcast_in_dim(self.base, shape, dimensions)
        return Scatter(shape, self.dtype, base, parts)

    def reshaped(self, shape: tuple) -> "Scatter":
        """The scatter reshaped: each point's row-major position, in the new shape's axes."""

        def points_of(points):
            linear = jnp.zeros_like(points[0])
            for point, size in zip(points, self.shape, strict=True):
                linear = linear * size + point
            new = []
            for size in reversed(shape):  # nonnegative: lax's div and rem, no floor's signs
                new.append(lax.rem(linear, jnp.asarray(size, linear.dtype)))
                linear = lax.div(linear, jnp.asarray(size, linear.dtype))
            return new[::-1]

        parts = tuple((points_of(points), updates) for points, updates in self.parts)
        base = None if self.base is None else self.base.reshape(shape)
        return Scatter(shape, self.dtype, base, parts)

    def placed(self, shape: tuple, starts) -> "Scatter":
        """The scatter written into zeros of ``shape`` at ``starts`` (clamped as ``lax``'s)."""
        starts = [
            jnp.clip(value(s), 0, n - size).astype(INDEX)
            for s, n, size in zip(starts, shape, self.shape, strict=True)
        ]
        parts = tuple(
            ([p + s for p, s in zip(points, starts, strict=True)], updates)
            for points, updates in self.parts
        )
        base = None
        if self.base is not None:
            base = lax.dynamic_update_slice(jnp.zeros(shape, self.dtype), self.base, starts)
        return Scatter(shape, self.dtype, base, parts)

    def plus(self, other) -> "Scatter | None":
        """This plus ``other`` (an array, zeros or another scatter of the same dtype), or None."""
        if isinstance(other, Zeros):
            return self
        if isinstance(other, Scatter):
            base = other.base if self.base is None else self.base
            if None not in (self.base, other.base):
                base = self.base + other.base
            return dataclasses.replace(self, base=base, parts=self.parts + other.parts)
        if isinstance(other, Lazy) or jnp.shape(other) != self.shape:
            return None
        return dataclasses.replace(self, base=other if self.base is None else self.base + other)


class NotKept(Lazy):
    """An ``atomic_add``'s old values, which the rewritten adds do not return."""

    def read(self):
        raise NotImplementedError("the old values of an atomic add of a scatter are not kept")


def scatter_add(eqn, operands: list):
    """A point ``scatter-add`` (a point gather's transpose), kept as a :class:`Scatter`."""
    operand, indices, updates = operands
    numbers, size = eqn.params["dimension_numbers"], eqn.invars[2].aval.size
    rank = len(eqn.invars[0].aval.shape)
    point = (
        tuple(numbers.scatter_dims_to_operand_dims) == tuple(range(rank))
        and tuple(numbers.inserted_window_dims) in ((), tuple(range(rank)))  # as the gathers
        and not numbers.operand_batching_dims
        and size * rank == eqn.invars[1].aval.size
    )
    if not point:
        if _one_slice(eqn, rank):  # (dynamic_slice's transpose, as JAX 0.12.1 batches it)
            placed = _placed_into(operand, updates, index_arrays(indices, rank), size)
            if placed is not None:
                return placed
        return bind(eqn, [value(operand), value(indices), value(updates)])
    shape = eqn.invars[0].aval.shape
    points = index_arrays(indices, rank)
    # (one update at one point a scalar: never an array of one entry on the way)
    one = size == 1 and not jnp.ndim(points[0])
    updates = one_entry(updates) if one else _shaped(updates, points[0].shape)
    if eqn.params["mode"] != lax.GatherScatterMode.CLIP:  # XLA drops what is out of bounds
        updates = jnp.where(in_bounds(points, shape), updates, 0)
    points = [jnp.clip(p, 0, n - 1) for p, n in zip(points, shape, strict=True)]
    scatter = Scatter(tuple(shape), updates.dtype, None, ((points, updates),))
    return scatter.plus(operand if isinstance(operand, (Zeros, Scatter)) else value(operand))


def _one_slice(eqn, rank: int) -> bool:
    """Whether a ``scatter-add`` adds one slice at one start (as ``reads._one_slice`` reads)."""
    numbers = eqn.params["dimension_numbers"]
    whole = tuple(numbers.update_window_dims) == tuple(range(rank))
    return (
        whole
        and eqn.invars[1].aval.shape == (rank,)
        and tuple(numbers.scatter_dims_to_operand_dims) == tuple(range(rank))
        and not (numbers.inserted_window_dims or numbers.operand_batching_dims)
        and eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP
    )


def _one_hot_sum(points: list, updates, shape: tuple):
    """``zeros(shape).at[points].add(updates)`` as one-hot products: ``Σ_e u_e [p_e = m]``.

    (A single point's is a select over the array, no sum: no array of one entry on the way.)
    """
    entries = points[0].ndim

    def spread(x):  # each entry's x, over the array's shape
        return lax.broadcast_in_dim(x, x.shape + tuple(shape), tuple(range(entries)))

    hits = all_of(
        spread(point)
        == lax.broadcasted_iota(point.dtype, (1,) * entries + tuple(shape), entries + axis)
        for axis, point in enumerate(points)
    )
    terms = jnp.where(hits, spread(updates), 0)
    return terms.sum(axis=tuple(range(entries))) if entries else terms


# Rules (:mod:`jax_sdpa._jaxpr`) for the equations that keep a :class:`Scatter` one: sums,
# widening casts, reshapes, axes of 1 added, placement in zeros (a row of a table:
# ``table[h][idx]``'s transpose) and an ``atomic_add``. Each answers None where the equation
# does not keep it so.


def _plus(eqn, operands):
    first, second = operands
    if isinstance(second, Scatter):
        first, second = second, first
    return first.plus(second) if isinstance(first, Scatter) else None


def _sum(eqn, operands):
    """``add_any`` (a transpose's sum of two cotangents) of arrays as an ``add``.

    The same sum, which every backend lowers (Mosaic GPU lowers no ``add_any``).
    """
    return lax.add(*(value(x) for x in operands))


def _placed(eqn, operands):
    """``dynamic_update_slice`` of a scatter, or of one entry, into zeros.

    (One entry is a scatter at one point: ``slopes[h]``'s transpose.)
    """
    zeros, update, *starts = operands
    return _placed_into(zeros, update, starts, math.prod(eqn.invars[1].aval.shape))


def _placed_into(zeros, update, starts, size: int):
    """``update`` (of ``size`` entries) written into ``zeros`` at ``starts``, or None."""
    if not isinstance(zeros, Zeros):
        return None
    if isinstance(update, Scatter):
        return update.placed(zeros.shape, starts)
    if size != 1:
        return None
    one = one_entry(update)
    points = [
        jnp.clip(value(s), 0, n - 1).astype(INDEX) for s, n in zip(starts, zeros.shape, strict=True)
    ]
    return Scatter(zeros.shape, zeros.dtype, None, ((points, one),))


def one_entry(update):
    """An array of one entry as a scalar (where a backend holds it as one: :class:`Expanded`)."""
    if isinstance(update, Expanded) and not jnp.ndim(update.value):
        return update.value
    update = value(update)
    return update.reshape(()) if jnp.ndim(update) else update


def _shaped(updates, shape: tuple):
    """Updates as an array of ``shape`` (a tile with axes of 1 added, :class:`Expanded`: itself)."""
    if isinstance(updates, Expanded) and jnp.shape(updates.value) == shape:
        return updates.value
    return value(updates).reshape(shape)


def _widened(eqn, operands):
    first = operands[0]
    return first.widened(eqn.params["new_dtype"]) if isinstance(first, Scatter) else None


def _expanded(eqn, operands):
    first, params = operands[0], eqn.params
    if isinstance(first, Scatter):
        return first.expanded(tuple(params["shape"]), tuple(params["broadcast_dimensions"]))
    return None


def _reshaped(eqn, operands):
    first, params = operands[0], eqn.params
    if isinstance(first, Scatter) and params.get("dimensions") is None:
        return first.reshaped(tuple(params["new_sizes"]))
    return None


def _atomic_add(eqn, operands: list):
    """``atomic_add(ref, index, scatter)``: the scatter's base, then each part at its points."""
    ref, transforms, value, mask = eqn.params["args_tree"].unflatten(operands)
    if not isinstance(value, Scatter) or len(transforms) != 1 or mask is not None:
        return None
    (index,) = transforms
    kept = [i for i in index.indices if isinstance(i, pl.Slice)]
    adds = atomic_kind(eqn.params) == "ADD"
    if not adds or len(kept) != len(value.shape):
        return None
    if value.base is not None:
        atomic_add(ref, index.indices, value.base)
    for points, updates in value.parts:
        points = iter(points)
        at = [next(points) + i.start if isinstance(i, pl.Slice) else i for i in index.indices]
        atomic_add(ref, tuple(at), updates)
    return NotKept()


def _zeros(eqn, operands: list):
    """A broadcast zero, kept (:class:`Zeros`): a scatter into it needs no dense add."""
    if is_zero(operands[0]) and not eqn.params["broadcast_dimensions"]:
        return Zeros(tuple(eqn.params["shape"]), eqn.outvars[0].aval.dtype)
    return None


# Then broadcast zeros, and the scatter-adds themselves.
SCATTERS = {
    "add": (_plus,),
    "add_any": (_plus, _sum),
    "atomic_rmw": (_atomic_add,),
    "dynamic_update_slice": (_placed,),
    "convert_element_type": (_widened,),
    "broadcast_in_dim": (_expanded, _zeros),
    "reshape": (_reshaped,),
    "scatter-add": (scatter_add,),
}
