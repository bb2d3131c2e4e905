"""Sigmoid attention (``normalizer="sigmoid"``): each weight ``σ(s + b)`` on its own.

Against the float64 reference (``tests/reference.py``, which writes the sigmoid's forward and
its hand-derived backward), on every implementation of the registry: masks, lengths, windows,
a ``score_mod`` with a captured array, GQA, T ≠ S, tiles that divide nothing, fully masked rows,
and the log of each row's total weight (the residual) with its own cotangent.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_sdpa as js
from tests import reference as ref
from tests.implementations import each_implementation
from tests.util import enable_x64, qkv

SLOPES = jnp.array([0.3, -0.2, 0.5, 0.1], jnp.float32)

CASES = {
    "plain": ({}, {}),
    "causal": ({"is_causal": True}, {"is_causal": True}),
    "lengths": (
        {"key_value_seq_lengths": jnp.array([9, 4], jnp.int32)},
        {"kv_lengths": np.array([9, 4])},
    ),
    "window": ({"local_window_size": (3, 1)}, {"window": (3, 1)}),
    "score_mod": (
        {"score_mod": lambda s, b, h, i, j: s - SLOPES[h] * jnp.abs(i - j).astype(s.dtype)},
        {"score_mod": lambda s, b, h, i, j: s - np.asarray(SLOPES, np.float64)[h] * np.abs(i - j)},
    ),
    "bias per head": ({"sigmoid_bias": jnp.array([0.0, -1.0, -2.0, 0.5])}, None),
}


# The inner loop and the x64 pass run two of the cases (every case's masks are the softmax's,
# tested on their own); CI runs them all.
SAMPLED = ("causal", "score_mod")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[] if c in SAMPLED else pytest.mark.slow) for c in CASES]
)
@each_implementation()
def test_sigmoid_attention_matches_the_reference_forward_and_backward(rng, impl, case):
    q, k, v = qkv(rng, 2, 7, 11, 4, 2, 8)  # GQA, T ≠ S
    keywords, rules = CASES[case]
    rules = {"sigmoid_bias": keywords["sigmoid_bias"]} if rules is None else rules
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    d_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)
    want = ref.attention(q, k, v, normalizer="sigmoid", d_out=d_out, d_lse=d_lse, **rules)

    def loss(q, k, v):
        out, lse = impl(q, k, v, normalizer="sigmoid", return_residual=True, **keywords)
        return (out * d_out).sum() + jnp.where(jnp.isfinite(lse), lse * d_lse, 0).sum(), (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(out, want["out"], atol=2e-6)
    np.testing.assert_allclose(lse, want["lse"], atol=2e-6)
    for name, got in zip(("dq", "dk", "dv"), grads, strict=True):
        assert ref.rel_err(got, want[name]) < 1e-5, name


@each_implementation("query lengths")
def test_fully_masked_sigmoid_rows_are_zero_with_zero_gradients(rng, impl):
    q, k, v = qkv(rng, 2, 5, 6, 2, 2, 4)
    q_len = jnp.array([3, 5], jnp.int32)  # the first sequence's last two rows are padding
    kv_len = jnp.array([6, 0], jnp.int32)  # the second sequence has no key at all

    def f(q, k, v):
        out, lse = impl(
            q,
            k,
            v,
            normalizer="sigmoid",
            query_seq_lengths=q_len,
            key_value_seq_lengths=kv_len,
            return_residual=True,
        )
        return out, lse

    out, lse = f(q, k, v)
    np.testing.assert_array_equal(out[1], 0)
    np.testing.assert_array_equal(lse[1], -jnp.inf)
    np.testing.assert_array_equal(out[0, 3:], 0)
    grads = jax.grad(lambda *a: (f(*a)[0] ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    np.testing.assert_array_equal(grads[0][1], 0)
    np.testing.assert_array_equal(grads[0][0, 3:], 0)


@each_implementation()
def test_sigmoid_in_bfloat16_keeps_the_dtype_and_is_near_float32(rng, impl):
    q, k, v = qkv(rng, 1, 6, 9, 2, 1, 16)
    low = impl(*(x.astype(jnp.bfloat16) for x in (q, k, v)), normalizer="sigmoid", is_causal=True)
    assert low.dtype == jnp.bfloat16
    full = js.dot_product_attention(q, k, v, normalizer="sigmoid", is_causal=True)
    np.testing.assert_allclose(low.astype(jnp.float32), full, atol=3e-2)


def test_masked_entries_weigh_exactly_zero_even_where_the_bias_is_large():
    # σ(s + b) of a masked entry is not relied on: with b = +30 it would be 1.
    scores = jnp.array([[0.0, 5.0, -3.0]])
    mask = jnp.array([[True, False, True]])
    weights = js.sigmoid_weights(scores, mask, bias=30.0)
    assert weights[0, 1] == 0.0
    np.testing.assert_allclose(weights[0, [0, 2]], jax.nn.sigmoid(jnp.array([30.0, 27.0])))


def test_the_default_bias_keeps_a_row_of_zero_scores_near_one():
    # σ(−log S) = 1 / (1 + S): S of them sum to S / (S + 1).
    for count in (1, 4, 1000):
        weights = js.sigmoid_weights(jnp.zeros((2, count)))
        np.testing.assert_allclose(weights.sum(-1), count / (count + 1), rtol=1e-6)


def test_the_default_bias_counts_each_sequence_s_keys_not_the_mask(rng):
    q, k, v = qkv(rng, 2, 4, 8, 2, 2, 4)
    lengths = jnp.array([8, 5], jnp.int32)
    got = js.dot_product_attention(
        q, k, v, normalizer="sigmoid", is_causal=True, key_value_seq_lengths=lengths
    )
    for b, count in enumerate((8, 5)):
        want = js.dot_product_attention(
            q[b : b + 1],
            k[b : b + 1],
            v[b : b + 1],
            normalizer="sigmoid",
            sigmoid_bias=-float(np.log(count)),
            is_causal=True,
            key_value_seq_lengths=lengths[b : b + 1],
        )
        np.testing.assert_allclose(got[b : b + 1], want, atol=1e-6)


def test_dense_sigmoid_gradients_pass_check_grads(rng):
    q, k, v = qkv(rng, 1, 3, 4, 2, 1, 4)
    fn = functools.partial(
        js.dot_product_attention, normalizer="sigmoid", is_causal=True, implementation="xla"
    )
    with enable_x64():
        wide = tuple(x.astype(jnp.float64) for x in (q, k, v))
        check_grads(fn, wide, order=2, modes=["rev"])


def test_merge_attention_adds_sigmoid_results(rng):
    q, k, v = qkv(rng, 2, 5, 9, 2, 2, 8)
    call = functools.partial(js.dot_product_attention, normalizer="sigmoid", return_residual=True)
    bias = -float(np.log(9))  # the whole call's S, which each part must share
    left = call(q, k[:, :4], v[:, :4], sigmoid_bias=bias)
    right = call(q, k[:, 4:], v[:, 4:], sigmoid_bias=bias)
    out, lse = js.merge_attention(left, right, normalizer="sigmoid")
    want_out, want_lse = call(q, k, v)
    np.testing.assert_allclose(out, want_out, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, atol=1e-6)
    np.testing.assert_allclose(out, left[0] + right[0], atol=1e-6)


@pytest.mark.parametrize(
    "keywords, error, message",
    [
        ({"normalizer": "tanh"}, ValueError, "`normalizer` must be one of 'softmax', 'sigmoid'"),
        ({"sigmoid_bias": 1.0}, ValueError, "`sigmoid_bias` needs `normalizer='sigmoid'`"),
        (
            {"normalizer": "sigmoid", "sigmoid_bias": jnp.zeros(3)},
            ValueError,
            r"`sigmoid_bias` must be a scalar or have shape \(heads,\) = \(2,\); got \(3,\)",
        ),
        (
            {"normalizer": "sigmoid", "sigmoid_bias": jnp.zeros(2, jnp.int32)},
            TypeError,
            "`sigmoid_bias` must have a floating-point dtype",
        ),
        (
            {"normalizer": "sigmoid", "sinks": jnp.zeros(2)},
            ValueError,
            "`sinks` have no meaning with `normalizer='sigmoid'`",
        ),
    ],
    ids=["unknown normalizer", "bias without sigmoid", "bias shape", "bias dtype", "sinks"],
)
def test_what_sigmoid_attention_refuses_names_the_argument(rng, keywords, error, message):
    q, k, v = qkv(rng, 1, 3, 4, 2, 1, 4)
    with pytest.raises(error, match=message):
        js.dot_product_attention(q, k, v, **keywords)
