"""Reading the arrays a call closes over inside a kernel: each read at the indices it uses.

A mask rule, a block mask or a ``score_mod`` reads its arrays by value: ``slopes[h]``,
``doc[q_idx]``, ``classes[i, j]``. Traced into a kernel body, those are ``dynamic_slice`` and
``gather`` of whole arrays, which Triton and Mosaic do not lower (they load from memory at an
index, they do not slice registers). :func:`evaluate` runs a function of such arrays with each
array left in memory (a Pallas ref) until it is read: slices, dynamic slices and point gathers
of it become loads at those indices (``ref[pl.ds(h, 1)]``, ``ref[q_idx]``); anything else loads
it whole. Positions are followed from their ``iota`` (a :class:`_Run`): a read at a tile's
positions is one load of a contiguous window (``ref[pl.ds(q_offset, block_q)]``), which is all
a TPU loads (Mosaic has no load at a vector of indices). The gradients of a ``score_mod``'s
arrays are the transposes of those reads (``scatter-add`` into zeros, placed in a row of a
table by ``dynamic_update_slice``), which the kernels do not lower either: they are kept as
a :class:`_Scatter` of points and updates until read, then spelled as sums of one-hot
products, ``d[m] = Σ_e g_e [idx_e = m]``, for arrays of up to :data:`ONE_HOT_MAX` entries, or
added into memory at their points by a kernel's ``atomic_add`` (and ``all``, ``any`` of
booleans become ``min``, ``max`` of integers).

The function's values are unchanged (out-of-bounds reads are clamped, or filled, as ``lax``
defines them), but for a ``bfloat16`` array's gradient added into ``float32`` memory, which
is summed in ``float32``; only how its reads are spelled is. The interpreter runs the
rewritten program too, so the tests check the values of the program a GPU or TPU is given.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jax_sdpa._indices import INDEX


@dataclasses.dataclass(frozen=True)
class _Unread:
    """Part of a ref not yet read: one index per axis, a ``pl.ds`` or a scalar (dropped axis)."""

    ref: Any
    index: tuple

    @property
    def shape(self) -> tuple:
        return tuple(i.size for i in self.index if isinstance(i, pl.Slice))

    def read(self):
        return self.ref[self.index]

    def kept(self) -> list[int]:
        """The ref's axes this part still has, in order."""
        return [n for n, i in enumerate(self.index) if isinstance(i, pl.Slice)]

    def narrowed(self, starts, sizes) -> "_Unread":
        """The part ``[starts : starts + sizes]`` of this one, starts clamped as ``lax``'s."""
        index = list(self.index)
        for axis, start, size, length in zip(self.kept(), starts, sizes, self.shape, strict=True):
            start = jnp.clip(_value(start), 0, length - size)
            index[axis] = pl.ds(index[axis].start + start, size)
        return _Unread(self.ref, tuple(index))

    def dropped(self, dimensions) -> "_Unread":
        """This part without its axes ``dimensions`` (each of size 1): they become scalars."""
        index = list(self.index)
        for position in dimensions:
            axis = self.kept()[position]
            index[axis] = index[axis].start
        return _Unread(self.ref, tuple(index))

    def at_points(self, points: list):
        """``part[points[0], points[1], …]`` of equal-shape index arrays, one per kept axis.

        Each is clamped into the part (as a ``CLIP`` gather): no read leaves it.
        """
        index = list(self.index)
        for axis, point, length in zip(self.kept(), points, self.shape, strict=True):
            index[axis] = index[axis].start + jnp.clip(point, 0, length - 1)
        return self.ref[tuple(index)]


@dataclasses.dataclass(frozen=True)
class _Joined:
    """``concatenate(parts, axis=-1)`` of gather indices, kept apart until the gather reads them."""

    parts: list

    def read(self):
        return jnp.concatenate(self.parts, axis=-1)


@dataclasses.dataclass(frozen=True)
class _Expanded:
    """A point gather's result, ``value`` with ``ones`` trailing axes of size 1 still to add."""

    value: Any
    ones: int

    def read(self):
        return self.value.reshape(self.value.shape + (1,) * self.ones)


@dataclasses.dataclass(frozen=True)
class _Run:
    """``base + shift + iota`` along ``axis`` of ``shape``, whose other axes are 1: positions.

    ``shift`` is the part known when traced (a literal), ``base`` the traced rest. ``wrap`` is
    ``n`` once a ``jnp`` index's wrap (``x + n`` where ``x < 0``) has been applied to it.
    """

    base: Any
    shift: int
    shape: tuple
    axis: int
    wrap: int | None = None

    @property
    def size(self) -> int:
        return self.shape[self.axis]

    @property
    def start(self):
        return self.base + self.shift

    def read(self):
        run = self.start + lax.broadcasted_iota(self.base.dtype, self.shape, self.axis)
        return run if self.wrap is None else jnp.where(run < 0, run + self.wrap, run)

    def reshaped(self, shape: tuple) -> "_Run | None":
        """The run as ``shape`` (axes of 1 added or dropped), or None if that is not all."""
        if math.prod(shape) != self.size or self.size not in shape:
            return None
        axis = next((n for n, size in enumerate(shape) if size == self.size), 0)
        return dataclasses.replace(self, shape=tuple(shape), axis=axis)

    def shifted(self, x, sign: int) -> "_Run | None":
        """The run plus (``sign`` 1) or minus (−1) a scalar ``x``, or None if ``x`` is not one."""
        if self.wrap is not None or isinstance(x, _LAZY) or jnp.ndim(x) != 0:
            return None
        if isinstance(x, jax.core.Tracer):
            return dataclasses.replace(self, base=self.base + sign * x)
        return dataclasses.replace(self, shift=self.shift + sign * int(x))


@dataclasses.dataclass(frozen=True)
class _Negative:
    """``run < 0``, kept until it is seen to choose a ``jnp`` index's wrap."""

    run: _Run

    def read(self):
        return self.run.read() < 0


# The most entries a scatter is read as one-hot products for: they hold this many per entry of
# the tile. A larger array (a table per position) is read as a scatter, which only the
# interpreter runs; a kernel adds it into memory instead (``Kernel.in_memory``).
ONE_HOT_MAX = 256


@dataclasses.dataclass(frozen=True)
class _Zeros:
    """A broadcast zero, kept until read: a scatter into it needs no dense add."""

    shape: tuple
    dtype: Any

    def read(self):
        return jnp.zeros(self.shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class _Scatter:
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

    def widened(self, dtype) -> "_Scatter | None":
        """The scatter cast to a float ``dtype`` at least as wide (its sums then in ``dtype``)."""
        if (
            not jnp.issubdtype(dtype, jnp.floating)
            or jnp.finfo(dtype).bits < jnp.finfo(self.dtype).bits
        ):
            return None
        cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
        parts = tuple((points, cast(updates)) for points, updates in self.parts)
        return _Scatter(self.shape, jnp.dtype(dtype), cast(self.base), parts)

    def expanded(self, shape: tuple, dimensions: tuple) -> "_Scatter | None":
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
        return _Scatter(shape, self.dtype, base, parts)

    def reshaped(self, shape: tuple) -> "_Scatter":
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
        return _Scatter(shape, self.dtype, base, parts)

    def placed(self, shape: tuple, starts) -> "_Scatter":
        """The scatter written into zeros of ``shape`` at ``starts`` (clamped as ``lax``'s)."""
        starts = [
            jnp.clip(_value(s), 0, n - size).astype(INDEX)
            for s, n, size in zip(starts, shape, self.shape, strict=True)
        ]
        parts = tuple(
            ([p + s for p, s in zip(points, starts, strict=True)], updates)
            for points, updates in self.parts
        )
        base = None
        if self.base is not None:
            base = lax.dynamic_update_slice(jnp.zeros(shape, self.dtype), self.base, starts)
        return _Scatter(shape, self.dtype, base, parts)

    def plus(self, other) -> "_Scatter | None":
        """This plus ``other`` (an array, zeros or another scatter of the same dtype), or None."""
        if isinstance(other, _Zeros):
            return self
        if isinstance(other, _Scatter):
            base = other.base if self.base is None else self.base
            if None not in (self.base, other.base):
                base = self.base + other.base
            return dataclasses.replace(self, base=base, parts=self.parts + other.parts)
        if isinstance(other, _LAZY) or jnp.shape(other) != self.shape:
            return None
        return dataclasses.replace(self, base=other if self.base is None else self.base + other)


class _NotKept:
    """An ``atomic_add``'s old values, which the rewritten adds do not return."""

    def read(self):
        raise NotImplementedError("the old values of an atomic add of a scatter are not kept")


_LAZY = (_Unread, _Joined, _Expanded, _Run, _Negative, _Zeros, _Scatter, _NotKept)


def _value(x):
    return x.read() if isinstance(x, _LAZY) else x


def evaluate(fn, refs: list, *args):
    """``fn(*values of refs, *args)``, each ref read only where and as ``fn`` reads it."""
    avals = [jax.ShapeDtypeStruct(ref.shape, ref.dtype) for ref in refs]
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*avals, *args)
    unread = [_Unread(ref, tuple(pl.ds(0, n) for n in ref.shape)) for ref in refs]
    outs = _eval(closed.jaxpr, closed.consts, [*unread, *jax.tree.leaves(args)])
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def _eval(jaxpr, consts, args) -> list:
    env = {}

    def read(var):
        return var.val if isinstance(var, jax.extend.core.Literal) else env[var]

    for var, x in zip(jaxpr.constvars, consts, strict=True):
        env[var] = x
    for var, x in zip(jaxpr.invars, args, strict=True):
        env[var] = x
    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, [read(v) for v in eqn.invars])
        for var, x in zip(
            eqn.outvars, outs if eqn.primitive.multiple_results else [outs], strict=True
        ):
            env[var] = x
    return [_value(read(v)) for v in jaxpr.outvars]


def _sub(params, *names):
    """The first sub-program among ``params[names]``, as ``(jaxpr, consts)``."""
    for name in names:
        if name in params:
            sub = params[name]
            return (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
    raise KeyError(names)


def _eqn(eqn, invals: list):
    name, params = eqn.primitive.name, eqn.params
    first = invals[0] if invals else None
    if name == "dynamic_slice" and isinstance(first, _Unread):
        return first.narrowed(invals[1:], params["slice_sizes"])
    if name == "slice" and isinstance(first, _Unread) and params.get("strides") is None:
        limits = zip(params["start_indices"], params["limit_indices"], strict=True)
        sizes = [b - a for a, b in limits]
        return first.narrowed(params["start_indices"], sizes)
    if name == "squeeze" and isinstance(first, _Unread):
        return first.dropped(params["dimensions"])
    if name == "reshape" and isinstance(first, _Unread) and _drops_leading_ones(first, params):
        return first.dropped(range(len(first.shape) - len(params["new_sizes"])))
    if name == "squeeze" and isinstance(first, _Expanded):
        return _squeezed(first, params["dimensions"])
    if name == "concatenate" and params["dimension"] == eqn.outvars[0].aval.ndim - 1:
        return _Joined([_value(x) for x in invals])
    if name == "gather" and isinstance(first, _Unread) and _point_gather(eqn, first):
        return _gather(first, invals[1], params)
    lazy = _on_runs(eqn, invals) or _on_scatters(eqn, invals)
    if lazy is not None:
        return lazy
    if name == "broadcast_in_dim" and _is_zero(first) and not params["broadcast_dimensions"]:
        return _Zeros(tuple(params["shape"]), eqn.outvars[0].aval.dtype)
    if name in ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint"):
        return _eval(*_sub(params, "jaxpr", "call_jaxpr"), invals)
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        return _eval(*_sub(params, "call_jaxpr", "fun_jaxpr"), invals)
    if name == "while":
        return _while(params, invals)
    if name == "cond":
        return _cond(params, invals)
    if name == "scan":
        return _scan(params, invals)
    if name == "scatter-add":
        return _scatter_add(eqn, *invals)
    invals = [_value(x) for x in invals]
    if name == "dynamic_update_slice":
        return _updated(*invals)
    if name in ("reduce_and", "reduce_or"):  # Triton reduces numbers, not booleans
        reduce = lax.reduce_min_p if name == "reduce_and" else lax.reduce_max_p
        return reduce.bind(invals[0].astype(jnp.int32), axes=params["axes"]) > 0
    return _bind(eqn, invals)


def _bind(eqn, invals: list):
    """The equation's own primitive on ``invals``, as ``jax.core.eval_jaxpr`` binds it."""
    with eqn.ctx.manager:
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))


def _drops_leading_ones(x: _Unread, params) -> bool:
    """Whether a reshape only drops leading axes of size 1."""
    extra = len(x.shape) - len(params["new_sizes"])
    return (
        extra >= 0
        and params.get("dimensions") is None
        and x.shape[:extra] == (1,) * extra
        and x.shape[extra:] == tuple(params["new_sizes"])
    )


def _squeezed(x: _Expanded, dimensions):
    trailing = set(range(x.value.ndim, x.value.ndim + x.ones))
    if set(dimensions) == trailing:
        return x.value
    return lax.squeeze(x.read(), dimensions)


def _point_gather(eqn, operand: _Unread) -> bool:
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


def _gather(operand: _Unread, indices, params):
    """A point gather: loads at the points (one contiguous load for a run of positions)."""
    rank = len(operand.shape)
    ones = 0 if params["dimension_numbers"].collapsed_slice_dims else rank
    if isinstance(indices, _Run):
        if rank == 1 and 0 < indices.size <= operand.shape[0]:
            return _Expanded(_read_run(operand, indices, params), ones)
        indices = indices.read()  # a run longer than the array
    points = _points(indices, rank)
    value = operand.at_points(points)
    if params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:  # read clamped, then filled
        inside = _inside(points, operand.shape)
        value = jnp.where(inside, value, _fill_value(params["fill_value"], value.dtype))
    return _Expanded(value, ones)


def _read_run(operand: _Unread, run: _Run, params):
    """``operand[run]`` of a 1-D part: one load of a contiguous window where the run lies inside.

    That is what a TPU loads (it has no load at a vector of indices) and the common case: the
    positions of a tile. A run that leaves the part (a tile past the end of a sequence) is read
    by :func:`_windowed`, equal to the gather's clamped or filled values.
    """
    (length,), count = operand.shape, run.size
    start = run.start

    def outside():
        points = run.read().reshape(count)
        value = _windowed(operand, jnp.clip(points, 0, length - 1))
        if params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
            fill = _fill_value(params["fill_value"], value.dtype)
            value = jnp.where(_inside([points], operand.shape), value, fill)
        return value

    within = (start >= 0) & (start <= length - count)
    value = lax.cond(within, lambda: operand.narrowed([start], [count]).read(), outside)
    return value.reshape(run.shape[:-1])


def _windowed(operand: _Unread, points):
    """``operand[points]`` of a 1-D part, points inside it: picked from windows of loads.

    Each point lies in one window: its entry is picked by a max over the window (the others at
    the dtype's least), which keeps every value as it is (−0, NaN, ∞).
    """
    (length,), count = operand.shape, points.size
    wide = jnp.int32 if operand.ref.dtype == jnp.bool_ else operand.ref.dtype
    floating = jnp.issubdtype(wide, jnp.floating)
    least = jnp.asarray(-jnp.inf if floating else jnp.iinfo(wide).min, wide)

    def window(c, value):
        lo = jnp.minimum(c * count, length - count)  # the last window overlaps the one before
        entries = operand.narrowed([lo], [count]).read().astype(wide)
        at = lo + lax.broadcasted_iota(points.dtype, (1, count), 1)
        hits = (points[:, None] == at) & (at >= c * count)
        picked = jnp.where(hits, entries[None, :], least).max(axis=1)
        found = hits.astype(jnp.int32).max(axis=1) > 0  # (Triton reduces no booleans)
        return jnp.where(found, picked, value)

    windows = INDEX(-(-length // count))  # int32 under x64 too: Mosaic has no int64
    value = lax.fori_loop(INDEX(0), windows, window, jnp.full(count, least))
    return value.astype(operand.ref.dtype)


def _on_runs(eqn, invals: list):
    """What an equation makes of positions, if it keeps them a :class:`_Run`; else None.

    Those that do: an integer iota, plus or minus a scalar, axes of 1 added or dropped, and a
    ``jnp`` index's wrap (``select_n(x < 0, x, x + n)``).
    """
    name, params = eqn.primitive.name, eqn.params
    if name == "iota" and jnp.issubdtype(params["dtype"], jnp.integer):
        shape, axis = tuple(params["shape"]), params["dimension"]
        if math.prod(shape) == shape[axis]:
            return _Run(jnp.zeros((), params["dtype"]), 0, shape, axis)
        return None
    first = invals[0] if invals else None
    if name == "select_n" and isinstance(first, _Negative) and len(invals) == 3:
        run, (kept, wrapped) = first.run, invals[1:]
        if (
            kept is run
            and isinstance(wrapped, _Run)
            and wrapped.base is run.base
            and (wrapped.shape, wrapped.axis, wrapped.wrap) == (run.shape, run.axis, None)
        ):
            return dataclasses.replace(run, wrap=wrapped.shift - run.shift)
        return None
    if not isinstance(first, _Run) and not (name == "add" and isinstance(invals[1], _Run)):
        return None
    shape = tuple(eqn.outvars[0].aval.shape)
    if name in ("broadcast_in_dim", "squeeze") or (
        name == "reshape" and params.get("dimensions") is None
    ):
        return first.reshaped(shape)
    if name == "convert_element_type" and params["new_dtype"] == first.base.dtype:
        return first
    if name == "add":
        run, other = (first, invals[1]) if isinstance(first, _Run) else (invals[1], first)
        return run.shifted(other, 1)
    if name == "sub":
        return first.shifted(invals[1], -1)
    if name == "lt" and _is_zero(invals[1]) and first.wrap is None:
        return _Negative(first)
    return None


def _is_zero(x) -> bool:
    """Whether ``x`` is a known (not traced) scalar ``+0``: a literal or a constant."""
    if isinstance(x, (jax.core.Tracer, *_LAZY)):
        return False
    x = np.asarray(x)
    return x.ndim == 0 and bool(x == 0) and not np.signbit(x)


def _inside(points: list, shape: tuple):
    return _all((p >= 0) & (p < n) for p, n in zip(points, shape, strict=True))


def _fill_value(fill, dtype):
    """``lax.gather``'s fill for out-of-bounds points: given, or its default for ``dtype``."""
    if fill is not None:
        return jnp.asarray(fill, dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.asarray(True)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if jnp.issubdtype(dtype, jnp.signedinteger) else info.max, dtype)


def _points(indices, rank: int) -> list:
    """The ``rank`` index arrays of a point gather's ``(..., rank)`` indices.

    Where the program built them by concatenation, its parts: a kernel reshapes, it does not
    slice.
    """
    parts = indices.parts if isinstance(indices, _Joined) else [_value(indices)]
    if len(parts) == rank and all(part.shape[-1] == 1 for part in parts):
        return [part.reshape(part.shape[:-1]) for part in parts]
    indices = _value(indices)
    return [indices[..., n] for n in range(rank)]


def _all(conditions):
    conditions = list(conditions)
    result = conditions[0]
    for condition in conditions[1:]:
        result = result & condition
    return result


def _updated(operand, update, *starts):
    """``dynamic_update_slice`` of a single entry, as a select against its position."""
    if update.size != 1:
        return lax.dynamic_update_slice(operand, update, starts)
    at = _all(
        lax.broadcasted_iota(jnp.int32, operand.shape, axis)
        == jnp.clip(start, 0, operand.shape[axis] - 1).astype(jnp.int32)
        for axis, start in enumerate(starts)
    )
    return jnp.where(at, update.reshape(()), operand)


def _scatter_add(eqn, operand, indices, updates):
    """A point ``scatter-add`` (a point gather's transpose), kept as a :class:`_Scatter`."""
    numbers = eqn.params["dimension_numbers"]
    given = updates = _value(updates)
    rank = len(eqn.invars[0].aval.shape)
    point = (
        tuple(numbers.scatter_dims_to_operand_dims) == tuple(range(rank))
        and tuple(numbers.inserted_window_dims) in ((), tuple(range(rank)))  # as the gathers
        and not numbers.operand_batching_dims
        and updates.size * rank == eqn.invars[1].aval.size
    )
    if not point:
        return _bind(eqn, [_value(operand), _value(indices), given])
    shape = eqn.invars[0].aval.shape
    points = _points(indices, rank)
    updates = updates.reshape(points[0].shape)
    if eqn.params["mode"] != lax.GatherScatterMode.CLIP:  # XLA drops what is out of bounds
        updates = jnp.where(_inside(points, shape), updates, 0)
    points = [jnp.clip(p, 0, n - 1) for p, n in zip(points, shape, strict=True)]
    scatter = _Scatter(tuple(shape), updates.dtype, None, ((points, updates),))
    return scatter.plus(operand if isinstance(operand, (_Zeros, _Scatter)) else _value(operand))


def _one_hot_sum(points: list, updates, shape: tuple):
    """``zeros(shape).at[points].add(updates)`` as one-hot products: ``Σ_e u_e [p_e = m]``."""
    rank, entries = len(shape), points[0].ndim
    hits = _all(
        point[(...,) + (None,) * rank]
        == lax.broadcasted_iota(point.dtype, (1,) * entries + tuple(shape), entries + axis)
        for axis, point in enumerate(points)
    )
    values = updates[(...,) + (None,) * rank]
    return jnp.where(hits, values, 0).sum(axis=tuple(range(entries)))


def _on_scatters(eqn, invals: list):
    """What an equation makes of a :class:`_Scatter`, if it keeps it one; else None.

    Those that do: sums, widening casts, reshapes, axes of 1 added, placement in zeros (a row
    of a table: ``table[h][idx]``'s transpose) and an ``atomic_add``.
    """
    name, params = eqn.primitive.name, eqn.params
    first = invals[0] if invals else None
    if name in ("add", "add_any"):
        second = invals[1]
        if isinstance(second, _Scatter):
            first, second = second, first
        return first.plus(second) if isinstance(first, _Scatter) else None
    if name == "atomic_rmw":
        return _atomic_add(eqn, invals)
    if name == "dynamic_update_slice" and isinstance(first, _Zeros):
        update = invals[1]
        return update.placed(first.shape, invals[2:]) if isinstance(update, _Scatter) else None
    if not isinstance(first, _Scatter):
        return None
    if name == "convert_element_type":
        return first.widened(params["new_dtype"])
    if name == "broadcast_in_dim":
        return first.expanded(tuple(params["shape"]), tuple(params["broadcast_dimensions"]))
    if name == "reshape" and params.get("dimensions") is None:
        return first.reshaped(tuple(params["new_sizes"]))
    return None


def _atomic_add(eqn, invals: list):
    """``atomic_add(ref, index, scatter)``: the scatter's base, then each part at its points."""
    ref, transforms, value, mask = eqn.params["args_tree"].unflatten(invals)
    if not isinstance(value, _Scatter) or len(transforms) != 1 or mask is not None:
        return None
    (index,) = transforms
    kept = [i for i in index.indices if isinstance(i, pl.Slice)]
    adds = eqn.params["atomic_type"].name == "ADD"  # (its enum is private to Pallas)
    if not adds or len(kept) != len(value.shape):
        return None
    if value.base is not None:
        pltriton.atomic_add(ref, index.indices, value.base)
    for points, updates in value.parts:
        points = iter(points)
        at = [next(points) + i.start if isinstance(i, pl.Slice) else i for i in index.indices]
        pltriton.atomic_add(ref, tuple(at), updates)
    return _NotKept()


def _while(params, invals):
    """A while loop rebuilt around the evaluation of its bodies.

    A loop mapped by ``jax.vmap`` has a predicate per element: it runs while any holds, each
    element kept where its own does not (as JAX's lowering of such a loop does).
    """
    cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
    cond_consts = invals[: params["cond_nconsts"]]
    body_consts = invals[params["cond_nconsts"] : params["cond_nconsts"] + params["body_nconsts"]]
    carry = [_value(x) for x in invals[params["cond_nconsts"] + params["body_nconsts"] :]]

    def holds(carry):
        return _eval(cond_jaxpr.jaxpr, cond_jaxpr.consts, [*cond_consts, *carry])[0]

    def cond(carry):
        pred = holds(carry)
        return pred if pred.ndim == 0 else pred.astype(jnp.int32).max() > 0

    def body(carry):
        new = _eval(body_jaxpr.jaxpr, body_jaxpr.consts, [*body_consts, *carry])
        if cond_jaxpr.jaxpr.outvars[0].aval.ndim == 0:
            return new  # (the body must not read the bound: Triton's loops would lose it)
        pred = holds(carry)
        expand = lambda x: pred.reshape(pred.shape + (1,) * (x.ndim - pred.ndim))  # noqa: E731
        return [jnp.where(expand(n), n, c) for n, c in zip(new, carry, strict=True)]

    return lax.while_loop(cond, body, carry)


def _cond(params, invals):
    index, *operands = invals
    branches = [
        (lambda branch: lambda: _eval(branch.jaxpr, branch.consts, operands))(b)
        for b in params["branches"]
    ]
    return lax.switch(_value(index), branches)


def _scan(params, invals):
    jaxpr, consts_count, carry_count = params["jaxpr"], params["num_consts"], params["num_carry"]
    consts = invals[:consts_count]
    carry = [_value(x) for x in invals[consts_count : consts_count + carry_count]]
    xs = [_value(x) for x in invals[consts_count + carry_count :]]

    def body(carry, x):
        outs = _eval(jaxpr.jaxpr, jaxpr.consts, [*consts, *carry, *x])
        return outs[:carry_count], outs[carry_count:]

    carry, ys = lax.scan(
        body, carry, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )
    return [*carry, *ys]
