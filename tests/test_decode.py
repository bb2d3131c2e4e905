"""The decode implementation: few queries against a long cache, against the float64 reference.

Split keys (chunks that divide the cache or not), lengths per sequence (0 and full included),
GQA and MQA, bottom-right causal, windows, soft cap, mods, sinks, bfloat16 caches, the
automatic choice, and gradients (which are the chunked path's).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from tests import reference as ref
from tests.util import qkv

BOTTOM_RIGHT = {"is_causal": True, "causal_alignment": "bottom_right"}
# Chunks of 40 keys, so that short caches split into several, and not evenly.
DECODE = {"implementation": js.Decode(block_kv=40)}


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("s", [1, 7, 40, 123])
@pytest.mark.parametrize("n, k", [(4, 2), (4, 1), (2, 2)])
def test_decode_matches_the_reference(rng, t, s, n, k):
    q, key, v = qkv(rng, 3, t, s, n, k, 8, hv=6)
    lengths = np.array([s, 0, max(s // 2, 1)])  # full, empty, half
    out, lse = js.dot_product_attention(
        q, key, v, key_value_seq_lengths=lengths, return_residual=True, **DECODE
    )
    want = ref.attention(q, key, v, kv_lengths=lengths)
    assert ref.rel_err(out, want["out"]) < 2e-6
    np.testing.assert_array_equal(np.asarray(out)[1], 0.0)  # length 0: zeros, no NaN
    np.testing.assert_allclose(lse, want["lse"], rtol=1e-5, atol=1e-6)


def test_many_query_rows_take_the_products_head_by_head(rng):
    # N·T = 128 rows: past the block-diagonal product's 64 columns.
    q, key, v = qkv(rng, 2, 16, 100, 8, 2, 8, hv=6)
    lengths = np.array([100, 37])
    out = js.dot_product_attention(
        q, key, v, key_value_seq_lengths=lengths, **BOTTOM_RIGHT, **DECODE
    )
    want = ref.attention(q, key, v, kv_lengths=lengths, is_causal=True, offset=100 - 16)
    assert ref.rel_err(out, want["out"]) < 2e-6


@pytest.mark.parametrize(
    "options, rules",
    [
        (BOTTOM_RIGHT, {"is_causal": True, "offset": 90 - 5}),
        ({**BOTTOM_RIGHT, "local_window_size": (17, 0)}, {"window": (17, 0), "offset": 85}),
        ({"logits_soft_cap": 2.0}, {}),
    ],
)
def test_decode_rules_and_soft_cap(rng, options, rules):
    q, key, v = qkv(rng, 2, 5, 90, 4, 2, 8)
    out = js.dot_product_attention(q, key, v, **DECODE, **options)
    soft_cap = options.get("logits_soft_cap")
    want = ref.attention(q, key, v, soft_cap=soft_cap, **rules)
    assert ref.rel_err(out, want["out"]) < 2e-6


def test_decode_with_bias_mods_and_sinks(rng):
    q, key, v = qkv(rng, 2, 2, 100, 4, 2, 8)
    bias = rng.normal(size=(2, 4, 2, 100))
    slopes = rng.uniform(0.01, 0.1, size=4)
    sinks = rng.normal(size=4)
    doc = np.repeat(np.arange(4), 25)

    def score_mod(lib):
        m = lib.asarray(slopes, dtype=lib.float32 if lib is jnp else None)
        return lambda s, b, h, i, j: s + m[h] * (j - i).astype(s.dtype)

    def mask_mod(lib):  # the two queries are the last two positions of the document mask
        d = lib.asarray(doc)
        return lambda b, h, i, j: d[i + 98] == d[j]

    out = js.dot_product_attention(
        q,
        key,
        v,
        jnp.asarray(bias, jnp.float32),
        **DECODE,
        score_mod=score_mod(jnp),
        mask_mod=mask_mod(jnp),
        sinks=jnp.asarray(sinks, jnp.float32),
    )
    want = ref.attention(
        q, key, v, bias, score_mod=score_mod(np), mask_mod=mask_mod(np), sinks=sinks
    )
    assert ref.rel_err(out, want["out"]) < 2e-6


def test_a_bfloat16_cache_accumulates_in_float32(rng):
    q, key, v = qkv(rng, 2, 1, 300, 8, 2, 16, dtype=jnp.bfloat16)
    out = js.dot_product_attention(q, key, v, **DECODE)
    assert out.dtype == jnp.bfloat16
    dense = js.dot_product_attention(q, key, v, implementation="xla")
    np.testing.assert_allclose(out.astype(np.float32), dense.astype(np.float32), atol=1e-2)
    want = ref.attention(q, key, v)["out"]
    assert ref.rel_err(out, want) < 1e-2


def test_the_gradient_equals_the_reference(rng):
    q, key, v = qkv(rng, 2, 3, 70, 4, 2, 8)
    lengths = np.array([70, 33])
    d_out = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, **DECODE)
        return jnp.sum(out * d_out)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, key, v)
    want = ref.attention(q, key, v, kv_lengths=lengths, d_out=d_out)
    for g, name in zip(got, ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(g, want[name]) < 1e-5


def test_the_automatic_choice_decodes_only_decoding_shapes(rng):
    def chosen(t, s):
        q, k, v = (jax.ShapeDtypeStruct((1, n, 4, 8), jnp.float32) for n in (t, s, s))

        def program(impl):
            def call(q, k, v):
                return js.dot_product_attention(q, k, v, implementation=impl)

            return str(jax.make_jaxpr(call)(q, k, v))

        return [name for name in ("decode", "chunked", "xla") if program(name) == program(None)]

    assert chosen(1, 2048) == ["decode"]  # N·T = 4 rows
    assert chosen(16, 1024) == ["decode"]  # 64 rows
    assert chosen(17, 4096) == ["chunked"]  # more rows, and training shapes: as before
    assert chosen(1, 512) == ["chunked"]
    q, k, v = qkv(rng, 1, 1, 2048, 4, 4, 8)
    with pytest.raises(ValueError, match="`implementation='decode'` has no dropout"):
        js.dot_product_attention(
            q, k, v, implementation="decode", dropout_rate=0.1, dropout_rng=jax.random.key(0)
        )
    # With dropout (training), the automatic choice passes over decode.
    js.dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0))


def test_the_block_diagonal_blend_is_the_weighted_sum(rng):
    # The GPU's blend: every head's weights times every head's values, the diagonal blocks kept.
    from jax_sdpa._decode import _block_diagonal_blend

    weights = rng.standard_normal((4, 3, 2, 50))  # (K, G, T, L)
    value = rng.standard_normal((50, 4, 16))  # (L, K, V)
    got = _block_diagonal_blend(jnp.asarray(weights), jnp.asarray(value))
    want = np.einsum("kgtl,lkv->kgtv", weights, value)
    assert got.shape == (4, 3, 2, 16) and ref.rel_err(got, want) < 1e-6
    value[7, 1, 3] = np.nan  # (a head's NaN stays in its own output, as in the sum)
    finite = np.isfinite(_block_diagonal_blend(jnp.asarray(weights), jnp.asarray(value)))
    assert finite[[0, 2, 3]].all() and not finite[1].all()


@pytest.mark.parametrize("platform, count", [("cuda", 2), ("cpu", 1)])
def test_on_a_gpu_the_decode_path_reads_the_values_in_one_product_as_they_lie(platform, count):
    # XLA on a GPU copied the whole cache to sum the values (issue 44's profile: a transpose
    # every call, most likely of the values); there they meet the weights in one product of the
    # (L, K·V) chunks, as the keys meet the queries. On a CPU, a multiply and a sum.
    from tests.lowering import exported

    q = jnp.zeros((2, 1, 8, 64), jnp.bfloat16)
    k = jnp.zeros((2, 4096, 2, 64), jnp.bfloat16)

    def call(q, k, v):
        return js.dot_product_attention(q, k, v, implementation="decode")

    if platform == "cpu":  # (this machine's)
        text = jax.jit(call).lower(q, k, k).as_text()
    else:
        text = exported(call, q, k, k, platform=platform)
    size = js.Decode().block_kv
    chunks = f"tensor<2x{4096 // size}x{size}x128xbf16>"  # (each sequence's (L, K·H) chunks)
    products = [line for line in text.splitlines() if "dot_general" in line and chunks in line]
    assert len(products) == count, products  # (the keys' product, and on a GPU the values')
