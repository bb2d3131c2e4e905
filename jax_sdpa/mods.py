r"""Ready-made ``score_mod`` and ``mask_mod`` functions: each a plain function returning a mod.

A ``score_mod(score, batch, head, q_idx, kv_idx) -> score`` and a
``mask_mod(batch, head, q_idx, kv_idx) -> bool`` take scalars (the library maps them over every
entry) and are passed to :func:`jax_sdpa.dot_product_attention` and its siblings::

    >>> import jax, jax.numpy as jnp, jax_sdpa
    >>> from jax_sdpa import mods
    >>> q = jax.random.normal(jax.random.key(0), (1, 6, 4, 8))
    >>> out = jax_sdpa.dot_product_attention(
    ...     q, q, q, score_mod=mods.alibi(mods.alibi_slopes(4)), mask_mod=mods.chunked_causal(3))
    >>> out.shape
    (1, 6, 4, 8)

The arrays a mod closes over (slopes, a bias table, prefix lengths) may be traced: gradients
reach them on every implementation.
"""

import functools
import math
from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

__all__ = [
    "MaskMod",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "and_masks",
    "chunked_causal",
    "document_mask",
    "or_masks",
    "prefix_lm",
    "relative_position_bias",
    "soft_cap",
]

#: ``score_mod(score, batch, head, q_idx, kv_idx) -> score``: a new logit from scalar arguments.
ScoreMod = Callable[..., Array]
#: ``mask_mod(batch, head, q_idx, kv_idx) -> bool``: whether the query may attend the key.
MaskMod = Callable[..., Array]


def alibi_slopes(num_heads: int) -> Array:
    r"""ALiBi's slope per head: :math:`m_h = 2^{-8 (h + 1) / n}` for ``n`` a power of two.

    For other head counts, the slopes of the power of two :math:`p` below ``n`` and then every
    other slope of :math:`2p`, as in the paper's reference code.

    Examples:
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
        >>> alibi_slopes(6).tolist()  # those of 4, then every other one of 8
        [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]

    References:
        Press, Smith & Lewis, Train Short, Test Long: Attention with Linear Biases Enables
        Input Length Extrapolation, ICLR 2022.
    """

    def powers_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    if num_heads < 1:
        raise ValueError(f"`num_heads` must be a positive int; got {num_heads!r}.")
    below = 2 ** math.floor(math.log2(num_heads))
    slopes = powers_of_two(below) + powers_of_two(2 * below)[0::2][: num_heads - below]
    return jnp.asarray(slopes, jnp.float32)


def alibi(slopes: ArrayLike) -> ScoreMod:
    r"""Linear biases by distance: :math:`s + m_h (j - i)`, negative for past keys.

    ``slopes`` has one entry per query head (:func:`alibi_slopes`, or learned). Meant for causal
    attention, as in the paper: without a causal mask, future keys would get a growing bonus.

    References:
        Press, Smith & Lewis, ICLR 2022.
    """
    slopes = jnp.asarray(slopes)

    def score_mod(score, batch, head, q_idx, kv_idx):
        return score + slopes[head].astype(score.dtype) * (kv_idx - q_idx).astype(score.dtype)

    return score_mod


def _t5_bucket(relative: Array, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's bucket of a relative position ``kv − q``: exact near 0, logarithmic up to the max."""
    n = -relative
    bucket = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0).astype(n.dtype) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    exact = num_buckets // 2
    far = n.astype(jnp.float32) / exact
    log_bucket = jnp.log(jnp.maximum(far, 1.0)) / math.log(max_distance / exact)
    large = exact + (log_bucket * (num_buckets - exact)).astype(n.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(n < exact, n, large)


def relative_position_bias(
    table: ArrayLike, num_buckets: int, max_distance: int, bidirectional: bool = True
) -> ScoreMod:
    r"""T5's learned relative-position bias: :math:`s + B[\mathrm{bucket}(j - i), h]`.

    ``table`` is ``(num_buckets, heads)``. Distances below ``num_buckets / 2`` (half that when
    ``bidirectional``, one half for each direction) get a bucket each; longer ones share
    logarithmically wider buckets up to ``max_distance``, beyond which all share the last.

    References:
        Raffel et al., Exploring the Limits of Transfer Learning with a Unified Text-to-Text
        Transformer, JMLR 2020, §2.1.
    """
    table = jnp.asarray(table)

    def score_mod(score, batch, head, q_idx, kv_idx):
        bucket = _t5_bucket(kv_idx - q_idx, num_buckets, max_distance, bidirectional)
        return score + table[bucket, head].astype(score.dtype)

    return score_mod


def soft_cap(cap: float) -> ScoreMod:
    r"""Squashes each score into ``(−cap, cap)``: :math:`c \tanh(s / c)` (Gemma 2).

    As a ``score_mod`` it applies after the bias; ``logits_soft_cap=`` applies before it.
    """

    def score_mod(score, batch, head, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    return score_mod


def prefix_lm(prefix_lengths: ArrayLike) -> MaskMod:
    r"""Prefix-LM: every query sees the first ``prefix_lengths[batch]`` keys, and causally after.

    :math:`j < p_b \lor j \le i`. ``prefix_lengths`` has one integer per sequence of the batch.

    References:
        Raffel et al., JMLR 2020, §3.2.1.
    """
    prefix_lengths = jnp.asarray(prefix_lengths)

    def mask_mod(batch, head, q_idx, kv_idx):
        return (kv_idx < prefix_lengths[batch]) | (kv_idx <= q_idx)

    return mask_mod


def chunked_causal(chunk_size: int) -> MaskMod:
    r"""Causal within chunks of ``chunk_size`` positions (Llama 4's local attention layers).

    :math:`\lfloor i/c \rfloor = \lfloor j/c \rfloor \land j \le i`.
    """

    def mask_mod(batch, head, q_idx, kv_idx):
        return (q_idx // chunk_size == kv_idx // chunk_size) & (kv_idx <= q_idx)

    return mask_mod


def document_mask(segment_ids: ArrayLike) -> MaskMod:
    r"""Packed documents: a query sees only keys of its own document, :math:`d_{b,i} = d_{b,j}`.

    ``segment_ids`` is ``(batch, seq)``, one document id per position (queries and keys are the
    same sequence). Combine with causality by :func:`and_masks`.
    """
    segment_ids = jnp.asarray(segment_ids)

    def mask_mod(batch, head, q_idx, kv_idx):
        return segment_ids[batch, q_idx] == segment_ids[batch, kv_idx]

    return mask_mod


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """Allowed where every one of ``mask_mods`` allows (all when there are none)."""

    def mask_mod(batch, head, q_idx, kv_idx):
        parts = (m(batch, head, q_idx, kv_idx) for m in mask_mods)
        return functools.reduce(jnp.logical_and, parts, jnp.bool_(True))

    return mask_mod


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """Allowed where any one of ``mask_mods`` allows (none when there are none)."""

    def mask_mod(batch, head, q_idx, kv_idx):
        parts = (m(batch, head, q_idx, kv_idx) for m in mask_mods)
        return functools.reduce(jnp.logical_or, parts, jnp.bool_(False))

    return mask_mod
