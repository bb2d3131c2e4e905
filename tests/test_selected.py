"""Attention over selected keys (``key_indices``): equal to the call with the equivalent dense mask.

The mask "key ``j`` is listed for query ``i``" (repeats once, strays nowhere), given to the
float64 reference, is the oracle: forward, log-sum-exp and gradients, with GQA, lengths,
bottom-right causal, windows, a ``score_mod`` with an array, quantized and shared-latent caches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from tests import reference as ref
from tests.util import qkv


def listed_mask(indices, seq_kv):
    """``(B, 1, T, S)``: True where query ``t`` lists key ``s`` (in range)."""
    b, t, _ = indices.shape
    mask = np.zeros((b, 1, t, seq_kv), bool)
    for (i, j, _), s in np.ndenumerate(np.asarray(indices)):
        if 0 <= s < seq_kv:
            mask[i, 0, j, s] = True
    return mask


def indices_for(rng, b, t, s, k):
    """Random indices ``(B, T, k)`` with a repeat in every row."""
    indices = rng.integers(0, s, size=(b, t, k))
    indices[..., 1] = indices[..., 0]
    return jnp.asarray(indices, jnp.int32)


@pytest.mark.parametrize(
    "options, rules",
    [
        ({}, {}),
        (
            {"is_causal": True, "causal_alignment": "bottom_right"},
            {"is_causal": True, "offset": 40},
        ),
        ({"local_window_size": (9, 3)}, {"window": (9, 3)}),
        (
            {"logits_soft_cap": 2.0, "normalizer": "sigmoid"},
            {"soft_cap": 2.0, "normalizer": "sigmoid"},
        ),
    ],
)
@pytest.mark.parametrize("n, k", [(4, 2), pytest.param(4, 1, marks=pytest.mark.x64_sampled)])
def test_selected_keys_equal_the_reference_with_the_listed_mask(rng, options, rules, n, k):
    q, key, v = qkv(rng, 2, 7, 47, n, k, 8, hv=6)
    indices = indices_for(rng, 2, 7, 47, 11)
    lengths = np.array([47, 30])
    out, lse = js.dot_product_attention(
        q,
        key,
        v,
        key_indices=indices,
        key_value_seq_lengths=lengths,
        return_residual=True,
        implementation=js.Selected(block_q=3),
        **options,
    )
    want = ref.attention(q, key, v, mask=listed_mask(indices, 47), kv_lengths=lengths, **rules)
    assert ref.rel_err(out, want["out"]) < 2e-6
    np.testing.assert_allclose(lse, want["lse"], rtol=1e-5, atol=1e-6)


def test_gradients_to_queries_keys_values_and_a_mods_array(rng):
    q, key, v = qkv(rng, 2, 6, 40, 4, 2, 8)
    indices = indices_for(rng, 2, 6, 40, 10)
    slopes = jnp.asarray(rng.uniform(0.01, 0.1, size=4), jnp.float32)
    d_out = jnp.asarray(rng.normal(size=(2, 6, 4, 8)), jnp.float32)

    def loss(q, key, v, slopes, **kw):
        def score_mod(s, b, h, i, j):
            return s + slopes[h] * (i - j).astype(s.dtype)

        out = js.dot_product_attention(q, key, v, is_causal=True, score_mod=score_mod, **kw)
        return jnp.sum(out * d_out)

    grads = jax.jit(jax.grad(lambda *a: loss(*a, key_indices=indices), argnums=(0, 1, 2, 3)))(
        q, key, v, slopes
    )
    mask = jnp.asarray(listed_mask(indices, 40))
    dense = jax.grad(lambda *a: loss(*a, mask=mask, implementation="xla"), argnums=(0, 1, 2, 3))(
        q, key, v, slopes
    )
    for got, want in zip(grads, dense, strict=True):
        np.testing.assert_allclose(got, want, atol=3e-6)


def test_unbatched_queries_list_their_keys_as_t_by_k(rng):
    # (T, N, H) queries, (S, K, H) keys and values, and (T, k) indices, as jax.nn takes them.
    q, key, v = qkv(rng, 1, 5, 33, 4, 2, 8)
    indices = indices_for(rng, 1, 5, 33, 6)
    out = js.dot_product_attention(q[0], key[0], v[0], key_indices=indices[0], is_causal=True)
    want = ref.attention(q, key, v, mask=listed_mask(indices, 33), is_causal=True)
    assert out.shape == (5, 4, 8) and ref.rel_err(out, want["out"][0]) < 2e-6


def test_a_row_with_no_valid_key_gives_zeros_and_zero_gradients(rng):
    q, key, v = qkv(rng, 1, 2, 30, 2, 1, 8)
    indices = jnp.array(
        [[[3, 5, 7], [25, 26, 27]]], jnp.int32
    )  # query 1's keys lie past the length

    def loss(q, key, v):
        out = js.dot_product_attention(
            q, key, v, key_indices=indices, key_value_seq_lengths=jnp.array([20])
        )
        return out, jnp.sum(out[:, 1])

    out, _ = loss(q, key, v)
    np.testing.assert_array_equal(out[0, 1], 0.0)
    grads = jax.grad(lambda *a: loss(*a)[1], argnums=(0, 1, 2))(q, key, v)
    for g in grads:
        assert np.all(np.isfinite(g)) and not np.any(g)


def test_out_of_range_indices_are_refused_or_under_jit_masked(rng):
    q, key, v = qkv(rng, 1, 3, 30, 2, 1, 8)
    indices = indices_for(rng, 1, 3, 30, 5)
    with pytest.raises(ValueError, match=r"`key_indices` must hold key positions in \[0, 30\)"):
        js.dot_product_attention(q, key, v, key_indices=indices.at[0, 1, 2].set(30))
    stray = indices.at[0, 1, 2].set(-1).at[0, 2, 4].set(99)
    out = jax.jit(lambda i: js.dot_product_attention(q, key, v, key_indices=i))(stray)
    want = ref.attention(q, key, v, mask=listed_mask(stray, 30))
    assert ref.rel_err(out, want["out"]) < 2e-6


def test_quantized_and_shared_latent_caches(rng):
    q, latent, _ = qkv(rng, 2, 1, 64, 8, 1, 16)
    indices = indices_for(rng, 2, 1, 64, 12)
    cache = js.quantize(latent)
    out = js.dot_product_attention(q, cache, js.LatentValues(12), key_indices=indices)
    values = cache.dequantize()
    want = ref.attention(q, values, values[..., :12], mask=listed_mask(indices, 64))
    assert ref.rel_err(out, want["out"]) < 2e-6


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"key_indices": jnp.zeros((2, 3, 4), jnp.float32)},
            "`key_indices` must have an integer dtype",
        ),
        (
            {"key_indices": jnp.zeros((2, 4, 4), jnp.int32)},
            r"`key_indices` must have shape \(batch, q_seq, k\) = \(2, 3, 4\)",
        ),
        (
            {"key_indices": jnp.zeros((2, 3, 4), jnp.int32), "implementation": "chunked"},
            "attends to every key",
        ),
        (
            {"key_indices": jnp.zeros((2, 3, 4), jnp.int32), "bias": jnp.zeros((1, 1, 3, 20))},
            "`key_indices` takes no bias",
        ),
        ({"implementation": "selected"}, "pass `key_indices`"),
    ],
)
def test_selected_errors(rng, kw, message):
    q, key, v = qkv(rng, 2, 3, 20, 2, 1, 8)
    with pytest.raises((ValueError, TypeError), match=message):
        js.dot_product_attention(q, key, v, **kw)


def test_no_query_or_no_key_gives_zeros(rng):
    q, key, v = qkv(rng, 1, 2, 5, 2, 1, 8)
    none = js.dot_product_attention(q[:, :0], key, v, key_indices=jnp.zeros((1, 0, 3), jnp.int32))
    assert none.shape == (1, 0, 2, 8)
    empty = jax.jit(lambda i: js.dot_product_attention(q, key[:, :0], v[:, :0], key_indices=i))
    np.testing.assert_array_equal(empty(jnp.zeros((1, 2, 3), jnp.int32)), 0.0)
