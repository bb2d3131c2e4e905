"""Mapping a single-head function over heads and batch with ``jax.vmap``, pytrees in and out.

Query head ``n`` uses key/value head ``n // G`` (GQA; MQA when ``K = 1``): arguments per query
head lead with ``(K, G)``, arguments per key/value head with ``K``, and the function is mapped
twice, so keys and values are never copied ``G`` times. Throughout, a leading axis of size 1
means "the same for all" (a bias shared by every head, a mask shared by the batch): it is
dropped and not mapped (``in_axes=None``), the broadcasting of ``jax.nn``'s bias and mask.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
from jaxtyping import Array


class Result(NamedTuple):
    """What every implementation returns: the output, each row's log-sum-exp, the weights.

    ``weights`` is ``None`` where they are never formed (the chunked, decode and ring paths);
    ``max_scores``, each row's largest allowed score, ``None`` where it is not known (cuDNN).
    """

    out: Array
    lse: Array
    weights: Array | None
    max_scores: Array | None = None

    def returned(self, residual: bool, max_scores: bool) -> Array | tuple[Array, ...]:
        """What a public call returns: ``out``, and the log-sum-exp and max scores asked for."""
        extra = (self.lse,) * residual + (self.max_scores,) * max_scores
        return (self.out, *extra) if extra else self.out


def _split(tree: Any) -> tuple[Any, Any]:
    """``(args, in_axes)`` for ``jax.vmap`` over every leaf's leading axis; size 1 is shared."""
    leaves, treedef = jax.tree.flatten(tree)
    shared = [x.shape[0] == 1 for x in leaves]
    args = treedef.unflatten([x[0] if s else x for x, s in zip(leaves, shared, strict=True)])
    return args, treedef.unflatten([None if s else 0 for s in shared])


def over_heads(fn: Callable, groups: tuple[int, int], per_query: Any, per_kv: Any = ()) -> Any:
    """``fn(per_query, per_kv)`` for every query head, results stacked ``(K, G, ...)``.

    ``groups = (K, G)``: ``per_query`` is a pytree whose leaves lead with ``(K, G)``, or with
    ``(1, 1)`` where all heads share them; ``per_kv`` one whose leaves lead with ``K`` (or 1).
    ``fn`` sees one head's slices of each.
    """
    kv_heads, group = groups

    def kv_head(per_query, per_kv):
        args, axes = _split(per_query)
        each = jax.vmap(lambda q: fn(q, per_kv), in_axes=(axes,), axis_size=group)
        return each(args)

    args, axes = _split((per_query, per_kv))
    return jax.vmap(kv_head, in_axes=axes, axis_size=kv_heads)(*args)


def over_batch(
    fn: Callable, batch_shape: tuple[int, ...], *args: Any, sequential: bool = False
) -> Any:
    """``fn(*args)`` for each sequence: every leaf of ``args`` leads with ``batch_shape`` (or 1s).

    One ``jax.vmap`` per batch axis, or with ``sequential`` one ``lax.map``: one sequence after
    the other, so that a ``lax.cond`` in ``fn`` that depends on the sequence still branches
    (under ``vmap`` it would compute both sides). Unbatched (``batch_shape = ()``) calls ``fn``.
    """
    if not batch_shape:
        return fn(*args)

    def inner(*args):
        return over_batch(fn, batch_shape[1:], *args, sequential=sequential)

    if not sequential or batch_shape[0] == 1:  # (a batch of one: nothing to map over)
        args, axes = _split(args)
        return jax.vmap(inner, in_axes=axes, axis_size=batch_shape[0])(*args)
    leaves, treedef = jax.tree.flatten(args)
    shared = [x.shape[0] == 1 for x in leaves]

    pairs = list(zip(leaves, shared, strict=True))

    def one(sequence):
        mapped = iter(sequence)
        return inner(*treedef.unflatten([x[0] if s else next(mapped) for x, s in pairs]))

    return lax.map(one, [x for x, s in pairs if not s])
