"""Reading the arrays a call closes over inside a kernel: each read at the indices it uses.

A mask rule, a block mask or a ``score_mod`` reads its arrays by value: ``slopes[h]``,
``doc[q_idx]``, ``classes[i, j]``. Traced into a kernel body, those are ``dynamic_slice`` and
``gather`` of whole arrays, which Triton and Mosaic do not lower (they load from memory at an
index, they do not slice registers). :func:`evaluate` runs a function of such arrays with each
array left in memory (a Pallas ref) until it is read: slices, dynamic slices and point gathers
of it become loads at those indices (``ref[pl.ds(h, 1)]``, ``ref[q_idx]``); anything else loads
it whole. The gradients of a ``score_mod``'s arrays are the transposes of those reads
(``dynamic_update_slice`` and ``scatter-add`` into zeros), which the kernels do not lower
either: they become sums of one-hot products, ``d[m] = Σ_e g_e [idx_e = m]`` (and ``all``,
``any`` of booleans become ``min``, ``max`` of integers).

The function's values are unchanged (out-of-bounds reads are clamped, or filled, as ``lax``
defines them); only how its reads are spelled is. The interpreter runs the rewritten program
too, so the tests check the values of the program a GPU or TPU is given.
"""

import dataclasses
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


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
            start = jnp.clip(start, 0, length - size)
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


_LAZY = (_Unread, _Joined, _Expanded)


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
    """Whether a gather reads single entries: ``operand[idx[..., 0], idx[..., 1], …]``."""
    numbers, rank = eqn.params["dimension_numbers"], len(operand.shape)
    return (
        tuple(eqn.params["slice_sizes"]) == (1,) * rank
        and tuple(numbers.start_index_map) == tuple(range(rank))
        and not numbers.collapsed_slice_dims
        and not numbers.operand_batching_dims
        and tuple(numbers.offset_dims)
        == tuple(range(eqn.outvars[0].aval.ndim - rank, eqn.outvars[0].aval.ndim))
    )


def _gather(operand: _Unread, indices, params):
    rank = len(operand.shape)
    points = _points(indices, rank)
    value = operand.at_points(points)
    if params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:  # read clamped, then filled
        inside = _inside(points, operand.shape)
        value = jnp.where(inside, value, _fill_value(params["fill_value"], value.dtype))
    return _Expanded(value, rank)


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
    parts = indices.parts if isinstance(indices, _Joined) else [indices]
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


# The most entries a point scatter-add is rewritten for: its one-hot products hold this many
# per entry of the tile. Larger arrays (a table per position) keep the scatter, which runs in
# the interpreter and which Triton and Mosaic do not lower.
_ONE_HOT_MAX = 256


def _scatter_add(eqn, operand, indices, updates):
    """A point ``scatter-add`` (a point gather's transpose) as a sum of one-hot products."""
    numbers = eqn.params["dimension_numbers"]
    operand, updates = _value(operand), _value(updates)
    rank = operand.ndim
    point = (
        tuple(numbers.scatter_dims_to_operand_dims) == tuple(range(rank))
        and not numbers.inserted_window_dims
        and not numbers.operand_batching_dims
        and updates.size * rank == eqn.invars[1].aval.size
    )
    if not point or operand.size > _ONE_HOT_MAX:
        return _bind(eqn, [operand, _value(indices), updates])
    points = _points(indices, rank)
    if eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP:  # clamped, as its gather's
        points = [jnp.clip(p, 0, n - 1) for p, n in zip(points, operand.shape, strict=True)]
    values = updates.reshape(points[0].shape)[(...,) + (None,) * rank]
    entries = points[0].ndim
    hits = _all(
        point[(...,) + (None,) * rank]
        == lax.broadcasted_iota(point.dtype, (1,) * entries + operand.shape, entries + axis)
        for axis, point in enumerate(points)
    )
    summed = jnp.where(hits, values, 0).sum(axis=tuple(range(entries)))
    return operand + summed.astype(operand.dtype)


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
