"""Adds into memory at points from a Mosaic GPU kernel: gradients of arrays read at many points.

The gradient of an array a ``score_mod`` reads at a tile of points (a table read at
``q_idx − kv_idx``) is a scatter-add, kept as a :class:`~jax_sdpa._kernels.scatters.Scatter`
of points and updates. The Mosaic GPU keys' kernel adds each tile's into a float32 vector of
the array's entries that all its programs share, ``plgpu.atomic_add(ref, scatter)``;
:func:`rules` spell that add. On a GPU each entry of the tile is added at its point by an
atomic reduction (PTX ``red``), as the Triton programs' atomic adds do. The GPU simulator runs
no inline Mosaic GPU: there each consumer scatter-adds the parts into a vector of its own
(``ref`` the consumer's row, read and written back), so no two of its threads add into one place.

An array read along one axis of a tile (``bias[kv_idx]``) has for gradient its tile's sums
along the other axis, a vector whose register layout holds each entry in several threads.
Kept as the tile (:class:`Folded`) until its scatter, it is added as a tile too: the sums in
its first row (or column), zeros elsewhere, each entry one thread's. Both paths refuse what a
GPU would not add (:class:`GradientAtPoints`): any value but a scatter of tiles or a scalar.
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import custom_batching, lax
from jax.experimental.mosaic.gpu import utils as mosaic_gpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, vector

from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import bind
from jax_sdpa._kernels.positions import Run, Uniform
from jax_sdpa._kernels.scatters import Scatter, one_entry, scatter_add
from jax_sdpa._kernels.values import Expanded, Joined, Lazy, Pending, Zeros
from jax_sdpa._kernels.windows import Window


def with_sums(kernel, shapes: list, parts: int, args) -> tuple:
    """``kernel(args, refs)``'s outputs, then the sums it added into ``refs``.

    A ref of float32 zeros ``(parts, entries)`` for each shape of ``shapes``; its sum, the
    parts' total. Made in a ``custom_vmap``, so that under ``vmap`` it is batched where
    ``args`` (a pytree of arrays) are, not wherever a ref is made: JAX batches those always (a
    batched value might be written to them), and ``vmap`` of a ``custom_vjp`` on arrays that are
    not batched (a batch of one) then refuses (JAX 0.12) or counts the sums once per example.
    (Under an outer ``vmap`` of arrays that do not vary along it the kernel still runs once per
    example, its values right.)
    """

    def call(args):
        refs = [jax.new_ref(jnp.zeros((parts, math.prod(s)), jnp.float32)) for s in shapes]
        outs = kernel(args, refs)
        return (*outs, *(ref[...].sum(0) for ref in refs))

    if not shapes:
        return kernel(args, [])
    batched = custom_batching.custom_vmap(call)

    @batched.def_vmap
    def _(size, in_batched, args):
        (in_batched,) = in_batched
        axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
        outs = jax.vmap(call, in_axes=(axes,), axis_size=size)(args)
        return outs, (True,) * len(outs)

    return batched(args)


def add_at(ref, points, updates) -> None:
    """``ref[points] += updates`` on a GPU, an atomic reduction per entry that is not 0.

    ``ref``: a float32 vector in global memory; ``points``: int32 indices into it, inside it,
    of the shape of the float32 ``updates``: a tile (``wgmma``'s layout) or a scalar (added by
    one thread).
    """
    scalar = jnp.ndim(updates) == 0
    if scalar:
        layout = plgpu.Layout.WG_SPLAT((1,))
        points, updates = (jnp.broadcast_to(x, (1,)) for x in (points, updates))
    else:
        layout = plgpu.Layout.WGMMA
        points = jnp.broadcast_to(points, updates.shape)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), layout, layout))
    def added(_, ref, points, updates):
        pointer = mosaic_gpu_utils.memref_ptr(ref)
        if pointer.type.address_space != 1:  # (a generic pointer: made a global one)
            pointer = llvm.addrspacecast(llvm.PointerType.get(address_space=1), pointer)
        pairs = zip(points.registers.flat, updates.registers.flat, strict=True)
        entries = [pair for p, u in pairs for pair in zip(_entries(p), _entries(u), strict=True)]
        if scalar:  # (every thread holds it)
            with mosaic_gpu_utils.single_thread(mosaic_gpu_utils.ThreadSubset.WARPGROUP):
                _reduce(pointer, entries[:1])
        else:
            _reduce(pointer, entries)

    added(ref, points, updates)


@dataclasses.dataclass(frozen=True)
class Folded(Pending):
    """A 2-D ``tile`` summed along ``axis``, then ``ops``, as ``shape`` (axes of 1 added).

    The gradient of an array read along the tile's other axis, kept as the tile so that its
    scatter (:func:`_scatter_along`) knows that axis, which its points lie along. ``ops``:
    elementwise operations of the sums with scalars on the way (``2 * bias[kv_idx]``'s
    product, a cast to a bfloat16 bias's dtype), with windows at their positions (a function's
    derivative), zeros, or other chains from the same sums (``rules``' ``folded_elementwise``).
    """

    tile: Any
    axis: int
    shape: tuple
    ops: tuple = ()

    def sums(self):
        """The sums (a vector), ``ops`` applied."""
        return self.applied(lax.reduce_sum(self.tile, (self.axis,)))

    def read(self):
        return self.sums().reshape(self.shape)

    def reshaped(self, shape: tuple) -> "Folded | None":
        """The sums as ``shape``, if that only adds or drops axes of 1 (else None)."""
        sizes = lambda shape: [n for n in shape if n != 1]  # noqa: E731
        return dataclasses.replace(self, shape=shape) if sizes(shape) == sizes(self.shape) else None


def _folded(eqn, operands):
    """``reduce_sum`` of a tile along one axis kept :class:`Folded` (of axes of 1: still it)."""
    x, axes, shape = operands[0], tuple(eqn.params["axes"]), tuple(eqn.outvars[0].aval.shape)
    if isinstance(x, Folded):
        return x.reshaped(shape) if all(x.shape[a] == 1 for a in axes) else None
    if isinstance(x, Lazy) or jnp.ndim(x) != 2 or len(axes) != 1:
        return None
    return Folded(x, axes[0], shape)


def _refolded(eqn, operands):
    """A :class:`Folded`'s axes of 1 added or dropped (``reshape``, ``broadcast_in_dim``)."""
    x = operands[0]
    return x.reshaped(tuple(eqn.outvars[0].aval.shape)) if isinstance(x, Folded) else None


def _one_tile(folded: list) -> bool:
    """Whether the :class:`Folded` are one tile's sums: the same tile, along the same axis."""
    return all(x.tile is folded[0].tile and x.axis == folded[0].axis for x in folded)


def _scatter_along(eqn, operands, along):
    """A :class:`Folded`'s scatter at positions along the tile's other axis, made a tile's.

    Its points, the positions over the whole tile, or values at them (``t[q_idx // 64]``, a
    :class:`Window` read in ``along``'s layout and broadcast), and one index along each other
    axis of the array (a table's row, ``t[h, kv_idx]``); its updates, the sums in the tile's
    first row (column), zeros elsewhere: added at each point once.
    """
    operand, points, updates = operands
    columns = points.parts if isinstance(points, Joined) else [points]
    runs = [x for x in columns if isinstance(x, Run | Window)]
    if not isinstance(updates, Folded) or len(runs) != 1:
        return None
    rank = len(eqn.invars[0].aval.shape)
    if len(columns) != rank or not all(isinstance(x, Run | Window | Uniform) for x in columns):
        return None
    axis = updates.axis
    shape, other = jnp.shape(updates.tile), 1 - axis
    if (runs[0].run if isinstance(runs[0], Window) else runs[0]).size != shape[other]:
        return None
    iota = lambda axis: plgpu.broadcasted_iota(INDEX, shape, axis, layout=plgpu.Layout.WGMMA)  # noqa: E731
    sums = lax.broadcast_in_dim(updates.sums(), shape, (other,))
    first = jnp.where(iota(axis) == 0, sums, jnp.zeros_like(sums))

    def at(x):
        if isinstance(x, Run):
            return x.at(iota(other))
        if isinstance(x, Window):
            points = x.broadcast(shape, other, along(other)).astype(INDEX)
            return plgpu.layout_cast(points, plgpu.Layout.WGMMA)
        return jnp.full(shape, x.scalar, INDEX)

    indices = Joined([Expanded(at(x), 1) for x in columns])
    return scatter_add(eqn, [operand, indices, first])


class GradientAtPoints(NotImplementedError):
    """The gradient of an array read at points a kernel does not sum at."""


def _parts(added, size: int) -> list:
    """The ``(points, updates)`` of a value a kernel adds into memory, the updates float32.

    A scatter's parts, at tiles of points or one (a vector's refused: a register layout holds
    each of its entries in several threads, along a tile's rows or its columns, which one its
    shape does not say; :class:`Folded` keeps the tile where it is known); a scalar's, at 0
    (``size`` 1: the gradient of a 0-d array); nothing else.
    """
    if isinstance(added, Scatter) and added.base is None:
        parts = [(points, updates) for (points,), updates in added.parts]
    elif not isinstance(added, Scatter) and size == 1:
        parts = [(jnp.zeros((), INDEX), one_entry(added))]
    else:
        raise GradientAtPoints("a gradient added into memory that is not a scatter")
    for _, updates in parts:
        if jnp.ndim(updates) not in (0, 2):
            raise GradientAtPoints(f"a gradient at a vector of {jnp.size(updates)} points")
    return [(points, updates.astype(jnp.float32)) for points, updates in parts]


def _entries(register) -> list:
    """A register's entries: a vector's each, or the scalar."""
    if not isinstance(register.type, ir.VectorType):
        return [register]
    (count,) = ir.VectorType(register.type).shape
    return [
        vector.extract(register, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
        for i in range(count)
    ]


def _reduce(pointer, entries) -> None:
    """``red.add``: each ``(point, update)``'s update added at ``pointer + point``, unless 0."""
    for point, update in entries:
        at = mosaic_gpu_utils.getelementptr(pointer, [point], ir.F32Type.get())
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [at, update],
            "{ .reg .pred nonzero; setp.neu.f32 nonzero, $1, 0f00000000; "
            "@nonzero red.relaxed.gpu.global.add.f32 [$0], $1; }",
            "l,f",
            has_side_effects=True,
        )


# The elementwise operations a gradient takes a tile's sums through: products, quotients, a
# negation, a cast, two cotangents added, a choice.
_ELEMENTWISE = ("mul", "div", "neg", "convert_element_type", "add_any", "select_n")


def rules(simulated: bool, along) -> dict:
    """The rule of ``plgpu.atomic_add(ref, value)``: ``value``'s parts added at their points.

    On a GPU (``simulated`` False) by :func:`add_at`; on the simulator by a scatter-add, read
    and written back (``ref`` is the adding consumer's own). Both refuse what :func:`_parts`
    refuses. With them the rules that keep a tile's sums along one axis :class:`Folded` to
    their scatter; ``along(axis)``: the backend's vectors along a tile's axis, in which a window
    that multiplies, divides or chooses the sums is read.
    """

    def folded_elementwise(eqn, operands):
        """One tile's :class:`Folded` through an elementwise operation: that tile's again.

        Its other operands windows at the sums' positions, zeros or scalars (or more of the
        tile's :class:`Folded`). The sums once, the operation on its operands as each stands at
        them: a :class:`Folded`'s ``ops`` applied, a window read in the sums' layout, zeros in
        their own dtype, a scalar as it is. (The gradient of ``2 * bias[kv_idx]``, of a cast, of
        ``jnp.tanh(bias[kv_idx])``: the sums times ``1 − tanh²``; of ``jnp.log``: over the bias;
        of ``w * w``: two products added, ``add_any``; of ``jnp.abs``: chosen by the sign.)
        """
        folded = [x for x in operands if isinstance(x, Folded)]

        def known(x):  # (what the sums' operation can read at their positions)
            scalar = not isinstance(x, Lazy) and jnp.ndim(x) == 0
            return scalar or isinstance(x, Folded | Window | Zeros)

        if not folded or not _one_tile(folded) or not all(map(known, operands)):
            return None
        vectors = along(1 - folded[0].axis)

        def at(x, sums):
            if isinstance(x, Folded):
                return x.applied(sums)
            if isinstance(x, Window):
                return x.values(vectors).reshape(sums.shape)
            return jnp.zeros(sums.shape, x.dtype) if isinstance(x, Zeros) else x

        def operation(sums):
            args = [at(x, sums) for x in operands]
            if eqn.primitive.name == "add_any":  # (which Mosaic GPU does not lower: a sum)
                return lax.add(*args)
            return bind(eqn, args)

        return dataclasses.replace(folded[0], ops=(operation,))

    def atomic_add(eqn, operands):
        tree = eqn.params["args_tree"]
        ref, transforms, added = tree.unflatten(operands)[:3]
        for transform in transforms:
            ref = ref.at[transform.indices]
        parts = _parts(added, tree.unflatten(eqn.invars)[2].aval.size)
        for points, updates in parts:
            if simulated:  # (the simulator's scatter-add: its sum of a point's updates)
                points = jnp.broadcast_to(points, jnp.shape(updates))  # (as add_at's)
                ref[...] = ref[...].at[jnp.ravel(points)].add(jnp.ravel(updates))
            else:
                add_at(ref, points, updates)
        return []

    return {
        "mgpu_atomic_store": (atomic_add,),
        "reduce_sum": (_folded,),
        **dict.fromkeys(_ELEMENTWISE, (folded_elementwise,)),
        "reshape": (_refolded,),
        "broadcast_in_dim": (_refolded,),
        "squeeze": (_refolded,),
        "scatter-add": (functools.partial(_scatter_along, along=along),),
    }
