"""A call's arrays fitted to its batch axes: shared by every sequence, or one per sequence.

:func:`shared` gives an array a leading 1 per batch axis; :func:`with_batch` does it for each
array field of a mask rule, by the axes the field declares (``_masks.per_sequence``).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from jax_sdpa._indices import INDEX, Index
from jax_sdpa._masks import MaskRule


def shared(x, batch: tuple[int, ...]) -> Array:
    """``x`` as an array every sequence of a ``batch`` shares: a leading 1 per batch axis."""
    x = jnp.asarray(x)
    return x.reshape((1,) * len(batch) + x.shape)


def with_batch(
    rule: MaskRule, batch: tuple[int, ...], sizes: dict[str, int], whole=None, first: Index = 0
) -> MaskRule:
    """``rule`` for a call with batch axes ``batch``: each array field leads with them.

    Each field says what its axes are (:func:`~jax_sdpa._masks.per_sequence`): one with exactly
    those is shared by the batch and gets a leading 1 per batch axis; one with the batch axes before
    them (each full or 1) is per sequence; any other shape is refused. Whether an array is per
    sequence never depends on its sizes happening to equal the batch's. A field that says nothing (a
    rule of the user's own), like the arrays a ``mask_mod`` closes over, is shared. ``sizes`` are
    the call's ``q_seq`` and ``kv_seq`` (a ring's whole sequences), which the per-sequence axes must
    have. On a ring that splits the leading batch axis over devices, ``whole`` is the whole batch's
    axes and ``first`` this device's first sequence: a per-sequence field may have the whole batch,
    of which the device takes its own.

    Raises:
        ValueError: Naming the rule's field, the shapes it may have and the one it has.
    """
    if not dataclasses.is_dataclass(rule):
        return jax.tree.map(lambda x: shared(x, batch), rule)
    nested = functools.partial(with_batch, batch=batch, sizes=sizes, whole=whole, first=first)

    def fitted(name: str, x, axes: tuple[str, ...], index: bool):
        x = jnp.asarray(x)
        own = tuple(sizes[axis] for axis in axes)
        lead = x.shape[: x.ndim - len(axes)]
        if whole is not None and lead == whole:  # the whole batch: this device's sequences
            x = lax.dynamic_slice_in_dim(x, first // math.prod(batch[1:]), batch[0])
            lead = batch
        if (
            x.shape[len(lead) :] != own
            or len(lead) not in (0, len(batch))
            or any(n not in (1, b) for n, b in zip(lead, batch, strict=False))
        ):
            raise ValueError(
                f"`mask_mod`'s {type(rule).__name__}.{name} must have shape {_letters(axes)} = "
                f"{own}, shared by the batch, or {_letters(('batch', *axes))} = "
                f"{(*(whole or batch), *own)}; got {x.shape}."
            )
        x = x if lead else shared(x, batch)
        return x.astype(INDEX) if index else x

    changes = {}
    for field in dataclasses.fields(rule):
        value, meta = getattr(rule, field.name), field.metadata
        if meta.get("static"):
            continue
        if isinstance(value, MaskRule):
            changes[field.name] = nested(value)
        elif isinstance(value, tuple) and value and all(isinstance(r, MaskRule) for r in value):
            changes[field.name] = tuple(map(nested, value))  # the parts of a combination
        elif "axes" in meta:
            fit = functools.partial(fitted, field.name, axes=meta["axes"], index=meta["index"])
            changes[field.name] = None if value is None else fit(value)
        else:
            changes[field.name] = jax.tree.map(lambda x: shared(x, batch), value)
    return dataclasses.replace(rule, **changes)


def _letters(names: tuple[str, ...]) -> str:
    """A shape in letters: ``(batch, q_seq)``, ``(q_seq,)``, ``()``."""
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"
