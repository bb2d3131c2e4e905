"""The arrays of a call checked against each other, and its sizes.

Query, key and value (arrays, :class:`~jax_sdpa.Quantized` caches, or
:class:`~jax_sdpa.LatentValues`), the pools and table of a paged call, and each query's selected
keys. :mod:`jax_sdpa._arguments` binds the rest of a call against the :class:`Shapes` found here.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_sdpa import _checks
from jax_sdpa._indices import INDEX
from jax_sdpa._latent import LatentValues
from jax_sdpa._quantized import Quantized, scale_shape
from jax_sdpa._ring_spec import RingSpec


class Shapes(NamedTuple):
    """The sizes of a call, once its query, key and value are checked."""

    batch: tuple[int, ...]
    seq_q: int
    heads: int
    seq_kv: int  # this device's keys, on a ring
    kv_heads: int
    shards: int = 1  # the ring's size (1 off a ring)
    batch_shards: int = 1  # the devices the batch and the heads are split over, on a ring
    head_shards: int = 1

    def per_logit(self) -> tuple[tuple[int, ...], str]:
        """The shape of the scores, and its letters: keys span the whole ring."""
        letters = f"({'batch, ' * len(self.batch)}heads, q_seq, kv_seq)"
        return (*self.batch, self.heads, self.seq_q, self.seq_kv * self.shards), letters


def query_key_value(query, key, value, ring: RingSpec | None, dtype=None, **_):
    """The three arrays (cast to ``dtype`` if given), checked against each other, and the sizes."""
    query = jnp.asarray(query) if dtype is None else jnp.asarray(query).astype(dtype)
    key, value = _cache("key", key, dtype), _cache("value", value, dtype)
    _same_form(key, value)
    latent, value = value, _latent(("key", "value"), key, value)
    layout = {
        "query": "(batch, q_seq, heads, d_k)",
        "key": "(batch, kv_seq, kv_heads, d_k)",
        "value": "(batch, kv_seq, kv_heads, d_v)",
    }
    for name, x in zip(layout, (query, key, value), strict=True):
        if x.ndim < 3:
            raise ValueError(
                f"`{name}` must have rank 4 {layout[name]} or rank 3 without batch; "
                f"got shape {x.shape}."
            )
        _checks.check_float(name, x)
    _checks.check_same_dtype(("query", "key", "value"), (query, key, value))
    batch_shape = query.shape[:-3]
    for name, x in (("key", key), ("value", value)):
        _checks.check_equal("batch shape", ("query", name), (batch_shape, x.shape[:-3]))
    *_, seq_q, heads, d_k = query.shape
    *_, seq_kv, kv_heads, _ = key.shape
    _checks.check_equal("feature size d_k", ("query", "key"), (d_k, key.shape[-1]))
    _checks.check_equal("length kv_seq", ("key", "value"), (seq_kv, value.shape[-3]))
    _checks.check_equal("number of heads kv_heads", ("key", "value"), (kv_heads, value.shape[-2]))
    _checks.check_heads(heads, kv_heads)
    shards = (1, 1, 1) if ring is None else (ring.shards, ring.batch_shards, ring.head_shards)
    shapes = Shapes(batch_shape, seq_q, heads, seq_kv, kv_heads, *shards)
    return query, key, latent, shapes


def pages(query, key_pages, value_pages, page_table, key_value_seq_lengths=None, **_):
    """A paged call's arrays, checked against each other, and its sizes.

    Returns ``(query, key_pages, value_pages, page_table, lengths, shapes)``: the pools with a
    leading 1 (shared by the batch), the lengths clamped to the pages (as they are under
    ``jit``, where they are not checked).
    """
    query, page_table = jnp.asarray(query), jnp.asarray(page_table)
    key_pages, value_pages = _cache("key_pages", key_pages), _cache("value_pages", value_pages)
    latent, value_pages = value_pages, _latent(("key_pages", "value_pages"), key_pages, value_pages)
    arrays = [query, key_pages, value_pages, page_table]
    lengths = jnp.asarray(key_value_seq_lengths)
    layouts = {
        "query": "(batch, q_seq, heads, d_k)",
        "key_pages": "(num_pages, page_size, kv_heads, d_k)",
        "value_pages": "(num_pages, page_size, kv_heads, d_v)",
    }
    for (name, layout), x in zip(layouts.items(), arrays, strict=False):
        _checks.check_ndim(name, x, (4,), layout)
        _checks.check_float(name, x)
    _checks.check_same_dtype(tuple(layouts), arrays[:3])
    batch, seq_q, heads, d_k = query.shape
    num_pages, page_size, kv_heads, _ = key_pages.shape
    _checks.check_equal("feature size d_k", ("query", "key_pages"), (d_k, key_pages.shape[-1]))
    _checks.check_equal(
        "pages (num_pages, page_size, kv_heads)",
        ("key_pages", "value_pages"),
        (key_pages.shape[:3], value_pages.shape[:3]),
    )
    _checks.check_heads(heads, kv_heads)
    _checks.check_ndim("page_table", page_table, (2,), "(batch, pages_per_sequence)")
    _checks.check_integer("page_table", page_table)
    _checks.check_shape("page_table", page_table, (batch, page_table.shape[1]), "(batch, pages)")
    _checks.check_shape("lengths", lengths, (batch,), "(batch,)")
    _checks.check_integer("lengths", lengths)
    capacity = page_table.shape[1] * page_size
    try:
        longest = int(jnp.max(lengths, initial=0))
        pages = (int(jnp.min(page_table, initial=0)), int(jnp.max(page_table, initial=0)))
    except jax.errors.ConcretizationTypeError:  # under jit: clamped here and where read
        longest, pages = 0, (0, 0)
    if longest > capacity:
        raise ValueError(
            f"`lengths` must be at most pages_per_sequence · page_size = {capacity}; got {longest}."
        )
    if pages[0] < 0 or pages[1] >= num_pages:
        raise ValueError(
            f"`page_table` must hold page numbers in [0, {num_pages}); "
            f"got {pages[0]} to {pages[1]}."
        )
    lengths = jnp.minimum(lengths, capacity).astype(INDEX)
    shapes = Shapes((batch,), seq_q, heads, capacity, kv_heads)
    pools = (jax.tree.map(lambda x: x[None], x) for x in (key_pages, latent))
    return query, *pools, page_table, lengths, shapes


def _latent(names: tuple[str, str], key, value):
    """``value``, or for :class:`~jax_sdpa.LatentValues` the shape and dtype it stands for."""
    if not isinstance(value, LatentValues):
        return value
    features = value.features
    if not isinstance(features, int) or not 0 < features <= key.shape[-1]:
        raise ValueError(
            f"`{names[1]}` is LatentValues(features): features must be an int in "
            f"[1, {key.shape[-1]}], the `{names[0]}` features; got {features!r}."
        )
    return value.like(key)


def _same_form(key, value) -> None:
    """Keys and values both quantized, or both not (latent values follow their keys)."""
    forms = [isinstance(x, Quantized) for x in (key, value)]
    if forms[0] != forms[1] and not isinstance(value, LatentValues):
        given = ", ".join(
            f"`{n}` {'quantized' if q else 'an array'}"
            for n, q in zip(("key", "value"), forms, strict=True)
        )
        raise ValueError(
            f"`key` and `value` must both be quantized caches or both arrays; got {given}."
        )


def _cache(name: str, x, dtype=None):
    """A key or value cache: an array (cast to ``dtype`` if given) or a checked quantized one."""
    if isinstance(x, LatentValues):
        return x
    if not isinstance(x, Quantized):
        x = jnp.asarray(x)
        return x if dtype is None else x.astype(dtype)
    if x.values.dtype not in (jnp.int8, jnp.float8_e4m3fn):
        raise TypeError(
            f"`{name}.values` must have dtype int8 or float8_e4m3fn; got {x.values.dtype}."
        )
    _checks.check_float(f"{name}.scale", x.scale)
    shapes = [scale_shape(x.shape, per_token) for per_token in (True, False)]
    if x.scale.shape not in shapes:
        raise ValueError(
            f"`{name}.scale` must have shape {shapes[0]} (one per token and head) or {shapes[1]} "
            f"(one per head) for values of shape {x.shape}; got {x.scale.shape}."
        )
    return x if dtype is None else Quantized(x.values, x.scale.astype(dtype))


def key_indices(shapes: Shapes, key_indices=None, **_) -> jax.Array | None:
    """Each query's keys ``(*batch, q_seq, k)``, integers in ``[0, kv_seq)`` where concrete."""
    if key_indices is None:
        return None
    key_indices = jnp.asarray(key_indices)
    _checks.check_integer("key_indices", key_indices)
    count = key_indices.shape[-1] if key_indices.ndim else 0
    expected = (*shapes.batch, shapes.seq_q, count)
    _checks.check_shape("key_indices", key_indices, expected, "(batch, q_seq, k)")
    if count == 0:
        raise ValueError("`key_indices` must list at least one key per query; got k = 0.")
    if key_indices.size == 0 or shapes.seq_kv == 0:  # no query, or no key: rows of zeros
        return key_indices.astype(INDEX)
    try:
        lo, hi = int(jnp.min(key_indices)), int(jnp.max(key_indices))
    except jax.errors.ConcretizationTypeError:  # under jit: read as masked where out of range
        lo, hi = 0, 0
    if lo < 0 or hi >= shapes.seq_kv:
        raise ValueError(
            f"`key_indices` must hold key positions in [0, {shapes.seq_kv}); got {lo} to {hi}."
        )
    return key_indices.astype(INDEX)
