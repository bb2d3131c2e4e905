"""jax_sdpa as flax's ``attention_fn``: linen and nnx, masks, sown weights, dropout, GQA.

Python 3.10 gets flax 0.10, whose nnx has neither ``is_causal`` nor GQA (``num_kv_heads``) nor
``nnx.capture``; the nnx tests use those where the installed flax has them.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import jax_sdpa as js


@pytest.fixture
def x(rng):
    return jnp.asarray(rng.normal(size=(2, 6, 16)), jnp.float32)


def linen_pair(**kwargs):
    def make(fn):
        return linen.MultiHeadDotProductAttention(
            num_heads=4, qkv_features=16, attention_fn=fn, **kwargs
        )

    return make(linen.dot_product_attention), make(js.dot_product_attention)


def test_linen_attention_fn_matches_flax_with_float_causal_mask(x):
    theirs, ours = linen_pair()
    params = theirs.init(jax.random.key(0), x)
    mask = linen.make_causal_mask(jnp.ones((2, 6)))  # float32, (B, 1, T, T): nonzero = keep
    assert mask.dtype == jnp.float32
    np.testing.assert_allclose(
        ours.apply(params, x, mask=mask), theirs.apply(params, x, mask=mask), atol=1e-5
    )
    unmasked = ours.apply(params, x)
    assert (
        float(np.abs(unmasked - ours.apply(params, x, mask=mask)).max()) > 1e-3
    )  # the mask is used


def test_linen_sow_weights(x):
    theirs, ours = linen_pair()
    params = theirs.init(jax.random.key(0), x)
    mask = linen.make_attention_mask(
        jnp.array([[1] * 6, [1] * 4 + [0] * 2]), jnp.array([[1] * 6, [1] * 4 + [0] * 2])
    )
    mask = mask.at[1, :, 4:].set(
        1
    )  # keep every query row non-empty: flax and jax_sdpa differ only there
    _, ours_state = ours.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])
    _, theirs_state = theirs.apply(
        params, x, mask=mask, sow_weights=True, mutable=["intermediates"]
    )
    w_ours = ours_state["intermediates"]["attention_weights"][0]
    w_theirs = theirs_state["intermediates"]["attention_weights"][0]
    assert w_ours.shape == (2, 4, 6, 6)
    np.testing.assert_allclose(w_ours, w_theirs, atol=1e-6)


@pytest.mark.parametrize("force_fp32_for_softmax", [False, True])
def test_linen_sown_weights_have_flax_s_dtype_in_bfloat16(x, force_fp32_for_softmax):
    # A bfloat16 model sows bfloat16 weights, or float32 ones where it forces the softmax to.
    theirs, ours = linen_pair(dtype=jnp.bfloat16, force_fp32_for_softmax=force_fp32_for_softmax)

    def weights(model):
        _, state = model.apply(params, x, sow_weights=True, mutable=["intermediates"])
        return state["intermediates"]["attention_weights"][0]

    with jax.numpy_dtype_promotion("standard"):  # flax's own code promotes implicitly
        params = theirs.init(jax.random.key(0), x)
        w_ours, w_theirs = weights(ours), weights(theirs)
    assert (
        w_ours.dtype == w_theirs.dtype == (jnp.float32 if force_fp32_for_softmax else jnp.bfloat16)
    )
    # (flax's bfloat16 softmax rounds more than ours, computed in float32 and rounded once)
    np.testing.assert_allclose(w_ours.astype(jnp.float32), w_theirs.astype(jnp.float32), atol=2e-2)


@pytest.mark.parametrize("force_fp32_for_softmax", [False, True])
def test_weights_have_the_inputs_dtype_as_flax_s(rng, force_fp32_for_softmax):
    q, k = (jnp.asarray(rng.normal(size=(2, 5, 3, 8)), jnp.bfloat16) for _ in range(2))
    keywords = dict(is_causal=False, force_fp32_for_softmax=force_fp32_for_softmax)
    ours = js.dot_product_attention_weights(q, k, **keywords)
    theirs = linen.dot_product_attention_weights(
        q, k, force_fp32_for_softmax=force_fp32_for_softmax
    )
    assert ours.dtype == theirs.dtype == (jnp.float32 if force_fp32_for_softmax else jnp.bfloat16)
    # Computed in float32 and rounded once: the float32 weights, rounded.
    wide = js.dot_product_attention_weights(q.astype(jnp.float32), k.astype(jnp.float32))
    np.testing.assert_array_equal(ours, wide.astype(ours.dtype))


def test_linen_dropout(x):
    _, ours = linen_pair(dropout_rate=0.5)
    params = ours.init(jax.random.key(0), x, deterministic=True)
    det = ours.apply(params, x, deterministic=True)
    plain = linen_pair()[1].apply(params, x)
    np.testing.assert_allclose(det, plain, atol=1e-6)
    a = ours.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    b = ours.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert np.isfinite(a).all() and float(np.abs(a - b).max()) > 1e-3


def nnx_pair(**kwargs):
    def make(fn):
        return nnx.MultiHeadAttention(
            num_heads=4,
            in_features=16,
            qkv_features=16,
            decode=False,
            rngs=nnx.Rngs(0),
            attention_fn=fn,
            **kwargs,
        )

    return make(nnx.dot_product_attention), make(js.dot_product_attention)


NNX_HAS_IS_CAUSAL = "is_causal" in inspect.signature(nnx.MultiHeadAttention.__call__).parameters
NNX_HAS_GQA = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters


@pytest.mark.parametrize("is_causal", [False, True] if NNX_HAS_IS_CAUSAL else [False])
def test_nnx_attention_fn_matches_flax(x, is_causal):
    theirs, ours = nnx_pair()
    mask = nnx.make_attention_mask(jnp.ones((2, 6)), jnp.array([[1.0] * 6, [1.0] * 5 + [0.0]]))
    kwargs = {"is_causal": is_causal} if NNX_HAS_IS_CAUSAL else {}
    np.testing.assert_allclose(
        ours(x, mask=mask, **kwargs), theirs(x, mask=mask, **kwargs), atol=1e-5
    )


def sown(model, x):
    """The output and the attention weights that ``model`` sows."""
    if hasattr(nnx, "capture"):
        out, state = nnx.capture(model, nnx.Intermediate)(x, sow_weights=True)
        return out, state["attention_weights"][0]
    out = model(x, sow_weights=True)
    return out, model.attention_weights.value[0]


def test_nnx_sow_weights_and_gqa(x):
    theirs, ours = nnx_pair(**({"num_kv_heads": 2} if NNX_HAS_GQA else {}))
    out_ours, w_ours = sown(ours, x)
    out_theirs, w_theirs = sown(theirs, x)
    np.testing.assert_allclose(out_ours, out_theirs, atol=1e-5)
    assert w_ours.shape == (2, 4, 6, 6)
    np.testing.assert_allclose(w_ours, w_theirs, atol=1e-6)


def test_nnx_dropout(x):
    _, ours = nnx_pair(dropout_rate=0.5)
    det = ours(x, deterministic=True)
    noisy = ours(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
    assert np.isfinite(noisy).all() and float(np.abs(noisy - det).max()) > 1e-3
