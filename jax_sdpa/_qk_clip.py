r"""QK-Clip: keep each head's largest attention logit at or below a threshold during training.

After an optimiser step, the heads whose largest logit :math:`S^{\max}_h` (from
``dot_product_attention(..., return_max_scores=True)``, maximised over the batch and the rows)
passed the threshold :math:`\tau` have their query and key projections scaled down so that the
same inputs would give :math:`\tau`: every logit of head :math:`h` is multiplied by
:math:`\gamma_h = \min(1, \tau / S^{\max}_h)`, half of it in each projection (Kimi K2's
MuonClip; Kimi Team, 2025). The other heads are untouched.
"""

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from jax_sdpa import _checks

__all__ = ["qk_clip"]


def qk_clip(
    query_kernel: Float[ArrayLike, "... heads head_dim"],
    key_kernel: Float[ArrayLike, "... kv_heads head_dim"],
    max_logits: Float[ArrayLike, " heads"],
    *,
    threshold: float,
) -> tuple[Array, Array]:
    r"""The query and key projections rescaled: no head's largest logit exceeds ``threshold``.

    Head :math:`h`'s logits :math:`q_h \cdot k_h` are bilinear in the two projections, so
    scaling them by :math:`a_h` and :math:`b_h` scales the logits by :math:`a_h b_h`; QK-Clip
    takes :math:`a_h b_h = \gamma_h = \min(1, \tau / S^{\max}_h)`. With one key head per query
    head, :math:`a_h = b_h = \sqrt{\gamma_h}`. Where ``G`` query heads share a key head (GQA),
    the key head takes :math:`\sqrt{\min_g \gamma_g}` of its group and each query head the rest,
    :math:`\gamma_h / \sqrt{\min_g \gamma_g}`, so that every head's logits are scaled by exactly
    its own :math:`\gamma_h`.

    Args:
        query_kernel: The query projection with the heads on its second-to-last axis
            (``(features, N, H)``, flax's ``DenseGeneral`` layout).
        key_kernel: The key projection, ``(features, K, H)``; ``K`` divides ``N``.
        max_logits: Each query head's largest logit since the last clip, ``(N,)``: the max over
            batch and queries of ``return_max_scores``' output (−∞ for a head that saw no key).
        threshold: :math:`\tau > 0`.

    Returns:
        ``(query_kernel, key_kernel)``, rescaled, in their dtypes.

    Raises:
        ValueError: If the heads do not fit together or ``threshold`` is not positive.

    Examples:
        >>> import jax.numpy as jnp
        >>> w_q, w_k = jnp.ones((3, 2, 4)), jnp.ones((3, 2, 4))
        >>> new_q, new_k = qk_clip(w_q, w_k, jnp.array([400.0, 50.0]), threshold=100.0)
        >>> (new_q * new_k).sum(axis=(0, 2))  # head 0's logits × 1/4, head 1's unchanged
        Array([ 3., 12.], dtype=float32)

    References:
        Kimi Team, Kimi K2: Open Agentic Intelligence, 2025 (MuonClip, QK-Clip).
    """
    query_kernel, key_kernel = jnp.asarray(query_kernel), jnp.asarray(key_kernel)
    max_logits = jnp.asarray(max_logits)
    if not threshold > 0:
        raise ValueError(f"`threshold` must be positive; got {threshold}.")
    heads, kv_heads = query_kernel.shape[-2], key_kernel.shape[-2]
    _checks.check_shape("max_logits", max_logits, (heads,), "(heads,)")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"`key_kernel`'s heads (axis −2) must divide `query_kernel`'s; got {kv_heads} and "
            f"{heads}."
        )
    dtype = jnp.promote_types(max_logits.dtype, jnp.float32)
    tau = jnp.asarray(threshold, dtype)
    top = max_logits.astype(dtype)
    gamma = jnp.where(top > tau, tau / jnp.where(top > tau, top, 1), 1)  # ≤ 1, 1 if under τ
    per_key = jnp.sqrt(gamma.reshape(kv_heads, -1).min(axis=1))
    per_query = gamma / jnp.repeat(per_key, heads // kv_heads)

    def scaled(kernel, factor):
        factor = factor.reshape((1,) * (kernel.ndim - 2) + (-1, 1)).astype(kernel.dtype)
        return kernel * factor

    return scaled(query_kernel, per_query), scaled(key_kernel, per_key)
