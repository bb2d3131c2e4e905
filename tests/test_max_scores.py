"""The max-score output (``return_max_scores=True``): each row's largest allowed logit.

Against the float64 reference on every implementation of the registry, with masks, lengths,
windows, a ``score_mod``, a soft cap, a bias, sinks (not counted), the sigmoid normaliser and
rows with no key (−∞); the outputs' order with ``return_residual``; no gradient through it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from tests import reference as ref
from tests.implementations import each_implementation
from tests.util import qkv

SLOPES = jnp.array([0.3, -0.2, 0.5, 0.1], jnp.float32)

CASES = {
    "causal": ({"is_causal": True}, {"is_causal": True}),
    "lengths and sinks": (
        {"key_value_seq_lengths": jnp.array([9, 0], jnp.int32), "sinks": jnp.full(4, 3.0)},
        {"kv_lengths": np.array([9, 0]), "sinks": np.full(4, 3.0)},
    ),
    "window and soft cap": (
        {"local_window_size": (3, 1), "logits_soft_cap": 1.5},
        {"window": (3, 1), "soft_cap": 1.5},
    ),
    "score_mod": (
        {"score_mod": lambda s, b, h, i, j: s - SLOPES[h] * jnp.abs(i - j).astype(s.dtype)},
        {"score_mod": lambda s, b, h, i, j: s - np.asarray(SLOPES, np.float64)[h] * np.abs(i - j)},
    ),
    "sigmoid": ({"normalizer": "sigmoid", "is_causal": True}, {"is_causal": True}),
}


# The inner loop and the x64 pass run one case; CI runs the others (slow); the sweep checks every
# call.
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[] if c == "lengths and sinks" else pytest.mark.slow) for c in CASES],
)
@each_implementation()
def test_max_scores_match_the_reference(rng, impl, case):
    q, k, v = qkv(rng, 2, 7, 11, 4, 2, 8)
    q = q * 3.0  # logits well above the others' rounding
    keywords, rules = CASES[case]
    want = ref.attention(q, k, v, **rules)["max_scores"]
    out, top = impl(q, k, v, return_max_scores=True, **keywords)
    assert top.shape == q.shape[:3] and top.dtype == jnp.float32
    np.testing.assert_array_equal(np.isfinite(top), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(np.where(finite, top, 0), np.where(finite, want, 0), atol=2e-6)


@each_implementation("bias")
def test_max_scores_include_the_bias(rng, impl):
    q, k, v = qkv(rng, 1, 4, 6, 2, 1, 8)
    bias = jnp.asarray(rng.normal(size=(1, 2, 4, 6)), jnp.float32).at[0, 1, 2].set(-jnp.inf)
    want = ref.attention(q, k, v, bias)["max_scores"]
    _, top = impl(q, k, v, bias, return_max_scores=True)
    np.testing.assert_allclose(top, want, atol=2e-6)


def test_the_outputs_come_in_order_and_the_max_has_no_gradient(rng):
    q, k, v = qkv(rng, 1, 4, 6, 2, 1, 8)

    def attend(q, **keywords):
        return js.dot_product_attention(q, k, v, implementation="chunked", **keywords)

    out, lse, top = attend(q, return_residual=True, return_max_scores=True)
    np.testing.assert_allclose(out, attend(q), atol=1e-6)
    np.testing.assert_allclose(lse, attend(q, return_residual=True)[1], atol=1e-6)
    np.testing.assert_allclose(top, attend(q, return_max_scores=True)[1], atol=1e-6)
    np.testing.assert_array_equal(
        jax.grad(lambda q: attend(q, return_max_scores=True)[1].sum())(q), 0
    )


def test_cudnn_is_not_asked_for_max_scores(rng, monkeypatch):
    q, k, v = qkv(rng, 1, 4, 6, 2, 1, 8)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="supports only jax.nn's arguments; got return_max_scores"):
        js.dot_product_attention(q, k, v, implementation="cudnn", return_max_scores=True)


# --- QK-Clip: the heads' largest logits kept at the threshold ----------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_qk_clip_brings_each_head_s_largest_logit_to_the_threshold(rng, kv_heads):
    x = jnp.asarray(rng.normal(size=(2, 9, 16)), jnp.float32)
    spread = jnp.array([4.0, 0.2, 3.0, 0.3], jnp.float32)[None, :, None]  # heads far apart
    w_q = jnp.asarray(rng.normal(size=(16, 4, 8)), jnp.float32) * spread
    w_k = jnp.asarray(rng.normal(size=(16, kv_heads, 8)), jnp.float32)

    def max_logits(w_q, w_k):
        q, k = jnp.einsum("btf,fnh->btnh", x, w_q), jnp.einsum("btf,fnh->btnh", x, w_k)
        _, top = js.dot_product_attention(q, k, k, is_causal=True, return_max_scores=True)
        return top.max(axis=(0, 1))  # per head

    before = max_logits(w_q, w_k)
    tau = float(jnp.sort(before)[1])  # two heads above, one at, one below
    new_q, new_k = js.qk_clip(w_q, w_k, before, threshold=tau)
    after = max_logits(new_q, new_k)
    np.testing.assert_allclose(after, jnp.minimum(before, tau), rtol=1e-5)


def test_qk_clip_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match=r"`max_logits` must have shape \(heads,\) = \(4,\)"):
        js.qk_clip(jnp.ones((3, 4, 2)), jnp.ones((3, 2, 2)), jnp.ones(3), threshold=1.0)
    with pytest.raises(ValueError, match="`threshold` must be positive"):
        js.qk_clip(jnp.ones((3, 4, 2)), jnp.ones((3, 2, 2)), jnp.ones(4), threshold=0.0)
    with pytest.raises(ValueError, match="must divide `query_kernel`'s; got 3 and 4"):
        js.qk_clip(jnp.ones((3, 4, 2)), jnp.ones((3, 3, 2)), jnp.ones(4), threshold=1.0)
