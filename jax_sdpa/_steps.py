r"""The steps of scaled dot-product attention, one head at a time.

.. math:: \mathrm{Attention}(Q, K, V) = \mathrm{softmax}\Big(\frac{Q K^\top}{\sqrt{d_k}}\Big) V

Each factor of the formula is one pure function here::

    scores  = raw_scores(query, key)          # Q Kᵀ                       (T, S)
    scores  = scale_scores(scores, scale)     # · 1/√d_k                   (T, S)
    weights = softmax_weights(scores, mask)   # row-wise masked softmax    (T, S)
    out     = weighted_sum(weights, value)    # weights · V                (T, d_v)

or, in place of the softmax, ``sigmoid_weights(scores, mask, bias)``: each weight on its own,
with no normalisation over the row (sigmoid attention).

Shape letters: ``T`` query length, ``S`` key/value length, ``d_k`` query/key features, ``d_v``
value features. Nothing here is batched or jitted: batching is one ``jax.vmap`` in
:func:`jax_sdpa.dot_product_attention`.

The softmax is written from small parts (``masked_scores``, ``exp_scores``, ``normalize``,
``logsumexp``) that :mod:`jax_sdpa._online_softmax` reuses to run the very same arithmetic over
key blocks instead of whole rows (Milakov & Gimelshein 2018; Rabe & Staats 2021).
"""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p
from jaxtyping import Array, ArrayLike, Bool, Float, Integer, Key

__all__ = [
    "default_scale",
    "dropout_weights",
    "raw_scores",
    "scale_scores",
    "soft_cap_scores",
    "sigmoid_weights",
    "softmax_weights",
    "weighted_sum",
]


def accumulation_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype scores and sums are computed in: ``dtype`` promoted to at least float32."""
    return jnp.dtype(jnp.float64 if jnp.finfo(dtype).bits > 32 else jnp.float32)


def large_negative(dtype: jnp.dtype) -> Array:
    """A finite stand-in for −∞, with headroom so that adding to it cannot overflow."""
    return jnp.asarray(-0.7 * jnp.finfo(dtype).max, dtype)


def raw_scores(
    query: Float[ArrayLike, "q_seq d_k"],
    key: Float[ArrayLike, "kv_seq d_k"],
    *,
    precision: lax.PrecisionLike = None,
) -> Float[Array, "q_seq kv_seq"]:
    r"""Dot products of every query with every key: :math:`s_{ij} = q_i \cdot k_j`.

    .. math:: S = Q K^\top

    Products are accumulated in at least float32 (float64 stays float64), whatever the input
    dtype, so bfloat16 inputs lose no precision in the sum.

    Args:
        query: Queries, shape ``(T, d_k)``.
        key: Keys, shape ``(S, d_k)``.
        precision: Optional ``jax.lax`` precision for the matrix product.

    Returns:
        Raw scores of shape ``(T, S)`` in ``promote_types(query.dtype, float32)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> raw_scores(jnp.array([[0.0, 2.0]]), jnp.eye(2))
        Array([[0., 2.]], dtype=float32)

    References:
        Vaswani et al., Attention Is All You Need, 2017, eq. (1).
    """
    query, key = jnp.asarray(query), jnp.asarray(key)
    return jnp.einsum(
        "td,sd->ts",
        query,
        key,
        precision=precision,
        preferred_element_type=accumulation_dtype(query.dtype),
    )


def default_scale(d_k: int) -> float:
    r"""The scale of the paper, :math:`1/\sqrt{d_k}`.

    With unit-variance queries and keys, :math:`q \cdot k` has variance :math:`d_k`; multiplying
    by :math:`1/\sqrt{d_k}` brings it back to 1 so the softmax does not saturate as ``d_k`` grows.

    Examples:
        >>> default_scale(64)
        0.125

    References:
        Vaswani et al., Attention Is All You Need, 2017, §3.2.1 and footnote 4.
    """
    return 1.0 / math.sqrt(d_k)


def scale_scores(
    scores: Float[ArrayLike, "q_seq kv_seq"], scale: float | Float[ArrayLike, ""]
) -> Float[Array, "q_seq kv_seq"]:
    r"""Multiplies the scores by ``scale``: :math:`s_{ij} \leftarrow \text{scale} \cdot s_{ij}`.

    Args:
        scores: Raw scores, shape ``(T, S)``.
        scale: The factor, usually :func:`default_scale` of ``d_k``; ``1.0`` leaves the scores
            unscaled.

    Returns:
        Scaled scores, same shape and dtype.

    Examples:
        >>> import jax.numpy as jnp
        >>> scale_scores(jnp.array([[4.0, 8.0]]), default_scale(16))
        Array([[1., 2.]], dtype=float32)
    """
    scores = jnp.asarray(scores)
    return scores * jnp.asarray(scale, scores.dtype)


def soft_cap_scores(
    scores: Float[ArrayLike, "q_seq kv_seq"], cap: float
) -> Float[Array, "q_seq kv_seq"]:
    r"""Squashes scores smoothly into ``(-cap, cap)``: :math:`s \leftarrow c \tanh(s / c)`.

    An optional step between scaling and the softmax (Gemma 2); near zero it is the identity.

    Args:
        scores: Scaled scores, shape ``(T, S)``.
        cap: The bound :math:`c > 0`.

    Returns:
        Capped scores, same shape and dtype.

    Examples:
        >>> import jax.numpy as jnp
        >>> soft_cap_scores(jnp.array([[0.0, 1e6]]), 30.0)
        Array([[ 0., 30.]], dtype=float32)

    References:
        Gemma Team, Gemma 2: Improving Open Language Models at a Practical Size, 2024.
    """
    scores = jnp.asarray(scores)
    cap = jnp.asarray(cap, scores.dtype)
    return cap * jnp.tanh(scores / cap)


def masked_scores(
    scores: Float[Array, "*q kv"], mask: Bool[Array, "*#q #kv"] | None
) -> Float[Array, "*q kv"]:
    r"""The scores with masked entries replaced by a finite −∞ (``large_negative``).

    After subtracting a real row max, :math:`e^{\text{fill} - r}` is exactly 0, so masked keys
    drop out without a second mask on the exponentials. A row with no allowed key keeps the fill
    as its max; :func:`normalize` and :func:`logsumexp` recognise it by that and return 0 and
    −∞. The fill being finite, ``fill − fill = 0`` there: no NaN, forward or backward.
    """
    return scores if mask is None else jnp.where(mask, scores, large_negative(scores.dtype))


def exp_scores(masked: Float[Array, "*q kv"], row_max: Float[Array, "*q"]) -> Float[Array, "*q kv"]:
    r"""Un-normalised weights :math:`p_{ij} = e^{s_{ij} - r_i}` for a row shift :math:`r_i`."""
    return jnp.exp(masked - row_max[..., None])


def folded_exp_scores(
    scores: Float[Array, "*q kv"],
    mask: Bool[Array, "*#q #kv"] | None,
    row_max: Float[Array, "*q"],
    scale: float,
) -> Float[Array, "*q kv"]:
    r""":func:`exp_scores` of the masked ``scale · scores``, the scale folded into base 2.

    :math:`p_{ij} = 2^{\,s_{ij} c - r_i \log_2 e}` with :math:`c = \text{scale} \cdot \log_2 e`: a
    fused multiply-add and a base-2 exponential an entry where the scaled form takes two
    multiplies, a subtraction and the exponential (FlashAttention's softmax; a kernel's, whose
    logits are its products times a positive scale). Masked entries are 0 after it, whatever
    they held, and so is every entry of a row whose shift is the fill (its keys all masked: the
    fill times :math:`\log_2 e` overflows to −∞ there).
    """
    log2e = math.log2(math.e)
    p = jnp.exp2(scores * (scale * log2e) - (row_max * log2e)[..., None])
    return p if mask is None else jnp.where(mask, p, 0)


def has_key(row_max: Float[Array, "*q"]) -> Bool[Array, "*q"]:
    """Rows that saw at least one allowed key: their max rose above the fill."""
    return row_max > large_negative(row_max.dtype)


def max_allowed(scores: Float[Array, "*q kv"], mask: Bool[Array, "*#q #kv"] | None):
    """Each row's largest allowed score, −∞ for a row with none (not differentiated)."""
    row_max = lax.stop_gradient(masked_scores(scores, mask).max(axis=-1))
    return jnp.where(has_key(row_max), row_max, -jnp.inf)


def normalize(
    x: Float[Array, "q ..."], denom: Float[Array, " q"], row_max: Float[Array, " q"]
) -> Float[Array, "q ..."]:
    """Divides each row by its softmax denominator; a row with no allowed key becomes 0."""
    trailing = tuple(range(row_max.ndim, x.ndim))  # (as new axes: a kernel reshapes no rows)
    seen = jnp.expand_dims(has_key(row_max), trailing)
    return jnp.where(seen, x / jnp.expand_dims(denom, trailing), 0)


def logsumexp(row_max: Float[Array, "*q"], denom: Float[Array, "*q"]) -> Float[Array, "*q"]:
    r"""The log of the softmax denominator, :math:`\log \sum_j m_{ij} e^{s_{ij}}`; −∞ for no key."""
    seen = has_key(row_max)
    return jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1)), -jnp.inf)


def _softmax_parts(
    scores: Float[Array, "q kv"], mask: Bool[Array, "#q #kv"] | None
) -> tuple[Float[Array, "q kv"], Float[Array, " q"], Float[Array, " q"]]:
    """The softmax before its division: numerators, the row max they are shifted by, row sums."""
    masked = masked_scores(scores, mask)
    # Subtracting the row max keeps exp() in range; the result does not depend on it.
    row_max = lax.stop_gradient(masked.max(axis=-1))
    p = exp_scores(masked, row_max)
    return p, row_max, p.sum(axis=-1)


def softmax_with_logsumexp(
    scores: Float[Array, "q_seq kv_seq"],
    mask: Bool[Array, "#q_seq #kv_seq"] | None = None,
    sink: Float[Array, ""] | None = None,
) -> tuple[Float[Array, "q_seq kv_seq"], Float[Array, " q_seq"]]:
    r""":func:`softmax_weights` together with each row's log-sum-exp (−∞ for a row with no key).

    With a ``sink`` logit :math:`\sigma`, a virtual key without a value joins every row (an
    attention sink; Xiao et al. 2024): :math:`w_{ij} = e^{s_{ij}} / (e^{\sigma} + \sum_k
    e^{s_{ik}})`, the log-sum-exp counts it, and a row with no allowed key has weights 0.
    """
    if sink is not None:
        rows = scores.shape[0]
        allowed = (
            jnp.ones(scores.shape, bool) if mask is None else jnp.broadcast_to(mask, scores.shape)
        )
        scores = jnp.concatenate([scores, jnp.full((rows, 1), sink, scores.dtype)], axis=1)
        mask = jnp.concatenate([allowed, jnp.ones((rows, 1), bool)], axis=1)
        weights, lse = softmax_with_logsumexp(scores, mask)
        return weights[:, :-1], lse
    p, row_max, denom = _softmax_parts(scores, mask)
    return normalize(p, denom, row_max), logsumexp(row_max, denom)


def softmax_weights(
    scores: Float[ArrayLike, "q_seq kv_seq"], mask: Bool[ArrayLike, "#q_seq #kv_seq"] | None = None
) -> Float[Array, "q_seq kv_seq"]:
    r"""Turns scores into attention weights; each row with an allowed key sums to 1.

    .. math:: w_{ij} = \frac{m_{ij}\, e^{s_{ij} - r_i}}{\sum_k m_{ik}\, e^{s_{ik} - r_i}},
        \qquad r_i = \max_{k:\, m_{ik}} s_{ik}

    Subtracting the row maximum :math:`r_i` changes nothing mathematically and keeps
    :math:`e^{x}` from overflowing. Masked entries are exactly 0, and so is a whole row with no
    allowed key (PyTorch, FlashAttention and FlexAttention do the same; ``jax.nn`` and flax give
    such a row uniform weights instead). A score of −∞ counts as masked, and so, in effect, does
    one below ``-0.7 · finfo(float32).max``.

    Args:
        scores: Scaled scores, shape ``(T, S)``, any float dtype (computed in at least float32).
        mask: Optional boolean mask broadcastable to ``(T, S)``; ``True`` means "may attend".

    Returns:
        Weights of shape ``(T, S)`` in ``promote_types(scores.dtype, float32)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> softmax_weights(jnp.array([[0.0, 1.0]]))  # [1, e] / (1 + e)
        Array([[0.26894143, 0.7310586 ]], dtype=float32)
        >>> softmax_weights(jnp.array([[0.0, 1.0]]), jnp.array([[True, False]]))
        Array([[1., 0.]], dtype=float32)

    References:
        Vaswani et al., Attention Is All You Need, 2017, eq. (1).
    """
    scores = jnp.asarray(scores)
    scores = scores.astype(accumulation_dtype(scores.dtype))
    allowed = scores != -jnp.inf
    p, row_max, denom = _softmax_parts(
        scores, allowed if mask is None else allowed & jnp.asarray(mask)
    )
    return normalize(p, denom, row_max)


def sigmoid_parts(
    scores: Float[Array, "*q kv"], mask: Bool[Array, "*#q #kv"] | None, bias: Float[Array, "..."]
) -> Float[Array, "*q kv"]:
    r"""The sigmoid weights :math:`\sigma(s + b)` of allowed entries, exactly 0 elsewhere.

    (``σ`` of a large negative number is not 0 in float32: the mask is applied, not relied on
    through the bias.)
    """
    bias = jnp.broadcast_to(bias.astype(scores.dtype), scores.shape[:-1])
    weights = jax.nn.sigmoid(scores + bias[..., None])
    return weights if mask is None else jnp.where(mask, weights, 0)


def log_total(weights: Float[Array, "*q kv"]) -> Float[Array, "*q"]:
    """The log of each row's total weight, −∞ for a row of zeros (with a zero gradient there)."""
    return log_of_sum(weights.sum(axis=-1))


def log_of_sum(total: Float[Array, "*q"]) -> Float[Array, "*q"]:
    """``log(total)``, −∞ where it is 0, with no NaN in its gradient there."""
    seen = total > 0
    return jnp.where(seen, jnp.log(jnp.where(seen, total, 1)), -jnp.inf)


def sigmoid_weights(
    scores: Float[ArrayLike, "q_seq kv_seq"],
    mask: Bool[ArrayLike, "#q_seq #kv_seq"] | None = None,
    bias: Float[ArrayLike, "#q_seq"] | float | None = None,
) -> Float[Array, "q_seq kv_seq"]:
    r"""Turns scores into attention weights one by one: no normalisation over the row.

    .. math:: w_{ij} = m_{ij}\, \sigma(s_{ij} + b) = \frac{m_{ij}}{1 + e^{-(s_{ij} + b)}},
        \qquad b = -\log S \text{ by default}

    With :math:`b = -\log S` a row of near-zero scores (as at initialisation) has weights
    :math:`1/(1+S)` and sums to about 1, as a softmax row does; the weights of a row are
    independent of each other, so the output over a union of keys is the sum of the outputs
    over each part (Ramapuram et al. 2024). Masked entries (and scores of −∞) are exactly 0.

    Args:
        scores: Scaled scores, shape ``(T, S)``, any float dtype (computed in at least float32).
        mask: Optional boolean mask broadcastable to ``(T, S)``; ``True`` means "may attend".
        bias: The bias :math:`b`, a scalar or one per row ``(T,)``; by default ``-log S``.

    Returns:
        Weights of shape ``(T, S)`` in ``promote_types(scores.dtype, float32)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> sigmoid_weights(jnp.zeros((1, 3)))  # σ(−log 3) = 1/4
        Array([[0.25, 0.25, 0.25]], dtype=float32)
        >>> sigmoid_weights(jnp.array([[0.0, 2.0]]), jnp.array([[True, False]]), bias=0.0)
        Array([[0.5, 0. ]], dtype=float32)

    References:
        Ramapuram et al., Theory, Analysis, and Best Practices for Sigmoid Self-Attention, 2024.
    """
    scores = jnp.asarray(scores)
    scores = scores.astype(accumulation_dtype(scores.dtype))
    if bias is None:
        bias = -math.log(scores.shape[-1])
    bias = jnp.broadcast_to(jnp.asarray(bias, scores.dtype), scores.shape[:-1])
    allowed = scores != -jnp.inf
    return sigmoid_parts(scores, allowed if mask is None else allowed & jnp.asarray(mask), bias)


def _keep_bits(
    seed: Integer[Array, "2"], q_idx: Integer[Array, "q 1"], kv_idx: Integer[Array, "1 kv"]
) -> Integer[Array, "q kv"]:
    """32 random bits per (query, key) position, a pure function of the seed and the position.

    Counter-based (Threefry-2x32, Salmon et al. 2011): any block of the (T, S) grid can be drawn
    on its own and equals the same block of the whole grid, so the dense and the blocked
    implementations drop exactly the same weights.
    """
    q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
    return threefry2x32_p.bind(seed[0], seed[1], q_idx, kv_idx)[0]


def dropout_weights(
    weights: Float[ArrayLike, "q_seq kv_seq"],
    rng: Key[Array, ""] | Integer[Array, "2"],
    *,
    rate: float,
    q_offset: int | Integer[Array, ""] = 0,
    kv_offset: int | Integer[Array, ""] = 0,
) -> Float[Array, "q_seq kv_seq"]:
    r"""Drops each weight with probability ``rate``, scaling the rest by :math:`1/(1-\text{rate})`.

    .. math:: \tilde w_{ij} = \frac{z_{ij}}{1 - \text{rate}}\, w_{ij},
        \qquad z_{ij} \sim \mathrm{Bernoulli}(1 - \text{rate})

    Flax's semantics (dropout on the attention weights, expectation preserved). The mask
    :math:`z` depends only on ``rng`` and the global position ``(q_offset + i, kv_offset + j)``,
    so a block of the weights drawn with its offsets gets the same mask as the whole matrix.

    Args:
        weights: Weights (or un-normalised weights of a block), shape ``(T, S)``.
        rng: A PRNG key (typed or raw ``uint32[2]``).
        rate: Drop probability in ``[0, 1)``.
        q_offset: Position of the first row in the full query sequence.
        kv_offset: Position of the first column in the full key sequence.

    Returns:
        Dropped-out weights, same shape and dtype.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> w = dropout_weights(jnp.full((4, 4), 0.25), jax.random.key(0), rate=0.5)
        >>> sorted(set(w.ravel().tolist()))  # survivors are doubled
        [0.0, 0.5]
    """
    weights = jnp.asarray(weights)
    seed = jax.random.bits(rng, (2,), jnp.uint32)
    # Counters, not indices: uint32 whatever their dtype and jax_enable_x64 (the bits need 32).
    q_idx = jnp.asarray(q_offset, jnp.uint32) + jnp.arange(weights.shape[0], dtype=jnp.uint32)
    kv_idx = jnp.asarray(kv_offset, jnp.uint32) + jnp.arange(weights.shape[1], dtype=jnp.uint32)
    q_idx, kv_idx = q_idx[:, None], kv_idx[None, :]
    keep_prob = 1.0 - rate
    threshold = jnp.uint32(min(round(keep_prob * 2.0**32), 2**32 - 1))
    keep = _keep_bits(seed, q_idx, kv_idx) < threshold
    return jnp.where(keep, weights / jnp.asarray(keep_prob, weights.dtype), 0)


def weighted_sum(
    weights: Float[ArrayLike, "q_seq kv_seq"],
    value: Float[ArrayLike, "kv_seq d_v"],
    *,
    precision: lax.PrecisionLike = None,
) -> Float[Array, "q_seq d_v"]:
    r"""Each output row is the weights' blend of the value rows: :math:`o_i = \sum_j w_{ij} v_j`.

    .. math:: O = W V

    The weights are cast to the value dtype (as ``jax.nn`` does, so low-precision inputs keep
    fast matrix units) and the sum is accumulated in at least float32.

    Args:
        weights: Attention weights, shape ``(T, S)``.
        value: Values, shape ``(S, d_v)``; ``d_v`` may differ from ``d_k``.
        precision: Optional ``jax.lax`` precision for the matrix product.

    Returns:
        Output of shape ``(T, d_v)`` in ``promote_types(value.dtype, float32)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> weighted_sum(jnp.array([[0.25, 0.75]]), jnp.array([[0.0, 4.0], [4.0, 0.0]]))
        Array([[3., 1.]], dtype=float32)
    """
    weights, value = jnp.asarray(weights), jnp.asarray(value)
    return cast_product("ts,sd->td", weights, value, value.dtype, precision=precision)


def cast_product(spec: str, a: Array, b: Array, dtype, *, precision=None) -> Array:
    """``einsum(spec, a, b)`` of the operands cast to ``dtype``, summed in at least float32."""
    return jnp.einsum(
        spec,
        a.astype(dtype),
        b.astype(dtype),
        precision=precision,
        preferred_element_type=accumulation_dtype(dtype),
    )
