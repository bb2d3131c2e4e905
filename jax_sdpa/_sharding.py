"""Sharding one long sequence over a device mesh: the layouts and a ready-made ring call.

:func:`ring_dot_product_attention` takes whole (global) arrays and a ``jax.sharding.Mesh``,
places them (sequence over one mesh axis, optionally batch and heads over others), runs
:func:`jax_sdpa.ring_attention` under ``jax.shard_map`` and returns the output, sharded the same
way. The same code runs on one host with several devices or on many hosts after
``jax.distributed.initialize()``: the mesh is what spans them.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any, Literal, overload

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike

from jax_sdpa import _checks
from jax_sdpa._dot_product import ring_attention
from jax_sdpa._keywords import RingKeywords
from jax_sdpa._ring_spec import Layout

if TYPE_CHECKING:  # Python 3.10's typing has no Unpack; typing_extensions is no dependency
    from typing_extensions import Unpack

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


def _check_split(
    query: Array, key: Array, value: Array, *, mesh: jax.sharding.Mesh, axes: dict, layout: Layout
) -> None:
    """Raises unless the mesh has ``axes`` and they split the batch, sequence and heads evenly."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.check_ndim(name, x, (4,), "(batch, seq, heads, dim)")
    for name, axis in axes.items():
        if axis is not None and axis not in mesh.shape:
            raise ValueError(f"`{name}` must be an axis of `mesh` {mesh.axis_names}; got {axis!r}.")
    seq_axis, batch_axis, head_axis = axes["seq_axis"], axes["batch_axis"], axes["head_axis"]
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


def _call_arrays(query: Array, **arrays: ArrayLike | None) -> dict[str, Array]:
    """The per-call arrays that are given, in order; ``bias`` and ``mask`` made rank 4."""
    named = {name: jnp.asarray(x) for name, x in arrays.items() if x is not None}
    for name in ("bias", "mask"):
        if name in named:
            x = named[name]
            named[name] = jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)
    if "sinks" in named:  # the whole call's heads (each device checks its own)
        _checks.check_shape("sinks", named["sinks"], query.shape[2:3], "(heads,)")
    return named


def _ring_specs(
    named: dict[str, Array],
    *,
    seq_axis: str,
    batch_axis: str | None,
    head_axis: str | None,
    return_residual: bool,
    return_max_scores: bool,
) -> tuple[tuple[P, ...], P | tuple[P, ...]]:
    """``shard_map``'s ``in_specs`` for query, key, value and ``named``, and its ``out_specs``."""

    def spec(name: str, x: Array) -> P:
        if name in ("bias", "mask"):  # (batch, heads, rows, columns); columns stay whole
            sharded = zip((batch_axis, head_axis, seq_axis), x.shape[:3], strict=True)
            return P(*(axis if size > 1 else None for axis, size in sharded), None)
        if name in ("sinks", "sigmoid_bias"):  # one per head, or one for all
            return P(head_axis) if x.ndim else P()
        return P(batch_axis)  # lengths

    seq_spec = P(batch_axis, seq_axis, head_axis, None)
    in_specs = (seq_spec,) * 3 + tuple(spec(name, x) for name, x in named.items())
    rows = (P(batch_axis, seq_axis, head_axis),) * (return_residual + return_max_scores)
    return in_specs, ((seq_spec, *rows) if rows else seq_spec)


def _on_each_device(
    query: Array,
    key: Array,
    value: Array,
    *arrays: Array,
    names: tuple[str, ...],
    shards: int,
    **keywords: Any,
) -> Array | tuple[Array, Array]:
    """Inside ``shard_map``: :func:`ring_attention` on this device's shards (``arrays`` by name).

    Striped, the shards are first restriped (and the result back): bias and mask rows follow the
    queries (sharded), their columns the keys (whole, put in striped order).
    """
    named = dict(zip(names, arrays, strict=True))
    striped = keywords["layout"] == "striped"
    restripe = functools.partial(_restripe, axis_name=keywords["axis_name"], shards=shards)
    if striped:
        query, key, value = (restripe(x, 1) for x in (query, key, value))
        for name in ("bias", "mask"):
            if name in named:
                x = restripe(named[name], 2) if named[name].shape[2] > 1 else named[name]
                named[name] = to_striped(x, shards, axis=3) if x.shape[3] > 1 else x
    result = ring_attention(query, key, value, **named, **keywords)
    if striped:
        result = jax.tree.map(lambda x: restripe(x, 1, inverse=True), result)
    return result


@overload
def ring_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: Literal[False] = False,
    return_max_scores: Literal[False] = False,
    mesh: jax.sharding.Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout = "contiguous",
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    **keywords: Unpack[RingKeywords],
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
    return_max_scores: Literal[False] = False,
    mesh: jax.sharding.Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout = "contiguous",
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    **keywords: Unpack[RingKeywords],
) -> tuple[Array, Array]: ...


@overload
def ring_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: bool = False,
    return_max_scores: Literal[True],
    mesh: jax.sharding.Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout = "contiguous",
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    **keywords: Unpack[RingKeywords],
) -> tuple[Array, ...]: ...


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
    return_max_scores: bool = False,
    **keywords: Unpack[RingKeywords],
) -> Array | tuple[Array, ...]:
    """:func:`jax_sdpa.dot_product_attention` on a mesh, the sequence split over ``seq_axis``.

    Arguments are whole ``(B, T, N, H)`` arrays (``bias`` and ``mask`` rank 4, broadcastable to
    ``(B, N, T, S)``). They are placed on ``mesh`` with the sequence sharded over ``seq_axis``
    and, if given, the batch over ``batch_axis`` and the heads over ``head_axis`` (both query and
    key/value heads must divide evenly); then :func:`jax_sdpa.ring_attention` runs on each
    device's shards. ``layout="striped"`` balances causal work: each device swaps parts of its
    block with others (``ppermute``, never an all-gather) to hold its striped chunks, and the
    output goes back the same way. ``keywords`` are :func:`jax_sdpa.ring_attention`'s other
    keywords.

    Returns:
        The output ``(B, T, N, V)`` sharded over the mesh, or with the statistics asked for, as
        :func:`jax_sdpa.dot_product_attention` returns them.

    Examples:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
        >>> q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
        >>> out = ring_dot_product_attention(q, q, q, mesh=mesh, seq_axis="seq", is_causal=True)
        >>> bool(abs(out - jax.nn.dot_product_attention(q, q, q, is_causal=True)).max() < 1e-6)
        True
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    axes = {"seq_axis": seq_axis, "batch_axis": batch_axis, "head_axis": head_axis}
    _check_split(query, key, value, mesh=mesh, axes=axes, layout=layout)
    named = _call_arrays(
        query,
        bias=bias,
        mask=mask,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        sinks=keywords.pop("sinks", None),  # one per head: each device gets its heads'
        sigmoid_bias=keywords.pop("sigmoid_bias", None),
    )
    returned = dict(return_residual=return_residual, return_max_scores=return_max_scores)
    in_specs, out_specs = _ring_specs(named, **axes, **returned)
    local = functools.partial(
        _on_each_device,
        names=tuple(named),
        shards=mesh.shape[seq_axis],
        axis_name=seq_axis,
        layout=layout,
        batch_axis=batch_axis,
        head_axis=head_axis,
        **returned,
        **keywords,
    )
    args = (query, key, value, *named.values())
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs, strict=True)]
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
