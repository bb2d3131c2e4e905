"""The fused kernel (``implementation="pallas"``): what this CPU machine can prove about it.

- In the Pallas interpreter, the kernel's forward pass and gradients (queries, keys, values,
  a ``score_mod``'s captured arrays, sinks) against the float64 reference: here, on the
  behaviour tests' rows (``tests/implementations.py``) and in the random sweep
  (``tests/sweep.py``).
- In the TPU simulator (``pltpu.InterpretParams``), which raises on the out-of-bounds and
  uninitialised reads the interpreter clamps: a few tiny cases.
- Lowering for ``cuda`` (Triton) and ``tpu`` (Mosaic), with every kernel module inside parsed,
  verified and (Triton's) compiled for sm_90: ``tests/test_lowering.py``. That it compiles is
  not that it runs on a device (``benchmarks/bench_device.py --smoke`` checks that on a GPU).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import jax_sdpa as js
from tests import reference as ref
from tests.util import enable_x64, qkv

INTERPRET = js.Pallas(block_q=16, block_kv=16, interpret=True)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(block_q=48), ValueError, "`Pallas.block_q` must be a power of two ≥ 16"),
        (dict(block_kv=8), ValueError, "`Pallas.block_kv` must be a power of two ≥ 16"),
        (dict(num_warps=3), ValueError, "`Pallas.num_warps` must be a power of two ≥ 1"),
        (dict(num_stages=0), ValueError, "`Pallas.num_stages` must be a positive int"),
        (dict(block_q=64.0), TypeError, "`Pallas.block_q` must be a positive int; got 64.0"),
        (dict(interpret="yes"), TypeError, "`Pallas.interpret` must be a bool, a pltpu"),
        (dict(backend="cuda"), ValueError, "`Pallas.backend` must be one of"),
    ],
)
def test_tunables_the_backends_cannot_take_are_refused_when_made(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        js.Pallas(**options)


def test_the_mosaic_gpu_kernel_says_which_jax_it_needs():
    if jax.__version_info__ >= (0, 11):
        assert js.Pallas(backend="mosaic_gpu").backend == "mosaic_gpu"
    else:
        with pytest.raises(ValueError, match=re.escape("needs JAX 0.11 or later")):
            js.Pallas(backend="mosaic_gpu")


def test_what_the_kernel_does_not_take_is_refused_and_none_falls_back():
    x = jnp.ones((1, 2, 1, 16))
    keywords = dict(dropout_rate=0.5, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="`implementation='pallas'` takes no dropout_rate"):
        js.dot_product_attention(x, x, x, implementation=INTERPRET, **keywords)
    # implementation=None never picks the kernel: it takes the call, as the XLA paths do.
    chosen = js.dot_product_attention(x, x, x, **keywords)
    np.testing.assert_allclose(
        chosen, js.dot_product_attention(x, x, x, implementation="xla", **keywords)
    )


@pytest.mark.parametrize(
    "bias_shape, mask_shape",
    [
        ((2, 1, 1, 7, 19), (1, 3, 4, 1, 19)),
        ((2, 3, 4, 1, 19), (2, 3, 1, 7, 1)),  # (both batch axes full; rows masked whole)
        (None, (2, 1, 4, 7, 19)),
    ],
)
def test_bias_and_mask_arrays_over_two_batch_axes_are_read_in_the_kernel(
    rng, bias_shape, mask_shape
):
    # Each array read at its own sequence (of the batch (2, 3)), head and positions, its
    # broadcast axes left out; the user's score_mod after the bias; a −∞ bias masks (a row).
    q, k, v = qkv(rng, 6, 7, 19, 4, 2, 16)  # (the batch flattened, for the reference)
    bias = mask = None
    if bias_shape is not None:
        bias = jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
        bias = (
            bias.at[..., 2, :].set(-jnp.inf)
            if bias_shape[-2] > 1
            else bias.at[..., 3].set(-jnp.inf)
        )
    if mask_shape is not None:
        mask = jnp.asarray(rng.random(mask_shape) > 0.3)

    def mod(s, b, h, i, j):
        return s * (1 + h.astype(s.dtype) / 4) + (b - i + j).astype(s.dtype) / 8

    def split(x):
        return x.reshape((2, 3, *x.shape[1:]))

    def ours(q, k, v, bias):
        out = js.dot_product_attention(
            *map(split, (q, k, v)), bias, mask, score_mod=mod, implementation=INTERPRET
        )
        return out.reshape(q.shape)

    def full(x):
        return None if x is None else np.broadcast_to(x, (2, 3, 4, 7, 19)).reshape(6, 4, 7, 19)

    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    want = ref.attention(q, k, v, full(bias), mask=full(mask), score_mod=mod, d_out=d_out)
    out, pull = jax.vjp(ours, q, k, v, bias)
    assert ref.rel_err(out, want["out"]) < 2e-6
    assert bias_shape is None or bias_shape[-2] == 1 or np.all(np.asarray(out)[:, 2] == 0)
    grads = pull(d_out)
    for got, name in zip(grads, ("dq", "dk", "dv"), strict=False):
        assert ref.rel_err(got, want[name]) < 2e-5, name
    if bias is not None:
        summed = want["dbias"].reshape(2, 3, 4, 7, 19)
        axes = tuple(i for i, n in enumerate(bias_shape) if n == 1)
        assert ref.rel_err(grads[3], summed.sum(axes, keepdims=True)) < 2e-5


def test_the_arrays_read_by_the_kernel_leak_no_tracer(rng):
    # (the mod the call writes for them closes over none of the call's arrays)
    q, k, v = qkv(rng, 2, 5, 9, 2, 1, 16)
    bias, mask = jnp.zeros((2, 1, 5, 9)), jnp.ones((1, 1, 5, 9), bool)

    def loss(q, bias):
        return js.dot_product_attention(q, k, v, bias, mask, implementation=INTERPRET).sum()

    with jax.checking_leaks():
        jax.grad(loss, argnums=(0, 1))(q, bias)


def test_a_plain_pallas_call_on_a_cpu_runs_the_interpreter(rng):
    q, k, v = qkv(rng, 1, 5, 9, 2, 1, 16)
    out = js.dot_product_attention(q, k, v, is_causal=True, implementation="pallas")
    want = ref.attention(q, k, v, is_causal=True)
    assert ref.rel_err(out, want["out"]) < 2e-6


@pytest.mark.parametrize(
    "keywords,folded",
    [
        (dict(is_causal=True), True),
        (dict(is_causal=True, scale=2.0, sinks=jnp.ones(2)), True),
        (dict(is_causal=True, logits_soft_cap=5.0), False),
        (dict(score_mod=lambda s, b, h, i, j: s + 1), False),
        (dict(scale=-1.0), False),
    ],
)
def test_the_kernels_fold_a_plain_scale_into_base_2_exponentials(keywords, folded):
    # FlashAttention's softmax: where the logits are the products times a positive scale, the
    # forward and backward kernels take 2^(s·scale·log2 e − m·log2 e), not e^(s·scale − m).
    # (bfloat16: float32 queries take the scale, whatever its sign, before the products.)
    x = jnp.ones((1, 40, 2, 16), jnp.bfloat16)

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, implementation=INTERPRET, **keywords)
        return out.astype(jnp.float32).sum()

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x))
    # A tile's exponentials (its rows' corrections stay e^(m − m')), in the three kernels.
    tiles = re.findall(r":f32\[16,16\] = (exp2?) ", jaxpr)
    assert len(tiles) >= 3 and set(tiles) == ({"exp2"} if folded else {"exp"})


def test_captured_arrays_sinks_and_a_document_mask_get_the_reference_gradients(rng):
    # ALiBi over a captured slope array, a relative-position table read at (h, i − j), sinks and
    # a document mask over a captured array: every gradient, against dense attention in float64;
    # and the others' where no derivative asks for the slopes' and the table's (fixed).
    b, t, s, n, k, h = 2, 21, 37, 4, 2, 16
    q, key, v = qkv(rng, b, t, s, n, k, h, hv=8)
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, n), jnp.float32)
    table = jnp.asarray(rng.normal(size=(n, 2 * s)), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=n), jnp.float32)
    doc = jnp.asarray(np.repeat(np.arange(4), 10)[:s], jnp.int32)

    def loss(implementation, q, key, v, slopes, table, sinks):
        def score_mod(score, b, h, i, j):
            return score - slopes[h] * jnp.abs(i - j).astype(score.dtype) + table[h, i - j + s]

        out = js.dot_product_attention(
            q,
            key,
            v,
            is_causal=True,
            sinks=sinks,
            score_mod=score_mod,
            mask_mod=lambda b, h, i, j: doc[i] == doc[j],
            implementation=implementation,
        )
        return (out * jnp.cos(out)).sum()

    args = (q, key, v, slopes, table, sinks)
    names = ("q", "k", "v", "slopes", "table", "sinks")
    for argnums in (range(6), (0, 1, 2, 5)):
        got = jax.grad(lambda *a: loss(INTERPRET, *a), argnums=argnums)(*args)
        with enable_x64():
            wide = jax.tree.map(lambda x: x.astype(jnp.float64), args)
            want = jax.grad(lambda *a: loss("xla", *a), argnums=argnums)(*wide)
        for n, g, w in zip(argnums, got, want, strict=True):
            assert ref.rel_err(g, w) < 1e-5, names[n]


Q_DOCUMENTS = jnp.array([0] * 7 + [1] * 9 + [2] * 4, jnp.int32)
KV_DOCUMENTS = jnp.array([0] * 11 + [1] * 6 + [2] * 7, jnp.int32)


@pytest.mark.parametrize(
    "keywords",
    [
        pytest.param(dict(is_causal=True), marks=pytest.mark.slow),
        dict(sinks=jnp.array([0.5, -1.0])),
        pytest.param(
            dict(
                score_mod=lambda s, b, h, i, j: s - 0.1 * jnp.abs(i - j).astype(s.dtype),
                local_window_size=(5, 0),
            ),
            marks=pytest.mark.slow,  # the simulator takes seconds a call: CI runs these three
        ),
        pytest.param(
            # Ids read at the positions: tiles of 16 past 20 queries and 24 keys read them
            # window by window, the others as one load.
            dict(mask_mod=lambda b, h, i, j: Q_DOCUMENTS[i] == KV_DOCUMENTS[j]),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["causal", "sinks", "score_mod and window", "documents"],
)
def test_the_tpu_simulator_finds_no_out_of_bounds_or_uninitialised_read(rng, keywords):
    # The simulator fills uninitialised memory with NaN and raises on out-of-bounds reads.
    q, k, v = qkv(rng, 1, 20, 24, 2, 1, 16)
    simulated = js.Pallas(block_q=16, block_kv=16, interpret=pltpu.InterpretParams())

    def loss(implementation, q, k, v):
        out = js.dot_product_attention(q, k, v, implementation=implementation, **keywords)
        return (out**2).sum(), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(simulated, q, k, v)
    (_, want), want_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(
        "xla", q, k, v
    )
    np.testing.assert_allclose(out, want, atol=2e-6)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)


@pytest.mark.slow  # the simulator takes seconds a call
def test_a_large_table_s_gradient_in_the_tpu_simulator_starts_from_zeros(rng):
    # All programs add into one gradient (more entries than one-hot sums take): programs that
    # run one after another zero it first, as a TPU never loads the zeros it is aliased to.
    q, k, v = qkv(rng, 1, 20, 24, 2, 1, 16)
    table = jnp.asarray(rng.normal(size=(2, 300)), jnp.float32)
    simulated = js.Pallas(block_q=16, block_kv=16, interpret=pltpu.InterpretParams())

    def loss(implementation, table):
        def score_mod(score, b, h, i, j):
            return score + table[h][i]

        out = js.dot_product_attention(q, k, v, score_mod=score_mod, implementation=implementation)
        return (out**2).sum()

    got = jax.grad(loss, argnums=1)(simulated, table)
    np.testing.assert_allclose(got, jax.grad(loss, argnums=1)("xla", table), atol=2e-5)
