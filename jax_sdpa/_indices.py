"""Positions and indices: every position, block number and batch or head index is one dtype.

They are int32 also where ``jax_enable_x64`` is on, so that the indices computed anywhere agree
with each other and with those the user's functions were traced with.
"""

import jax.numpy as jnp
from jaxtyping import Array, Integer

Index = int | Integer[Array, ""]
#: The dtype of every position, block number and batch or head index.
INDEX = jnp.int32


def indices(*starts: Index) -> tuple[Integer[Array, ""], ...]:
    """The start indices of a ``lax.dynamic_slice``, as :data:`INDEX`.

    (Python ints beside traced int32 indices would become int64 under x64, and a dynamic slice
    refuses mixed types.)
    """
    return tuple(jnp.asarray(start, INDEX) for start in starts)


def positions(start: Index, count: int) -> Integer[Array, " count"]:
    """``start, start + 1, …, start + count − 1``: a run of positions, as :data:`INDEX`."""
    return jnp.asarray(start, INDEX) + jnp.arange(count, dtype=INDEX)


def at_start(offsets) -> bool:
    """Whether global ``offsets`` are all position 0, as Python ints (known when tracing)."""
    return all(isinstance(x, int) and x == 0 for x in offsets)


def listed(visited: Array) -> tuple[Array, Array]:
    """The visited blocks along the last axis, listed: FlexAttention's counts and indices.

    ``(count, order)``: how many of the boolean ``visited`` are, and all the blocks' indices with
    those first, in order (a stable sort).
    """
    order = jnp.argsort(~visited, axis=-1, stable=True)
    return visited.sum(axis=-1).astype(INDEX), order.astype(INDEX)
