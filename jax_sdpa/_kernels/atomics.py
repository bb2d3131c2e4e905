"""Adds into memory at points from a Mosaic GPU kernel: gradients of arrays read at many points.

The gradient of an array a ``score_mod`` reads at a tile of points (a table read at
``q_idx − kv_idx``) is a scatter-add, kept as a :class:`~jax_sdpa._kernels.scatters.Scatter`
of points and updates. The Mosaic GPU keys' kernel adds each tile's into a float32 vector of
the array's entries that all its programs share, ``plgpu.atomic_add(ref, scatter)``;
:func:`rules` spell that add. On a GPU each entry of the tile is added at its point by an
atomic reduction (PTX ``red``), as the Triton programs' atomic adds do. The GPU simulator runs
no inline Mosaic GPU: there each consumer reads, adds to and writes back a vector of its own
(``ref`` the consumer's row), so no two of its threads add into one place. Both refuse what a
GPU would not add (:class:`GradientAtPoints`): a vector read along one axis of a tile (its
register layouts hold each entry in several threads), any value but a scatter or a scalar.
"""

import math

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax.experimental.mosaic.gpu import utils as mosaic_gpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, vector

from jax_sdpa._indices import INDEX
from jax_sdpa._kernels.scatters import Scatter, one_entry
from jax_sdpa._kernels.values import value


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


class GradientAtPoints(NotImplementedError):
    """The gradient of an array read at points a kernel does not sum at."""


def _parts(added, size: int) -> list:
    """The ``(points, updates)`` of a value a kernel adds into memory, the updates float32.

    A scatter's parts, at tiles of points or one (a vector's refused: a register layout holds
    each of its entries in several threads, along a tile's rows or its columns, which one its
    shape does not say); a scalar's, at 0 (``size`` 1: the gradient of a 0-d array); nothing
    else.
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


def rules(simulated: bool) -> dict:
    """The rule of ``plgpu.atomic_add(ref, value)``: ``value``'s parts added at their points.

    On a GPU (``simulated`` False) by :func:`add_at`; on the simulator read, added and written
    back (``ref`` is the adding consumer's own). Both refuse what :func:`_parts` refuses.
    """

    def atomic_add(eqn, operands):
        tree = eqn.params["args_tree"]
        ref, transforms, added = tree.unflatten(operands)[:3]
        for transform in transforms:
            ref = ref.at[transform.indices]
        parts = _parts(added, tree.unflatten(eqn.invars)[2].aval.size)
        if simulated:
            ref[...] += value(added).astype(jnp.float32).reshape(ref.shape)
        else:
            for points, updates in parts:
                add_at(ref, points, updates)
        return []

    return {"mgpu_atomic_store": (atomic_add,)}
