"""merge_attention: attention over two sets of keys, combined, equals attention over their union."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from tests import reference as ref
from tests.implementations import each_implementation
from tests.util import qkv


def halves(q, k, v, mask, split, impl):
    """Attention over keys [0, split) and [split, S) separately, each with its residual."""
    f = functools.partial(impl, return_residual=True)
    left = f(q, k[:, :split], v[:, :split], mask=mask[..., :split])
    right = f(q, k[:, split:], v[:, split:], mask=mask[..., split:])
    return left, right


@each_implementation("mask")
# The inner loop keeps the edge split (one key on the left); CI also runs the other two.
@pytest.mark.parametrize("split", [1, *(pytest.param(n, marks=pytest.mark.slow) for n in (4, 8))])
def test_merge_equals_attention_over_the_concatenated_keys(rng, impl, split):
    # GQA, d_v ≠ d_k; row 0 of batch 0 sees no key at all, row 1 only keys of the right half,
    # row 2 only keys of the left half.
    q, k, v = qkv(rng, 2, 5, 9, 4, 2, 6, hv=3)
    mask = jnp.asarray(rng.random((2, 4, 5, 9)) < 0.7)
    mask = mask.at[0, :, 0].set(False).at[0, :, 1, :split].set(False).at[0, :, 2, split:].set(False)
    out, lse = js.merge_attention(*halves(q, k, v, mask, split, impl))
    expected = ref.attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, expected["out"], atol=2e-6)
    np.testing.assert_allclose(lse, expected["lse"], atol=2e-6)
    np.testing.assert_array_equal(np.asarray(out)[0, 0], 0)
    assert np.isneginf(np.asarray(lse)[0, 0]).all()
    whole, whole_lse = impl(q, k, v, mask=mask, return_residual=True)
    np.testing.assert_allclose(out, whole, atol=2e-6)
    np.testing.assert_allclose(lse, whole_lse, atol=2e-6)


@each_implementation("mask")
def test_merge_gradients_equal_the_reference(rng, impl):
    q, k, v = qkv(rng, 1, 6, 7, 2, 1, 4)
    mask = jnp.ones((1, 2, 6, 7), bool).at[0, 1, 3].set(False).at[0, 0, 4, 3:].set(False)
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    expected = ref.attention(q, k, v, mask=mask, d_out=d_out)

    def merged(q, k, v):
        out, _ = js.merge_attention(*halves(q, k, v, mask, 3, impl))
        return (out * d_out).sum()

    grads = jax.jit(jax.grad(merged, argnums=(0, 1, 2)))(q, k, v)
    for got, name in zip(grads, ("dq", "dk", "dv"), strict=True):
        assert np.isfinite(np.asarray(got)).all()
        assert ref.rel_err(got, expected[name]) <= 1e-5, name


def test_merge_gradients_reach_out_and_lse_and_stay_finite_without_keys():
    # By hand: lse = log(e^a + e^b), out = σ(a − b)·x + σ(b − a)·y.
    a, b = jnp.array([0.3, -jnp.inf]), jnp.array([1.1, -jnp.inf])
    x, y = jnp.array([[2.0], [0.0]]), jnp.array([[-1.0], [0.0]])

    def f(a, b, x, y):
        out, lse = js.merge_attention((x, a), (y, b))
        return out.sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    out, lse = js.merge_attention((x, a), (y, b))
    w = 1 / (1 + np.exp(1.1 - 0.3))
    np.testing.assert_allclose(out[:, 0], [w * 2 - (1 - w), 0], rtol=1e-6)
    np.testing.assert_allclose(lse[0], np.logaddexp(0.3, 1.1), rtol=1e-6)
    assert np.isneginf(np.asarray(lse)[1])
    ga, gb, gx, gy = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(a, b, x, y)
    # d/da [σ(a−b)·x + σ(b−a)·y] = w(1−w)(x − y), and d lse/da = w.
    np.testing.assert_allclose(ga[0], w * (1 - w) * 3 + w, rtol=1e-5)
    np.testing.assert_allclose(gb[0], -w * (1 - w) * 3 + (1 - w), rtol=1e-5)
    np.testing.assert_allclose([gx[0, 0], gy[0, 0]], [w, 1 - w], rtol=1e-6)
    for g in (ga, gb, gx, gy):
        assert np.isfinite(np.asarray(g)).all() and float(np.abs(np.asarray(g)[1]).max()) == 0


def test_merge_of_results_without_query_rows():
    out, lse = js.merge_attention(*[(jnp.zeros((2, 0, 4, 8)), jnp.zeros((2, 0, 4)))] * 2)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 0, 4)


def test_merge_under_jit_and_in_low_precision(rng):
    q, k, v = qkv(rng, 2, 4, 6, 2, 2, 8, dtype=jnp.bfloat16)
    mask = jnp.ones((1, 1, 4, 6), bool)
    left, right = halves(q, k, v, mask, 2, js.dot_product_attention)
    out, lse = jax.jit(js.merge_attention)(left, right)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    expected = ref.attention(q, k, v)
    assert float(np.abs(np.asarray(out, np.float64) - expected["out"]).max()) <= 3e-2


@pytest.mark.parametrize(
    "a,b,error,message",
    [
        (
            (jnp.ones((2, 3, 4)), jnp.ones((2, 3))),
            (jnp.ones((2, 3, 5)), jnp.ones((2, 3))),
            ValueError,
            "`out_a` and `out_b` must have the same shape; got (2, 3, 4) and (2, 3, 5).",
        ),
        (
            (jnp.ones((2, 3, 4)), jnp.ones((2, 4))),
            (jnp.ones((2, 3, 4)), jnp.ones((2, 3))),
            ValueError,
            "`lse_a` must have shape out.shape[:-1] = (2, 3); got (2, 4).",
        ),
        (
            (jnp.ones((2, 3, 4)), jnp.ones((2, 3))),
            (jnp.ones((2, 3, 4), jnp.bfloat16), jnp.ones((2, 3))),
            TypeError,
            "`out_a`, `out_b` must have the same dtype",
        ),
    ],
)
def test_merge_errors(a, b, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        js.merge_attention(a, b)


def test_folded_exponentials_by_hand():
    # Scores [0, √2] at scale 1/√2 are the logits [0, 1]: on the row max 1, weights [1/e, 1];
    # a masked entry (NaN as read) and a row with no key yet (its shift the fill) give 0.
    from jax_sdpa._steps import folded_exp_scores, large_negative

    scores = jnp.array([[0.0, math.sqrt(2.0), jnp.nan], [1.0, 2.0, 3.0]], jnp.float32)
    mask = jnp.array([[True, True, False], [False, False, False]])
    shift = jnp.array([1.0, large_negative(jnp.dtype(jnp.float32))], jnp.float32)
    p = folded_exp_scores(scores, mask, shift, 1 / math.sqrt(2.0))
    np.testing.assert_allclose(p, [[1 / math.e, 1.0, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_a_softmax_block_with_the_scale_folded_is_the_scaled_blocks(dtype):
    # Two blocks of 5 keys, by the scale folded (a kernel's) and of the scaled scores (XLA's):
    # row 0 meets its first key in the second block, row 1 none at all (masked entries NaN, as
    # read past a sequence's end), row 2 every key; then the rows' weights from their lse.
    from jax_sdpa._online_softmax import SOFTMAX, add, init

    dtype = jnp.dtype(dtype)
    if jnp.finfo(dtype).bits > 32 and not jax.config.jax_enable_x64:
        pytest.skip("float64 needs JAX_SDPA_X64=1")
    rng = np.random.default_rng(0)
    scale = 0.3
    scores = jnp.asarray(rng.normal(size=(2, 3, 5)) * 4, dtype)
    mask = jnp.ones((2, 3, 5), bool).at[0, :2].set(False).at[1, 1].set(False)
    scores = jnp.where(mask, scores, jnp.nan)
    value = jnp.asarray(rng.normal(size=(2, 5, 4)), dtype)
    folded = scaled = init(scores, (3,), (3, 4))
    for block in range(2):
        at = (scores[block], mask[block], value[block])
        folded = add(folded, SOFTMAX.block(folded, *at[:2], scale=scale), at[2])
        scaled = SOFTMAX.update(scaled, scale * at[0], *at[1:])
    tolerance = {"rtol": 1e-6 if dtype == jnp.float32 else 1e-14}
    out, lse = SOFTMAX.finish(folded, dtype)
    expected_out, expected_lse = SOFTMAX.finish(scaled, dtype)
    np.testing.assert_allclose(out, expected_out, **tolerance)
    np.testing.assert_allclose(lse, expected_lse, **tolerance)
    np.testing.assert_array_equal(out[1], 0)
    assert np.isneginf(np.asarray(lse)[1]) and np.isfinite(np.asarray(lse)[[0, 2]]).all()
    np.testing.assert_allclose(folded.top, scaled.top, **tolerance)
    finite = jnp.where(jnp.isfinite(lse), lse, 0)
    for block in range(2):
        p = SOFTMAX.recompute(scores[block], mask[block], finite, None, scale=scale)
        expected = SOFTMAX.recompute(scale * scores[block], mask[block], finite, None)
        np.testing.assert_allclose(p, expected, **tolerance)
