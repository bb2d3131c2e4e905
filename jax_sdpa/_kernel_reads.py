"""Reading the arrays a call closes over inside a kernel: each read at the indices it uses.

A mask rule, a block mask or a ``score_mod`` reads its arrays by value: ``slopes[h]``,
``doc[q_idx]``, ``classes[i, j]``. Traced into a kernel body, those are ``dynamic_slice`` and
``gather`` of whole arrays, which Triton and Mosaic do not lower (they load from memory at an
index, they do not slice registers). :func:`evaluate` runs a function of such arrays with each
array left in memory (a Pallas ref) until it is read: slices, dynamic slices and point gathers
of it become loads at those indices (``ref[pl.ds(h, 1)]``, ``ref[q_idx]``); anything else loads
it whole. Positions are followed from their ``iota`` (a
:class:`~jax_sdpa._kernel_positions.Run`): a read at a tile's positions is one load of a
contiguous window (``ref[pl.ds(q_offset, block_q)]``), which is all a TPU loads (Mosaic has no
load at a vector of indices). The gradients of a ``score_mod``'s arrays are the transposes of
those reads (``scatter-add`` into zeros, placed in a row of a table by
``dynamic_update_slice``), which the kernels do not lower either: they are kept as a
:class:`~jax_sdpa._kernel_scatters.Scatter` of points and updates until read, then spelled as
sums of one-hot products, ``d[m] = Σ_e g_e [idx_e = m]``, for arrays of up to ``ONE_HOT_MAX``
entries, or added into memory at their points by a kernel's ``atomic_add`` (and ``all``, ``any``
of booleans become ``min``, ``max`` of integers).

The function's values are unchanged (out-of-bounds reads are clamped, or filled, as ``lax``
defines them), but for a ``bfloat16`` array's gradient added into ``float32`` memory, which is
summed in ``float32``; only how its reads are spelled is. The interpreter runs the rewritten
program too, so the tests check the values of the program a GPU or TPU is given.
"""

import dataclasses
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jax_sdpa._kernel_positions import Run, Uniform, on_runs, read_run
from jax_sdpa._kernel_scatters import Zeros, on_scatters, scatter_add
from jax_sdpa._kernel_values import (
    Joined,
    Lazy,
    Unread,
    fill_value,
    in_bounds,
    index_arrays,
    is_zero,
    value,
)
from jax_sdpa._masks import all_of
from jax_sdpa._user_functions import bind, scan_operands, while_operands


@dataclasses.dataclass(frozen=True)
class _Expanded(Lazy):
    """A point gather's result, ``value`` with ``ones`` trailing axes of size 1 still to add."""

    value: Any
    ones: int

    def read(self):
        return self.value.reshape(self.value.shape + (1,) * self.ones)


def evaluate(fn, refs: list, *args):
    """``fn(*values of refs, *args)``, each ref read only where and as ``fn`` reads it."""
    avals = [jax.ShapeDtypeStruct(ref.shape, ref.dtype) for ref in refs]
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*avals, *args)
    unread = [Unread(ref, tuple(pl.ds(0, n) for n in ref.shape)) for ref in refs]
    outs = _eval(closed.jaxpr, closed.consts, [*unread, *jax.tree.leaves(args)])
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def _eval(jaxpr, consts, args) -> list:
    env = {}

    def read(var):
        if isinstance(var, jax.extend.core.Literal):
            return np.asarray(var.val, var.aval.dtype)
        return env[var]

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
    return [value(read(v)) for v in jaxpr.outvars]


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
    if name == "dynamic_slice" and isinstance(first, Unread):
        return first.narrowed(invals[1:], params["slice_sizes"])
    if name == "slice" and isinstance(first, Unread) and params.get("strides") is None:
        limits = zip(params["start_indices"], params["limit_indices"], strict=True)
        sizes = [b - a for a, b in limits]
        return first.narrowed(params["start_indices"], sizes)
    if name == "squeeze" and isinstance(first, Unread):
        return first.dropped(params["dimensions"])
    if name == "reshape" and isinstance(first, Unread) and _drops_leading_ones(first, params):
        return first.dropped(range(len(first.shape) - len(params["new_sizes"])))
    if name == "squeeze" and isinstance(first, _Expanded):
        return _squeezed(first, params["dimensions"])
    if name == "concatenate" and params["dimension"] == eqn.outvars[0].aval.ndim - 1:
        return Joined(list(invals))
    if name == "gather" and isinstance(first, Unread) and _point_gather(eqn, first):
        return _gather(first, invals[1], params)
    lazy = on_runs(eqn, invals) or on_scatters(eqn, invals)
    if lazy is not None:
        return lazy
    if name == "broadcast_in_dim" and is_zero(first) and not params["broadcast_dimensions"]:
        return Zeros(tuple(params["shape"]), eqn.outvars[0].aval.dtype)
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
        return scatter_add(eqn, *invals)
    invals = [value(x) for x in invals]
    if name == "dynamic_update_slice":
        return _updated(*invals)
    if name in ("reduce_and", "reduce_or"):  # Triton reduces numbers, not booleans
        reduce = lax.reduce_min if name == "reduce_and" else lax.reduce_max
        return reduce(invals[0].astype(jnp.int32), params["axes"]) > 0
    return bind(eqn, invals)


def _drops_leading_ones(x: Unread, params) -> bool:
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


def _point_gather(eqn, operand: Unread) -> bool:
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


def _gather(operand: Unread, indices, params):
    """A point gather: loads at the points (one contiguous load for a run of positions)."""
    ones = 0 if params["dimension_numbers"].collapsed_slice_dims else len(operand.shape)
    operand, indices, inside = _along_a_run(operand, indices)
    value = _gathered(operand, indices, params)
    if params["mode"] == lax.GatherScatterMode.FILL_OR_DROP and inside is not None:
        value = jnp.where(inside, value, fill_value(params["fill_value"], value.dtype))
    return _Expanded(value, ones)


def _along_a_run(operand: Unread, indices):
    """A gather at positions along one axis and one index along the others, as a 1-D gather.

    ``(operand, indices, inside)``: the operand's row at those indices (clamped), the positions,
    and whether the indices lie inside (None if nothing was taken). Any other gather is as given.
    """
    parts = indices.parts if isinstance(indices, Joined) else []
    runs = [n for n, part in enumerate(parts) if isinstance(part, Run)]
    if len(parts) != len(operand.shape) or len(runs) != 1:
        return operand, indices, None
    scalars = {n: part.scalar for n, part in enumerate(parts) if isinstance(part, Uniform)}
    if len(scalars) != len(parts) - 1:
        return operand, indices, None
    inside = in_bounds(list(scalars.values()), [operand.shape[n] for n in scalars])
    return operand.taken(scalars), parts[runs[0]], inside


def _gathered(operand: Unread, indices, params):
    """The values of a point gather, before axes of 1 are added."""
    rank = len(operand.shape)
    if isinstance(indices, Run):
        if rank == 1 and 0 < indices.size <= operand.shape[0]:
            return read_run(operand, indices, params)
        indices = indices.read()  # a run longer than the array
    points = index_arrays(indices, rank)
    value = operand.at_points(points)
    if params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:  # read clamped, then filled
        inside = in_bounds(points, operand.shape)
        value = jnp.where(inside, value, fill_value(params["fill_value"], value.dtype))
    return value


def _updated(operand, update, *starts):
    """``dynamic_update_slice`` of a single entry, as a select against its position."""
    if update.size != 1:
        return lax.dynamic_update_slice(operand, update, starts)
    at = all_of(
        lax.broadcasted_iota(jnp.int32, operand.shape, axis)
        == jnp.clip(start, 0, operand.shape[axis] - 1).astype(jnp.int32)
        for axis, start in enumerate(starts)
    )
    return jnp.where(at, update.reshape(()), operand)


def _while(params, invals):
    """A while loop rebuilt around the evaluation of its bodies.

    A loop mapped by ``jax.vmap`` has a predicate per element: it runs while any holds, each
    element kept where its own does not (as JAX's lowering of such a loop does).
    """
    cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
    cond_consts, body_consts, carry = while_operands(params, invals)
    carry = [value(x) for x in carry]

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
    return lax.switch(value(index), branches)


def _scan(params, invals):
    jaxpr = params["jaxpr"]
    consts, carry, xs = scan_operands(params, invals)
    carry, xs = [value(x) for x in carry], [value(x) for x in xs]

    def body(carry, x):
        outs = _eval(jaxpr.jaxpr, jaxpr.consts, [*consts, *carry, *x])
        return outs[: len(carry)], outs[len(carry) :]

    carry, ys = lax.scan(
        body, carry, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )
    return [*carry, *ys]
