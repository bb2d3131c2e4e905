r"""Single-head attention: the steps composed, in the order of the formula.

.. math:: \mathrm{out} = \mathrm{dropout}\big(\mathrm{softmax}_{\text{mask}}(
    \mathrm{cap}(\text{scale} \cdot Q K^\top) + \text{bias})\big)\, V

:func:`attention_head` is the dense composition for one head; :func:`dense_sequence` maps it over
the heads of one sequence (the ``"xla"`` implementation); :func:`attention` is the checked,
public single-head function.
"""

import dataclasses

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float

from jax_sdpa import _checks
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result, over_heads
from jax_sdpa._masks import CausalMask
from jax_sdpa._steps import (
    default_scale,
    max_allowed,
    weighted_sum,
)

__all__ = ["attention"]


def attention_head(
    formula: Formula,
    query: Float[Array, "q_seq d_k"],
    key: Float[Array, "kv_seq d_k"],
    value: Float[Array, "kv_seq d_v"],
    arrays: CallArrays,
) -> Result:
    """The dense single-head composition, unchecked: ``(out, logsumexp, weights)``."""
    scores, allowed = formula.scores(query, key, arrays)
    weights, lse = formula.normalizer.weights(scores, allowed, arrays.sigmoid_bias, arrays.sinks)
    dropped = formula.drop(weights, arrays.dropout_rng)
    out = weighted_sum(dropped, value, precision=formula.precision)
    return Result(out.astype(value.dtype), lse, weights, max_allowed(scores, allowed))


def _weights_head(formula: Formula, query, key, value, arrays: CallArrays) -> Result:
    """The weights after dropout, as flax's ``dot_product_attention_weights`` returns them."""
    result = attention_head(
        formula, query, key, value, dataclasses.replace(arrays, dropout_rng=None)
    )
    return result._replace(weights=formula.drop(result.weights, arrays.dropout_rng))


def dense_sequence(
    formula: Formula, query, key, value, arrays: CallArrays, *, dropped_weights: bool = False
) -> Result:
    """The dense head over the heads of one sequence: ``(T, N, H)`` queries, ``(S, K, ·)`` keys.

    Returns ``(T, N, V)`` outputs, a ``(T, N)`` log-sum-exp and ``(N, T, S)`` weights (after
    dropout with ``dropped_weights``); each key/value head serves its ``G = N // K`` query heads.
    """
    seq, heads, _ = query.shape
    groups = (key.shape[1], heads // key.shape[1])  # (K, G)
    head = _weights_head if dropped_weights else attention_head

    def each(per_query, per_kv):
        return head(formula, per_query[0], *per_kv, per_query[1])

    query = jnp.moveaxis(query.reshape(seq, *groups, -1), 0, 2)  # (K, G, T, H)
    kv = (jnp.moveaxis(key, 1, 0), jnp.moveaxis(value, 1, 0))
    result = over_heads(each, groups, (query, arrays.by_head(groups)), kv)
    out, lse, weights, top = (x.reshape(heads, *x.shape[2:]) for x in result)
    # (N, T, V) → (T, N, V) and (N, T) → (T, N), the layout of jax.nn.
    return Result(jnp.moveaxis(out, 0, 1), jnp.moveaxis(lse, 0, 1), weights, top.T)


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
    formula = Formula(
        default_scale(query.shape[1]) if scale is None else scale, precision=precision
    )
    arrays = CallArrays(bias, mask, CausalMask() if is_causal else None)
    out, _, weights, _ = attention_head(formula, query, key, value, arrays)
    return (out, weights) if return_weights else out
