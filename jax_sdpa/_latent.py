r"""Shared-latent caches: values that are the keys' leading features (multi-head latent attention).

DeepSeek-V2/V3's multi-head latent attention (MLA, DeepSeek-AI 2024), decoded with its
projections absorbed into the queries and the output, attends every query head to one
key/value head whose key is the latent row :math:`[c; k_\mathrm{rope}]` (576 features) and
whose value is its first part :math:`c` (512): the cache holds each latent row once, and
``value=LatentValues(512)`` says so. The decode and paged paths then read that one array for
both products (the blend runs over the whole row and keeps its first ``features`` outputs), and
so does the Mosaic GPU kernel (each block of the latent copied once); the other paths attend to
the slice ``key[..., :features]``.
"""

import dataclasses

import jax

__all__ = ["LatentValues"]


@dataclasses.dataclass(frozen=True)
class LatentValues:
    """``value=LatentValues(features)``: the values are ``key[..., :features]``, not an array.

    Attributes:
        features: ``V``, the number of leading key features that are the values (512 in
            DeepSeek-V3's latent cache of 576).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax_sdpa import dot_product_attention
        >>> latent = jax.random.normal(jax.random.key(0), (1, 2048, 1, 576))  # one kv head
        >>> q = jax.random.normal(jax.random.key(1), (1, 1, 16, 576))
        >>> out = dot_product_attention(q, latent, LatentValues(512))
        >>> out.shape
        (1, 1, 16, 512)
        >>> same = dot_product_attention(q, latent, latent[..., :512])
        >>> bool(jnp.abs(out - same).max() < 1e-6)
        True
    """

    features: int

    def of(self, key):
        """The values as an array of their own: ``key[..., :features]``.

        Of a quantized ``key`` (:class:`~jax_sdpa.Quantized`), its values' features, each
        token's scale as it is (its last axis is 1).
        """
        return jax.tree.map(lambda x: x[..., : self.features], key)

    def like(self, key) -> jax.ShapeDtypeStruct:
        """The shape and dtype the values have, for a cache ``key``."""
        return jax.ShapeDtypeStruct((*key.shape[:-1], self.features), key.dtype)


# A pytree without leaves: it passes through jit, vmap and the cache writers as it is.
jax.tree_util.register_dataclass(LatentValues, data_fields=[], meta_fields=["features"])
