"""Positions in a kernel's rewritten program: a run ``start + iota`` read as one window.

A tile's positions are followed from their ``iota`` (:class:`Run`) through adds, reshapes and
the ``jnp`` negative-index wrap, so that a read at them (``documents[q_idx]``) is one load of a
contiguous window, which is all a TPU loads (:mod:`jax_sdpa._kernels.reads`), kept as a
:class:`Window` until read: a backend whose tiles' rows and columns have layouts of their own
(Mosaic GPU) loads it where it meets a tile, in the layout of that axis (:func:`tile_positions`).
There, positions an operation keeps no run (``q_idx // 64``) are a :class:`Window` of their own,
and values read at a window's values (``bias[q_idx // 64]``, ``doc_bias[ids[kv_idx]]``) one more
of its operations (:mod:`jax_sdpa._kernels.reads`).
"""

import dataclasses
import math
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax

from jax_sdpa._jax_compat import bind
from jax_sdpa._jaxpr import answer
from jax_sdpa._kernels import rewrites
from jax_sdpa._kernels.values import (
    Expanded,
    Lazy,
    Unread,
    Zeros,
    is_zero,
    value,
)
from jax_sdpa._kernels.windows import Window


@dataclasses.dataclass(frozen=True)
class Run(Lazy):
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
        return self.at(lax.broadcasted_iota(self.base.dtype, self.shape, self.axis))

    def at(self, iota):
        """The positions ``iota`` (``0 … size − 1``, of any shape or layout) along the run."""
        run = self.start + iota
        return run if self.wrap is None else jnp.where(run < 0, run + self.wrap, run)

    def reshaped(self, shape: tuple) -> "Run | None":
        """The run as ``shape`` (axes of 1 added or dropped), or None if that is not all."""
        if math.prod(shape) != self.size or self.size not in shape:
            return None
        axis = next((n for n, size in enumerate(shape) if size == self.size), 0)
        return dataclasses.replace(self, shape=tuple(shape), axis=axis)

    def shifted(self, x, sign: int) -> "Run | None":
        """The run plus (``sign`` 1) or minus (−1) a scalar ``x`` (or one broadcast).

        None if ``x`` is not one.
        """
        if isinstance(x, Uniform):
            x = x.scalar
        if self.wrap is not None or isinstance(x, Lazy) or jnp.ndim(x) != 0:
            return None
        if isinstance(x, jax.core.Tracer):
            return dataclasses.replace(self, base=self.base + sign * x)
        return dataclasses.replace(self, shift=self.shift + sign * int(x))


@dataclasses.dataclass(frozen=True)
class Grid(Lazy):
    """A :class:`Run` broadcast over a whole tile: one iota of the tile's shape, read as such.

    (The run's ``jnp`` wrap, if any, applied to it.) ``laid_out`` places the iota in a
    backend's registers: Mosaic GPU's layout inference, left to find the layout of positions
    across a kernel's loops, gives up (:func:`tile_positions`).
    """

    run: Run
    shape: tuple
    axis: int
    laid_out: Any

    def read(self):
        iota = lax.broadcasted_iota(self.run.base.dtype, self.shape, self.axis)
        return self.run.at(self.laid_out(iota))


@dataclasses.dataclass(frozen=True)
class Compared(Lazy):
    """A run compared with a scalar (``kv_idx < length``), kept until it is broadcast over a tile.

    Then the comparison is made there, of the tile's positions (:func:`tile_positions`).
    ``operands``: the run and the scalar (a :class:`Uniform`, an array or a ref's element), in
    the equation's order.
    """

    eqn: Any
    operands: tuple

    @property
    def run(self) -> Run:
        return next(x for x in self.operands if isinstance(x, Run))

    def over(self, positions):
        """The comparison of ``positions`` (an array of any shape) with the scalar."""
        return bind(
            self.eqn, [positions if isinstance(x, Run) else _scalar(x) for x in self.operands]
        )

    def read(self):
        return self.over(self.run.read())


def _scalar(x):
    """A :class:`Uniform`'s scalar, :class:`Zeros`' 0, or one element (an array's, a ref's)."""
    if isinstance(x, Zeros):
        return jnp.zeros((), x.dtype)
    x = x.scalar if isinstance(x, Uniform) else value(x)
    return x if jnp.ndim(x) == 0 else jnp.reshape(x, ())


@dataclasses.dataclass(frozen=True)
class Uniform(Lazy):
    """A scalar broadcast to ``shape``: the same at every point of a tile.

    A gather at positions along one axis and at such an index along the others (``doc[b, i]``)
    reads a window of one row (:func:`jax_sdpa._kernels.reads._gather`); with a window, it is
    a scalar (``jnp.where(jnp.isnan(w), 0.0, w)``: :func:`tile_positions`).
    """

    scalar: Any
    shape: tuple

    def read(self):
        return jnp.broadcast_to(self.scalar, self.shape)


@dataclasses.dataclass(frozen=True)
class Negative(Lazy):
    """``run < 0``, kept until it is seen to choose a ``jnp`` index's wrap."""

    run: Run

    def read(self):
        return self.run.read() < 0


# Rules (:mod:`jax_sdpa._jaxpr`) for the equations that keep positions a :class:`Run`: an
# integer iota, plus or minus a scalar, axes of 1 added or dropped, and a ``jnp`` index's wrap
# (``select_n(x < 0, x, x + n)``); and a scalar broadcast (:class:`Uniform`). Each
# answers None where the equation does not keep them so.


def _iota(eqn, operands):
    params = eqn.params
    shape, axis = tuple(params["shape"]), params["dimension"]
    if jnp.issubdtype(params["dtype"], jnp.integer) and math.prod(shape) == shape[axis]:
        return Run(jnp.zeros((), params["dtype"]), 0, shape, axis)
    return None


def _reshaped(eqn, operands):
    """``broadcast_in_dim``, ``squeeze`` or ``reshape`` of a run or an index that is uniform."""
    first, shape = operands[0], tuple(eqn.outvars[0].aval.shape)
    if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
        return None
    if isinstance(first, Uniform):
        return Uniform(first.scalar, shape) if _uniform(first.scalar, shape) else None
    if isinstance(first, Run | Window):
        return first.reshaped(shape)
    if isinstance(first, Expanded) and not jnp.ndim(first.value):  # (JAX 0.12.1's ``a[b, i]``)
        first = first.value  # (a scalar first made an array of one entry, then broadcast)
    scalar = not isinstance(first, Lazy) and jnp.ndim(first) == 0
    if eqn.primitive.name == "broadcast_in_dim" and scalar and _uniform(first, shape):
        return Uniform(first, shape)
    return None


def _uniform(scalar, shape: tuple) -> bool:
    """Whether a broadcast ``scalar`` is kept :class:`Uniform`: an index, or a window's number.

    A number broadcast along one axis (``jnp.where(jnp.isnan(w), 1.0, w)``), but zeros, which
    a gradient's scatters start from (:class:`~jax_sdpa._kernels.values.Zeros`, which
    windows take as scalars too), and tiles, which the kernels' reductions take as arrays.
    """
    dtype = jnp.result_type(scalar)
    if jnp.issubdtype(dtype, jnp.integer):
        return True
    along_one_axis = sum(n > 1 for n in shape) == 1
    return jnp.issubdtype(dtype, jnp.floating) and along_one_axis and not is_zero(scalar)


def _wrapped(eqn, operands):
    """``select_n(run < 0, run, run + n)``: a ``jnp`` index's wrap of negative positions."""
    first = operands[0]
    if not isinstance(first, Negative) or len(operands) != 3:
        return None
    run, (kept, wrapped) = first.run, operands[1:]
    if (
        kept is run
        and isinstance(wrapped, Run)
        and wrapped.base is run.base
        and (wrapped.shape, wrapped.axis, wrapped.wrap) == (run.shape, run.axis, None)
    ):
        return dataclasses.replace(run, wrap=wrapped.shift - run.shift)
    return None


def _converted(eqn, operands):
    first = operands[0]
    if isinstance(first, Run) and eqn.params["new_dtype"] == first.base.dtype:
        return first
    return None


def _plus(eqn, operands):
    first, second = operands
    run, other = (first, second) if isinstance(first, Run) else (second, first)
    return run.shifted(other, 1) if isinstance(run, Run) else None


def _minus(eqn, operands):
    first, second = operands
    return first.shifted(second, -1) if isinstance(first, Run) else None


def _negative(eqn, operands):
    first, second = operands
    if isinstance(first, Run) and is_zero(second) and first.wrap is None:
        return Negative(first)
    return None


POSITIONS = {
    "iota": (_iota,),
    "broadcast_in_dim": (_reshaped,),
    "squeeze": (_reshaped,),
    "reshape": (_reshaped,),
    "select_n": (_wrapped,),
    "convert_element_type": (_converted,),
    "add": (_plus,),
    "sub": (_minus,),
    "lt": (_negative,),
}


def tile_positions(laid_out, along) -> dict:
    """A backend's rules before those: positions and values at them broadcast over a whole tile.

    By a ``broadcast_in_dim`` of a run, or by an operation whose other operand spans the tile
    (``q_idx[:, None] >= kv_idx[None, :]``): one iota of the tile's shape, placed by
    ``laid_out`` (a :class:`Grid`). A :class:`Window` is read there, as a vector along the
    tile's axis (``along(axis)``: its :class:`Vectors`), and broadcast; elementwise operations
    of a window and scalars on the way are kept for its values.
    """

    def spread(x, shape: tuple, axis: int):
        """``x`` over ``shape`` if it is a run (or a run compared) or a window along ``axis``.

        A run becomes a grid, a comparison an array of the grid's, a window its values
        broadcast; None for anything else.
        """
        if isinstance(x, Compared):
            grid = spread(x.run, shape, axis)
            return None if grid is None else x.over(value(grid))
        run = x.run if isinstance(x, Window) else x
        if not isinstance(run, Run) or math.prod(shape) == run.size or shape[axis] != run.size:
            return None  # (axes of 1 added or dropped: still a run)
        if isinstance(x, Window):  # (its values read at the run's positions, wrapped or not)
            return laid_out(x.broadcast(shape, axis, along(axis)))
        return Grid(x, shape, axis, laid_out)

    def run_of(x):
        return x.run if isinstance(x, Compared | Window) else x

    def tiled(eqn, operands):
        """Over a tile; with axes of 1 after it, an :class:`Expanded` tile (a gather's indices)."""
        first, shape = operands[0], tuple(eqn.outvars[0].aval.shape)
        if not isinstance(first, Run | Compared | Window):
            return None
        axis = eqn.params["broadcast_dimensions"][run_of(first).axis]
        if len(shape) > 2 and axis < 2 and set(shape[2:]) == {1}:
            tile = spread(first, shape[:2], axis)
            grid = tile if isinstance(tile, Grid) else None  # (a tile's own positions)
            return None if tile is None else Expanded(value(tile), len(shape) - 2, grid)
        return spread(first, shape, axis)

    def elementwise(eqn, operands):
        shape = tuple(eqn.outvars[0].aval.shape)
        grids = [
            spread(x, shape, run_of(x).axis)
            if isinstance(x, Run | Compared | Window) and len(run_of(x).shape) == len(shape)
            else None
            for x in operands
        ]
        if all(grid is None for grid in grids):
            return None
        reads = [
            value(x if grid is None else grid) for x, grid in zip(operands, grids, strict=True)
        ]
        return rewrites.bound(eqn, reads)

    def compared(eqn, operands):
        """A run compared with a scalar: :class:`Compared` (but ``run < 0``, a ``jnp`` wrap's)."""
        runs = [x for x in operands if isinstance(x, Run) and x.wrap is None]
        others = [x for x in operands if not isinstance(x, Run)]
        wrap = eqn.primitive.name == "lt" and isinstance(operands[0], Run) and is_zero(operands[1])
        single = len(runs) == 1 and len(others) == 1 and is_scalar(others[0])
        return Compared(eqn, tuple(operands)) if single and not wrap else None

    def of_a_window(eqn, operands):
        """Windows along one axis of a tile and scalars (``ids == 0``, ``a[kv_idx] * b[kv_idx]``).

        The operation kept for the first window, the others read each at its own run, in the
        same layout (arrays of other lengths too: their runs differ by their wraps). A run that
        the operation keeps no run (``q_idx // 64``) is a window of its own positions, and a run
        compared with a scalar one of the comparisons (``keep[kv_idx // 64] | (kv_idx == 0)``).
        """
        if any(isinstance(x, Run) for x in operands):  # (kept a run where POSITIONS keeps one)
            kept = answer(POSITIONS.get(eqn.primitive.name, ()), eqn, operands)
            if kept is not None:
                return kept
        operands = [as_window(x) for x in operands]
        window = next((x for x in operands if isinstance(x, Window)), None)
        along = lambda x: isinstance(x, Window) and x.shape == window.shape  # noqa: E731
        if window is None or not all(along(x) or is_scalar(x) for x in operands):
            return None
        read = next(v for v, x in zip(eqn.invars, operands, strict=True) if x is window)
        if eqn.outvars[0].aval.shape != read.aval.shape:
            return None  # (a bit cast to another width: not elementwise)

        def operation(values, vectors):
            def operand(x):
                if x is window:
                    return values
                if isinstance(x, Window):
                    return x.values(vectors)
                return jnp.broadcast_to(_scalar(x), values.shape)

            return rewrites.bound(eqn, [operand(x) for x in operands])

        return window.then(operation)

    def rewritten(eqn, operands):
        """A rewrite, its operands read (a window's is :func:`of_a_window`'s, first), or None."""
        computed = rewrites.for_mosaic_gpu(eqn)
        return None if computed is None else computed(*map(value, operands))

    comparisons = ("eq", "ne", "lt", "le", "gt", "ge")
    binary = ("add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor", "atan2", "pow")
    binary += ("shift_left", "shift_right_arithmetic", "shift_right_logical")
    unary = ("convert_element_type", "neg", "not", "abs", "sign", "round", "exp", "exp2", "log")
    unary += ("log2", "sqrt", "rsqrt", "square", "tanh", "logistic", "sin", "cos")
    unary += ("one_minus_square", "select_n", "bitcast_convert_type")  # (JAX 0.12's tanh, erf)
    rules = {
        "broadcast_in_dim": (tiled,),
        **{name: (elementwise, of_a_window) for name in binary},
        **{name: (elementwise, compared, of_a_window) for name in comparisons},
        **{name: (of_a_window, rewritten) for name in unary},
    }
    # (a window's rewritten by of_a_window's bound, the rest by rewritten)
    for name in ("integer_pow", "rem", *rewrites.REWRITES):
        rules[name] = rules.get(name, (of_a_window,)) + (rewritten,)
    return rules


def as_window(x):
    """A run (or a run compared with a scalar) as a window of its positions; anything else as is."""
    if isinstance(x, Compared):
        return Window.positions(x.run).then(lambda positions, vectors: x.over(positions))
    return Window.positions(x) if isinstance(x, Run) else x


def is_scalar(x) -> bool:
    """Whether ``x`` is one number at every point: a :class:`Uniform`, zeros, or one element."""
    return (
        isinstance(x, Uniform | Zeros)
        or (isinstance(x, Unread) and math.prod(x.shape) == 1)
        or (not isinstance(x, Lazy) and jnp.size(x) == 1)
    )
