"""create_block_mask: its classes against the mask itself, its use as a mask_mod, skipping.

The classes are checked against the whole mask, evaluated in NumPy; a call given a BlockMask
must equal the same call given the function, on every implementation and under ``jax.grad``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from jax_sdpa import _block_mask
from tests.implementations import each_implementation
from tests.util import equations, qkv


def documents(doc):
    """Causal within each document: doc[b, i] is the document of position i in sequence b."""
    return lambda b, h, i, j: (doc[b, i] == doc[b, j]) & (j <= i)


def expected_classes(allowed, block_q, block_kv):
    """0 / 1 / 2 (empty / partial / full) of each tile of a ``(..., T, S)`` boolean mask."""
    t, s = allowed.shape[-2:]
    rows = range(0, t, block_q)
    cols = range(0, s, block_kv)
    tiles = [[allowed[..., i : i + block_q, j : j + block_kv] for j in cols] for i in rows]
    classes = [
        [
            np.where(tile.all(axis=(-2, -1)), 2, np.where(tile.any(axis=(-2, -1)), 1, 0))
            for tile in r
        ]
        for r in tiles
    ]
    return np.moveaxis(np.array(classes), (0, 1), (-2, -1))


def grid(mask_mod, batch, heads, t, s):
    """The mask of every (batch, head, q, kv), with NumPy index grids."""
    b, h, i, j = np.ix_(np.arange(batch), np.arange(heads), np.arange(t), np.arange(s))
    return np.broadcast_to(mask_mod(b, h, i, j), (batch, heads, t, s))


@pytest.mark.parametrize("block_q, block_kv", [(8, 8), (5, 7), (64, 3)])
def test_classes_are_those_of_the_mask(rng, block_q, block_kv):
    t, s = 37, 29  # blocks divide neither
    doc = np.sort(rng.integers(0, 4, size=(2, 40)), axis=1)

    def mask_mod(doc):  # head 1 also sees the first three keys
        return lambda b, h, i, j: documents(doc)(b, h, i, j) | ((h == 1) & (j < 3))

    block_mask = js.create_block_mask(
        mask_mod(jnp.asarray(doc)), 2, 3, t, s, block_q=block_q, block_kv=block_kv
    )
    want = expected_classes(grid(mask_mod(doc), 2, 3, t, s), min(block_q, t), min(block_kv, s))
    assert block_mask.classes.dtype == jnp.int8
    np.testing.assert_array_equal(block_mask.classes, want)


def test_classes_share_the_axes_the_mask_does_not_read():
    causal = js.create_block_mask(lambda b, h, i, j: j <= i, 4, 8, 64, 64, block_q=16, block_kv=16)
    assert causal.classes.shape == (4, 1, 4, 4)  # no head read: one for all
    shared = js.create_block_mask(js.CausalMask(), None, None, 64, 64, block_q=16, block_kv=16)
    np.testing.assert_array_equal(shared.classes[0], causal.classes[0])
    np.testing.assert_array_equal(
        shared.classes[0, 0], np.tril(np.ones((4, 4)), -1) * 2 + np.eye(4)
    )


@each_implementation()
def test_a_block_mask_is_its_mask_mod_forward_and_backward(rng, impl):
    q, k, v = qkv(rng, 2, 11, 13, 4, 2, 6)
    doc = jnp.asarray(np.sort(rng.integers(0, 3, size=(2, 13)), axis=1))
    mask_mod = lambda b, h, i, j: documents(doc)(b, h, i, j) | (h == 3)  # noqa: E731
    block_mask = js.create_block_mask(mask_mod, 2, 4, 11, 13, block_q=4, block_kv=2)

    def loss(mask_mod, q, k, v):
        out, lse = impl(q, k, v, mask_mod=mask_mod, is_causal=True, return_residual=True)
        return jnp.sum(out * jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    for given, want in zip(
        jax.value_and_grad(loss, argnums=(1, 2, 3))(block_mask, q, k, v),
        jax.value_and_grad(loss, argnums=(1, 2, 3))(mask_mod, q, k, v),
        strict=True,
    ):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), given, want
        )


@pytest.mark.parametrize(
    "implementation, t", [(js.Chunked(4, 4), 12), (js.Pallas(block_q=16, block_kv=16), 32)]
)
def test_a_block_mask_with_the_calls_tiles_is_read_not_classified_again(
    rng, monkeypatch, implementation, t
):
    q, k, v = qkv(rng, 2, t, t, 4, 2, 8)
    doc = jnp.asarray(np.sort(rng.integers(0, 3, size=(2, t)), axis=1))
    mask_mod = lambda b, h, i, j: documents(doc)(b, h, i, j) | ((h == 3) & (j < 2))  # noqa: E731
    block = implementation.block_q
    own, other = (
        js.create_block_mask(mask_mod, 2, 4, t, t, block_q=size, block_kv=size)
        for size in (block, block // 2)
    )
    heads = jnp.arange(4)
    for b in (0, 1):  # what is read is what classifying would give
        np.testing.assert_array_equal(
            own._classes(b, heads),
            _block_mask.classify_blocks(js.AndMask((own,)), t, t, block, block, b, heads),
        )
    classified = []
    real = _block_mask.classify_blocks
    monkeypatch.setattr(
        _block_mask, "classify_blocks", lambda *args: classified.append(1) or real(*args)
    )

    def loss(mask_mod, q, k, v, implementation=implementation):
        out = js.dot_product_attention(q, k, v, mask_mod=mask_mod, implementation=implementation)
        return jnp.sum(out * jnp.sin(out))

    want = jax.value_and_grad(loss, argnums=(1, 2, 3))(mask_mod, q, k, v, "xla")
    for block_mask, reclassified in ((own, False), (other, True)):
        classified.clear()
        given = jax.value_and_grad(loss, argnums=(1, 2, 3))(block_mask, q, k, v)
        assert bool(classified) == reclassified
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), given, want
        )


def test_a_block_mask_built_under_jit_is_reused_by_every_layer(rng):
    q, k, v = qkv(rng, 1, 64, 64, 2, 2, 8)
    doc = jnp.repeat(jnp.arange(4), 16)[None]

    @jax.jit
    def model(doc, q, k, v):
        block_mask = js.create_block_mask(documents(doc), 1, None, 64, 64, block_q=16, block_kv=16)
        for _ in range(2):  # two layers, one block mask
            q = js.dot_product_attention(q, k, v, mask_mod=block_mask, implementation="chunked")
        return q, block_mask

    out, block_mask = model(doc, q, k, v)
    assert isinstance(block_mask, js.BlockMask)
    np.testing.assert_array_equal(block_mask.classes[0, 0], np.eye(4, dtype=np.int8))
    want = q
    for _ in range(2):
        want = js.dot_product_attention(want, k, v, mask_mod=documents(doc), implementation="xla")
    np.testing.assert_allclose(out, want, atol=2e-6)


def test_building_never_holds_the_whole_mask():
    t = s = 8192
    doc = jnp.repeat(jnp.arange(16), 512)[None]
    program = jax.make_jaxpr(
        lambda doc: js.create_block_mask(documents(doc), 1, None, t, s).classes
    )(doc)

    # (of every value the program and its loops' bodies make)
    sizes = [np.prod(v.aval.shape) for eqn in equations(program.jaxpr) for v in eqn.outvars]
    assert max(sizes) <= t * s // 16


def test_a_batch_still_skips_the_tiles_its_sequences_exclude(rng):
    # NaN in a key block is invisible only if the block is never computed; under jax.vmap a
    # skipped tile would be computed and selected away, and its NaN would leak.
    q, k, v = qkv(rng, 2, 8, 8, 2, 1, 4)
    v = v.at[0, 4:].set(jnp.nan)  # sequence 0: its second key block is excluded
    v = v.at[1, :4].set(jnp.nan)  # sequence 1: its first
    excluded = lambda b, h, i, j: jnp.where(b == 0, j < 4, j >= 4)  # noqa: E731
    chunked = {"implementation": js.Chunked(4, 4)}
    for mask_mod in (
        excluded,
        js.create_block_mask(excluded, 2, None, 8, 8, block_q=4, block_kv=4),
    ):
        out = js.dot_product_attention(q, k, v, mask_mod=mask_mod, **chunked)
        assert np.isfinite(np.asarray(out)).all()
        g = jax.grad(
            lambda q, m=mask_mod: js.dot_product_attention(q, k, v, mask_mod=m, **chunked).sum()
        )
        assert np.isfinite(np.asarray(g(q))).all()


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((None, None, 0, 8), {}, ValueError, "`q_len` must be a positive int; got 0."),
        ((None, 0, 8, 8), {}, ValueError, "`heads` must be a positive int; got 0."),
        ((None, None, 8, 8), {"block_kv": 2.0}, TypeError, "`block_kv` must be a positive int"),
    ],
)
def test_create_block_mask_errors(args, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        js.create_block_mask(lambda b, h, i, j: j <= i, *args, **kwargs)


def test_a_block_mask_of_other_shapes_is_refused(rng):
    q, k, v = qkv(rng, 2, 8, 8, 4, 4, 4)
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    cases = [
        (
            js.create_block_mask(causal, None, None, 8, 16),
            "BlockMask for (q_len, kv_len) = (8, 16)",
        ),
        (js.create_block_mask(causal, 3, None, 8, 8), "BlockMask for batch 3 and 1 heads"),
        (js.create_block_mask(lambda b, h, i, j: h > 0, None, 2, 8, 8), "for batch 1 and 2 heads"),
    ]
    for block_mask, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            js.dot_product_attention(q, k, v, mask_mod=block_mask)
    with pytest.raises(TypeError, match="`mask_mod` must be a function"):
        js.create_block_mask(3, None, None, 8, 8)


def test_a_block_mask_for_any_head_or_sequence_of_a_mask_that_reads_them_is_refused():
    with pytest.raises(ValueError, match=re.escape("`heads` must be given: `mask_mod` reads")):
        js.create_block_mask(lambda b, h, i, j: (h > 0) | (j <= i), None, None, 8, 8)
    doc = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match=re.escape("`batch` must be given: `mask_mod` reads")):
        js.create_block_mask(documents(doc), None, None, 8, 8)


def test_a_block_mask_keeps_the_loop_bounds_of_the_rules_it_holds():
    # The chunked path wraps an opaque rule in a BlockMask: a causal part keeps its triangle.
    rule = js.CausalMask() & js.create_block_mask(lambda b, h, i, j: j <= i, None, None, 8, 8).rule
    block_mask = js.BlockMask(rule, jnp.ones((1, 1, 2, 2), jnp.int8), 4, 4, 8, 8)
    assert [int(x) for x in block_mask.kv_range(0, 4)] == [0, 4]
    assert [int(x) for x in block_mask.q_range(4, 8)] == [4, 2**31 - 1]
