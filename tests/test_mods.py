"""jax_sdpa.mods: each built-in against its definition (NumPy) and the matching keyword."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from jax_sdpa import mods
from tests import reference as ref
from tests.implementations import each_implementation
from tests.util import qkv


def on_grid(mask_mod, batch, t, s, head=0):
    """A mask_mod evaluated on the (t, s) grid of one sequence and head, as NumPy."""
    i, j = jnp.meshgrid(jnp.arange(t), jnp.arange(s), indexing="ij")
    return np.asarray(jax.vmap(jax.vmap(lambda i, j: mask_mod(batch, head, i, j)))(i, j))


def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(mods.alibi_slopes(8), [2.0**-k for k in range(1, 9)], rtol=1e-7)
    # 12 heads: the 8 slopes of 8, then the odd-numbered slopes of 16 (2^-0.5, 2^-1.5, ...).
    want = [2.0**-k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
    np.testing.assert_allclose(mods.alibi_slopes(12), want, rtol=1e-6)
    with pytest.raises(ValueError, match="`num_heads` must be a positive int; got 0."):
        mods.alibi_slopes(0)


@each_implementation()
def test_alibi_against_the_reference(rng, impl):
    q, k, v = qkv(rng, 2, 6, 9, 4, 2, 8)
    slopes = np.asarray(mods.alibi_slopes(4), np.float64)
    out = impl(q, k, v, score_mod=mods.alibi(slopes), is_causal=True)
    expected = ref.attention(
        q, k, v, is_causal=True, score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i)
    )
    np.testing.assert_allclose(out, expected["out"], atol=2e-6)


def t5_bucket(relative, num_buckets, max_distance, bidirectional):
    """T5's _relative_position_bucket, transcribed for one integer."""
    ret, n = 0, -relative
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    large = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return ret + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bias_buckets_are_t5s(bidirectional):
    table = jnp.arange(32, dtype=jnp.float32)[:, None] * jnp.ones((1, 2), jnp.float32)  # bucket
    score_mod = mods.relative_position_bias(table, 32, 128, bidirectional)
    relative = jnp.arange(-300, 301)
    got = jax.vmap(lambda r: score_mod(jnp.float32(0), 0, 1, 0, r))(relative)
    want = [t5_bucket(int(r), 32, 128, bidirectional) for r in relative]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_relative_position_bias_table_gets_gradients(rng):
    q, k, v = qkv(rng, 1, 8, 8, 2, 2, 4)
    table = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)

    def f(table, impl):
        score_mod = mods.relative_position_bias(table, 8, 16)
        return js.dot_product_attention(q, k, v, score_mod=score_mod, implementation=impl).sum()

    dense, chunked = (jax.grad(f)(table, impl) for impl in ("xla", "chunked"))
    assert float(np.abs(dense).max()) > 0
    np.testing.assert_allclose(chunked, dense, atol=1e-5)


@each_implementation()
def test_soft_cap_mod_equals_the_keyword(rng, impl):
    q, k, v = qkv(rng, 1, 7, 7, 2, 2, 16)
    q = q * 4
    by_mod = impl(q, k, v, score_mod=mods.soft_cap(2.0))
    np.testing.assert_allclose(by_mod, impl(q, k, v, logits_soft_cap=2.0), atol=1e-6)


def test_mask_mods_match_their_definitions():
    i, j = np.indices((10, 12))
    lengths = jnp.array([3, 7])
    for b in (0, 1):
        np.testing.assert_array_equal(
            on_grid(mods.prefix_lm(lengths), b, 10, 12), (j < int(lengths[b])) | (j <= i)
        )
    np.testing.assert_array_equal(
        on_grid(mods.chunked_causal(4), 0, 10, 12), (i // 4 == j // 4) & (j <= i)
    )
    docs = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], [0] * 6 + [1] * 6])
    for b in (0, 1):
        np.testing.assert_array_equal(
            on_grid(mods.document_mask(docs), b, 12, 12), docs[b][:, None] == docs[b][None, :]
        )
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    window = lambda b, h, i, j: j >= i - 2  # noqa: E731
    np.testing.assert_array_equal(
        on_grid(mods.and_masks(causal, window), 0, 10, 12), (j <= i) & (j >= i - 2)
    )
    np.testing.assert_array_equal(
        on_grid(mods.or_masks(causal, window), 0, 10, 12), (j <= i) | (j >= i - 2)
    )
    assert on_grid(mods.and_masks(), 0, 2, 2).all() and not on_grid(mods.or_masks(), 0, 2, 2).any()


@each_implementation("segment ids")
def test_document_mask_and_causal_equal_segment_ids_with_is_causal(rng, impl):
    q, k, v = qkv(rng, 2, 9, 9, 2, 1, 4)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(2, 9)), axis=1), jnp.int32)
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    got = impl(q, k, v, mask_mod=mods.and_masks(mods.document_mask(seg), causal))
    want = impl(q, k, v, query_segment_ids=seg, is_causal=True)
    np.testing.assert_array_equal(got, want)
