import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js

_QKV = (jnp.ones((1, 2, 1, 4)),) * 3

Q = jnp.ones((2, 5, 4, 8), jnp.float32)
KV = jnp.ones((2, 7, 2, 8), jnp.float32)


def call(**overrides):
    args = dict(query=Q, key=KV, value=KV)
    args.update(overrides)
    return js.dot_product_attention(**args)


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        (
            dict(query=jnp.ones((5, 8), jnp.float32)),
            ValueError,
            "`query` must have rank 4 (batch, q_seq, heads, d_k) or rank 3 without batch; got shape (5, 8).",
        ),
        (
            dict(
                key=jnp.ones((2, 7, 2, 6), jnp.float32), value=jnp.ones((2, 7, 2, 6), jnp.float32)
            ),
            ValueError,
            "`query` and `key` must have the same feature size d_k; got 8 and 6.",
        ),
        (
            dict(query=jnp.ones((2, 5, 3, 8), jnp.float32)),
            ValueError,
            "The number of query heads must be a multiple of the key/value heads; got 3 query heads and 2 ",
        ),
        (
            dict(value=jnp.ones((2, 6, 2, 8), jnp.float32)),
            ValueError,
            "`key` and `value` must have the same length kv_seq; got 7 and 6.",
        ),
        (
            dict(value=jnp.ones((2, 7, 1, 8), jnp.float32)),
            ValueError,
            "`key` and `value` must have the same number of heads kv_heads; got 2 and 1.",
        ),
        (
            dict(
                key=jnp.ones((3, 7, 2, 8), jnp.float32), value=jnp.ones((3, 7, 2, 8), jnp.float32)
            ),
            ValueError,
            "`query` and `key` must have the same batch shape; got (2,) and (3,).",
        ),
        (
            dict(query=jnp.ones((2, 5, 4, 8), jnp.int32)),
            TypeError,
            "`query` must have a floating-point dtype; got int32.",
        ),
        (  # (jax.nn takes complex64 with a warning and drops the imaginary part)
            dict(query=jnp.ones((2, 5, 4, 8), jnp.complex64)),
            TypeError,
            "`query` must have a floating-point dtype; got complex64.",
        ),
        (
            dict(value=jnp.ones((2, 7, 2, 8), jnp.bfloat16)),
            TypeError,
            "`query`, `key`, `value` must have the same dtype (cast them, or pass `dtype=`); got "
            "`query` float32, `key` float32, `value` bfloat16.",
        ),
        (
            dict(mask=jnp.ones((2, 4, 5, 6), bool)),
            ValueError,
            "`mask` must broadcast to (batch, heads, q_seq, kv_seq) = (2, 4, 5, 7); got (2, 4, 5, 6).",
        ),
        (
            dict(mask=jnp.ones((3, 1, 5, 7), bool)),
            ValueError,
            "`mask` must broadcast to (batch, heads, q_seq, kv_seq) = (2, 4, 5, 7); got (3, 1, 5, 7).",
        ),
        (
            dict(bias=jnp.ones((2, 2, 5, 7), jnp.float32)),
            ValueError,
            "`bias` must broadcast to (batch, heads, q_seq, kv_seq) = (2, 4, 5, 7); got (2, 2, 5, 7).",
        ),
        (
            dict(bias=jnp.ones((5, 7), jnp.int32)),
            TypeError,
            "`bias` must have a floating-point dtype; got int32.",
        ),
        (
            dict(query_seq_lengths=jnp.ones((3,), jnp.int32)),
            ValueError,
            "`query_seq_lengths` must have shape (batch) = (2,); got (3,).",
        ),
        (
            dict(key_value_seq_lengths=jnp.ones((2,), jnp.float32)),
            TypeError,
            "`key_value_seq_lengths` must have an integer dtype; got float32.",
        ),
        (
            dict(
                query_segment_ids=jnp.ones((2, 4), jnp.int32),
                key_value_segment_ids=jnp.ones((2, 7), jnp.int32),
            ),
            ValueError,
            "`query_segment_ids` must have shape (batch, seq) = (2, 5); got (2, 4).",
        ),
        (
            dict(query_segment_ids=jnp.ones((2, 5), jnp.int32)),
            ValueError,
            "`query_segment_ids` and `key_value_segment_ids` must both be given when q_seq != kv_seq; "
            "got q_seq 5 and kv_seq 7.",
        ),
        (
            dict(local_window_size=-1),
            ValueError,
            "`local_window_size` must be a non-negative int or a pair (left, right) of them; got -1.",
        ),
        (
            dict(local_window_size=(2, -3)),
            ValueError,
            "`local_window_size` must be a non-negative int or a pair (left, right) of them; got (2, -3).",
        ),
        (
            dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)),
            ValueError,
            "`dropout_rate` must be in [0.0, 1.0); got 1.0.",
        ),
        (dict(dropout_rate=-0.1), ValueError, "`dropout_rate` must be in [0.0, 1.0); got -0.1."),
        (dict(dropout_rate="0.1"), TypeError, "`dropout_rate` must be a Python number; got str."),
        (
            dict(dropout_rate=0.1),
            ValueError,
            "`dropout_rng` must be a PRNG key when `dropout_rate` > 0 and `deterministic` is False; got "
            "None (dropout_rate=0.1).",
        ),
        (
            dict(implementation="flash"),
            ValueError,
            "`implementation` must be one of None, 'xla', 'chunked', 'decode', 'selected', 'cudnn', "
            "'pallas', Chunked(...), Decode(...), Selected(...), Pallas(...); got 'flash'.",
        ),
        (
            dict(implementation="cudnn"),
            ValueError,
            "`implementation='cudnn'` needs a CUDA GPU with cuDNN; JAX's backend is 'cpu'.",
        ),
        (
            dict(causal_alignment="bottom"),
            ValueError,
            "`causal_alignment` must be one of 'top_left', 'bottom_right'; got 'bottom'.",
        ),
        (dict(logits_soft_cap=0.0), ValueError, "`logits_soft_cap` must be positive; got 0.0."),
        (dict(scale="big"), TypeError, "`scale` must be a Python float; got str."),
        (
            dict(qk_attn_weights_einsum=jnp.einsum),
            ValueError,
            "`qk_attn_weights_einsum` must be None: jax_sdpa computes its own products; got ",
        ),
    ],
)
def test_dot_product_attention_errors(overrides, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        call(**overrides)


def test_traced_scale_is_rejected_with_a_clear_message():
    with pytest.raises(
        TypeError, match=re.escape("`scale` must be a Python float (a static value)")
    ):
        jax.jit(lambda s: call(scale=s))(0.5)


def test_errors_are_raised_at_trace_time():
    with pytest.raises(ValueError, match="must broadcast"):
        jax.jit(lambda q: call(query=q, mask=jnp.ones((2, 4, 5, 6), bool))).lower(Q)


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        (
            (
                jnp.ones((2, 5, 8), jnp.float32),
                jnp.ones((7, 8), jnp.float32),
                jnp.ones((7, 8), jnp.float32),
            ),
            {},
            ValueError,
            "`query` must have rank 2 (q_seq, d_k); got shape (2, 5, 8).",
        ),
        (
            (
                jnp.ones((5, 8), jnp.float32),
                jnp.ones((7, 6), jnp.float32),
                jnp.ones((7, 8), jnp.float32),
            ),
            {},
            ValueError,
            "`query` and `key` must have the same feature size d_k; got 8 and 6.",
        ),
        (
            (
                jnp.ones((5, 8), jnp.float32),
                jnp.ones((7, 8), jnp.float32),
                jnp.ones((6, 8), jnp.float32),
            ),
            {},
            ValueError,
            "`key` and `value` must have the same length kv_seq; got 7 and 6.",
        ),
        (
            (
                jnp.ones((5, 8), jnp.float32),
                jnp.ones((7, 8), jnp.float32),
                jnp.ones((7, 8), jnp.float32),
            ),
            {"mask": jnp.ones((5, 6), bool)},
            ValueError,
            "`mask` must broadcast to (q_seq, kv_seq) = (5, 7); got (5, 6).",
        ),
        (
            (
                jnp.ones((5, 8), jnp.int32),
                jnp.ones((7, 8), jnp.float32),
                jnp.ones((7, 8), jnp.float32),
            ),
            {},
            TypeError,
            "`query` must have a floating-point dtype; got int32.",
        ),
    ],
)
def test_single_head_attention_errors(args, kwargs, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        js.attention(*args, **kwargs)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: js.Chunked(block_q=0),
            ValueError,
            "`Chunked.block_q` must be a positive int; got 0.",
        ),
        (
            lambda: js.Decode(block_kv=2.0),
            TypeError,
            "`Decode.block_kv` must be a positive int; got 2.0.",
        ),
        (
            lambda: js.Ring(block_kv=-1),
            ValueError,
            "`Ring.block_kv` must be a positive int; got -1.",
        ),
        (
            lambda: js.dot_product_attention(*_QKV, implementation=js.Ring()),
            TypeError,
            "`implementation` must be one of None, 'xla', 'chunked', 'decode', 'selected', 'cudnn', "
            "'pallas', Chunked(...), Decode(...), Selected(...), Pallas(...); got Ring(block_q=512, block_kv=512, "
            "kernel=None).",
        ),
        (
            lambda: js.paged_attention(
                *_QKV, jnp.zeros((1, 1), jnp.int32), jnp.array([1]), implementation="paged"
            ),
            ValueError,
            "`implementation` must be one of None, Paged(...); got 'paged'.",
        ),
    ],
)
def test_implementation_options_are_checked_when_made_and_when_passed(make, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        make()


def test_the_options_run_what_they_configure(rng):
    # Equal objects are one configuration (hashable, a jit cache key), and the tiles they set
    # reach the call: a tile of one key block cannot skip what a tile of four can.
    assert js.Chunked(3, 4) == js.Chunked(block_q=3, block_kv=4)
    assert hash(js.Chunked(3, 4)) == hash(js.Chunked(3, 4))
    q, k, v = (jnp.asarray(rng.normal(size=(1, 8, 1, 4)), jnp.float32) for _ in range(3))
    v = v.at[:, 4:].set(jnp.nan)  # finite where the keys past 4 are never computed
    small = js.dot_product_attention(q, k, v, is_causal=True, implementation=js.Chunked(4, 4))
    large = js.dot_product_attention(q, k, v, is_causal=True, implementation=js.Chunked(8, 8))
    assert np.isfinite(np.asarray(small)[:, :4]).all()
    assert np.isnan(np.asarray(large)[:, :4]).any()
