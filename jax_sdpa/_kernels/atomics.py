"""Adds into memory at points from a Mosaic GPU kernel: gradients of arrays read at many points.

The gradient of an array a ``score_mod`` reads at more than one point of a tile (a table read
at ``q_idx − kv_idx``, a vector at ``kv_idx``) is a scatter-add, kept as a
:class:`~jax_sdpa._kernels.scatters.Scatter` of points and updates. The Mosaic GPU keys'
kernel adds each tile's into a float32 vector of the array's entries that all its programs
share, ``plgpu.atomic_add(ref, scatter)``; :func:`rules` spell that add. On a GPU each entry of
the tile is added at its point by an atomic reduction (PTX ``red``), as the Triton programs'
atomic adds do. The GPU simulator runs no inline Mosaic GPU: there each consumer reads, adds
to and writes back a vector of its own (``ref`` the consumer's row), so no two of its threads
add into one place.
"""

import math

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax.experimental.mosaic.gpu import WGSplatFragLayout
from jax.experimental.mosaic.gpu import utils as mosaic_gpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, vector

from jax_sdpa._kernels.scatters import Scatter
from jax_sdpa._kernels.values import value


def with_sums(kernel, shapes: list, parts: int, args) -> tuple:
    """``kernel(args, refs)``'s outputs, then the sums it added into ``refs``.

    A ref of float32 zeros ``(parts, entries)`` for each shape of ``shapes``; its sum, the
    parts' total. Under ``vmap``, batched only where ``args`` (a pytree of arrays) are: JAX
    batches any ref made under ``vmap`` (a batched value might be written to it), which would
    make the sums of a call on arrays that are not batched, and ``vmap`` of a ``custom_vjp``
    count them once per example.
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
        if not any(jax.tree.leaves(in_batched)):
            outs = call(args)
            return outs, (False,) * len(outs)
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
    if jnp.ndim(updates) == 0:
        layout = plgpu.Layout.WG_SPLAT((1,))
        points, updates = (jnp.broadcast_to(x, (1,)) for x in (points, updates))
    else:
        layout = plgpu.Layout.WGMMA
        points, updates = _as_tile(points, updates)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), layout, layout))
    def added(_, ref, points, updates):
        pointer = mosaic_gpu_utils.memref_ptr(ref)
        if pointer.type.address_space != 1:  # (a generic pointer: made a global one)
            pointer = llvm.addrspacecast(llvm.PointerType.get(address_space=1), pointer)
        pairs = zip(points.registers.flat, updates.registers.flat, strict=True)
        entries = [pair for p, u in pairs for pair in zip(_entries(p), _entries(u), strict=True)]
        if isinstance(updates.layout, WGSplatFragLayout):  # (every thread holds it)
            with mosaic_gpu_utils.single_thread(mosaic_gpu_utils.ThreadSubset.WARPGROUP):
                _reduce(pointer, entries[:1])
        else:
            _reduce(pointer, entries)

    added(ref, points, updates)


class GradientAtPoints(NotImplementedError):
    """The gradient of an array read at points a kernel does not sum at."""


def _as_tile(points, updates):
    """Points and updates as a tile of ``wgmma``'s layout (each entry is one thread's).

    A vector is refused (:class:`GradientAtPoints`): a register layout holds each of its
    entries in several threads, along a tile's rows or its columns, which one its shape does
    not say.
    """
    if jnp.ndim(updates) == 1:
        raise GradientAtPoints(f"a gradient at a vector of {jnp.size(updates)} points")
    return jnp.broadcast_to(points, updates.shape), updates


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
            "{ .reg .pred nonzero; setp.ne.f32 nonzero, $1, 0f00000000; "
            "@nonzero red.relaxed.gpu.global.add.f32 [$0], $1; }",
            "l,f",
            has_side_effects=True,
        )


def rules(simulated: bool) -> dict:
    """The rule of ``plgpu.atomic_add(ref, value)`` with a scatter or any value in registers.

    On a GPU (``simulated`` False) the scatter's parts are added at their points
    (:func:`add_at`), any other value by the atomic add itself; on the simulator, each is read,
    added and written back (``ref`` is the adding consumer's own).
    """

    def atomic_add(eqn, operands):
        ref, transforms, added = eqn.params["args_tree"].unflatten(operands)[:3]
        for transform in transforms:
            ref = ref.at[transform.indices]
        if simulated:
            ref[...] += value(added)
            return []
        if not isinstance(added, Scatter):
            return None
        if added.base is not None:
            plgpu.atomic_add(ref, added.base)
        for (points,), updates in added.parts:
            add_at(ref, points, updates)
        return []

    return {"mgpu_atomic_store": (atomic_add,)}
