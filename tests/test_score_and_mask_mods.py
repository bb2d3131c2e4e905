"""score_mod, mask_mod and sinks: against the float64 reference, numerical gradients, and errors.

The mods are written once and run both ways: on jax scalars inside the library, and on whole
NumPy index grids (broadcast) inside the float64 reference.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_sdpa as js
from tests import reference as ref
from tests.implementations import each_implementation
from tests.util import enable_x64, qkv


def alibi(slopes):
    return lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(s.dtype)


def relative_bias(table, reach):
    """A learned bias per head and clipped distance: table[h, clip(j − i) + reach]."""
    return lambda s, b, h, i, j: s + table[h, (j - i).clip(-reach, reach) + reach].astype(s.dtype)


def documents(doc):
    """Causal within each document: doc[b, i] is the document of position i in sequence b."""
    return lambda b, h, i, j: (doc[b, i] == doc[b, j]) & (j <= i)


def setup(rng, t=7, s=9):
    q, k, v = qkv(rng, 2, t, s, 4, 2, 6, hv=5)
    slopes = rng.uniform(0.1, 1.0, size=4)
    table = rng.normal(size=(4, 7))
    doc = np.sort(rng.integers(0, 3, size=(2, max(t, s))), axis=1)
    sinks = rng.normal(size=4)
    return (q, k, v), slopes, table, doc, sinks


@each_implementation()
@pytest.mark.parametrize("with_sinks", [False, True])
def test_mods_and_sinks_against_reference(rng, impl, with_sinks):
    (q, k, v), slopes, table, doc, sinks = setup(rng)
    doc[1, 2] = 7  # in sequence 1, query 2 is alone in its document: no key but itself

    def score_mod(lib):
        a, r = alibi(lib(slopes)), relative_bias(lib(table), 3)
        return lambda s, b, h, i, j: r(a(s, b, h, i, j), b, h, i, j)

    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)

    def head_mask(lib):  # head 3 sees every key
        return lambda b, h, i, j: documents(lib(doc))(b, h, i, j) | (h == 3)

    out, lse = impl(
        q,
        k,
        v,
        score_mod=score_mod(f32),
        mask_mod=head_mask(jnp.asarray),
        sinks=f32(sinks) if with_sinks else None,
        return_residual=True,
    )
    expected = ref.attention(
        q,
        k,
        v,
        score_mod=score_mod(np.asarray),
        mask_mod=head_mask(np.asarray),
        sinks=sinks if with_sinks else None,
    )
    np.testing.assert_allclose(out, expected["out"], atol=2e-6)
    np.testing.assert_allclose(lse, expected["lse"], atol=2e-5)


@each_implementation()
def test_a_mod_that_transforms_its_arrays_whole_gets_their_gradients(rng, impl):
    # exp of learned log-slopes, a bfloat16 cast of a table and an array the function makes of
    # literals: computed once, ahead of the tiles; the gradients reach the arrays the user
    # holds through that part too. A literal (−∞ in a jnp.where) stays a constant.
    (q, k, v), slopes, table, _, _ = setup(rng)
    log_slopes = jnp.asarray(np.log(slopes), jnp.float32)
    table = jnp.asarray(table, jnp.float32)

    def loss(implementation, q, k, v, log_slopes, table):
        def score_mod(s, b, h, i, j):
            s = s + jnp.exp(log_slopes)[h] * (j - i).astype(s.dtype)
            s = s + table.astype(jnp.bfloat16).astype(s.dtype)[h, (j - i).clip(-3, 3) + 3]
            s = s * jnp.linspace(0.5, 1.5, 8, dtype=s.dtype)[i % 8]
            return jnp.where(j <= i + 1, s, -jnp.inf)

        out = implementation(q, k, v, score_mod=score_mod)
        return (out * jnp.cos(out)).sum()

    args, argnums = (q, k, v, log_slopes, table), (0, 1, 2, 3, 4)
    got = jax.grad(functools.partial(loss, impl), argnums=argnums)(*args)
    with enable_x64():
        wide = [x.astype(jnp.float64) for x in args]
        xla = functools.partial(js.dot_product_attention, implementation="xla")
        want = jax.grad(functools.partial(loss, xla), argnums=argnums)(*wide)
    for name, g, w in zip(("q", "k", "v", "log_slopes", "table"), got, want, strict=True):
        assert ref.rel_err(g, w) < 1e-5, name


@each_implementation()
def test_rows_without_keys_output_zero_and_the_sink_is_their_log_sum_exp(rng, impl):
    q, k, v = qkv(rng, 1, 4, 5, 2, 2, 4)
    sinks = jnp.array([0.5, -2.0])
    nothing = lambda b, h, i, j: (i != 2) & (j >= 0)  # noqa: E731  row 2 sees no key

    def f(sinks, q):
        return impl(q, k, v, mask_mod=nothing, sinks=sinks, return_residual=True)

    out, lse = f(sinks, q)
    np.testing.assert_array_equal(np.asarray(out)[0, 2], 0)
    np.testing.assert_allclose(lse[0, 2], sinks, atol=1e-6)
    g = jax.jit(jax.grad(lambda s, q: f(s, q)[0].sum(), argnums=(0, 1)))(sinks, q)
    assert all(np.isfinite(np.asarray(x)).all() for x in g)
    np.testing.assert_array_equal(np.asarray(g[1])[0, 2], 0)


def test_dense_gradients_are_the_numerical_ones_in_float64(rng):
    (q, k, v), slopes, table, doc, sinks = setup(rng, t=5, s=6)
    with enable_x64():
        q, k, v, slopes, table, sinks = (
            jnp.asarray(x, jnp.float64) for x in (q, k, v, slopes, table, sinks)
        )

        def f(q, k, v, slopes, table, sinks):
            a, r = alibi(jnp.asarray(slopes)), relative_bias(jnp.asarray(table), 2)
            return js.dot_product_attention(
                q,
                k,
                v,
                implementation="xla",
                mask_mod=documents(jnp.asarray(doc)),
                sinks=sinks,
                score_mod=lambda s, b, h, i, j: r(a(s, b, h, i, j), b, h, i, j),
            )

        check_grads(
            f, (q, k, v, slopes, table, sinks), order=1, modes=["rev"], atol=1e-6, rtol=1e-6
        )


@pytest.mark.parametrize(
    "block_q,block_kv",
    # The inner loop keeps the tiles that divide nothing; CI also runs the other two.
    [
        pytest.param(3, 4, marks=pytest.mark.slow),
        (2, 5),
        pytest.param(16, 16, marks=pytest.mark.slow),
    ],
)
def test_chunked_gradients_equal_dense_for_every_captured_array(rng, block_q, block_kv):
    (q, k, v), slopes, table, doc, sinks = setup(rng)
    bias = jnp.asarray(rng.normal(size=(2, 4, 7, 9)), jnp.float32)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    d_out = jnp.asarray(rng.normal(size=(2, 7, 4, 5)), jnp.float32)

    def loss(impl, q, k, v, bias, slopes, table, sinks):
        a, r = alibi(slopes), relative_bias(table, 3)
        out = impl(
            q,
            k,
            v,
            bias,
            mask_mod=documents(jnp.asarray(doc)),
            sinks=sinks,
            is_causal=True,
            score_mod=lambda s, b, h, i, j: r(a(s, b, h, i, j), b, h, i, j),
        )
        return (out * d_out).sum()

    args = (q, k, v, bias, f32(slopes), f32(table), f32(sinks))
    chunked = functools.partial(
        js.dot_product_attention, implementation=js.Chunked(block_q, block_kv)
    )
    got = jax.jit(jax.grad(functools.partial(loss, chunked), argnums=tuple(range(7))))(*args)
    want = jax.jit(
        jax.grad(
            functools.partial(
                loss, functools.partial(js.dot_product_attention, implementation="xla")
            ),
            argnums=tuple(range(7)),
        )
    )(*args)
    for name, a, b in zip(
        ("q", "k", "v", "bias", "slopes", "table", "sinks"), got, want, strict=True
    ):
        assert ref.rel_err(a, b) <= 2e-5, name


@each_implementation()
def test_built_in_rules_as_mask_mod_equal_the_keywords(rng, impl):
    q, k, v = qkv(rng, 2, 6, 8, 2, 1, 4)
    lengths = jnp.array([8, 5], jnp.int32)
    rule = js.CausalMask(2) & js.LocalWindowMask(3, 0, 2) & js.LengthMask(None, lengths)
    got = impl(q, k, v, mask_mod=rule)
    want = impl(
        q,
        k,
        v,
        is_causal=True,
        causal_alignment="bottom_right",
        local_window_size=(3, 0),
        key_value_seq_lengths=lengths,
    )
    np.testing.assert_array_equal(got, want)


@each_implementation()
def test_a_mod_that_writes_minus_infinity_on_masked_entries_leaks_no_nan(rng, impl):
    # FlexAttention's footgun (pytorch#150321): −∞ from the score_mod masks the entry exactly.
    q, k, v = qkv(rng, 1, 6, 6, 2, 2, 4)
    causal_by_hand = lambda s, b, h, i, j: jnp.where(j <= i, s, -jnp.inf)  # noqa: E731
    f = lambda q: impl(q, k, v, score_mod=causal_by_hand)  # noqa: E731
    np.testing.assert_allclose(f(q), js.dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    g = jax.jit(jax.grad(lambda q: f(q).sum()))(q)
    want = jax.jit(jax.grad(lambda q: js.dot_product_attention(q, k, v, is_causal=True).sum()))(q)
    np.testing.assert_allclose(g, want, atol=1e-5)


@each_implementation()
def test_mods_under_jit_vmap_and_checkpoint(rng, impl):
    q, k, v = qkv(rng, 2, 5, 5, 2, 2, 4)
    slopes = jnp.asarray(rng.uniform(size=(3, 2)), jnp.float32)  # three models' slopes

    def f(slopes, q):
        return impl(q, k, v, score_mod=alibi(slopes), is_causal=True)

    batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(slopes, q)
    for n in range(3):
        np.testing.assert_allclose(batched[n], f(slopes[n], q), atol=1e-6)
    g = jax.jit(jax.grad(lambda s: jax.checkpoint(f)(s, q).sum()))(slopes[0])
    np.testing.assert_allclose(g, jax.jit(jax.grad(lambda s: f(s, q).sum()))(slopes[0]), atol=1e-6)
    assert float(np.abs(g).max()) > 0


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (
            dict(score_mod=3),
            TypeError,
            "`score_mod` must be a function score_mod(score, batch, head, q_idx, kv_idx) -> score; got int.",
        ),
        (dict(score_mod=lambda s, b, h: s), TypeError, "`score_mod` must accept 5 scalars"),
        (
            dict(score_mod=lambda s, b, h, i, j: i),
            TypeError,
            "`score_mod` must return one float scalar; got int32[].",
        ),
        (
            dict(score_mod=lambda s, b, h, i, j: jnp.ones(2, jnp.float32)),
            TypeError,
            "`score_mod` must return one float scalar; got float32[2].",
        ),
        (
            dict(mask_mod=lambda b, h, i, j: i.astype(jnp.float32)),
            TypeError,
            "`mask_mod` must return one bool scalar; got",
        ),
        (
            dict(mask_mod="causal"),
            TypeError,
            "`mask_mod` must be a function mask_mod(batch, head, q_idx, kv_idx) -> bool; got str.",
        ),
        (
            dict(sinks=jnp.zeros(3)),
            ValueError,
            "`sinks` must have shape (heads,) = (4,); got (3,).",
        ),
        (
            dict(sinks=jnp.zeros(4, jnp.int32)),
            TypeError,
            "`sinks` must have a floating-point dtype; got int32.",
        ),
        (
            dict(score_mod=lambda s, b, h, i, j: s, implementation="cudnn"),
            ValueError,
            "`implementation='cudnn'` needs a CUDA GPU",
        ),
    ],
)
def test_mod_errors(kwargs, error, message):
    q, kv = jnp.ones((2, 5, 4, 8)), jnp.ones((2, 7, 2, 8))
    with pytest.raises(error, match="^" + re.escape(message)):
        js.dot_product_attention(q, kv, kv, **kwargs)


def test_cudnn_refuses_mods(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match="got segment ids or mask_mod, score_mod, sinks"):
        js.dot_product_attention(
            q,
            q,
            q,
            implementation="cudnn",
            score_mod=lambda s, b, h, i, j: s,
            mask_mod=lambda b, h, i, j: i >= j,
            sinks=jnp.zeros(2),
        )


def test_flax_attention_fn_with_a_score_mod_and_a_mask_mod(rng):
    # functools.partial(dot_product_attention, score_mod=...) as a linen attention_fn equals
    # flax's own attention with the same ALiBi given as a bias and the mask as a mask.
    from flax import linen

    x = jnp.asarray(rng.normal(size=(2, 6, 16)), jnp.float32)
    slopes = js.mods.alibi_slopes(4)
    i, j = jnp.arange(6)[:, None], jnp.arange(6)[None, :]
    alibi_bias = slopes[:, None, None] * (j - i).astype(jnp.float32)[None]  # (heads, T, S)

    def layer(fn):
        return linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, attention_fn=fn)

    ours = layer(
        functools.partial(
            js.dot_product_attention,
            score_mod=js.mods.alibi(slopes),
            mask_mod=js.mods.chunked_causal(3),
        )
    )
    theirs = layer(
        lambda q, k, v, **kw: linen.dot_product_attention(
            q, k, v, bias=alibi_bias[None], mask=((i // 3 == j // 3) & (j <= i))[None, None]
        )
    )
    params = theirs.init(jax.random.key(0), x)
    np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x), atol=1e-5)


def test_chunked_skips_the_tiles_a_mask_mod_excludes(rng):
    # NaN in a key block is invisible only if the block is never computed (a masked but
    # computed block would multiply its NaN values by zero weights): as for is_causal.
    q, k, v = qkv(rng, 1, 8, 8, 2, 1, 4)
    v = v.at[:, 4:].set(jnp.nan)
    chunked = {"implementation": js.Chunked(4, 4)}
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    out = js.dot_product_attention(q, k, v, mask_mod=causal, **chunked)
    assert np.isfinite(np.asarray(out)[:, :4]).all()
    # Each head its own pattern: a tile is skipped only where every head excludes it.
    by_head = lambda b, h, i, j: (j <= i) & ((h == 0) | (j < 4))  # noqa: E731
    out = js.dot_product_attention(q, k, v, mask_mod=by_head, **chunked)
    assert np.isfinite(np.asarray(out)[:, :4]).all() and np.isnan(np.asarray(out)[:, 4:, 0]).all()
    g = jax.jit(
        jax.grad(
            lambda q: js.dot_product_attention(q, k, v, mask_mod=causal, **chunked)[:, :4].sum()
        )
    )(q)
    assert np.isfinite(np.asarray(g)[:, :4]).all()  # the backward skips the tile too
    # The same with finite values equals the dense path.
    v = v.at[:, 4:].set(1.0)
    np.testing.assert_allclose(
        js.dot_product_attention(q, k, v, mask_mod=by_head, **chunked),
        js.dot_product_attention(q, k, v, mask_mod=by_head, implementation="xla"),
        atol=1e-6,
    )


@each_implementation("bias")
def test_a_minus_infinity_bias_still_masks_under_a_score_mod(rng, impl):
    # The mod sees 0 where the bias is −∞ (no NaN in the gradient of what it closes over), and
    # the entry stays masked whatever the mod returns there.
    q, k, v = qkv(rng, 1, 5, 6, 2, 2, 4)
    bias = jnp.zeros((1, 2, 5, 6), jnp.float32).at[:, :, :, 2].set(-jnp.inf)
    t = jnp.array([2.0, 0.5], jnp.float32)

    def f(t):
        mod = lambda s, b, h, i, j: s * t[h]  # noqa: E731
        return impl(q, k, v, bias, score_mod=mod)

    expected = ref.attention(
        q, k, v, np.asarray(bias), score_mod=lambda s, b, h, i, j: s * np.asarray(t)[h]
    )
    np.testing.assert_allclose(f(t), expected["out"], atol=2e-6)
    assert np.isfinite(np.asarray(jax.jit(jax.grad(lambda t: f(t).sum()))(t))).all()
    capped = impl(q, k, v, bias, score_mod=js.mods.soft_cap(1.0))
    np.testing.assert_allclose(capped, impl(q, k, v, bias, logits_soft_cap=1.0), atol=1e-6)


def test_a_mod_reading_a_value_that_changed_is_traced_again(rng):
    q, k, v = qkv(rng, 1, 4, 4, 2, 2, 4)
    weight = {"w": 1.0}
    mod = lambda s, b, h, i, j: s * weight["w"]  # noqa: E731
    first = js.dot_product_attention(q, k, v, score_mod=mod)
    weight["w"] = 3.0
    np.testing.assert_allclose(
        js.dot_product_attention(q, k, v, score_mod=mod),
        js.dot_product_attention(q, k, v, scale=3.0 / 2.0),
        atol=1e-6,
    )
    assert float(np.abs(first - js.dot_product_attention(q, k, v, score_mod=mod)).max()) > 1e-3


@each_implementation()
def test_minus_infinity_sinks_are_no_sinks(rng, impl):
    q, k, v = qkv(rng, 1, 4, 5, 2, 2, 4)
    nothing = lambda b, h, i, j: (i != 1) & (j >= 0)  # noqa: E731
    sinks = jnp.full((2,), -jnp.inf)

    def f(sinks):
        return impl(q, k, v, mask_mod=nothing, sinks=sinks)

    np.testing.assert_allclose(f(sinks), impl(q, k, v, mask_mod=nothing), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(lambda s: f(s).sum()))(sinks)), 0)


def test_built_in_rules_without_batch_axes_are_shared():
    q = jnp.ones((2, 5, 2, 4))
    shared = js.dot_product_attention(q, q, q, mask_mod=js.LengthMask(None, jnp.array(3)))
    lengths = jnp.array([3, 3], jnp.int32)
    np.testing.assert_array_equal(
        shared, js.dot_product_attention(q, q, q, key_value_seq_lengths=lengths)
    )


@pytest.mark.parametrize("batch", [4, 3])
def test_a_rule_shared_by_the_batch_is_so_whatever_the_batch_size(rng, batch):
    # Segment ids of shape (T,) are shared by the batch, also when T happens to equal B; ids
    # with the batch axis first are per sequence. Nothing is guessed from sizes.
    q = jnp.asarray(rng.normal(size=(batch, 4, 2, 8)), jnp.float32)
    ids = jnp.array([0, 0, 1, 1], jnp.int32)
    for implementation in ("xla", js.Chunked(block_q=3)):
        impl = functools.partial(js.dot_product_attention, implementation=implementation)
        shared = impl(q, q, q, mask_mod=js.SegmentMask(ids, ids))
        keyword = impl(q, q, q, query_segment_ids=jnp.broadcast_to(ids, (batch, 4)))
        np.testing.assert_array_equal(shared, keyword)
    own = jnp.asarray(rng.integers(0, 2, size=(batch, 4)), jnp.int32)
    np.testing.assert_array_equal(
        js.dot_product_attention(q, q, q, mask_mod=js.SegmentMask(own, own)),
        js.dot_product_attention(q, q, q, query_segment_ids=own),
    )
    message = (
        "`mask_mod`'s SegmentMask.q_segment_ids must have shape (q_seq,) = (4,), shared by the "
        f"batch, or (batch, q_seq) = ({batch}, 4); got (2, 4)."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        wrong = jnp.zeros((2, 4), jnp.int32)
        js.dot_product_attention(q, q, q, mask_mod=js.SegmentMask(wrong, wrong))


@pytest.mark.parametrize("implementation", ["xla", "chunked", "decode", "paged"])
def test_with_no_keys_the_log_sum_exp_is_the_sink_and_it_has_its_gradient(implementation):
    # S = 0 (no pages at all, for the paged cache): each row's only logit is its head's sink.
    q = jnp.ones((1, 2, 2, 4), jnp.float32)
    sinks = jnp.array([0.5, -1.0], jnp.float32)

    def lse(sinks):
        if implementation == "paged":
            pages = jnp.ones((4, 2, 2, 4), jnp.float32)
            table, lengths = jnp.zeros((1, 0), jnp.int32), jnp.array([0], jnp.int32)
            call = js.paged_attention(
                q, pages, pages, table, lengths, sinks=sinks, return_residual=True
            )
        else:
            empty = jnp.ones((1, 0, 2, 4), jnp.float32)
            call = js.dot_product_attention(
                q, empty, empty, sinks=sinks, return_residual=True, implementation=implementation
            )
        np.testing.assert_array_equal(call[0], 0)
        return call[1]

    np.testing.assert_array_equal(lse(sinks), jnp.broadcast_to(sinks, (1, 2, 2)))
    np.testing.assert_array_equal(jax.grad(lambda s: lse(s).sum())(sinks), [2.0, 2.0])


@pytest.mark.parametrize("implementation", ["chunked", "decode"])
def test_a_table_no_derivative_asks_for_has_no_gradient_accumulated(rng, implementation):
    # The paths with their own backward (a jax.custom_vjp) compute a closed-over array's
    # gradient only where a derivative asks for it (as FlexAttention's requires_grad); the
    # queries' gradient is the same either way.
    (q, _, _), *_ = setup(rng)
    table = jnp.linspace(-1.0, 1.0, 5 * 300, dtype=jnp.float32).reshape(5, 300)

    def loss(implementation, q, table):
        def relative(s, b, h, i, j):
            return s + table[h % 5, i - j + 150]

        out = js.dot_product_attention(q, q, q, score_mod=relative, implementation=implementation)
        return (out * jnp.cos(out)).sum()

    for argnums in ((0,), (0, 1)):
        program = jax.grad(functools.partial(loss, implementation), argnums=argnums)
        text = str(jax.make_jaxpr(program)(q, table))
        sums = re.findall(r"f32\[[\d,]*5,300\] = (?:add|add_any|scatter-add|reduce_sum)\b", text)
        assert bool(sums) == (1 in argnums)  # (the table's gradient summed, or not at all)
        want = jax.grad(functools.partial(loss, "xla"), argnums=argnums)(q, table)
        for g, w in zip(program(q, table), want, strict=True):
            assert ref.rel_err(g, w) < 1e-5
