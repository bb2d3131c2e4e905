"""Quantized KV caches: the round trip, and attention equal to the reference on the dequantized cache.

The decode and paged paths read the 8-bit values and apply the scales outside the products, so
their results are those of the dequantized cache ``values · scale`` to float32 rounding; against
the float32 cache they are off by the quantization, within the bound of ``_quantized``'s
docstring (checked here as measured).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from tests import reference as ref
from tests.test_paged import expected, gathered, paged_cache
from tests.util import qkv

FORMATS = ["int8", "float8_e4m3fn"]
# The x64 pass runs the int8 rows of the matrices: float8 differs in its values, not its indices.
SAMPLED = ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.x64_sampled)]
DECODE = {"implementation": js.Decode(block_kv=40)}  # chunks that divide nothing below


def test_int8_rounds_each_row_to_its_largest_element(rng):
    x = jnp.asarray(rng.normal(size=(2, 9, 3, 16)), jnp.float32).at[0, 4, 1].set(0.0)
    cache = js.quantize(x, "int8")
    assert cache.values.dtype == jnp.int8 and cache.scale.shape == (2, 9, 3, 1)
    peak = np.abs(np.asarray(x)).max(-1, keepdims=True)
    # An all-zero row gets the scale 1 (and reads back as zeros); the others max|x| / 127.
    np.testing.assert_allclose(cache.scale, np.where(peak > 0, peak / 127, 1), rtol=1e-6)
    largest = np.abs(np.asarray(cache.values, np.int32)).max(-1)
    np.testing.assert_array_equal(largest, np.where(peak[..., 0] > 0, 127, 0))
    assert np.all(np.abs(cache.dequantize() - x) <= cache.scale / 2 * (1 + 1e-6))


def test_float8_has_one_scale_per_head_and_three_mantissa_bits(rng):
    x = jnp.asarray(rng.normal(size=(2, 9, 3, 16)), jnp.float32)
    cache = js.quantize(x, "float8_e4m3fn")
    assert cache.values.dtype == jnp.float8_e4m3fn and cache.scale.shape == (1, 1, 3, 1)
    peak = np.abs(np.asarray(x)).max(axis=(0, 1, 3))
    np.testing.assert_allclose(cache.scale.ravel(), peak / 448, rtol=1e-6)
    normal = np.abs(np.asarray(x)) >= 2.0**-6 * np.asarray(cache.scale)  # float8's normals
    error = np.abs(np.asarray(cache.dequantize() - x))
    assert np.all(error[normal] <= 2.0**-4 * np.abs(np.asarray(x))[normal] * (1 + 1e-6))
    assert np.all(error[~normal] <= 2.0**-10 * np.broadcast_to(cache.scale, x.shape)[~normal])


def test_a_given_float8_scale_saturates_what_it_does_not_cover():
    cache = js.quantize(jnp.array([[[[1.0, -900.0, 3.0]]]]), "float8_e4m3fn", scale=1.0)
    np.testing.assert_array_equal(cache.dequantize()[0, 0, 0], [1.0, -448.0, 3.0])


@pytest.mark.parametrize("fmt", SAMPLED)
@pytest.mark.parametrize("t, n, k", [(1, 4, 2), (3, 4, 1), (16, 8, 2)])  # 16·8: head by head
def test_decode_equals_the_reference_on_the_dequantized_cache(rng, fmt, t, n, k):
    q, key, v = qkv(rng, 3, t, 123, n, k, 8, hv=6)
    key, v = js.quantize(key, fmt), js.quantize(v, fmt)
    lengths = np.array([123, 0, 61])
    out, lse = js.dot_product_attention(
        q, key, v, key_value_seq_lengths=lengths, return_residual=True, **DECODE
    )
    want = ref.attention(q, key.dequantize(), v.dequantize(), kv_lengths=lengths)
    assert ref.rel_err(out, want["out"]) < 2e-6
    np.testing.assert_array_equal(np.asarray(out)[1], 0.0)
    np.testing.assert_allclose(lse, want["lse"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", SAMPLED)
def test_rules_mods_and_the_automatic_choice(rng, fmt):
    q, key, v = qkv(rng, 2, 5, 90, 4, 2, 8)
    slopes = rng.uniform(0.01, 0.1, size=4)

    def score_mod(lib):
        m = lib.asarray(slopes, dtype=lib.float32 if lib is jnp else None)
        return lambda s, b, h, i, j: s + m[h] * j.astype(s.dtype)

    options = {"is_causal": True, "causal_alignment": "bottom_right", "local_window_size": (17, 0)}
    quantized = js.quantize(key, fmt), js.quantize(v, fmt)
    out = js.dot_product_attention(
        q, *quantized, score_mod=score_mod(jnp), logits_soft_cap=3.0, **options
    )
    want = ref.attention(
        q,
        *(x.dequantize() for x in quantized),
        is_causal=True,
        window=(17, 0),
        offset=85,
        soft_cap=3.0,
        score_mod=score_mod(np),
    )
    assert ref.rel_err(out, want["out"]) < 2e-6


@pytest.mark.parametrize("fmt", SAMPLED)
def test_unbatched_queries_and_caches(rng, fmt):
    # (T, N, H) queries against (S, K, H) caches, as jax.nn takes unbatched inputs.
    q, key, v = qkv(rng, 1, 2, 37, 4, 2, 8)
    cache = [js.quantize(x[0], fmt) for x in (key, v)]
    assert cache[0].values.shape == (37, 2, 8)
    causal = {"is_causal": True, "causal_alignment": "bottom_right"}
    out = js.dot_product_attention(q[0], *cache, **causal, **DECODE)
    want = ref.attention(q, *(x.dequantize()[None] for x in cache), is_causal=True, offset=35)
    assert out.shape == (2, 4, 8) and ref.rel_err(out, want["out"][0]) < 2e-6


@pytest.mark.parametrize("fmt", SAMPLED)
def test_query_gradients_equal_the_reference_on_the_dequantized_cache(rng, fmt):
    q, key, v = qkv(rng, 2, 2, 70, 4, 2, 8)
    key, v = js.quantize(key, fmt), js.quantize(v, fmt)
    lengths = np.array([70, 33])
    d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)

    def loss(q, key, v):
        out = js.dot_product_attention(q, key, v, key_value_seq_lengths=lengths, **DECODE)
        return jnp.sum(out * d_out)

    grad = jax.jit(jax.grad(loss))(q, key, v)
    want = ref.attention(q, key.dequantize(), v.dequantize(), kv_lengths=lengths, d_out=d_out)
    assert ref.rel_err(grad, want["dq"]) < 1e-5


def _quantized(x, fmt, scale):
    """``quantize`` compiled, as the writers are: XLA may divide by 127 as a product by 1/127."""
    return jax.jit(js.quantize, static_argnums=1)(x, fmt, scale=scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_pools_written_by_the_writer_equal_the_reference(rng, fmt):
    key_pages, value_pages, table = paged_cache(rng, 3, 6, 7, 2, 8)
    pools = (
        js.quantize(jnp.zeros_like(key_pages), fmt),
        js.quantize(jnp.zeros_like(value_pages), fmt),
    )
    _, new_k, new_v = qkv(rng, 3, 1, 42, 4, 2, 8)
    pools = jax.jit(js.update_paged_cache)(*pools, new_k, new_v, table, jnp.zeros(3, jnp.int32))
    q = jnp.asarray(rng.normal(size=(3, 3, 4, 8)), jnp.float32)
    lengths = jnp.array([42, 0, 17])
    out = js.paged_attention(q, *pools, table, lengths, implementation=js.Paged(14))
    want = expected(q, *(p.dequantize() for p in pools), table, lengths)
    assert ref.rel_err(out, want["out"]) < 2e-6
    # The pools from zeros: int8 writes each new row's own scale, float8 the pool's (here 1).
    written = gathered(pools[0].dequantize(), table)
    scale = None if fmt == "int8" else pools[0].scale
    np.testing.assert_array_equal(written, _quantized(new_k, fmt, scale).dequantize())


@pytest.mark.parametrize("fmt", FORMATS)
def test_update_cache_quantizes_the_new_rows_in_the_caches_format(rng, fmt):
    cache = js.quantize(jnp.asarray(rng.normal(size=(2, 10, 2, 8)), jnp.float32), fmt)
    new = jnp.asarray(rng.normal(size=(2, 3, 2, 8)), jnp.float32)
    keys, _ = jax.jit(js.update_cache)(cache, cache, new, new, jnp.array([4, 7]))
    # int8: a scale per token, the new rows' own; float8: the cache's, fixed.
    scale = None if fmt == "int8" else cache.scale
    want = np.array(cache.dequantize())
    for b, p in enumerate([4, 7]):
        want[b, p : p + 3] = _quantized(new[b : b + 1], fmt, scale).dequantize()[0]
    np.testing.assert_array_equal(keys.dequantize(), want)
    if fmt != "int8":
        np.testing.assert_array_equal(keys.scale, cache.scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_against_the_float32_cache_is_within_the_bound(rng, fmt):
    # Softmax weights move by at most e^{2Δ} − 1 in total when each score moves by at most Δ:
    # |Δout| ≤ (e^{2Δ} − 1) max|v| + max|Δv|, Δ = scale · max over keys of |q|·|Δk|.
    q, key, v = qkv(rng, 2, 1, 200, 4, 2, 16)
    quantized = js.quantize(key, fmt), js.quantize(v, fmt)
    out = js.dot_product_attention(q, *quantized)
    exact = ref.attention(q, key, v)["out"]
    dk, dv = (
        np.abs(np.asarray(x.dequantize() - y)) for x, y in zip(quantized, (key, v), strict=True)
    )
    # Each query head n reads key head n // 2; the scale is 1/√16.
    shift = np.einsum("btnh,bsnh->bns", np.abs(np.asarray(q)), np.repeat(dk, 2, 2)).max() / 4
    bound = np.expm1(2 * shift) * np.abs(np.asarray(v)).max() + dv.max()
    error = np.abs(np.asarray(out) - exact).max()
    assert 0 < error <= bound


def test_a_bfloat16_cache(rng):
    q, key, v = qkv(rng, 2, 1, 90, 4, 2, 16, dtype=jnp.bfloat16)
    quantized = js.quantize(key), js.quantize(v)
    assert quantized[0].dtype == jnp.bfloat16
    out = js.dot_product_attention(q, *quantized)
    want = ref.attention(q, *(x.dequantize() for x in quantized))
    assert out.dtype == jnp.bfloat16 and ref.rel_err(out, want["out"]) < 2e-2


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            {"implementation": "chunked"},
            ValueError,
            "`implementation='chunked'` reads float caches",
        ),
        ({"key": "values int32"}, TypeError, "`key.values` must have dtype int8 or float8_e4m3fn"),
        ({"key": "scale shape"}, ValueError, r"`key.scale` must have shape \(2, 50, 2, 1\)"),
        ({"query": "bf16"}, TypeError, "must have the same dtype"),
        (
            {"implementation": "decode", "dropout_rate": 0.1, "dropout_rng": jax.random.key(0)},
            ValueError,
            "has no dropout .*use a float cache and 'chunked'",
        ),
    ],
)
def test_quantized_errors(rng, change, error, message):
    q, key, v = qkv(rng, 2, 1, 50, 4, 2, 8)
    key, v = js.quantize(key), js.quantize(v)
    kw = {k: x for k, x in change.items() if k in ("implementation", "dropout_rate", "dropout_rng")}
    if change.get("key") == "values int32":
        key = js.Quantized(key.values.astype(jnp.int32), key.scale)
    if change.get("key") == "scale shape":
        key = js.Quantized(key.values, key.scale[:, :1, :1])
    if change.get("query") == "bf16":
        q = q.astype(jnp.bfloat16)
    with pytest.raises(error, match=message):
        js.dot_product_attention(q, key, v, **kw)


def test_quantize_errors():
    with pytest.raises(ValueError, match=r"`x` must have rank 3 or more .*got shape \(4, 8\)"):
        js.quantize(jnp.zeros((4, 8)))
    with pytest.raises(ValueError, match="`format` must be one of"):
        js.quantize(jnp.zeros((1, 2, 1, 4)), "int4")
    with pytest.raises(TypeError, match="`x` must have a floating-point dtype"):
        js.quantize(jnp.zeros((1, 2, 1, 4), jnp.int32))
    with pytest.raises(ValueError, match="`scale` must broadcast"):
        js.quantize(jnp.zeros((1, 2, 3, 4)), "float8_e4m3fn", scale=jnp.ones(2))


def test_writers_keep_int8_scales_per_token_even_with_one_slot_per_page():
    pool = js.quantize(jnp.zeros((6, 1, 1, 8), jnp.float32))  # pages of one token
    new = jnp.asarray([[[[2.0] * 8]], [[[-3.0] * 8]]], jnp.float32)  # (B, T, K, H) = (2, 1, 1, 8)
    table = jnp.array([[0, 1, 2], [3, 4, 5]])
    keys, _ = js.update_paged_cache(pool, pool, new, new, table, jnp.array([0, 1]))
    np.testing.assert_allclose(keys.dequantize()[:, 0, 0, 0], [2.0, 0, 0, 0, -3.0, 0], rtol=1e-6)
