"""Shared-latent caches (MLA): ``value=LatentValues(V)`` equals the values given as ``key[..., :V]``.

Against the float64 reference on every implementation that takes the call (the decode and paged
paths, and the Mosaic GPU kernel, read the one array; the others attend to its slice), gradients
to the queries and the latent cache, a quantized latent cache, and the paged writer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from tests import reference as ref
from tests.test_paged import expected, gathered

LATENT = js.LatentValues(12)


def latent_cache(rng, b=2, s=90, h=16):
    """Queries for 8 heads against one latent head of ``h`` features, the first 12 the values."""
    q = jnp.asarray(rng.normal(size=(b, 3, 8, h)), jnp.float32)
    return q, jnp.asarray(rng.normal(size=(b, s, 1, h)), jnp.float32)


INTERPRET = js.Pallas(interpret=True)


@pytest.mark.parametrize(
    "implementation", [None, "xla", "chunked", js.Decode(block_kv=40), INTERPRET]
)
def test_latent_values_equal_the_reference_with_the_slice_as_values(rng, implementation):
    q, latent = latent_cache(rng)
    lengths = np.array([90, 37])
    rules = {"is_causal": True, "causal_alignment": "bottom_right"}
    out = js.dot_product_attention(
        q, latent, LATENT, key_value_seq_lengths=lengths, implementation=implementation, **rules
    )
    want = ref.attention(q, latent, latent[..., :12], kv_lengths=lengths, is_causal=True, offset=87)
    assert out.shape == (2, 3, 8, 12)
    assert ref.rel_err(out, want["out"]) < 2e-6


@pytest.mark.parametrize("implementation", [js.Decode(block_kv=40), INTERPRET])
def test_gradients_reach_the_queries_and_the_latent_cache_through_both_products(
    rng, implementation
):
    q, latent = latent_cache(rng)

    def loss(q, latent, value_of, implementation):
        out = js.dot_product_attention(q, latent, value_of(latent), implementation=implementation)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape))

    grads = jax.grad(loss, argnums=(0, 1))(q, latent, lambda _: LATENT, implementation)
    dense = jax.grad(loss, argnums=(0, 1))(q, latent, lambda x: x[..., :12], "xla")
    for got, want in zip(grads, dense, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6)


def test_a_quantized_latent_cache(rng):
    q, latent = latent_cache(rng)
    cache = js.quantize(latent)
    out = js.dot_product_attention(q, cache, LATENT)
    values = cache.dequantize()
    assert ref.rel_err(out, ref.attention(q, values, values[..., :12])["out"]) < 2e-6


def test_paged_latent_pools_are_written_once_and_read_for_both_products(rng):
    _, latent = latent_cache(rng, s=35)
    q = jnp.asarray(rng.normal(size=(2, 1, 8, 16)), jnp.float32)
    table = jnp.asarray(rng.permutation(12)[:10].reshape(2, 5), jnp.int32)
    pool, values = js.update_paged_cache(
        jnp.zeros((12, 7, 1, 16), jnp.float32), LATENT, latent, None, table, jnp.zeros(2, jnp.int32)
    )
    assert values is LATENT
    np.testing.assert_array_equal(gathered(pool, table), latent)
    lengths = jnp.array([35, 20])
    want = expected(q, pool, pool[..., :12], table, lengths)["out"]
    for paged in (js.Paged(14), js.Paged(kernel=INTERPRET)):
        out = js.paged_attention(q, pool, LATENT, table, lengths, implementation=paged)
        assert ref.rel_err(out, want) < 2e-6


@pytest.mark.parametrize("features", [0, 17, 2.0])
def test_latent_features_must_be_the_keys_own(rng, features):
    q, latent = latent_cache(rng)
    with pytest.raises(ValueError, match=r"features must be an int in \[1, 16\]"):
        js.dot_product_attention(q, latent, js.LatentValues(features))
