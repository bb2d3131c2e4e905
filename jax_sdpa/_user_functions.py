r"""The user's functions (``score_mod``, ``mask_mod``) as programs: traced once, replayed per tile.

A mod is a Python closure over arrays (ALiBi slopes, a bias table, document ids). Each call
traces it to a jaxpr whose inputs are its scalar arguments *and* the arrays it closed over (as
``jax.closure_convert`` does, but for every array, traced or not): the arrays then travel with
the call's other arrays — into ``jax.jit``, through the implementations' own backward passes,
round a ring of devices — and get gradients, while every tile replays the jaxpr.

Inside ``jax.shard_map``, whose default ``check_vma=True`` types each value by the mesh axes it
varies over, a replay must agree with those types: the tile's positions vary over the ring while
a literal or a table in the trace does not. There the replay casts every operand to the axes its
inputs vary over (``lax.pcast(..., to="varying")``, a no-op at run time), as ``jax.numpy`` does
when it meets such operands while the user's function runs.

All indices are :data:`~jax_sdpa._indices.INDEX` (int32), also where ``jax_enable_x64`` is on.
"""

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

from jax_sdpa._indices import INDEX
from jax_sdpa._masks import MaskRule, rule_class, static_field

INDEX_ARGUMENT = jax.ShapeDtypeStruct((), INDEX)

_EVALUATORS: dict = {}  # jaxpr text and shapes → its evaluator; cleared when it grows large


def _axes_of(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # JAX 0.10; before, the axes were ``aval.vma``
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


def varying_axes(tree) -> frozenset:
    """The mesh axes any leaf of ``tree`` varies over (``shard_map``'s types; empty outside)."""
    return frozenset().union(*map(_axes_of, jax.tree.leaves(tree)))


def vary(x, axes: frozenset):
    """``x`` cast to vary over ``axes`` too (a no-op at run time)."""
    missing = tuple(sorted(axes - varying_axes(x), key=str))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # JAX before 0.8.2


# The primitives that call a jaxpr as a function, and the parameter that holds it: a replay
# inside shard_map evaluates the callee itself (its jaxpr is typed for the trace's operands).
# ("pjit" is JAX's name for "jit" before 0.7.)
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "checkpoint": "jaxpr",
}


def _replayed(closed, axes: frozenset):
    """A function of a jaxpr's inputs that replays it, every operand varying over ``axes``."""
    if isinstance(closed, Jaxpr):
        closed = ClosedJaxpr(closed, ())
    return lambda *args: _replay_varying(closed.jaxpr, list(closed.consts), list(args), axes)


def _control_flow(eqn, operands: list, axes: frozenset) -> list:
    """A ``cond``, ``scan`` or ``while`` traced again, from its replayed jaxprs."""
    p = eqn.params
    if eqn.primitive.name == "cond":
        branches = [_replayed(branch, axes) for branch in p["branches"]]
        return lax.switch(operands[0], branches, *operands[1:])
    if eqn.primitive.name == "scan":
        consts, carry, xs = scan_operands(p, operands)
        body = _replayed(p["jaxpr"], axes)

        def step(carry, x):
            outs = body(*consts, *carry, *x)
            return outs[: len(carry)], outs[len(carry) :]

        carry, ys = lax.scan(step, carry, xs, p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]
    cond_consts, body_consts, init = while_operands(p, operands)
    cond, body = _replayed(p["cond_jaxpr"], axes), _replayed(p["body_jaxpr"], axes)
    return lax.while_loop(
        lambda c: cond(*cond_consts, *c)[0], lambda c: body(*body_consts, *c), init
    )


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


def _replay_varying(jaxpr: Jaxpr, consts: list, args: list, axes: frozenset) -> list:
    """``jaxpr`` evaluated with every operand cast to vary over ``axes``.

    A callee (a ``jit`` inside ``jax.numpy``, a ``custom_jvp`` function) is evaluated in place,
    so a custom derivative rule in the user's function gives way to the derivative of what it
    computes; a ``cond``, ``scan`` or ``while`` is traced again from its replayed jaxprs; the
    ``pvary`` casts of the trace are already done.
    """
    env = {}

    def read(var):
        return jnp.asarray(var.val, var.aval.dtype) if isinstance(var, Literal) else env[var]

    env.update(zip(jaxpr.constvars, (vary(x, axes) for x in consts), strict=True))
    env.update(zip(jaxpr.invars, (vary(x, axes) for x in args), strict=True))
    for eqn in jaxpr.eqns:
        operands = [vary(read(var), axes) for var in eqn.invars]
        name = eqn.primitive.name
        if name in ("pvary", "pcast"):
            outs = operands
        elif name in _CALLS:
            outs = _replayed(eqn.params[_CALLS[name]], axes)(*operands)
        elif name in ("cond", "scan", "while"):
            outs = _control_flow(eqn, operands, axes)
        else:
            outs = eqn.primitive.bind(*operands, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(var) for var in jaxpr.outvars]


def _replay(closed: ClosedJaxpr, args: list):
    """The one result of ``closed`` on ``args``."""
    axes = varying_axes(args)
    if not axes:
        return jaxpr_as_fun(closed)(*args)[0]
    return _replay_varying(closed.jaxpr, list(closed.consts), args, axes)[0]


def _hoisted(fn, args: list) -> tuple:
    """``(g, arrays)``: ``fn(*args) == g(*args, *arrays)`` for every array ``fn`` closes over.

    As ``jax.closure_convert``, but every closed-over array is hoisted, traced or not: a table
    the function closes over is an input of the compiled program, not a constant baked into it.
    ``fn`` is traced afresh on every call (it may read values that changed since), and ``g`` is
    shared by every function that traces to the same program with the same shapes, so that a
    call with new values, or with a new but equal lambda, reuses the compiled program.
    ``g.reads`` says which of ``args`` the function reads.
    """
    program, arrays = _precomputed(jax.make_jaxpr(lambda *a: fn(*a))(*args), len(args))
    key = (str(program.jaxpr), tuple(jax.typeof(x) for x in (*args, *arrays)))
    if key not in _EVALUATORS:
        if len(_EVALUATORS) > 256:
            _EVALUATORS.clear()
        count = len(args)

        def evaluate(*args_and_arrays):
            return _replay(program, [*args_and_arrays[count:], *args_and_arrays[:count]])

        jaxpr = program.jaxpr
        read = {id(x) for eqn in jaxpr.eqns for x in eqn.invars} | {id(x) for x in jaxpr.outvars}
        evaluate.reads = tuple(id(x) in read for x in jaxpr.invars[len(jaxpr.invars) - count :])
        _EVALUATORS[key] = evaluate
    return _EVALUATORS[key], arrays


def _precomputed(closed: ClosedJaxpr, count: int) -> tuple[ClosedJaxpr, tuple]:
    """A function's program split in two: what it computes from its closed-over arrays alone.

    ``(program, arrays)``: that part computed now (``arrays``), and the rest, a program of
    those arrays and then the ``count`` arguments.

    ``table.astype(jnp.bfloat16)[h, i - j]`` casts the table once here, not in every tile: the
    tiles (and a kernel's body, which takes no operation over a whole array of any shape) keep
    only what depends on the positions. The gradients of the arrays flow through the part
    computed here as through any JAX function.
    """
    consts = list(closed.consts)
    program = ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ())
    known, unknown, _, residuals = pe.partial_eval_jaxpr_nounits(
        program, [False] * len(consts) + [True] * count, instantiate=True
    )
    axes = varying_axes(consts)
    if axes:
        results = _replay_varying(known.jaxpr, list(known.consts), consts, axes)
    else:
        results = jaxpr_as_fun(known)(*consts)
    # (the unknown part takes the residuals before the arguments)
    return unknown, tuple(results[len(results) - len(residuals) :])


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
    (hoisted as ``jax.closure_convert`` does), which are leaves of the rule; ``uses_head`` is
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
