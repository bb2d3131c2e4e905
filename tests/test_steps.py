import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_sdpa as js
from tests.profile import examples

E = math.e


def test_hand_case_sqrt2_e():
    # q = [0, √2], k = I: raw scores [0, √2]; scaled by 1/√2 they are [0, 1] → weights [1, e]/(1+e).
    q = jnp.array([[0.0, math.sqrt(2.0)]])
    scores = js.raw_scores(q, jnp.eye(2))
    np.testing.assert_allclose(scores, [[0.0, math.sqrt(2.0)]], rtol=1e-7)
    scaled = js.scale_scores(scores, js.default_scale(2))
    np.testing.assert_allclose(scaled, [[0.0, 1.0]], atol=1e-7)
    weights = js.softmax_weights(scaled)
    np.testing.assert_allclose(weights, [[1 / (1 + E), E / (1 + E)]], rtol=1e-6)
    out = js.weighted_sum(weights, jnp.array([[1.0, 0.0], [0.0, 1.0]]))
    np.testing.assert_allclose(out, [[1 / (1 + E), E / (1 + E)]], rtol=1e-6)


def test_mask_hand_case():
    weights = js.softmax_weights(jnp.array([[0.0, 1.0]]), jnp.array([[True, False]]))
    np.testing.assert_array_equal(weights, [[1.0, 0.0]])


def test_default_scale():
    assert js.default_scale(64) == 0.125
    assert js.default_scale(2) == pytest.approx(1 / math.sqrt(2))


def test_raw_scores_matches_numpy(rng):
    q, k = rng.normal(size=(5, 8)), rng.normal(size=(7, 8))
    got = js.raw_scores(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32))
    assert got.shape == (5, 7)
    np.testing.assert_allclose(got, q @ k.T, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_scores_accumulate_in_float32(dtype):
    # 4096 products of 1·(1/64): the exact sum 64 is representable, but a bf16 running sum of
    # 1/64 steps stalls long before it; float32 accumulation must get it exactly.
    q = jnp.ones((1, 4096), dtype)
    k = jnp.full((1, 4096), 1 / 64, dtype)
    scores = js.raw_scores(q, k)
    assert scores.dtype == jnp.float32
    assert float(scores[0, 0]) == 64.0


def test_scale_scores_and_soft_cap():
    s = jnp.array([[4.0, -8.0]])
    np.testing.assert_allclose(js.scale_scores(s, 0.25), [[1.0, -2.0]])
    capped = js.soft_cap_scores(jnp.array([[0.0, 0.5, 1e6, -1e6]]), 2.0)
    np.testing.assert_allclose(capped, [[0.0, 2 * math.tanh(0.25), 2.0, -2.0]], rtol=1e-6)


def test_softmax_matches_numpy_and_is_shift_invariant(rng):
    s = rng.normal(size=(4, 6)) * 5
    ref = np.exp(s - s.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    got = js.softmax_weights(jnp.asarray(s, jnp.float32))
    np.testing.assert_allclose(got, ref, atol=1e-6)
    shifted = js.softmax_weights(jnp.asarray(s + 1000.0, jnp.float32))
    np.testing.assert_allclose(shifted, ref, atol=1e-4)


def test_softmax_large_scores_do_not_overflow():
    w = js.softmax_weights(jnp.array([[1e4, 1e4 - 1.0, -1e4]]))
    np.testing.assert_allclose(w, [[1 / (1 + 1 / E), (1 / E) / (1 + 1 / E), 0.0]], rtol=1e-6)


def test_fully_masked_row_is_zero_with_zero_gradient():
    s = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    mask = jnp.array([[True, True], [False, False]])
    w = js.softmax_weights(s, mask)
    np.testing.assert_array_equal(w[1], [0.0, 0.0])
    np.testing.assert_allclose(w[0].sum(), 1.0, rtol=1e-6)
    grad = jax.grad(lambda s: (js.softmax_weights(s, mask) * jnp.arange(4.0).reshape(2, 2)).sum())(
        s
    )
    assert np.isfinite(grad).all()
    np.testing.assert_array_equal(grad[1], [0.0, 0.0])


def test_minus_inf_score_counts_as_masked():
    s = jnp.array([[0.0, -jnp.inf, 1.0], [-jnp.inf, -jnp.inf, -jnp.inf]])
    w = js.softmax_weights(s)
    np.testing.assert_allclose(w[0], [1 / (1 + E), 0.0, E / (1 + E)], rtol=1e-6)
    np.testing.assert_array_equal(w[1], [0.0, 0.0, 0.0])
    grad = jax.grad(lambda s: (js.softmax_weights(s) ** 2).sum())(s)
    assert np.isfinite(grad).all()


def test_softmax_gradient_matches_jacobian_formula(rng):
    # d w / d s = diag(w) − w wᵀ for each row.
    s = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    jac = jax.jacobian(lambda s: js.softmax_weights(s[None, :])[0])(s)
    w = np.asarray(js.softmax_weights(s[None, :])[0], np.float64)
    np.testing.assert_allclose(jac, np.diag(w) - np.outer(w, w), atol=1e-6)


def test_weighted_sum_blends_value_rows():
    v = jnp.array([[0.0, 4.0], [4.0, 0.0]])
    np.testing.assert_allclose(js.weighted_sum(jnp.array([[0.25, 0.75]]), v), [[3.0, 1.0]])
    # d_v differs from d_k freely: 3 value features.
    out = js.weighted_sum(jnp.array([[1.0, 0.0]]), jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
    np.testing.assert_array_equal(out, [[1.0, 2.0, 3.0]])


def test_steps_jit_and_grad_check():
    from jax.test_util import check_grads

    q = jax.random.normal(jax.random.key(0), (3, 4))
    k = jax.random.normal(jax.random.key(1), (5, 4))
    v = jax.random.normal(jax.random.key(2), (5, 2))

    def f(q, k, v):
        w = js.softmax_weights(js.scale_scores(js.raw_scores(q, k), 0.5))
        return js.weighted_sum(w, v)

    np.testing.assert_allclose(jax.jit(f)(q, k, v), f(q, k, v), atol=1e-6)
    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_dropout_statistics_and_scaling():
    w = jnp.full((256, 256), 1.0)
    dropped = js.dropout_weights(w, jax.random.key(0), rate=0.25)
    kept = np.asarray(dropped != 0)
    assert abs(kept.mean() - 0.75) < 0.01  # 65536 draws: std of the mean ≈ 0.0017
    np.testing.assert_allclose(np.asarray(dropped)[kept], 1 / 0.75, rtol=1e-6)
    again = js.dropout_weights(w, jax.random.key(0), rate=0.25)
    np.testing.assert_array_equal(dropped, again)
    other = js.dropout_weights(w, jax.random.key(1), rate=0.25)
    assert (np.asarray(other != 0) != kept).mean() > 0.2


def test_dropout_block_equals_slice_of_whole():
    w = jnp.ones((10, 12))
    rng = jax.random.PRNGKey(3)  # raw uint32 keys work as well as typed ones
    whole = js.dropout_weights(w, rng, rate=0.5)
    block = js.dropout_weights(w[3:7, 5:12], rng, rate=0.5, q_offset=3, kv_offset=5)
    np.testing.assert_array_equal(block, whole[3:7, 5:12])


@settings(max_examples=examples("rows"), deadline=None)
@given(
    t=st.integers(1, 9),
    s=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    density=st.floats(0.0, 1.0),
)
def test_property_rows_sum_to_one_and_masked_weights_are_zero(t, s, seed, density):
    gen = np.random.default_rng(seed)
    scores = jnp.asarray(gen.normal(size=(t, s)) * 4, jnp.float32)
    mask = gen.random((t, s)) < density
    w = np.asarray(js.softmax_weights(scores, jnp.asarray(mask)))
    assert (w[~mask] == 0).all()
    assert (w >= 0).all()
    has_key = mask.any(axis=1)
    np.testing.assert_allclose(w[has_key].sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(w[~has_key], 0.0)
