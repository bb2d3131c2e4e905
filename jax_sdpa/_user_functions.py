r"""The user's functions (``score_mod``, ``mask_mod``) as programs: traced once, replayed per tile.

A mod is a Python closure over arrays (ALiBi slopes, a bias table, document ids). Each call
traces it to a jaxpr whose inputs are its scalar arguments *and* the arrays it closed over (as
``jax.closure_convert`` does, but for every array, traced or not); what it computes from those
arrays alone (``jnp.exp(log_slopes)``, a table cast to bfloat16) is computed once, ahead, and
its results take the arrays' place. They travel with the call's other arrays — into
``jax.jit``, through the implementations' own backward passes, round a ring of devices — and
their gradients reach the user's arrays, while every tile replays the rest of the jaxpr.

Inside ``jax.shard_map``, whose default ``check_vma=True`` types each value by the mesh axes it
varies over, a replay must agree with those types: the tile's positions vary over the ring while
a literal or a table in the trace does not. There the replay casts every operand to the axes its
inputs vary over (``lax.pcast(..., to="varying")``, a no-op at run time), as ``jax.numpy`` does
when it meets such operands while the user's function runs.

All indices are :data:`~jax_sdpa._indices.INDEX` (int32), also where ``jax_enable_x64`` is on.
"""

import contextlib
import contextvars
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Jaxpr, Literal

from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import VARYING_CASTS, bind, cast_to_varying, varying_axes_of
from jax_sdpa._jaxpr import Rules, evaluate, read
from jax_sdpa._masks import MaskRule, rule_class, static_field

INDEX_ARGUMENT = jax.ShapeDtypeStruct((), INDEX)

_EVALUATORS: dict = {}  # jaxpr text and shapes → its evaluator; cleared when it grows large


def varying_axes(tree) -> frozenset:
    """The mesh axes any leaf of ``tree`` varies over (``shard_map``'s types; empty outside)."""
    return frozenset().union(*map(varying_axes_of, jax.tree.leaves(tree)))


def vary(x, axes: frozenset):
    """``x`` cast to vary over ``axes`` too (a no-op at run time)."""
    missing = tuple(sorted(axes - varying_axes(x), key=str))
    return cast_to_varying(x, missing) if missing else x


# Inside shard_map the trace's own casts are already done: the replay casts every operand.
_ALREADY_VARYING = {
    name: (lambda eqn, operands: operands if eqn.primitive.multiple_results else operands[0],)
    for name in VARYING_CASTS
}


def _replay(eqns, env: dict, axes: frozenset) -> None:
    """Evaluates ``eqns`` into ``env``: outside ``shard_map`` (no ``axes``) as JAX binds them.

    Inside, every operand is cast to vary over ``axes`` (:func:`vary`) and each equation bound
    in the context of the call that replays it (its mesh, its types), not the one the function
    was traced in: an evaluator is shared by every call whose function traces to the same
    program. Within :func:`float64_as_float32`, every float64 operand and result is float32.
    Either way a callee (a ``jit`` inside ``jax.numpy``, a ``custom_jvp`` function) is
    interpreted in place, so a custom derivative rule in the user's function gives way to the
    derivative of what it computes; a ``cond``, ``scan`` or ``while`` is traced again around
    its replayed bodies.
    """
    narrowed = _FLOAT32.get()
    if not axes and not narrowed:
        return evaluate(eqns, env, Rules(inline=False))

    def operand(x):
        x = vary(x, axes) if axes else x
        wide = narrowed and getattr(x, "dtype", None) == jnp.float64
        return x.astype(jnp.float32) if wide else x

    def bound(eqn, operands: list):
        params = {k: jnp.float32 for k in _DTYPES if narrowed and eqn.params.get(k) == jnp.float64}
        return bind(eqn, operands, its_context=not axes, params=params)

    table = _ALREADY_VARYING if axes else {}
    return evaluate(eqns, env, Rules(table=table, operand=operand, bind=bound))


# The parameters that name a result's dtype (convert_element_type, iota, dot_general).
_DTYPES = ("new_dtype", "dtype", "preferred_element_type")

_FLOAT32 = contextvars.ContextVar("float64_as_float32", default=False)


@contextlib.contextmanager
def float64_as_float32():
    """Within it, the user's functions compute float64 as float32 (replayed so: :func:`_replay`).

    For a kernel backend that computes no float64 (Mosaic GPU), whose programs hold the arrays
    the functions closed over as float32 (``jax_enable_x64``'s ``jnp.array([0.5, 0.25])``).
    Only where ``jax_enable_x64`` is on (elsewhere there is no float64): there the replay
    interprets the functions' callees in place, and a custom derivative rule inside gives way
    to the derivative of what it computes, as inside ``shard_map``.
    """
    token = _FLOAT32.set(jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64)
    try:
        yield
    finally:
        _FLOAT32.reset(token)


def _hoisted(fn, args: list) -> tuple:
    """``(g, arrays)``: ``fn(*args) == g(*args, *arrays)``, ``arrays`` what ``fn`` closes over.

    As ``jax.closure_convert``, but every closed-over array is hoisted, traced or not: a table
    the function closes over is an input of the compiled program, not a constant baked into it.
    What the function computes from those arrays alone is computed here, once, and ``arrays``
    are its results (:func:`_precomputed`). ``fn`` is traced afresh on every call (it may read
    values that changed since), and ``g`` is shared by every function that traces to the same
    program with the same shapes, so that a call with new values, or with a new but equal
    lambda, reuses the compiled program. ``g.reads`` says which of ``args`` the function reads.
    """
    closed = jax.make_jaxpr(lambda *a: fn(*a))(*args)
    jaxpr, consts = closed.jaxpr, list(closed.consts)
    ahead, rest, residuals = _precomputed(jaxpr)
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    _replay(ahead, env, varying_axes(consts))
    arrays = tuple(env[var] for var in residuals)
    key = (str(jaxpr), tuple(jax.typeof(x) for x in (*args, *consts)))
    if key not in _EVALUATORS:
        if len(_EVALUATORS) > 256:
            _EVALUATORS.clear()
        count = len(args)

        def evaluator(*args_and_arrays):
            env = dict(zip(residuals, args_and_arrays[count:], strict=True))
            env.update(zip(jaxpr.invars, args_and_arrays[:count], strict=True))
            _replay(rest, env, varying_axes(args_and_arrays))
            return read(env, jaxpr.outvars[0])

        used = {id(var) for eqn in rest for var in eqn.invars} | {id(var) for var in jaxpr.outvars}
        evaluator.reads = tuple(id(x) in used for x in jaxpr.invars)
        _EVALUATORS[key] = evaluator
    return _EVALUATORS[key], arrays


def _precomputed(jaxpr: Jaxpr) -> tuple[list, list, list]:
    """What a function computes from the arrays it closes over alone, to compute ahead.

    ``(ahead, rest, residuals)``: the equations to replay ahead, those to replay per tile, and
    the variables of the first (or the arrays) that the rest reads. Ahead: the equations that
    read those arrays (the jaxpr's constants) and nothing else but literals, and those that
    make an array of literals alone (``jnp.arange(4)``, a table written in the function).

    ``table.astype(jnp.bfloat16)[h, i - j]`` casts the table once, ahead, not in every tile:
    the tiles (and a kernel's body, which takes no operation over a whole array of any shape)
    keep only what depends on the arguments. The gradients of the arrays flow through the part
    computed ahead as through any JAX function. A scalar of literals alone stays (a ``-jnp.inf``
    in a ``jnp.where``): a constant, not an array; it is also replayed ahead where an equation
    there reads it.
    """
    derived, constants, ahead, moved = set(jaxpr.constvars), set(), [], []
    for eqn in jaxpr.eqns:
        variables = [var for var in eqn.invars if not isinstance(var, Literal)]
        if eqn.effects or not all(var in derived or var in constants for var in variables):
            continue
        ahead.append(eqn)
        if any(var in derived for var in variables) or any(v.aval.ndim for v in eqn.outvars):
            derived.update(eqn.outvars)
            moved.append(eqn)
        else:
            constants.update(eqn.outvars)
    skipped = {id(eqn) for eqn in moved}
    rest = [eqn for eqn in jaxpr.eqns if id(eqn) not in skipped]
    used = [var for eqn in rest for var in eqn.invars] + list(jaxpr.outvars)
    variables = (var for var in used if not isinstance(var, Literal))
    residuals = list(dict.fromkeys(var for var in variables if var in derived))
    return ahead, rest, residuals


def convert(name: str, fn, signature: str, example: tuple, kind: str) -> tuple:
    """``fn`` with the arrays it closes over as arguments (:func:`_hoisted`), checked.

    ``example`` holds the ``jax.ShapeDtypeStruct`` of each scalar argument; ``kind`` is what it
    must return, ``"float"`` or ``"bool"``.
    """
    if not callable(fn):
        raise TypeError(f"`{name}` must be a function {signature}; got {type(fn).__name__}.")
    args = [jnp.zeros(x.shape, x.dtype) for x in example]
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as error:
        raise TypeError(
            f"`{name}` must accept {len(example)} scalars {signature}; {error}."
        ) from None
    except ValueError:  # no signature to inspect (some built-ins): calling it will tell
        pass
    out = jax.eval_shape(fn, *args)
    is_array = isinstance(out, jax.ShapeDtypeStruct)
    want = jnp.floating if kind == "float" else jnp.bool_
    if not is_array or out.shape != () or not jnp.issubdtype(out.dtype, want):
        got = f"{out.dtype}{list(out.shape)}" if is_array else type(out).__name__
        raise TypeError(f"`{name}` must return one {kind} scalar; got {got}.")
    return _hoisted(fn, args)


@rule_class
class FunctionMask(MaskRule):
    """A ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` of scalars, evaluated entry by entry.

    ``fn`` takes the four indices and then ``consts``, the arrays ``mask_mod`` closed over
    (hoisted as ``jax.closure_convert`` does, or what it computes from them alone: see
    :func:`_hoisted`), which are leaves of the rule; ``uses_head`` is
    False where it ignores its head argument (then one head's tiles stand for all), and
    ``uses_batch`` where it ignores its batch argument. Its ranges
    claim nothing (``opaque``): the chunked path evaluates it on each tile to skip the tiles
    it excludes.
    """

    fn: Callable = static_field()
    consts: tuple = ()  # shared by the batch, as every field that says nothing (with_batch)
    uses_head: bool = static_field(True)
    uses_batch: bool = static_field(True)

    @property
    def opaque(self) -> bool:
        return True

    @property
    def per_head(self) -> bool:
        return self.uses_head

    def __call__(self, q_idx, kv_idx):
        return self.at(q_idx, kv_idx, 0, 0)

    def at(self, q_idx, kv_idx, batch, head):
        def entry(q, kv):
            return self.fn(batch, head, q, kv, *self.consts)

        if jnp.ndim(q_idx) == jnp.ndim(kv_idx) == 2 and q_idx.shape[1] == kv_idx.shape[0] == 1:
            # A grid: what depends on the query alone (a document id) is computed once a row.
            return jax.vmap(jax.vmap(entry, (None, 0)), (0, None))(q_idx[:, 0], kv_idx[0])
        q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
        return jax.vmap(entry)(q_idx.ravel(), kv_idx.ravel()).reshape(q_idx.shape)


def function_mask(mask_mod) -> FunctionMask:
    """A user's ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` as a rule, checked."""
    signature = "mask_mod(batch, head, q_idx, kv_idx) -> bool"
    fn, consts = convert("mask_mod", mask_mod, signature, (INDEX_ARGUMENT,) * 4, "bool")
    batch, head = fn.reads[:2]
    return FunctionMask(fn, consts, uses_head=head, uses_batch=batch)
