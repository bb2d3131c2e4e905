"""Sharding one long sequence over a device mesh: the layouts and a ready-made ring call.

:func:`ring_dot_product_attention` takes whole (global) arrays and a ``jax.sharding.Mesh``,
places them (sequence over one mesh axis, optionally batch and heads over others), runs
:func:`jax_sdpa.ring_attention` under ``jax.shard_map`` and returns the output, sharded the same
way. The same code runs on one host with several devices or on many hosts after
``jax.distributed.initialize()``: the mesh is what spans them.
"""

import functools
import itertools
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike

from jax_sdpa import _checks
from jax_sdpa._dot_product import ring_attention
from jax_sdpa._ring import Layout

__all__ = ["from_striped", "ring_dot_product_attention", "to_striped"]


def _striped_order(length: int, shards: int) -> jnp.ndarray:
    """Positions in striped order: chunks ``0, 2P−1, 1, 2P−2, …`` of ``length / 2P`` each."""
    chunk = length // (2 * shards)
    chunks = [c for p in range(shards) for c in (p, 2 * shards - 1 - p)]
    return jnp.concatenate([jnp.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def to_striped(x: ArrayLike, shards: int, *, axis: int = 1) -> Array:
    """Reorders a sequence axis for ``layout="striped"`` over ``shards`` devices.

    The sequence is cut into ``2 · shards`` equal chunks and device ``p`` gets chunks ``p`` and
    ``2 · shards − 1 − p``: under a causal mask each device then has about the same work (with the
    contiguous layout, device 0 attends to almost nothing and the last device to everything).

    Examples:
        >>> import jax.numpy as jnp
        >>> to_striped(jnp.arange(8), 2, axis=0)
        Array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
    """
    x = jnp.asarray(x)
    length = x.shape[axis]
    _checks.check_equal_parts(
        "x", length, 2 * shards, f"axis {axis}", f"(two for each of {shards} `shards`)"
    )
    return jnp.take(x, _striped_order(length, shards), axis=axis)


def from_striped(x: ArrayLike, shards: int, *, axis: int = 1) -> Array:
    """Undoes :func:`to_striped`."""
    x = jnp.asarray(x)
    return jnp.take(x, jnp.argsort(_striped_order(x.shape[axis], shards)), axis=axis)


def _restripe(x: Array, axis: int, *, axis_name: str, shards: int, inverse: bool = False) -> Array:
    """Inside ``shard_map``: this device's contiguous block as its striped chunks, or back.

    Of the ``2P`` chunks, device ``d`` holds ``2d`` and ``2d + 1`` in the contiguous layout and
    ``d`` and ``2P − 1 − d`` in the striped one. Chunks travel by ``ppermute``, one per pair of
    (half it leaves, half it fills): each device sends and receives one block, and no device
    ever holds the whole sequence (reordering the global array instead gathers it).
    """

    def contiguous(chunk):  # (device, half)
        return chunk // 2, chunk % 2

    def striped(chunk):
        return (chunk, 0) if chunk < shards else (2 * shards - 1 - chunk, 1)

    source, target = (striped, contiguous) if inverse else (contiguous, striped)
    moves = [(source(c), target(c)) for c in range(2 * shards)]
    halves = jnp.split(x, 2, axis=axis)
    filled = [None, None]
    for leaves, fills in itertools.product((0, 1), (0, 1)):
        pairs = [(s[0], t[0]) for s, t in moves if (s[1], t[1]) == (leaves, fills)]
        if pairs:  # devices that receive nothing get zeros: the other move fills them
            moved = lax.ppermute(halves[leaves], axis_name, pairs)
            filled[fills] = moved if filled[fills] is None else filled[fills] + moved
    return jnp.concatenate(filled, axis=axis)


@overload
def ring_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: Literal[False] = False,
    mesh: jax.sharding.Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout = "contiguous",
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    **options: Any,
) -> Array: ...


@overload
def ring_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: Literal[True],
    mesh: jax.sharding.Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout = "contiguous",
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    **options: Any,
) -> tuple[Array, Array]: ...


def ring_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    mesh: jax.sharding.Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout = "contiguous",
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    return_residual: bool = False,
    **options: Any,
) -> Array | tuple[Array, Array]:
    """:func:`jax_sdpa.dot_product_attention` on a mesh, the sequence split over ``seq_axis``.

    Arguments are whole ``(B, T, N, H)`` arrays (``bias`` and ``mask`` rank 4, broadcastable to
    ``(B, N, T, S)``). They are placed on ``mesh`` with the sequence sharded over ``seq_axis``
    and, if given, the batch over ``batch_axis`` and the heads over ``head_axis`` (both query and
    key/value heads must divide evenly); then :func:`jax_sdpa.ring_attention` runs on each
    device's shards. ``layout="striped"`` balances causal work: each device swaps parts of its
    block with others (``ppermute``, never an all-gather) to hold its striped chunks, and the
    output goes back the same way. ``options`` are :func:`jax_sdpa.ring_attention`'s other
    keywords.

    Returns:
        The output ``(B, T, N, V)`` sharded over the mesh, or ``(out, logsumexp)``.

    Examples:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
        >>> q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
        >>> out = ring_dot_product_attention(q, q, q, mesh=mesh, seq_axis="seq", is_causal=True)
        >>> bool(abs(out - jax.nn.dot_product_attention(q, q, q, is_causal=True)).max() < 1e-6)
        True
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.check_ndim(name, x, (4,), "(batch, seq, heads, dim)")
    axes = {"seq_axis": seq_axis, "batch_axis": batch_axis, "head_axis": head_axis}
    for name, axis in axes.items():
        if axis is not None and axis not in mesh.shape:
            raise ValueError(f"`{name}` must be an axis of `mesh` {mesh.axis_names}; got {axis!r}.")
    shards = mesh.shape[seq_axis]
    # Each axis: (its dimension, the mesh axis, how many parts); striped, a device holds two chunks.
    splits = {"sequence": (1, seq_axis, shards * (2 if layout == "striped" else 1))}
    splits["batch"] = (0, batch_axis, 1 if batch_axis is None else mesh.shape[batch_axis])
    splits["heads"] = (2, head_axis, 1 if head_axis is None else mesh.shape[head_axis])
    for name, x in (("query", query), ("key", key)):
        for what, (dim, axis, parts) in splits.items():
            striped = what == "sequence" and layout == "striped"
            where = f"over mesh axis {axis!r}" + f" {_checks.STRIPED}" * striped
            _checks.check_equal_parts(name, x.shape[dim], parts, what, where)
    extras = {"bias": bias, "mask": mask}
    extras = {
        k: jnp.reshape(jnp.asarray(x), (1,) * (4 - jnp.ndim(x)) + jnp.shape(x))
        for k, x in extras.items()
        if x is not None
    }

    def spec_4d(x):  # bias / mask: (batch, heads, rows, columns); columns stay whole
        return P(
            batch_axis if x.shape[0] > 1 else None,
            head_axis if x.shape[1] > 1 else None,
            seq_axis if x.shape[2] > 1 else None,
            None,
        )

    seq_spec = P(batch_axis, seq_axis, head_axis, None)
    lengths = {
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
    }
    lengths = {k: jnp.asarray(x) for k, x in lengths.items() if x is not None}
    sinks = options.pop("sinks", None)  # one per head: each device gets its heads'
    per_head = {} if sinks is None else {"sinks": jnp.asarray(sinks)}
    if sinks is not None:  # the whole call's heads (each device checks its own)
        _checks.check_shape("sinks", per_head["sinks"], query.shape[2:3], "(heads,)")
    in_specs = (
        (seq_spec,) * 3
        + tuple(spec_4d(x) for x in extras.values())
        + (P(batch_axis),) * len(lengths)
        + (P(head_axis),) * len(per_head)
    )
    out_specs = (seq_spec, P(batch_axis, seq_axis, head_axis)) if return_residual else seq_spec

    restripe = functools.partial(_restripe, axis_name=seq_axis, shards=shards)

    def local(query, key, value, *rest):
        named = dict(zip([*extras, *lengths, *per_head], rest, strict=True))
        if layout == "striped":
            query, key, value = (restripe(x, 1) for x in (query, key, value))
            for name in extras:  # rows follow the queries (sharded), columns the keys (whole)
                x = restripe(named[name], 2) if named[name].shape[2] > 1 else named[name]
                named[name] = to_striped(x, shards, axis=3) if x.shape[3] > 1 else x
        result = ring_attention(
            query,
            key,
            value,
            axis_name=seq_axis,
            layout=layout,
            batch_axis=batch_axis,
            head_axis=head_axis,
            return_residual=return_residual,
            **named,
            **options,
        )
        if layout == "striped":
            result = jax.tree.map(lambda x: restripe(x, 1, inverse=True), result)
        return result

    args = (query, key, value, *extras.values(), *lengths.values(), *per_head.values())
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs, strict=True)]
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
