"""One interpreter of jaxprs with rules by primitive: the library's two rewrites are rule sets.

The library evaluates two kinds of programs equation by equation. A user's ``score_mod`` or
``mask_mod`` is replayed per tile, inside ``jax.shard_map`` with every operand cast to vary over
the ring's axes (:mod:`jax_sdpa._user_functions`); a kernel's body is rewritten so that the
arrays it reads stay in memory until read, its reads become loads and its scatters one-hot sums
or atomic adds (:mod:`jax_sdpa._kernels.reads`). Both are :func:`interpret` with their
:class:`Rules`:

1. Each equation's operands are read (a literal with its own dtype, never JAX's weak one) and
   passed through ``rules.operand`` (the replay's cast to varying).
2. ``rules.table[primitive]`` is tried in order: the first rule that answers (anything but None)
   gives the equation's outputs, as the primitive's ``bind`` would. Precedence within a
   primitive is the order of its tuple (:func:`table` merges rule sets in the order given).
3. Unanswered, a call (``jit``, a custom derivative's function, ``checkpoint``) is interpreted
   in place with the same rules (its outputs left as they are: a value not read yet stays so),
   and a ``cond``, ``scan`` or ``while`` is traced again around the
   interpretation of its bodies, so that the rules reach every equation; with ``rules.inline``
   off they are bound as they are.
4. Any other equation is bound by ``rules.bind`` (as ``jax.core.eval_jaxpr`` binds it, by
   default), its operands first made arrays by ``rules.array`` (the kernel's values not read
   yet are read then).

A ``while`` mapped by ``jax.vmap`` (its predicate per element) runs while any element's holds,
each element kept where its own does not, as JAX's lowering of such a loop does.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jax_sdpa._jax_compat import CALLS, bind, scan_operands, while_operands

Rule = Callable  # rule(eqn, operands) -> the equation's outputs as bind gives them, or None


def _identity(x):
    return x


@dataclasses.dataclass(frozen=True)
class Rules:
    """How :func:`interpret` evaluates equations (its steps 1–4)."""

    table: Mapping[str, tuple[Rule, ...]] = dataclasses.field(default_factory=dict)
    operand: Callable = _identity
    array: Callable = _identity
    inline: bool = True
    bind: Callable = bind  # bind(eqn, operands): as jax.core.eval_jaxpr binds, by default


def table(*rule_sets: Mapping[str, tuple[Rule, ...]]) -> dict[str, tuple[Rule, ...]]:
    """The rule sets merged: for each primitive, the first set's rules before the second's."""
    merged: dict[str, tuple[Rule, ...]] = {}
    for rule_set in rule_sets:
        for name, rules in rule_set.items():
            merged[name] = merged.get(name, ()) + tuple(rules)
    return merged


def interpret(jaxpr: Jaxpr, consts, args, rules: Rules, *, kept: bool = False) -> list:
    """The outputs of ``jaxpr`` on ``args``, its constants ``consts``, under ``rules``.

    Made arrays by ``rules.array``, or (``kept``: a call interpreted in place) as the rules
    left them.
    """
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    evaluate(jaxpr.eqns, env, rules)
    outs = [read(env, var) for var in jaxpr.outvars]
    return outs if kept else [rules.array(x) for x in outs]


def read(env: dict, var):
    """A variable's value, or a literal's, in the literal's own dtype (strong, not weak)."""
    return np.asarray(var.val, var.aval.dtype) if isinstance(var, Literal) else env[var]


def evaluate(eqns, env: dict, rules: Rules) -> None:
    """Evaluates ``eqns`` in order into ``env`` (variable → value) under ``rules``."""
    for eqn in eqns:
        operands = [rules.operand(read(env, var)) for var in eqn.invars]
        outs = _equation(eqn, operands, rules)
        env.update(zip(eqn.outvars, outs, strict=True))


def answer(rules: tuple[Rule, ...], eqn, operands: list):
    """What the first of ``rules`` that answers (anything but None) makes of ``eqn``, or None."""
    answers = (rule(eqn, operands) for rule in rules)
    return next((outs for outs in answers if outs is not None), None)


def _equation(eqn, operands: list, rules: Rules) -> list:
    """One equation's outputs, as a list."""
    name = eqn.primitive.name
    outs = answer(rules.table.get(name, ()), eqn, operands)
    if outs is not None:
        return outs if eqn.primitive.multiple_results else [outs]
    if rules.inline and name in CALLS:
        return interpret(*_program(eqn.params[CALLS[name]]), operands, rules, kept=True)
    if rules.inline and name in _CONTROL_FLOW:
        return _CONTROL_FLOW[name](eqn.params, operands, rules)
    outs = rules.bind(eqn, [rules.array(x) for x in operands])
    return outs if eqn.primitive.multiple_results else [outs]


def _program(sub) -> tuple:
    """A parameter's jaxpr as ``(jaxpr, consts)``."""
    return (sub.jaxpr, sub.consts) if isinstance(sub, ClosedJaxpr) else (sub, ())


def _while(params, operands: list, rules: Rules) -> list:
    cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
    cond_consts, body_consts, carry = while_operands(params, operands)
    # The condition's constants are read once, before the loop (Pallas before JAX 0.7 has no
    # condition that reads memory).
    cond_consts, carry = [rules.array(x) for x in cond_consts], [rules.array(x) for x in carry]

    def holds(carry):
        return interpret(*_program(cond_jaxpr), [*cond_consts, *carry], rules)[0]

    def cond(carry):
        pred = holds(carry)
        return pred if pred.ndim == 0 else pred.astype(jnp.int32).max() > 0

    def body(carry):
        new = interpret(*_program(body_jaxpr), [*body_consts, *carry], rules)
        if cond_jaxpr.jaxpr.outvars[0].aval.ndim == 0:
            return new  # (the body must not read the bound: Triton's loops would lose it)
        pred = holds(carry)
        expand = lambda x: pred.reshape(pred.shape + (1,) * (x.ndim - pred.ndim))  # noqa: E731
        return [jnp.where(expand(n), n, c) for n, c in zip(new, carry, strict=True)]

    return lax.while_loop(cond, body, carry)


def _cond(params, operands: list, rules: Rules) -> list:
    index, *operands = operands
    branches = [
        functools.partial(interpret, *_program(branch), operands, rules)
        for branch in params["branches"]
    ]
    return lax.switch(rules.array(index), branches)


def _scan(params, operands: list, rules: Rules) -> list:
    consts, carry, xs = scan_operands(params, operands)
    carry, xs = [rules.array(x) for x in carry], [rules.array(x) for x in xs]

    def body(carry, x):
        outs = interpret(*_program(params["jaxpr"]), [*consts, *carry, *x], rules)
        return outs[: len(carry)], outs[len(carry) :]

    carry, ys = lax.scan(
        body, carry, xs, length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )
    return [*carry, *ys]


_CONTROL_FLOW = {"while": _while, "cond": _cond, "scan": _scan}
