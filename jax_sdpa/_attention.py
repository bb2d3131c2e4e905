r"""Single-head attention: the steps composed, in the order of the formula.

.. math:: \mathrm{out} = \mathrm{dropout}\big(\mathrm{softmax}_{\text{mask}}(
    \mathrm{cap}(\text{scale} \cdot Q K^\top) + \text{bias})\big)\, V

``score_block`` is the score side of the formula for any block of queries and keys (the whole
matrix is one block); the dense implementation calls it once and the chunked implementation
once per block, so the two cannot drift apart.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float, Integer, Key

from jax_sdpa import _checks
from jax_sdpa._masks import CausalMask, MaskRule, materialize_mask
from jax_sdpa._steps import (
    default_scale,
    dropout_weights,
    raw_scores,
    scale_scores,
    soft_cap_scores,
    softmax_with_logsumexp,
    weighted_sum,
)

__all__ = ["attention"]


def score_block(
    query: Float[Array, "q d_k"],
    key: Float[Array, "kv d_k"],
    bias: Float[Array, "#q #kv"] | None,
    mask: Bool[Array, "#q #kv"] | None,
    rule: MaskRule | None,
    *,
    scale: float,
    soft_cap: float | None,
    precision: lax.PrecisionLike,
    q_offset: int | Integer[Array, ""] = 0,
    kv_offset: int | Integer[Array, ""] = 0,
) -> tuple[Float[Array, "q kv"], Bool[Array, "#q #kv"] | None]:
    """Scores of a block of queries against a block of keys, and which of them are allowed.

    raw scores → scale → optional soft cap → + bias; the mask is the given array AND the rule
    evaluated at the block's global positions (``q_offset``, ``kv_offset``) AND, with a bias,
    "the score is not −∞". ``None`` when nothing is masked.
    """
    scores = scale_scores(raw_scores(query, key, precision=precision), scale)
    if soft_cap is not None:
        scores = soft_cap_scores(scores, soft_cap)
    if bias is not None:
        scores = scores + bias.astype(scores.dtype)
        finite = scores != -jnp.inf  # a −∞ bias masks its key exactly
        mask = finite if mask is None else mask & finite
    if rule is not None:
        allowed = materialize_mask(
            rule, query.shape[0], key.shape[0], q_offset=q_offset, kv_offset=kv_offset
        )
        mask = allowed if mask is None else mask & allowed
    return scores, mask


def split_group_axis(x: Array | None) -> tuple[Array | None, int | None]:
    """Splits off a head axis for ``jax.vmap``: size 1 is shared (dropped, ``in_axes=None``).

    A leading axis of any other size is mapped (``in_axes=0``).
    """
    if x is None or x.shape[0] == 1:
        return (None if x is None else x[0]), None
    return x, 0


def by_head(x: Array | None, heads: tuple[int, int]) -> Array | None:
    """A per-head ``(N, ...)`` bias, mask or dropout keys as ``(K, G, ...)``.

    A leading axis of 1 (shared by all heads) becomes ``(1, 1, ...)``.
    """
    if x is None:
        return None
    return x.reshape((heads if x.shape[0] > 1 else (1, 1)) + x.shape[1:])


def per_head(fn, n_mapped: int, bias, mask, rngs):
    """``fn(*mapped, bias, mask, rng)`` mapped (``jax.vmap``) over the query heads of a group.

    The first ``n_mapped`` arguments always carry the head axis; the bias, mask and dropout keys
    carry it unless the whole group shares them (a leading axis of size 1).
    """
    (bias, b_ax), (mask, m_ax), (rngs, r_ax) = map(split_group_axis, (bias, mask, rngs))
    mapped = jax.vmap(fn, in_axes=(0,) * n_mapped + (b_ax, m_ax, r_ax))
    return lambda *args: mapped(*args, bias, mask, rngs)


def per_query_head(fn, n_group: int, bias, mask, rngs):
    """``fn(*group_args, *kv_args, bias, mask, rng)`` for every query head (``jax.vmap`` twice).

    The first ``n_group`` arguments lead with ``(K, G)``, the others with ``K`` (shared by the
    ``G`` query heads of a key/value head); bias, mask and dropout keys lead with ``(K, G)``, or
    ``(1, 1)`` when all heads share them.
    """
    (bias, b_ax), (mask, m_ax), (rngs, r_ax) = map(split_group_axis, (bias, mask, rngs))

    def kv_head(bias, mask, rngs, *args):
        group_args, kv_args = args[:n_group], args[n_group:]
        each = per_head(
            lambda *a: fn(*a[:n_group], *kv_args, *a[n_group:]), n_group, bias, mask, rngs
        )
        return each(*group_args)

    def mapped(*args):
        in_axes = (b_ax, m_ax, r_ax) + (0,) * len(args)
        return jax.vmap(kv_head, in_axes=in_axes)(bias, mask, rngs, *args)

    return mapped


def attention_head(
    query: Float[Array, "q_seq d_k"],
    key: Float[Array, "kv_seq d_k"],
    value: Float[Array, "kv_seq d_v"],
    bias: Float[Array, "#q_seq #kv_seq"] | None,
    mask: Bool[Array, "#q_seq #kv_seq"] | None,
    rule: MaskRule | None,
    dropout_rng: Key[Array, ""] | None,
    *,
    scale: float,
    soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    precision: lax.PrecisionLike = None,
) -> tuple[Float[Array, "q_seq d_v"], Float[Array, " q_seq"], Float[Array, "q_seq kv_seq"]]:
    """The dense single-head composition, unchecked: ``(out, logsumexp, weights)``.

    This is the function :func:`jax_sdpa.dot_product_attention` ``jax.vmap``-s over heads and
    batch for ``implementation="xla"``.
    """
    scores, mask = score_block(
        query, key, bias, mask, rule, scale=scale, soft_cap=soft_cap, precision=precision
    )
    weights, lse = softmax_with_logsumexp(scores, mask)
    dropped = (
        weights if dropout_rng is None else dropout_weights(weights, dropout_rng, rate=dropout_rate)
    )
    out = weighted_sum(dropped, value, precision=precision)
    return out.astype(value.dtype), lse, weights


def attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    return_weights: bool = False,
    precision: lax.PrecisionLike = None,
) -> Float[Array, "q_seq d_v"] | tuple[Float[Array, "q_seq d_v"], Float[Array, "q_seq kv_seq"]]:
    r"""Scaled dot-product attention for one head: the four steps composed.

    .. math:: \mathrm{out} = \mathrm{softmax}_{\text{mask}}\Big(
        \text{scale} \cdot Q K^\top + \text{bias}\Big)\, V

    which is, step by step::

        scores  = scale_scores(raw_scores(query, key), scale)   (+ bias)
        weights = softmax_weights(scores, mask)                 (& causal)
        out     = weighted_sum(weights, value)

    Args:
        query: Queries, shape ``(T, d_k)``.
        key: Keys, shape ``(S, d_k)``.
        value: Values, shape ``(S, d_v)``.
        bias: Optional additive bias broadcastable to ``(T, S)``, added after scaling.
        mask: Optional boolean mask broadcastable to ``(T, S)``; ``True`` = may attend.
        scale: Factor on the raw scores; ``None`` means :func:`default_scale` ``(d_k)``.
        is_causal: If True, query ``i`` attends only keys ``j <= i`` (top-left aligned).
        return_weights: Also return the ``(T, S)`` attention weights.
        precision: Optional ``jax.lax`` precision for both matrix products.

    Returns:
        The output ``(T, d_v)`` in the input dtype, or ``(out, weights)``. A query with no
        allowed key outputs zeros.

    Raises:
        ValueError: On shapes that do not fit together.
        TypeError: On non-float inputs, or inputs of different dtypes.

    Examples:
        >>> import jax.numpy as jnp
        >>> q = jnp.array([[0.0, 2.0**0.5]])  # scaled by 1/√2 the scores are [0, 1]
        >>> out, w = attention(q, jnp.eye(2), jnp.eye(2), return_weights=True)
        >>> w  # [1, e] / (1 + e)
        Array([[0.26894143, 0.7310586 ]], dtype=float32)

    References:
        Vaswani et al., Attention Is All You Need, 2017, §3.2.1.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    for name, x, what in [
        ("query", query, "(q_seq, d_k)"),
        ("key", key, "(kv_seq, d_k)"),
        ("value", value, "(kv_seq, d_v)"),
    ]:
        _checks.check_ndim(name, x, (2,), what)
        _checks.check_float(name, x)
    _checks.check_same_dtype(("query", "key", "value"), (query, key, value))
    _checks.check_equal("feature size d_k", ("query", "key"), (query.shape[1], key.shape[1]))
    _checks.check_equal("length kv_seq", ("key", "value"), (key.shape[0], value.shape[0]))
    target = (query.shape[0], key.shape[0])
    if bias is not None:
        bias = jnp.asarray(bias)
        _checks.check_float("bias", bias)
        _checks.check_broadcastable("bias", bias, target, "(q_seq, kv_seq)")
        bias = jnp.reshape(bias, (1,) * (2 - bias.ndim) + bias.shape)
    if mask is not None:
        mask = jnp.asarray(mask)
        _checks.check_broadcastable("mask", mask, target, "(q_seq, kv_seq)")
        mask = jnp.reshape(mask != 0, (1,) * (2 - mask.ndim) + mask.shape)
    out, _, weights = attention_head(
        query,
        key,
        value,
        bias,
        mask,
        CausalMask() if is_causal else None,
        None,
        scale=default_scale(query.shape[1]) if scale is None else scale,
        precision=precision,
    )
    return (out, weights) if return_weights else out
