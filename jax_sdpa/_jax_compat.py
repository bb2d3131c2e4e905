"""JAX's internals, and the differences between JAX versions, in one place.

Tested with JAX 0.6.2 (what Python 3.10 installs), 0.10.2 (what CI installs, Python 3.11), 0.11.2
(the GPU image) and 0.12.0.1 (the newest release, Python 3.12 and 3.13). What the library needs
of JAX that is not public, or that changed between those versions, is here, each with the
versions that need it: no other module imports ``jax._src``, reads a version-dependent attribute
or names a primitive whose name changed, so a JAX release that breaks the library breaks it
here. (JAX's own warning that Pallas's Triton backend is deprecated, from 0.11, is left to be
seen: it is true of the GPU kernel.)
"""

import contextlib
import inspect

import jax
import jax.extend
from jax import lax
from jax._src import core as _core  # the current trace and tracers: no public API says them
from jax._src.interpreters import ad as _ad  # (reverse mode's LinearizeTrace is not public)
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe  # (JAX before 0.7: reverse mode's tracers)
from jax._src.lax import special as _special  # (the Bessel functions' decompositions)
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# --- shard_map's types ------------------------------------------------------------------------


def varying_axes_of(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``jax.shard_map`` (empty outside).

    JAX 0.10 types them as ``aval.mat.varying``; earlier JAX as ``aval.vma``.
    """
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


# The primitives of ``shard_map``'s casts to varying (``pvary`` before JAX 0.8.2).
VARYING_CASTS = ("pvary", "pcast")


def cast_to_varying(x, axes: tuple):
    """``x`` cast to vary over ``axes`` too (a no-op at run time).

    ``lax.pcast`` from JAX 0.8.2, ``lax.pvary`` before.
    """
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)


def as_computed(x):
    """``x`` typed as the values a kernel computes are, inside ``jax.shard_map``.

    Pallas traces a kernel's body with ``shard_map``'s checks off, so what it computes varies
    over no mesh axis, but a Mosaic GPU load keeps its ref's axes (JAX 0.11 and 0.12): the
    branches of a ``lax.cond`` that loads in one and computes in the other then differ. ``x``
    chosen from two copies of itself is computed (a no-op on the device; the choice is one
    of ``x``'s shape, which Mosaic GPU's warpgroups take where they broadcast no scalar).
    """
    return lax.select_n(lax.eq(x, x), x, x)


def shaped_like(shape: tuple, dtype, like) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output's type, varying over the mesh axes ``like`` varies over.

    JAX 0.10 takes them as ``manual_axis_type``; earlier JAX as ``vma``.
    """
    aval = jax.typeof(like)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    return jax.ShapeDtypeStruct(shape, dtype, vma=getattr(aval, "vma", frozenset()))


# --- the equations of a jaxpr -------------------------------------------------------------------

# The primitives that call a jaxpr as a function, and the parameter that holds it ("pjit" is
# JAX's name for "jit" before 0.7; "core_call", "remat" and "custom_vjp_call_jaxpr" are older
# names some versions still emit).
CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


# Primitives whose lowering is JAX's own decomposition into other primitives (``mlir.lower_fun``
# of these functions): what a backend that has no rule for the primitive can compute in its
# place. (bessel_i1e's from JAX 0.12: XLA's own before.)
DECOMPOSITIONS = {
    name: getattr(_special, f"{name}_impl")
    for name in ("bessel_i0e", "bessel_i1e")
    if hasattr(_special, f"{name}_impl")
}


def bind(eqn, operands: list, *, its_context: bool = True, params=None):
    """The equation's own primitive on ``operands``, as ``jax.core.eval_jaxpr`` binds it.

    With the parameters its primitive binds with (``params`` in place of some of the
    equation's), in the equation's context (the mesh and types it was traced with), or without
    it in the caller's.
    """
    params = eqn.primitive.get_bind_params({**eqn.params, **(params or {})})
    if isinstance(params, tuple):  # JAX before 0.7: (sub-functions, parameters)
        subfuns, params = params
        operands = [*subfuns, *operands]
    with eqn.ctx.manager if its_context else contextlib.nullcontext():
        return eqn.primitive.bind(*operands, **params)


def live(closed: jax.extend.core.ClosedJaxpr, args: list) -> tuple:
    """``(jaxpr, args)``: a closed jaxpr without the equations no output (or effect) needs.

    Its constants become its first inputs, before ``args``; the inputs nothing reads are
    dropped, and their arguments with them.
    """
    jaxpr = _pe.convert_constvars_jaxpr(closed.jaxpr)
    jaxpr, used = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    args = [x for x, use in zip([*closed.consts, *args], used, strict=True) if use]
    return jaxpr, args


def scan_operands(params, operands: list) -> tuple[list, list, list]:
    """A ``scan``'s operands split into constants, carry and scanned arrays.

    JAX 0.11 keeps that split as a flat tree (``ft_in``), earlier JAX as two counts.
    """
    if "ft_in" in params:
        return tuple(list(part) for part in params["ft_in"].update(operands).unpack())
    return _split(operands, params["num_consts"], params["num_carry"])


def while_operands(params, operands: list) -> tuple[list, list, list]:
    """A ``while``'s operands split into its condition's constants, its body's and the carry."""
    return _split(operands, params["cond_nconsts"], params["body_nconsts"])


def _split(xs: list, first: int, second: int) -> tuple[list, list, list]:
    return xs[:first], xs[first : first + second], xs[first + second :]


# ``jax.nn.dot_product_attention(..., return_residual=True)`` (its log-sum-exp): JAX 0.7 and after.
JAX_NN_GIVES_LSE = "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters


# Pallas kernels inside ``shard_map`` (the ring's steps by the kernel): JAX 0.7 and after. Before,
# their lowering wants a mesh context and the interpreter's values came out wrong (JAX 0.6.2).
PALLAS_UNDER_SHARD_MAP = jax.__version_info__ >= (0, 7)

# The Mosaic GPU kernel is written for Mosaic GPU's Warpgroup semantics, whose layout inference
# JAX 0.10 cannot solve for it (tried); 0.11 and later do, and have the GPU simulator.
MOSAIC_GPU_KERNEL = jax.__version_info__ >= (0, 11)
if MOSAIC_GPU_KERNEL:
    from jax.experimental.pallas import mosaic_gpu as _plgpu

    GPU_SIMULATOR: tuple = (_plgpu.InterpretGPUParams,)
else:
    GPU_SIMULATOR = ()
# A ``wgmma`` into an accumulator given its value (``pl.run_state(...)(plgpu.ACC.init(x))``) on
# the GPU simulator: JAX 0.12 and after. JAX 0.11's lowers no jaxpr with its effect (on a GPU
# it lowers from 0.11).
SIMULATES_WGMMA_INTO = jax.__version_info__ >= (0, 12)


def triton_atomic_add(ref, index, value) -> None:
    """Pallas's atomic add on a GPU.

    ``pallas.triton.atomic_add``; ``pallas.atomic_add`` before JAX 0.7, whose indexer puts a
    constant index on the device with ``device_put``, which Triton does not lower: a constant is
    given as a value computed in the kernel.
    """
    if hasattr(pltriton, "atomic_add"):
        pltriton.atomic_add(ref, index, value)
        return
    computed = [i if isinstance(i, (pl.Slice, jax.core.Tracer)) else lax.full((), i) for i in index]
    pl.atomic_add(ref, tuple(computed), value)


def atomic_kind(params) -> str:
    """The operation of a Pallas ``atomic_rmw`` equation (``"ADD"``, …): its enum is private."""
    return params["atomic_type"].name


# --- the transformations a call is made under ---------------------------------------------------


def enclosing_traces():
    """The traces a call is made under, innermost first."""
    trace = getattr(_core, "trace_ctx", None) and _core.trace_ctx.trace
    while trace is not None:
        yield trace
        trace = getattr(trace, "parent_trace", None)


def is_batching(trace) -> bool:
    return isinstance(trace, _batching.BatchTrace)


def is_jvp(trace) -> bool:
    return isinstance(trace, _ad.JVPTrace)


def is_differentiating(trace) -> bool:
    """Forward mode's trace, or reverse mode's linearization."""
    return isinstance(trace, (_ad.JVPTrace, _ad.LinearizeTrace))


def carries(leaves, trace) -> bool:
    """Whether some leaf is (or, under ``vmap`` or reverse mode, holds) a tracer of ``trace``."""
    for x in leaves:
        while isinstance(x, _core.Tracer) and x._trace is not trace:
            x = getattr(x, "val", getattr(x, "primal", None))
        if x is not None and isinstance(x, _core.Tracer):
            return True
    return False


def mapped_by_vmap(tree) -> bool:
    """Whether ``jax.vmap`` maps a call on ``tree``.

    Seen from inside the call: not a ``vmap`` of a ``jax.jit`` that traced the call first.
    """
    leaves = jax.tree.leaves(tree)
    return any(is_batching(t) and carries(leaves, t) for t in enclosing_traces())


def under_jvp_of(tree) -> bool:
    """Whether the innermost transformation of a call on ``tree``, through ``vmap``, is a JVP.

    That is ``jax.jvp`` or ``jax.jacfwd`` of the call, with a tangent in some leaf; a JVP further
    out, over a reverse-mode one (``jax.hessian``), differentiates the backward pass instead.
    Not seen from here: a JVP of a ``jax.jit`` or a ``jax.checkpoint`` that calls attention (the
    call is traced first, transformed afterwards).
    """
    trace = next((t for t in enclosing_traces() if not is_batching(t)), None)
    leaves = jax.tree.leaves(tree)
    if trace is None or not is_jvp(trace) or not carries(leaves, trace):
        return False
    # JAX before 0.7 linearizes reverse mode through a JVP trace too, its tangents then partial
    # evaluation's tracers.
    reverse = not getattr(jax.config, "jax_use_direct_linearize", True) and any(
        isinstance(tangent, _pe.JaxprTracer) for tangent in _tangents(leaves, trace)
    )
    return not reverse


def _tangents(leaves, trace):
    """The tangents ``trace`` carries in ``leaves`` (as :func:`carries` finds its tracers)."""
    for x in leaves:
        while isinstance(x, _core.Tracer) and x._trace is not trace:
            x = getattr(x, "val", getattr(x, "primal", None))
        if isinstance(x, _core.Tracer):
            yield x.tangent


def differentiated_twice(tree) -> bool:
    """Whether two derivatives enclose a call on ``tree``.

    That is ``jax.hessian``, or a jvp or grad of a ``jax.grad``: two differentiating traces
    (forward mode's or reverse mode's linearization) that the leaves carry. Not seen, as for
    :func:`under_jvp_of`, where a ``jax.jit`` between them traced the call first.
    """
    leaves = jax.tree.leaves(tree)
    return sum(is_differentiating(t) and carries(leaves, t) for t in enclosing_traces()) >= 2
