import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_sdpa as js
import jax_sdpa._cudnn
from jax_sdpa._jax_compat import JAX_NN_GIVES_LSE
from tests import reference as ref
from tests.implementations import each_implementation
from tests.profile import examples
from tests.util import enable_x64, equations, nn_attention, qkv


def grads(fn, q, k, v, bias, d_out):
    """Gradients of ⟨fn(q, k, v, bias), d_out⟩ with respect to q, k, v (and bias)."""
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    return jax.jit(jax.grad(lambda *a: (fn(*a) * d_out).sum(), argnums=argnums))(q, k, v, bias)


# --- accuracy against the float64 reference -------------------------------------------------


@pytest.mark.parametrize(
    "impl",
    [
        functools.partial(js.dot_product_attention, implementation="xla"),
        functools.partial(js.dot_product_attention, implementation="chunked"),
        functools.partial(js.dot_product_attention, implementation=js.Chunked(96, 160)),
    ],
    ids=["xla", "chunked-default-blocks", "chunked-96x160"],
)
@pytest.mark.parametrize("causal", [False, True])
def test_float32_accuracy_against_float64_reference(rng, impl, causal):
    # The bar: f32, unit-scale inputs, T ≤ 512, d ≤ 128: forward ≤ 2e-6, grads ≤ 1e-5.
    q, k, v = qkv(rng, 1, 512, 512, 2, 1, 128)
    bias = jnp.asarray(rng.normal(size=(1, 2, 512, 512)), jnp.float32)
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    expected = ref.attention(q, k, v, bias, is_causal=causal, d_out=d_out)
    fn = functools.partial(impl, is_causal=causal)
    out = fn(q, k, v, bias)
    assert float(np.abs(np.asarray(out) - expected["out"]).max()) <= 2e-6
    dq, dk, dv, dbias = grads(lambda q, k, v, b: fn(q, k, v, b), q, k, v, bias, d_out)
    for got, name in [(dq, "dq"), (dk, "dk"), (dv, "dv"), (dbias, "dbias")]:
        assert ref.rel_err(got, expected[name]) <= 1e-5, name


# --- layouts, heads, shapes ----------------------------------------------------------------


@each_implementation()
def test_unbatched_tnh_and_extra_batch_axes(rng, impl):
    q, k, v = qkv(rng, 6, 5, 7, 4, 2, 8)
    f = functools.partial(impl, is_causal=True)
    out = f(q, k, v)
    np.testing.assert_allclose(f(q[2], k[2], v[2]), out[2], atol=1e-6)

    def split(x):
        return x.reshape(2, 3, *x.shape[1:])

    np.testing.assert_allclose(f(split(q), split(k), split(v)).reshape(out.shape), out, atol=1e-6)
    if "mask" in impl.lacks:  # the kernel's: the rest broadcasts a mask array
        return
    mask = jnp.asarray(rng.random((2, 1, 1, 5, 7)) < 0.7)  # broadcast over the 2nd batch axis
    got = f(split(q), split(k), split(v), mask=mask)
    full_mask = jnp.broadcast_to(mask, (2, 3, 1, 5, 7)).reshape(6, 1, 5, 7)
    np.testing.assert_allclose(got.reshape(out.shape), f(q, k, v, mask=full_mask), atol=1e-6)


@each_implementation()
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1)])  # GQA and MQA (MHA: every test)
def test_gqa_and_mqa_against_reference(rng, impl, heads, kv_heads):
    q, k, v = qkv(rng, 2, 6, 9, heads, kv_heads, 8, hv=5)  # d_v = 5 ≠ d_k = 8
    d_out = jnp.asarray(rng.normal(size=(2, 6, heads, 5)), jnp.float32)
    expected = ref.attention(q, k, v, d_out=d_out)
    fn = functools.partial(impl)
    out = fn(q, k, v)
    assert out.shape == (2, 6, heads, 5)
    np.testing.assert_allclose(out, expected["out"], atol=2e-6)
    for got, name in zip(
        grads(lambda q, k, v, b: fn(q, k, v), q, k, v, None, d_out), ("dq", "dk", "dv"), strict=True
    ):
        assert ref.rel_err(got, expected[name]) <= 1e-5


def _intermediate_sizes(jaxpr):
    """Element counts of every value an (outer or nested) jaxpr computes."""
    for eqn in equations(jaxpr):
        yield from (int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))


@each_implementation("small intermediates")
def test_gqa_does_not_copy_keys_and_values(impl):
    # T=3 queries, S=16 keys, 8 query heads over 2 key/value heads: a key or value repeated per
    # query head would hold S·N·H = 512 numbers; nothing in the program may be that big.
    q = jnp.ones((1, 3, 8, 4))
    kv = jnp.ones((1, 16, 2, 4))
    fn = functools.partial(impl)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))(
        q, kv, kv
    )
    assert max(_intermediate_sizes(jaxpr.jaxpr)) < 16 * 8 * 4


@each_implementation("mask")
def test_return_residual_logsumexp(rng, impl):
    q, k, v = qkv(rng, 2, 5, 6, 2, 2, 4)
    mask = jnp.ones((2, 1, 5, 6), bool).at[0, :, 3].set(False)
    out, lse = impl(q, k, v, mask=mask, return_residual=True)
    expected = ref.attention(q, k, v, mask=mask)
    assert lse.shape == (2, 5, 2) and lse.dtype == jnp.float32
    np.testing.assert_allclose(lse, expected["lse"], atol=2e-6)
    assert np.isneginf(np.asarray(lse)[0, 3]).all()  # no key: log(0)
    assert (
        js.dot_product_attention(q, k, v, return_residual=True, dtype=jnp.bfloat16)[1].dtype
        == jnp.float32
    )


# --- features beyond jax.nn -------------------------------------------------------------------


@each_implementation()
def test_soft_cap_against_reference(rng, impl):
    q, k, v = qkv(rng, 1, 7, 7, 2, 2, 16)
    q = q * 4  # large scores, so the cap bites
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    expected = ref.attention(q, k, v, soft_cap=2.0, is_causal=True, d_out=d_out)
    fn = functools.partial(impl, logits_soft_cap=2.0, is_causal=True)
    np.testing.assert_allclose(fn(q, k, v), expected["out"], atol=2e-6)
    for got, name in zip(
        grads(lambda q, k, v, b: fn(q, k, v), q, k, v, None, d_out), ("dq", "dk", "dv"), strict=True
    ):
        assert ref.rel_err(got, expected[name]) <= 1e-5
    assert (
        float(np.abs(fn(q, k, v) - js.dot_product_attention(q, k, v, is_causal=True)).max()) > 1e-2
    )


@each_implementation()
def test_a_causal_offset_per_sequence_moves_each_sequence_s_diagonal(rng, impl):
    # CausalMask/LocalWindowMask with offsets: sequence b's queries sit at 1 + offsets[b] + i.
    q, k, v = qkv(rng, 3, 3, 8, 2, 2, 4)
    offsets = jnp.array([-1, 4, 1])
    rule = js.CausalMask(1, offsets) & js.LocalWindowMask(2, 0, 1, offsets)
    out = impl(q, k, v, mask_mod=rule)
    for b, offset in enumerate(offsets.tolist()):
        one = (x[b : b + 1] for x in (q, k, v))
        want = ref.attention(*one, is_causal=True, window=(2, 0), offset=1 + offset)
        np.testing.assert_allclose(out[b : b + 1], want["out"], atol=2e-6)


@each_implementation()
def test_bottom_right_causal_for_kv_cache_decoding(rng, impl):
    q, k, v = qkv(rng, 2, 3, 8, 2, 2, 4)
    out = impl(q, k, v, is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_allclose(
        out, ref.attention(q, k, v, is_causal=True, offset=5)["out"], atol=2e-6
    )
    # One decoding step: the newest query sees every cached key (top-left would see only key 0).
    step = js.dot_product_attention(
        q[:, -1:], k, v, is_causal=True, causal_alignment="bottom_right"
    )
    np.testing.assert_allclose(step, js.dot_product_attention(q[:, -1:], k, v), atol=1e-6)
    top_left = js.dot_product_attention(q[:, -1:], k, v, is_causal=True)
    np.testing.assert_allclose(top_left, jnp.broadcast_to(v[:, :1], top_left.shape), atol=1e-6)
    window = impl(
        q,
        k,
        v,
        local_window_size=(2, 0),
        causal_alignment="bottom_right",
    )
    np.testing.assert_allclose(
        window, ref.attention(q, k, v, window=(2, 0), offset=5)["out"], atol=2e-6
    )


@each_implementation("segment ids")
def test_segment_ids_for_packed_sequences(rng, impl):
    q, k, v = qkv(rng, 2, 8, 8, 2, 1, 4)
    seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 3]], jnp.int32)
    out = impl(q, k, v, query_segment_ids=seg, is_causal=True)
    expected = ref.attention(q, k, v, q_segments=seg, kv_segments=seg, is_causal=True)
    np.testing.assert_allclose(out, expected["out"], atol=2e-6)
    # Packing is the same as running each sequence on its own.
    alone = js.dot_product_attention(q[:1, 3:5], k[:1, 3:5], v[:1, 3:5], is_causal=True)
    np.testing.assert_allclose(out[:1, 3:5], alone, atol=1e-6)


def test_dropout_semantics(rng):
    q, k, v = qkv(rng, 2, 16, 16, 4, 2, 8)
    f = functools.partial(js.dot_product_attention, q, k, v, dropout_rate=0.3)
    plain = js.dot_product_attention(q, k, v)
    np.testing.assert_array_equal(f(deterministic=True), plain)  # evaluation mode: no dropout
    rng_key = jax.random.key(7)
    once, again = f(dropout_rng=rng_key), f(dropout_rng=rng_key)
    np.testing.assert_array_equal(once, again)
    assert float(np.abs(once - plain).max()) > 1e-2
    # The output is the dropped-out weights (flax: dropout on the weights) times V.
    for broadcast in (True, False):
        weights = js.dot_product_attention_weights(
            q, k, dropout_rate=0.3, dropout_rng=rng_key, broadcast_dropout=broadcast
        )
        out = f(dropout_rng=rng_key, broadcast_dropout=broadcast)
        expected = jnp.einsum("bnts,bsnv->btnv", weights, jnp.repeat(v, 2, axis=2))
        np.testing.assert_allclose(out, expected, atol=1e-5)
        kept = np.asarray(weights) != 0
        assert abs(kept.mean() - 0.7) < 0.05
        same_mask = all((kept[i, j] == kept[0, 0]).all() for i in range(2) for j in range(4))
        assert (
            same_mask == broadcast
        )  # broadcast_dropout: one mask for every batch element and head
    # Expectation is preserved: averaging many draws approaches the output without dropout.
    draws = jax.vmap(lambda r: f(dropout_rng=r))(jax.random.split(rng_key, 400))
    assert float(np.abs(draws.mean(0) - plain).max()) < 0.15


def test_dropout_gradients_match_reference_with_the_same_mask(rng):
    q, k, v = qkv(rng, 1, 6, 6, 2, 2, 4)
    rng_key = jax.random.key(1)
    weights = js.dot_product_attention_weights(q, k, dropout_rate=0.5, dropout_rng=rng_key)
    keep = np.asarray(weights != 0)

    def manual(q, k, v):  # same formula, the mask given as a constant
        w = js.dot_product_attention_weights(q, k)
        return jnp.einsum("bnts,bsnv->btnv", jnp.where(keep, w / 0.5, 0), v)

    def f(q, k, v, b):
        return js.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng_key)

    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    for got, want in zip(
        grads(f, q, k, v, None, d_out),
        grads(lambda q, k, v, b: manual(q, k, v), q, k, v, None, d_out),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_weights_function_matches_reference_and_flax(rng):
    from flax import linen

    q, k, _ = qkv(rng, 2, 5, 7, 3, 3, 4)
    mask = jnp.asarray(rng.random((2, 1, 5, 7)) < 0.8).at[:, :, :, 0].set(True)
    w = js.dot_product_attention_weights(q, k, mask=mask)
    np.testing.assert_allclose(w, ref.attention(q, k, k, mask=mask)["weights"], atol=1e-6)
    np.testing.assert_allclose(w, linen.dot_product_attention_weights(q, k, mask=mask), atol=1e-6)


# --- fully masked rows ---------------------------------------------------------------------


@each_implementation("bias", "mask", "query lengths")
def test_rows_without_keys_are_zero_with_zero_gradients(rng, impl):
    q, k, v = qkv(rng, 2, 4, 5, 2, 2, 4)
    mask = jnp.ones((2, 2, 4, 5), bool).at[0, 1, 2].set(False)  # one fully masked row
    bias = jnp.zeros((2, 2, 4, 5)).at[1, 0, 3].set(-jnp.inf)  # a whole bias row of −∞
    q_len = jnp.array([4, 3], jnp.int32)  # a padded query row

    def f(q, k, v, bias):
        return impl(q, k, v, bias, mask=mask, query_seq_lengths=q_len)

    out = np.asarray(f(q, k, v, bias))
    assert np.isfinite(out).all()
    for b, t, n in [(0, 2, 1), (1, 3, 0), (1, 3, 1)]:
        np.testing.assert_array_equal(out[b, t, n], 0)
    d_out = jnp.ones_like(q)
    g = grads(f, q, k, v, bias, d_out)
    assert all(np.isfinite(np.asarray(x)).all() for x in g)
    np.testing.assert_array_equal(np.asarray(g[0])[0, 2, 1], 0)  # dq of the masked row
    np.testing.assert_array_equal(np.asarray(g[3])[0, 1, 2], 0)  # dbias of the masked row
    # What jax.nn does instead (documented difference): the mean of the values.
    nn_out = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(nn_out[0, 2, 1], v[0, :, 1].mean(0), atol=1e-6)


@pytest.mark.parametrize("t,s", [(0, 5), (4, 0), (0, 0)])
@pytest.mark.parametrize(
    "impl",
    [functools.partial(js.dot_product_attention, implementation="xla"), js.dot_product_attention],
    ids=["xla", "auto"],
)
def test_empty_query_or_key_sequences(rng, impl, t, s):
    # No query: an empty output. No key: every row has nothing to attend to, so it is 0 (as for
    # a fully masked row) with log-sum-exp −∞; jax.nn returns the same shapes.
    q, k, v = qkv(rng, 2, t, s, 4, 2, 8)
    out, lse = impl(q, k, v, is_causal=True, return_residual=True)
    assert out.shape == jax.nn.dot_product_attention(q, k, v).shape == (2, t, 4, 8)
    assert lse.shape == (2, t, 4) and lse.dtype == jnp.float32
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_array_equal(lse, -np.inf)
    assert js.dot_product_attention_weights(q, k).shape == (2, 4, t, s)
    g = jax.jit(jax.grad(lambda *a: impl(*a).sum(), argnums=(0, 1, 2)))(q, k, v)
    assert [x.shape for x in g] == [q.shape, k.shape, v.shape]
    assert all(not np.asarray(x).any() for x in g)


# --- transformations and dtypes --------------------------------------------------------------


@each_implementation()
def test_jit_vmap_jacobian(rng, impl):
    q, k, v = qkv(rng, 3, 4, 5, 2, 1, 3)
    f = functools.partial(impl, is_causal=True)
    np.testing.assert_allclose(jax.jit(f)(q, k, v), f(q, k, v), atol=1e-6)
    np.testing.assert_allclose(
        jax.vmap(f)(q, k, v), f(q, k, v), atol=1e-6
    )  # vmap of the batch axis
    jac = jax.jacobian(f)(q[0], k[0], v[0])
    jac_nn = jax.jacobian(functools.partial(jax.nn.dot_product_attention, is_causal=True))(
        q[0], k[0], v[0]
    )
    np.testing.assert_allclose(jac, jac_nn, atol=2e-6)


@each_implementation()
@settings(max_examples=examples("vmapped"), deadline=None)
@given(
    t=st.integers(1, 6), s=st.integers(1, 6), n=st.sampled_from([1, 2]), seed=st.integers(0, 1000)
)
def test_property_vmapped_single_head_equals_batched(impl, t, s, n, seed):
    gen = np.random.default_rng(seed)
    q, k, v = qkv(gen, 2, t, s, n, n, 3)
    f = functools.partial(impl)
    batched = f(q, k, v, is_causal=True)
    single = functools.partial(js.attention, is_causal=True)
    per_head = jax.vmap(jax.vmap(single, in_axes=(1, 1, 1), out_axes=1))(q, k, v)
    np.testing.assert_allclose(per_head, batched, atol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(q, k, v), f(q, k, v), atol=1e-6)


@each_implementation()
@pytest.mark.parametrize("dtype,atol", [(jnp.bfloat16, 3e-2), (jnp.float16, 4e-3)])
def test_low_precision_inputs_keep_dtype_and_accuracy(rng, impl, dtype, atol):
    q, k, v = qkv(rng, 2, 64, 64, 2, 2, 32, dtype=dtype)
    out = impl(q, k, v, is_causal=True)
    assert out.dtype == dtype
    expected = ref.attention(q, k, v, is_causal=True)["out"]  # the same rounded inputs, in f64
    assert float(np.abs(np.asarray(out, np.float64) - expected).max()) <= atol
    g = jax.jit(jax.grad(lambda q: impl(q, k, v).astype(jnp.float32).sum()))(q)
    assert g.dtype == dtype and np.isfinite(np.asarray(g, np.float32)).all()


@each_implementation()
def test_float64_stays_float64(rng, impl):
    with enable_x64():
        q, k, v = qkv(rng, 1, 9, 11, 2, 2, 4, dtype=jnp.float64)
        out = impl(q, k, v, is_causal=True)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, ref.attention(q, k, v, is_causal=True)["out"], atol=1e-12)


def test_numpy_inputs_and_precision(rng):
    q, k, v = (np.asarray(x) for x in qkv(rng, 1, 3, 4, 2, 2, 4))
    out = js.dot_product_attention(q, k, v, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(out, ref.attention(q, k, v)["out"], atol=2e-6)


# --- the chunked implementation against the dense one ----------------------------------------


@pytest.mark.parametrize(
    "t,s,block_q,block_kv",
    [(1, 1, 4, 4), (7, 13, 3, 5), (13, 7, 5, 3), (31, 29, 8, 8), (17, 17, 17, 1)],
)
@pytest.mark.slow  # compile-bound; the sweep draws such lengths in every run
def test_chunked_equals_dense_on_tiny_and_prime_lengths(rng, t, s, block_q, block_kv):
    q, k, v = qkv(rng, 2, t, s, 4, 2, 6, hv=3)
    bias = jnp.asarray(rng.normal(size=(2, 4, t, s)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, 1, s)) < 0.8)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(2, t))), jnp.int32)
    kv_seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(2, s))), jnp.int32)
    kwargs = dict(
        is_causal=True,
        causal_alignment="bottom_right",
        local_window_size=(4, 2),
        query_segment_ids=seg,
        key_value_segment_ids=kv_seg,
        logits_soft_cap=3.0,
    )

    def f(implementation, q, k, v, bias):
        options = dict(return_residual=True, implementation=implementation, **kwargs)
        return js.dot_product_attention(q, k, v, bias, mask, **options)

    chunked = js.Chunked(block_q, block_kv)
    (out, lse), (out_d, lse_d) = f(chunked, q, k, v, bias), f("xla", q, k, v, bias)
    np.testing.assert_allclose(out, out_d, atol=1e-6)
    np.testing.assert_allclose(lse, lse_d, atol=1e-5)
    d_out = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    g = grads(lambda *a: f(chunked, *a)[0], q, k, v, bias, d_out)
    g_d = grads(lambda *a: f("xla", *a)[0], q, k, v, bias, d_out)
    for got, want in zip(g, g_d, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_chunked_dropout_drops_exactly_what_dense_drops(rng):
    q, k, v = qkv(rng, 2, 11, 9, 2, 2, 4)
    kwargs = dict(
        dropout_rate=0.4, dropout_rng=jax.random.key(5), broadcast_dropout=False, is_causal=True
    )

    def f(implementation, q, k, v):
        return js.dot_product_attention(q, k, v, implementation=implementation, **kwargs)

    chunked = js.Chunked(4, 3)
    np.testing.assert_allclose(f(chunked, q, k, v), f("xla", q, k, v), atol=1e-6)
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    g = grads(lambda q, k, v, b: f(chunked, q, k, v), q, k, v, None, d_out)
    g_d = grads(lambda q, k, v, b: f("xla", q, k, v), q, k, v, None, d_out)
    for got, want in zip(g, g_d, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_chunked_skips_blocks_past_the_causal_diagonal_and_the_lengths(rng):
    # NaN in a key block is invisible to the output only if the block is never computed: a masked
    # but computed block would still multiply its NaN values by zero weights.
    q, k, v = qkv(rng, 1, 8, 8, 1, 1, 4)
    v = v.at[:, 4:].set(jnp.nan)
    chunked = {"implementation": js.Chunked(4, 4)}
    out = js.dot_product_attention(q, k, v, is_causal=True, **chunked)
    assert np.isfinite(np.asarray(out)[:, :4]).all()  # rows 0-3 never visit keys 4-7
    dense = js.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert np.isnan(np.asarray(dense)[:, :4]).any()  # the dense path multiplies 0 · NaN
    lengths = jnp.array([4], jnp.int32)
    out = js.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, **chunked)
    assert np.isfinite(np.asarray(out)).all()
    g = jax.jit(
        jax.grad(
            lambda q: js.dot_product_attention(
                q, k, v, key_value_seq_lengths=lengths, **chunked
            ).sum()
        )
    )(q)
    assert np.isfinite(np.asarray(g)).all()


def _uses_chunked(fn, *args) -> bool:
    # A fresh wrapper each time: make_jaxpr caches traces per function and argument shapes.
    return "while" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


def test_automatic_choice_of_implementation(rng, monkeypatch):
    q, k, v = qkv(rng, 1, 64, 64, 2, 2, 4)
    f = functools.partial(js.dot_product_attention, is_causal=True)
    assert _uses_chunked(f, q, k, v)  # on CPU as fast as dense or faster at every size
    sow = functools.partial(f, module=type("Module", (), {"sow": lambda *a: None})())
    assert not _uses_chunked(sow, q, k, v)  # sown weights need the dense path
    # On an accelerator: dense while B·N·T·S ≤ 2^24 scores, chunked above.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not _uses_chunked(f, q, k, v)
    big = jax.ShapeDtypeStruct((1, 4097, 1, 4), jnp.float32)
    assert _uses_chunked(f, big, big, big)


@pytest.mark.skipif(not JAX_NN_GIVES_LSE, reason="JAX before 0.7: the refusal below")
def test_cudnn_is_handed_the_call_in_jax_nn_arguments(rng, monkeypatch):
    # No GPU here: pretend there is one and let jax.nn's xla path stand in for its cuDNN kernel,
    # so that what is checked is the call jax_sdpa hands over after its own checks (the mask
    # rules back as jax.nn's flags and lengths).
    q, k, v = qkv(rng, 2, 6, 6, 4, 2, 8)
    bias = jnp.asarray(rng.normal(size=(1, 4, 6, 6)), jnp.float32)
    handed = _on_a_gpu_recording_cudnn(monkeypatch)
    kwargs = dict(
        is_causal=True,
        local_window_size=(2, 0),  # (with lengths, jax.nn's cuDNN takes no right side)
        query_seq_lengths=jnp.array([6, 5], jnp.int32),
        key_value_seq_lengths=jnp.array([6, 4], jnp.int32),
        scale=0.3,
    )
    out = js.dot_product_attention(q, k, v, bias, implementation="cudnn", **kwargs)
    assert len(handed) == 1
    np.testing.assert_allclose(out, nn_attention(q, k, v, bias, **kwargs), atol=1e-6)
    expected = ref.attention(
        q,
        k,
        v,
        bias,
        is_causal=True,
        window=(2, 0),
        scale=0.3,
        q_lengths=kwargs["query_seq_lengths"],
        kv_lengths=kwargs["key_value_seq_lengths"],
    )
    np.testing.assert_allclose(out, expected["out"], atol=2e-6)
    # Unbatched (TNH): jax.nn wants lengths of shape (1,), which ours hold as ().
    lengths = jnp.array([4], jnp.int32)
    unbatched = js.dot_product_attention(
        q[1], k[1], v[1], implementation="cudnn", key_value_seq_lengths=lengths
    )
    expected = ref.attention(q[1:], k[1:], v[1:], kv_lengths=lengths)["out"][0]
    np.testing.assert_allclose(unbatched, expected, atol=2e-6)
    with pytest.raises(ValueError, match="supports only jax.nn's arguments; got logits_soft_cap"):
        js.dot_product_attention(q, k, v, implementation="cudnn", logits_soft_cap=2.0)
    with pytest.raises(ValueError, match="got a window's right side without is_causal"):
        js.dot_product_attention(q, k, v, implementation="cudnn", local_window_size=(2, 2))
    with pytest.raises(ValueError, match="never forms the attention weights"):
        js.dot_product_attention(q, k, v, implementation="chunked", module=object())


@pytest.mark.skipif(JAX_NN_GIVES_LSE, reason="JAX 0.7 and later: the call above")
def test_cudnn_before_jax_0_7_is_refused_with_the_version(rng, monkeypatch):
    q, k, v = qkv(rng, 2, 6, 6, 4, 2, 8)  # (jax.nn gives no log-sum-exp there)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match=f"needs JAX 0.7 or later .*JAX is {jax.__version__}"):
        js.dot_product_attention(q, k, v, implementation="cudnn")


def _on_a_gpu_recording_cudnn(monkeypatch) -> list:
    """A GPU pretended, jax.nn's XLA path standing in for its cuDNN kernel: the calls handed over."""
    handed = []

    def cudnn(*args, implementation, **kwargs):
        handed.append(kwargs)
        return nn_attention(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax_sdpa._cudnn, "flash_attention_device", lambda: True)  # an sm_80+
    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn)
    return handed


@pytest.mark.skipif(not JAX_NN_GIVES_LSE, reason="cuDNN's row needs JAX 0.7")
def test_the_default_on_a_gpu_hands_cudnn_the_calls_whose_result_is_ours(rng, monkeypatch):
    # cuDNN is the fastest measured on a GPU for the calls it takes: the default hands it every
    # call where cuDNN's result is this library's, and only those.
    handed = _on_a_gpu_recording_cudnn(monkeypatch)
    q, k, v = qkv(rng, 2, 8, 8, 4, 2, 16, dtype=jnp.bfloat16)
    window = dict(local_window_size=(2, 1))  # (cuDNN's window is left; causal gives the right)

    def handed_to_cudnn(q=q, k=k, v=v, *args, **kwargs) -> bool:
        # (traced, and run where handed: a call kept is computed by paths other tests check)
        before = len(handed)
        traced = jax.jit(lambda *a: js.dot_product_attention(*a, **kwargs)).trace(q, k, v, *args)
        if len(handed) == before:
            return False
        out = traced.lower().compile()(q, k, v, *args)
        want = js.dot_product_attention(q, k, v, *args, implementation="xla", **kwargs)
        want = want[0] if kwargs.get("return_residual") else want
        got = out[0] if kwargs.get("return_residual") else out
        np.testing.assert_allclose(*(np.asarray(x, np.float32) for x in (got, want)), atol=2e-2)
        return True

    assert handed_to_cudnn()  # GQA, bfloat16
    assert handed_to_cudnn(is_causal=True)
    assert handed_to_cudnn(is_causal=True, **window)
    with jax.numpy_dtype_promotion("standard"):  # (the stand-in's backward, lowered here)
        grads = jax.grad(lambda q: js.dot_product_attention(q, k, v, is_causal=True).sum())(q)
    assert len(handed) == 4 and np.isfinite(np.asarray(grads, np.float32)).all()
    # float16 too (traced only: jax.nn's XLA path, the stand-in, does not compile it on a CPU).
    jax.eval_shape(js.dot_product_attention, *(x.astype(jnp.float16) for x in (q, k, v)))
    assert len(handed) == 5
    # Where a row may have no key, cuDNN's row is not ours (jax.nn gives the mean of the values,
    # or NaN); where cuDNN lacks an argument, a dtype or a width; where the log-sum-exp's
    # gradient is asked for: XLA, as jax.nn's own default falls back to.
    mask = jnp.asarray(rng.random((2, 1, 8, 8)) < 0.7)
    bias = jnp.zeros((1, 4, 8, 8), jnp.bfloat16)
    lengths = jnp.array([8, 3], jnp.int32)
    assert not handed_to_cudnn(q, k, v, None, mask)
    assert not handed_to_cudnn(q, k, v, bias)
    assert not handed_to_cudnn(key_value_seq_lengths=lengths)
    assert not handed_to_cudnn(q[:, :5], is_causal=True)  # T ≠ S: a row's diagonal may be gone
    assert not handed_to_cudnn(q[:, :5], k[:, :6], v[:, :6], **window)
    assert not handed_to_cudnn(**window)  # a window without a causal mask: rows' right sides
    assert not handed_to_cudnn(precision=jax.lax.Precision.HIGHEST)  # which cuDNN has not
    assert not handed_to_cudnn(logits_soft_cap=5.0)
    assert not handed_to_cudnn(*(x.astype(jnp.float32) for x in (q, k, v)))
    wide = qkv(rng, 1, 8, 8, 2, 2, 136, dtype=jnp.bfloat16)
    assert not handed_to_cudnn(*wide)
    assert not handed_to_cudnn(v=v[..., :8])  # d_v ≠ d_k
    assert not handed_to_cudnn(return_residual=True)
    assert handed_to_cudnn(q[:, :5], k[:, :6], v[:, :6])  # T ≠ S without a mask: every key
    # Decoding shapes too (a query against a cache), where the decode path would run.
    cache = qkv(rng, 2, 1, 1024, 4, 2, 16, dtype=jnp.bfloat16)
    assert handed_to_cudnn(*cache)
    assert not handed_to_cudnn(*cache, key_value_seq_lengths=jnp.array([1024, 7], jnp.int32))
    # cuDNN's backward is not differentiable: no hessian and no jvp through it.
    before = len(handed)
    jax.jvp(lambda q: js.dot_product_attention(q, k, v), (q,), (q,))
    small = [x[:1, :2] for x in (k, v)]
    jax.hessian(lambda q: js.dot_product_attention(q, *small).astype(jnp.float32).sum())(q[:1, :2])
    assert len(handed) == before
    # Under jax.vmap of the call (jax.nn's cuDNN batches axis 0 of every input, not one unmapped).
    before = len(handed)
    jax.vmap(lambda q: js.dot_product_attention(q, k, v, is_causal=True))(q[None])
    assert len(handed) == before
    # MLA's latent values: the values a slice of the keys (d_v ≠ d_k here: not cuDNN's).
    assert not handed_to_cudnn(v=js.LatentValues(8))
    # Not on a GPU without cuDNN's flash attention (before sm_80, or not CUDA).
    monkeypatch.setattr(jax_sdpa._cudnn, "flash_attention_device", lambda: False)
    assert not handed_to_cudnn(is_causal=True)
    with pytest.raises(TypeError, match="backward pass is cuDNN kernels"):
        jax.hessian(lambda q: js.dot_product_attention(q, k, v, implementation="cudnn").sum())(q)
