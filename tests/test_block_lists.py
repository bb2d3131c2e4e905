"""Block lists (``BlockMask.from_kv_blocks``): each query block attends the key blocks it lists.

The oracle is the dense mask the lists stand for, given to the float64 reference; the chunked
path with the lists' tiles loops over each list, the dense path evaluates the rule.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from tests import reference as ref
from tests.util import qkv

BLOCK = 8
CHUNKED = js.Chunked(block_q=BLOCK, block_kv=BLOCK)


def dense(counts, lists, q_len, kv_len):
    """``(B or 1, H or 1, q_len, kv_len)``: True inside the listed blocks."""
    counts, lists = np.asarray(counts), np.asarray(lists)
    mask = np.zeros((*counts.shape[:2], q_len, kv_len), bool)
    for b, h, i in np.ndindex(counts.shape):
        for j in lists[b, h, i, : counts[b, h, i]]:
            if 0 <= j < -(-kv_len // BLOCK):
                mask[b, h, i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = True
    return mask


def random_lists(rng, batch, heads, q_blocks, kv_blocks, listed=3):
    lists = rng.integers(0, kv_blocks, size=(batch, heads, q_blocks, listed))
    lists[..., 1] = lists[..., 0]  # a repeat
    counts = rng.integers(0, listed + 1, size=(batch, heads, q_blocks))
    counts[0, :, 0] = 0  # a query block that lists nothing, for every head: zeros
    return jnp.asarray(counts, jnp.int32), jnp.asarray(lists, jnp.int32)


@pytest.mark.parametrize(
    "implementation, heads, causal", [(CHUNKED, 4, True), (CHUNKED, 1, False), ("xla", 4, True)]
)
def test_block_lists_equal_the_reference_with_their_dense_mask(rng, implementation, heads, causal):
    q, key, v = qkv(rng, 2, 40, 44, 4, 2, 8)  # 5 query blocks, 6 key blocks (the last partial)
    counts, lists = random_lists(rng, 2, heads, 5, 6)
    mask_mod = (lambda b, h, i, j: i >= j) if causal else None
    block_mask = js.BlockMask.from_kv_blocks(
        counts, lists, q_len=40, kv_len=44, block_q=BLOCK, block_kv=BLOCK, mask_mod=mask_mod
    )
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(q, key, v):
        out = js.dot_product_attention(
            q, key, v, mask_mod=block_mask, implementation=implementation
        )
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, key, v)
    want = ref.attention(
        q, key, v, mask=dense(counts, lists, 40, 44), is_causal=causal, d_out=d_out
    )
    assert ref.rel_err(out, want["out"]) < 2e-6
    np.testing.assert_array_equal(np.asarray(out)[0, :BLOCK], 0.0)  # block 0 of sequence 0
    for got, name in zip(grads, ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(got, want[name]) < 1e-5


def test_a_create_block_mask_converts_to_lists_and_back(rng):
    q, key, v = qkv(rng, 1, 32, 32, 2, 1, 8)
    window = js.create_block_mask(
        lambda b, h, i, j: abs(i - j) <= 5, None, None, 32, 32, block_q=BLOCK, block_kv=BLOCK
    )
    counts, lists = window.to_kv_blocks()
    np.testing.assert_array_equal(counts[0, 0], [2, 3, 3, 2])
    again = js.BlockMask.from_kv_blocks(
        counts, lists, q_len=32, kv_len=32, block_q=BLOCK, block_kv=BLOCK, mask_mod=window.rule
    )
    outs = [
        js.dot_product_attention(q, key, v, mask_mod=m, implementation=CHUNKED)
        for m in (window, again)
    ]
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)
    assert ref.rel_err(outs[1], ref.attention(q, key, v, window=(5, 5))["out"]) < 2e-6


def test_stray_block_numbers_are_refused_or_under_jit_list_nothing(rng):
    counts, lists = jnp.array([[[2, 1]]]), jnp.array([[[[0, 4], [1, 1]]]])
    with pytest.raises(ValueError, match=r"`kv_indices` must hold key blocks in \[0, 2\)"):
        js.BlockMask.from_kv_blocks(
            counts, lists, q_len=16, kv_len=16, block_q=BLOCK, block_kv=BLOCK
        )
    build = jax.jit(
        lambda c, x: js.BlockMask.from_kv_blocks(
            c, x, q_len=16, kv_len=16, block_q=BLOCK, block_kv=BLOCK
        )
    )
    np.testing.assert_array_equal(build(counts, lists).classes[0, 0], [[2, 0], [0, 2]])


@pytest.mark.parametrize(
    "counts, lists, message",
    [
        (
            jnp.zeros((1, 1, 3), jnp.int32),
            jnp.zeros((1, 1, 3, 2), jnp.int32),
            r"`kv_indices` must have shape",
        ),
        (
            jnp.zeros((1, 1, 1), jnp.int32),
            jnp.zeros((1, 1, 2, 2), jnp.int32),
            r"`kv_num_blocks` must have shape",
        ),
        (
            jnp.zeros((1, 1, 2)),
            jnp.zeros((1, 1, 2, 2), jnp.int32),
            "`kv_num_blocks` must have an integer dtype",
        ),
        (
            jnp.array([[[0, 3]]]),
            jnp.zeros((1, 1, 2, 2), jnp.int32),
            r"`kv_num_blocks` must count in \[0, 2\] .*got 0 to 3",
        ),
    ],
)
def test_block_list_errors(counts, lists, message):
    with pytest.raises((ValueError, TypeError), match=message):
        js.BlockMask.from_kv_blocks(
            counts, lists, q_len=16, kv_len=16, block_q=BLOCK, block_kv=BLOCK
        )


@pytest.mark.parametrize(
    "implementation, t", [(js.Decode(block_kv=BLOCK), 2), (CHUNKED, 16)], ids=["decode", "chunked"]
)
def test_the_loops_read_only_the_listed_blocks(rng, implementation, t):
    # Keys and values are NaN in every block no query block lists: one read of them (even a
    # masked product, 0 · NaN) would make the result NaN.
    q, key, v = qkv(rng, 2, t, 64, 4, 2, 8)  # 8 key blocks
    lists = jnp.array([[2, 5], [0, 7]], jnp.int32)  # per sequence, shared by its query blocks
    q_blocks = -(-t // BLOCK)
    lists = jnp.broadcast_to(lists[:, None, None], (2, 1, q_blocks, 2))
    counts = jnp.full((2, 1, q_blocks), 2, jnp.int32)
    block_mask = js.BlockMask.from_kv_blocks(
        counts, lists, q_len=t, kv_len=64, block_q=BLOCK, block_kv=BLOCK
    )
    allowed = dense(counts, lists, t, 64)
    poisoned = jnp.asarray(np.where(allowed.any(axis=(1, 2))[:, :, None, None], 0.0, np.nan))
    key, v = key + poisoned.astype(key.dtype), v + poisoned.astype(v.dtype)
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(q, key, v):
        out = js.dot_product_attention(
            q, key, v, mask_mod=block_mask, implementation=implementation
        )
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, key, v)
    clean = [jnp.nan_to_num(x, nan=0.0) for x in (key, v)]
    want = ref.attention(q, *clean, mask=allowed, d_out=d_out)
    assert ref.rel_err(out, want["out"]) < 2e-6
    assert ref.rel_err(grads[0], want["dq"]) < 1e-5
    for got, name in zip(grads[1:], ("dk", "dv"), strict=True):  # 0 on the blocks not read
        assert ref.rel_err(got, want[name]) < 1e-5
