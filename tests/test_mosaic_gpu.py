"""The Mosaic GPU kernel (``Pallas(backend="mosaic_gpu")``, Hopper): what a CPU can prove of it.

- Its forward and backward kernels on the GPU simulator (``plgpu.InterpretGPUParams``: shared
  memory, the three warpgroups, TMA copies and barriers simulated) against the float64
  reference, in bfloat16 (and float16): causal and not, GQA, windows, sinks, a ``score_mod``,
  sigmoid, a log-sum-exp, the largest scores, values wider than keys, rows with no key (0, with
  0 gradients), key and query lengths, lengths no tile divides, heads that are not a power of
  two, a block mask (only its listed blocks visited); arrays read along positions and at tiles
  of points; the gradient of a ``score_mod``'s array read at one index (summed in the keys'
  kernel's registers), at a tile of points or along an axis (added into memory there), under
  ``vmap`` too. Decoding: query heads packed, keys split,
  sinks met once; paged caches and 8-bit caches (int8, float8) read as they are, with the
  gradients of the queries and the scales.
- Lowering for ``cuda`` on this CPU (Mosaic GPU's layout inference and its shared-memory check
  run then) of the forward and both backward kernels, for 64, 128 and 256 wide heads: each
  kernel module is then parsed and verified with Mosaic GPU's dialect. Compiling
  it to a cubin is XLA's (C++ passes a CPU jaxlib does not carry), so "lowers and verifies" is
  all this says; a device runs it (``benchmarks/bench_device.py``).

JAX 0.11 and later (the kernel's Warpgroup semantics): skipped before.
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from jax_sdpa import mods
from jax_sdpa._jax_compat import MOSAIC_GPU_KERNEL
from tests import reference as ref
from tests.util import abstract_mesh, enable_x64, paged_pool, qkv, run_pytest

# x64 off in the x64 pass too: x64 on is test_the_kernels_run_with_x64_on's subject.
pytestmark = [
    pytest.mark.skipif(not MOSAIC_GPU_KERNEL, reason="Mosaic GPU kernel: JAX ≥ 0.11"),
    pytest.mark.x64_sampled,
]
# The backward kernels on the simulator, and the forward's rarer cases: outside the inner loop
# (`-m "not slow"`, CI's newest-JAX pass), for JAX's GPU simulator hangs now and then on 2 cores,
# warpgroups blocked at barriers inside XLA:CPU's threads (tests/conftest.py's settings made it
# rarer, not gone; each simulated call is a chance of it); run them with
# `python -m pytest tests/test_mosaic_gpu.py` under JAX 0.11 or later.
SIMULATED_SLOW = pytest.mark.slow


def _simulated():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return js.Pallas(interpret=plgpu.InterpretGPUParams())


def _slope(score, b, h, i, j):
    """ALiBi with a slope per head, written once for the kernel and the reference."""
    return score - 0.1 * (h + 1).astype(score.dtype) * (i - j).astype(score.dtype)


CASES = {
    "causal": (dict(is_causal=True), dict(is_causal=True)),
    "no mask": ({}, {}),
    "window": (
        dict(is_causal=True, local_window_size=(40, 0)),
        dict(is_causal=True, window=(40, 0)),
    ),
    "soft cap": (dict(is_causal=True, logits_soft_cap=5.0), dict(is_causal=True, soft_cap=5.0)),
    "score_mod": (dict(score_mod=lambda *a: _slope(*a)), dict(score_mod=lambda *a: _slope(*a))),
    "sinks": (
        dict(is_causal=True, sinks=jnp.array([0.5, -1.0, 2.0, 0.0])),
        dict(is_causal=True, sinks=np.array([0.5, -1.0, 2.0, 0.0])),
    ),
}


# (The inner loop simulates each mod at the size no tile divides, and whole tiles without one.)
WHOLE_TILES = ("causal", "no mask")


@pytest.mark.parametrize(
    "case, seq, width",
    [(case, 200, 96) for case in CASES]
    + [
        pytest.param(case, 128, 64, marks=[] if case in WHOLE_TILES else SIMULATED_SLOW)
        for case in CASES
    ],
)
def test_the_forward_kernel_on_the_gpu_simulator_is_the_reference(case, seq, width):
    ours, theirs = CASES[case]
    q, k, v = qkv(np.random.default_rng(0), 1, seq, seq, 4, 2, width, dtype=jnp.bfloat16)
    out, lse = js.dot_product_attention(
        q, k, v, implementation=_simulated(), return_residual=True, **ours
    )
    want = ref.attention(q, k, v, **theirs)
    assert out.dtype == jnp.bfloat16
    assert ref.rel_err(out, want["out"]) < 2e-2  # (bfloat16 inputs and weights)
    finite = np.isfinite(want["lse"])
    assert ref.rel_err(np.where(finite, lse, 0), np.where(finite, want["lse"], 0)) < 1e-2


def test_the_kernels_run_with_x64_on():
    # Under jax_enable_x64 a Python int is an int64: the ring's slot keeps its steps' dtype.
    # (In a process of its own, x64 on from its start, as users set it.)
    node = "test_the_forward_kernel_on_the_gpu_simulator_is_the_reference and causal-128-64"
    run_pytest("tests/test_mosaic_gpu.py", "-k", node, env={"JAX_SDPA_X64": "1"})


def test_sigmoid_attention_and_more_keys_than_queries_on_the_gpu_simulator():
    q, k, v = qkv(np.random.default_rng(1), 2, 64, 300, 2, 1, 64, dtype=jnp.bfloat16)
    out = js.dot_product_attention(q, k, v, normalizer="sigmoid", implementation=_simulated())
    want = ref.attention(q, k, v, normalizer="sigmoid")
    assert ref.rel_err(out, want["out"]) < 2e-2


def test_float32_inputs_run_the_other_kernel_and_are_the_reference():
    q, k, v = qkv(np.random.default_rng(5), 1, 100, 100, 2, 1, 64)  # (Mosaic GPU's take 16 bits)
    out = js.dot_product_attention(q, k, v, is_causal=True, implementation=_simulated())
    assert out.dtype == jnp.float32
    assert ref.rel_err(out, ref.attention(q, k, v, is_causal=True)["out"]) < 1e-5


GRADIENT_CASES = {
    "causal GQA": ((200, 200, 4, 2, 96), dict(is_causal=True)),
    "no mask, more keys": ((64, 300, 2, 1, 64), {}),
    "window": ((256, 256, 2, 2, 64), dict(is_causal=True, window=(40, 0))),
    "soft cap": ((128, 128, 4, 2, 64), dict(is_causal=True, soft_cap=5.0)),
    "score_mod": ((128, 128, 4, 2, 64), dict(score_mod=_slope)),
    "sinks": ((128, 128, 4, 2, 64), dict(is_causal=True, sinks=np.array([0.5, -1.0, 2.0, 0.0]))),
    "sigmoid": ((128, 128, 2, 1, 64), dict(normalizer="sigmoid")),
    "key lengths": ((128, 256, 2, 1, 64), dict(is_causal=True, kv_lengths=np.array([100, 256]))),
    # Programs whose consumers meet no block: keys padded past half a program, a window past
    # the queries' lengths.
    "causal, 60": ((60, 60, 2, 1, 64), dict(is_causal=True)),
    "window, query lengths": (
        (100, 100, 2, 1, 64),
        dict(is_causal=True, window=(30, 0), q_lengths=np.array([40, 100])),
    ),
}
OURS = {"window": "local_window_size", "soft_cap": "logits_soft_cap"}
LENGTHS = {"q_lengths": "query_seq_lengths", "kv_lengths": "key_value_seq_lengths"}


@pytest.mark.parametrize("case", list(GRADIENT_CASES))
@SIMULATED_SLOW
def test_the_backward_kernels_on_the_gpu_simulator_are_the_reference(case):
    (t, s, n, kv_heads, width), theirs = GRADIENT_CASES[case]
    q, k, v = qkv(np.random.default_rng(2), 2, t, s, n, kv_heads, width, dtype=jnp.bfloat16)
    ours = {OURS.get(name, name): x for name, x in theirs.items() if name not in LENGTHS}
    ours |= {LENGTHS[name]: jnp.asarray(x) for name, x in theirs.items() if name in LENGTHS}
    _assert_simulated_gradients(q, k, v, ours, theirs)


def _no_key_before_40(b, h, i, j):
    """Rows 0 … 39 may attend no key; the others, causally."""
    return (i >= 40) & (j <= i)


@SIMULATED_SLOW
def test_float16_wider_values_max_scores_and_rows_with_no_key_on_the_gpu_simulator():
    # float16; values 128 wide against 64-wide queries and keys; each row's largest score;
    # rows with no key: 0 out, 0 gradients, no NaN.
    q, k, v = qkv(np.random.default_rng(12), 1, 128, 128, 2, 1, 64, 128, dtype=jnp.float16)
    d_out = jnp.asarray(np.random.default_rng(13).normal(size=(1, 128, 2, 128)), jnp.float16)

    def loss(q, k, v):
        out, top = js.dot_product_attention(
            q,
            k,
            v,
            mask_mod=_no_key_before_40,
            return_max_scores=True,
            implementation=_simulated(),
        )
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), (out, top)

    (_, (out, top)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    want = ref.attention(q, k, v, d_out=d_out, mask_mod=_no_key_before_40)
    assert out.dtype == jnp.float16 and out.shape == (1, 128, 2, 128)
    assert ref.rel_err(out, want["out"]) < 2e-2
    assert not np.any(np.asarray(out[:, :40])) and np.all(np.isneginf(top[:, :40]))
    assert ref.rel_err(top[:, 40:], want["max_scores"][:, 40:]) < 1e-2
    for got, name in zip(grads, ("dq", "dk", "dv"), strict=True):
        assert np.all(np.isfinite(np.asarray(got, np.float32))), name
        assert ref.rel_err(got, want[name]) < 2e-2, name
    assert not np.any(np.asarray(grads[0][:, :40]))


@pytest.mark.parametrize(  # (values of 256 beside narrower queries: the sides of the wider)
    "dtype, widths", [(jnp.float16, (64, 128)), (jnp.bfloat16, (96, 256))]
)
def test_float16_and_wider_values_lower_for_cuda(dtype, widths):
    from tests.lowering import mosaic_gpu_kernels

    q = jnp.zeros((1, 256, 2, widths[0]), dtype)
    v = jnp.zeros((1, 256, 2, widths[1]), dtype)
    pallas = js.Pallas(backend="mosaic_gpu")

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, is_causal=True, implementation=pallas)
        return out.astype(jnp.float32).sum()

    assert len(mosaic_gpu_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, q, v)) == 3


def _assert_simulated_gradients(q, k, v, ours, theirs):
    """The gradients of a call with keywords ``ours`` on the simulator are the reference's."""
    d_out = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.bfloat16)

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, implementation=_simulated(), **ours)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = ref.attention(q, k, v, d_out=d_out, **theirs)
    for got, name in zip(grads, ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(got, want[name]) < 2e-2, name  # (bfloat16 inputs and weights)


@SIMULATED_SLOW
def test_a_block_mask_on_the_gpu_simulator_is_the_reference():
    def band(b, h, i, j):
        return (i >= j) & (i - j < 100)

    block_mask = js.create_block_mask(band, None, None, 256, 256, block_q=128, block_kv=128)
    q, k, v = qkv(np.random.default_rng(6), 1, 256, 256, 2, 1, 64, dtype=jnp.bfloat16)
    d_out = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.bfloat16)

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, mask_mod=block_mask, implementation=_simulated())
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = ref.attention(q, k, v, d_out=d_out, mask_mod=band)
    for got, name in zip(grads, ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(got, want[name]) < 2e-2, name


@SIMULATED_SLOW
def test_a_block_mask_made_at_other_tiles_is_read_not_classified_again(monkeypatch):
    from jax_sdpa import _block_mask
    from jax_sdpa._kernels.schedule import Lists

    def band(b, h, i, j):
        return (i >= j) & (i - j < 100)

    # FlexAttention's blocks (128 × 128), not the kernels' tiles (64 × 128, 64 × 64)
    block_mask = js.create_block_mask(band, None, None, 256, 256, block_q=128, block_kv=128)
    classified, listed = [], []
    for module, name, calls in (
        (_block_mask, "classify_blocks", classified),
        (Lists, "of", listed),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, real=real, calls=calls: calls.append(1) or real(*a)
        )
    jax.clear_caches()  # (a call traced before with these shapes would not classify again)
    q, k, v = qkv(np.random.default_rng(14), 1, 256, 256, 2, 1, 64, dtype=jnp.bfloat16)
    _assert_simulated_gradients(q, k, v, dict(mask_mod=block_mask), dict(mask_mod=band))
    assert not classified and listed  # (the kernels list the mask's blocks)


def _alibi(*at):
    """ALiBi with captured slopes: their gradient is the keys' kernel's."""
    return CAPTURED["ALiBi's slopes"][1](CAPTURED["ALiBi's slopes"][0], *at)


def _listed(b, h, i, j):
    """A rule per head that allows no key from 128 on: no kernel's block there is listed."""
    return (j < 128) & ((h == 0) | (j <= i))


@SIMULATED_SLOW
def test_the_kernels_visit_only_the_blocks_a_block_mask_lists():
    # NaN in the blocks no tile lists: a kernel that visited one would put 0 · NaN in the
    # products. 200 positions: the padded queries are listed for nothing.
    q, k, v = qkv(np.random.default_rng(10), 1, 200, 200, 2, 1, 64, dtype=jnp.bfloat16)
    unlisted = (jnp.arange(200) >= 128)[None, :, None, None]
    k_nan, v_nan = (jnp.where(unlisted, jnp.nan, x) for x in (k, v))
    d_out = jnp.asarray(np.random.default_rng(11).normal(size=q.shape), jnp.bfloat16)

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, mask_mod=_listed, implementation=_simulated())
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k_nan, v_nan)
    want = ref.attention(q, k, v, d_out=d_out, mask_mod=_listed)
    assert ref.rel_err(out, want["out"]) < 2e-2
    for got, name in zip(grads, ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(got, want[name]) < 2e-2, name


@jax.custom_vjp
def _reversed(x):
    """``x``, its gradient negated: a custom rule the kernels must keep (not the identity's)."""
    return x


_reversed.defvjp(lambda x: (x, None), lambda _, g: (-g,))


DOCUMENT_IDS = np.arange(256) // 70  # (four documents, the last of 46 keys)

CAPTURED = {  # (arrays read at one index: their gradients are the Mosaic GPU keys' kernel's)
    "ALiBi's slopes": (
        jnp.array([0.1, 0.2, 0.05, 0.3], jnp.float32),
        lambda slopes, score, b, h, i, j: score - slopes[h] * (i - j).astype(score.dtype),
    ),
    "a table per head, read twice": (
        jnp.array([[1.0, 0.5], [0.8, -0.2], [1.2, 0.1], [0.9, 0.3]], jnp.float32),
        lambda w, score, b, h, i, j: score * w[h, 0] + w[h, 1],
    ),
    "a temperature": (jnp.array(0.7, jnp.float32), lambda t, score, b, h, i, j: score * t),
    "a temperature where i >= j": (  # (the score read twice: its cotangents summed, add_any)
        jnp.array(0.7, jnp.float32),
        lambda t, score, b, h, i, j: jnp.where(i >= j, score * t, score),
    ),
    "three entries, taken with a fill": (  # (not a power of two; a gather's transpose)
        jnp.array([0.9, 1.1, 0.6], jnp.float32),
        lambda t, score, b, h, i, j: score * jnp.take(t, h % 3, mode="fill"),
    ),
    # Read at tiles of points: their gradients added into memory at them (AT_POINTS).
    "a relative table": (
        jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + t[i - j + 150],
    ),
    "a temperature per block of queries": (  # (a vector of points: the positions divided)
        jnp.array([0.5, 1.5, 1.0, 2.0], jnp.float32),
        lambda t, score, b, h, i, j: score * t[i // 64],
    ),
    "a table of blocks per head": (  # (tiles of points along both axes, at one head)
        jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(4, 4, 4),
        lambda t, score, b, h, i, j: score + t[h, i // 64, j // 64],
    ),
    "a bias per document, read at its ids": (  # (added at the values read at the keys)
        jnp.array([0.4, -0.3, 0.8, 0.1], jnp.float32),
        lambda t, score, b, h, i, j: score + t[jnp.asarray(DOCUMENT_IDS)[j]],
    ),
    "a table per head at q_idx − kv_idx": (
        jnp.linspace(-1.0, 1.0, 1200, dtype=jnp.float32).reshape(4, 300),
        lambda t, score, b, h, i, j: score + t[h, i - j + 150],
    ),
    "a small table at many points": (  # (16 entries: one point a tile would be in registers)
        jnp.linspace(0.5, 1.5, 16, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score * t[(i - j) % 16],
    ),
    "a temperature and a relative table": (  # (a 0-d array's gradient added at 0)
        (jnp.array(0.7, jnp.float32), jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32)),
        lambda t, score, b, h, i, j: score * t[0] + t[1][i - j + 150],
    ),
    "a bias per key": (  # (read along one axis: each tile's sums over its rows added)
        jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + t[j],
    ),
    "a bfloat16 bias per key, doubled": (  # (the sums times 2, cast: kept with the tile)
        jnp.linspace(-1.0, 1.0, 128, dtype=jnp.bfloat16),
        lambda t, score, b, h, i, j: score + 2.0 * t[j].astype(score.dtype),
    ),
    "a temperature per query, wrapped": (  # (a bias per query's gradient is 0: the rows')
        jnp.linspace(0.5, 1.5, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score * t[i - 128],
    ),
    "a relative table where i >= j": (
        jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32),
        lambda t, score, b, h, i, j: jnp.where(i >= j, score + t[i - j + 150], score),
    ),
    "a bias per key through tanh": (  # (the sums times 1 − tanh², read at the keys)
        jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + jnp.tanh(t[j]),
    ),
    "a bias per key squared": (  # (the sums times 2 t, read at the keys)
        jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + t[j] * t[j],
    ),
    "a bias per key read once, squared": (  # (two products of the sums, added: add_any)
        jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: (lambda w: score + w * w)(t[j]),
    ),
    "a ratio of two biases per key": (  # (the divisor's, the sums times −a / b², a power)
        (
            jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32),
            jnp.linspace(0.5, 2.0, 128, dtype=jnp.float32),
        ),
        lambda t, score, b, h, i, j: score + t[0][j] / t[1][j],
    ),
    "biases per key of two lengths, multiplied": (  # (each read at its own run: clamped)
        (
            jnp.linspace(-1.0, 1.0, 100, dtype=jnp.float32),
            jnp.linspace(0.5, 2.0, 200, dtype=jnp.float32),
        ),
        lambda t, score, b, h, i, j: score + t[0][j] * t[1][j],
    ),
    "a table's row per head along the keys": (  # (the sums at (h, kv_idx), flattened)
        jnp.linspace(-1.0, 1.0, 4 * 256, dtype=jnp.float32).reshape(4, 256),
        lambda t, score, b, h, i, j: score + t[h, j],
    ),
    "a bfloat16 bias per key through abs": (  # (the sums or their negation, by the sign, cast)
        jnp.linspace(-1.0, 1.0, 128, dtype=jnp.bfloat16),
        lambda t, score, b, h, i, j: score + jnp.abs(t[j]).astype(score.dtype),
    ),
    "a bias per key through log": (  # (the sums divided by the bias, read at the keys)
        jnp.linspace(0.5, 2.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + jnp.log(t[j]),
    ),
    "a bias per key through a custom rule": (  # (the gradient reversed: the sums negated)
        jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + _reversed(t[j]),
    ),
    "a bias per key through floor, log1p and more": (  # (a window's: read in the sums' layout)
        jnp.linspace(0.1, 2.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + _rounded_and_more(t[j]) + jnp.log2(t[j]),
    ),
    "a bias per key through sinh, atan and more": (  # (rewritten: rewrites.REWRITES)
        jnp.linspace(-2.0, 2.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: (
            score + jnp.sinh(t[j]) + jnp.cosh(t[j]) - jnp.arctan(t[j]) + jnp.cbrt(t[j])
        ),
    ),
    "a bias per key through erf and erfc": (  # (JAX 0.12's derivatives split x by bit casts)
        jnp.linspace(-2.0, 2.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + jax.lax.erf(t[j]) - jax.lax.erfc(0.5 * t[j]),
    ),
    "a bias per key, its NaNs replaced": (  # (the constants scalars of the window's)
        jnp.where(jnp.arange(128) % 3 == 0, jnp.nan, jnp.linspace(-1.0, 1.0, 128)),
        lambda t, score, b, h, i, j: (
            score + jnp.where(jnp.isnan(t[j]), 1.0, t[j]) + jnp.nan_to_num(t[j])
        ),
    ),
    "a bias per key to a power": (  # (pow, as 2 ** (y log2 |x|): the sums times 1.5 t ** 0.5)
        jnp.linspace(0.5, 2.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + t[j] ** 1.5,
    ),
    "a bias per key through sqrt": (  # (the sums times 0.5 / sqrt, read at the keys)
        jnp.linspace(0.5, 2.0, 128, dtype=jnp.float32),
        lambda t, score, b, h, i, j: score + jnp.sqrt(t[j]),
    ),
    "a bias matrix": (  # (a 2-D window a tile: its gradient added into memory at the tile)
        jnp.sin(0.37 * jnp.arange(256 * 256, dtype=jnp.float32)).reshape(256, 256),
        lambda t, score, b, h, i, j: score + t[i, j],
    ),
    "slopes and a relative table": (  # (one point and many, all added into memory)
        (jnp.array([0.1, 0.2, 0.05, 0.3]), jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32)),
        lambda t, score, b, h, i, j: (
            score - t[0][h] * (i - j).astype(score.dtype) + t[1][i - j + 150]
        ),
    ),
}


AT_POINTS = {
    "a relative table",
    "a bias matrix",
    "a bias per key",
    "a bias per key through tanh",
    "a bias per key squared",
    "a bias per key read once, squared",
    "a ratio of two biases per key",
    "biases per key of two lengths, multiplied",
    "a table's row per head along the keys",
    "a bfloat16 bias per key through abs",
    "a bias per key through log",
    "a bias per key through sqrt",
    "a bias per key to a power",
    "a bias per key through floor, log1p and more",
    "a bias per key through sinh, atan and more",
    "a bias per key through erf and erfc",
    "a bias per key, its NaNs replaced",
    "a bias per key through a custom rule",
    "a bfloat16 bias per key, doubled",
    "a temperature per query, wrapped",
    "a relative table where i >= j",
    "a table per head at q_idx − kv_idx",
    "a temperature per block of queries",
    "a table of blocks per head",
    "a bias per document, read at its ids",
    "a small table at many points",
    "a temperature and a relative table",
    "slopes and a relative table",
}


def _causal_gradients(mod):
    """``grads(q, k, v, array, implementation)`` of a causal call with ``score_mod(array, …)``."""

    def loss(q, k, v, array, implementation):
        out = js.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            score_mod=lambda *at: mod(array, *at),
            implementation=implementation,
        )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2, 3))


@pytest.mark.parametrize("case", list(CAPTURED))
@SIMULATED_SLOW
def test_a_captured_arrays_gradient_with_the_mosaic_gpu_kernels(case):
    q, k, v = qkv(np.random.default_rng(4), 1, 128, 128, 4, 2, 64, dtype=jnp.bfloat16)
    array, mod = CAPTURED[case]
    grads = _causal_gradients(mod)
    jaxpr = str(jax.make_jaxpr(grads, static_argnums=4)(q, k, v, array, _simulated()))
    assert "jax_sdpa_backward" not in jaxpr  # (no Triton program: the keys' kernel is ours)
    got = grads(q, k, v, array, _simulated())
    with enable_x64():
        wide = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), (q, k, v, array))
        want = grads(*wide, "xla")
    for g, w, name in zip(got[:3], want[:3], ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(g, w) < 2e-2, name
    for g, w in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3]), strict=True):
        assert ref.rel_err(g, w) < 2e-2, "d_array"


# (CI adds the gradient at ids read at the keys as at a temperature per block of queries)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=pytest.mark.slow) if "at its ids" in case else case
        for case in CAPTURED
    ],
)
def test_a_captured_arrays_gradient_lowers_for_cuda_in_the_keys_kernel(case):
    from tests.lowering import mosaic_gpu_kernels

    array, mod = CAPTURED[case]
    q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def loss(q, k, v, array):
        out = js.dot_product_attention(
            q, k, v, score_mod=lambda *at: mod(array, *at), implementation=pallas
        )
        return out.astype(jnp.float32).sum()

    kernels = mosaic_gpu_kernels(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, k, array)
    assert len(kernels) == 3  # (no Triton program for the keys)
    # (0.11's module check reads op names only: ``red`` up to its type's first digit)
    adds = sum("red.relaxed.gpu.global.add.f" in kernel for kernel in kernels)
    assert adds == (case in AT_POINTS)  # the keys' kernel's atomic reductions, or none


def test_a_table_no_derivative_asks_for_has_no_gradient_in_the_keys_kernel():
    from tests.lowering import mosaic_gpu_kernels

    array, mod = CAPTURED["a relative table"]
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def loss(q, array):
        out = js.dot_product_attention(
            q, q, q, score_mod=lambda *at: mod(array, *at), implementation=pallas
        )
        return out.astype(jnp.float32).sum()

    for argnums, adds in (((0,), 0), ((0, 1), 1)):
        kernels = mosaic_gpu_kernels(jax.grad(loss, argnums=argnums), q, array)
        assert sum("red.relaxed.gpu.global.add.f" in kernel for kernel in kernels) == adds


# Arrays as jax_enable_x64 makes them (float64), the mods' math on them float64 too: the Mosaic
# GPU kernels hold them, and compute it, in float32.
FLOAT64 = {
    "ALiBi's slopes": (
        jnp.array([0.1, 0.2, 0.05, 0.3]),
        lambda t, score, b, h, i, j: score - (t[h] * (i - j).astype(t.dtype)).astype(score.dtype),
    ),
    "a relative table": (
        jnp.linspace(-1.0, 1.0, 300),
        lambda t, score, b, h, i, j: score + t[i - j + 150].astype(score.dtype),
    ),
    "a bias per key through tanh": (
        jnp.linspace(-1.0, 1.0, 128),
        lambda t, score, b, h, i, j: score + jnp.tanh(t[j]).astype(score.dtype),
    ),
}


def _in_float64(case):
    array, mod = FLOAT64[case]
    return jnp.asarray(array, jnp.float64), mod


@pytest.mark.parametrize("case", FLOAT64)
def test_a_float64_arrays_gradient_under_x64_lowers_for_cuda_in_the_keys_kernel(case):
    """(Before, float64 math failed to lower, or the keys' kernel was Triton's.)"""
    from tests.lowering import mosaic_gpu_kernels

    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")
    with enable_x64():
        array, mod = _in_float64(case)

        def loss(q, array):
            out = js.dot_product_attention(
                q, q, q, score_mod=lambda *at: mod(array, *at), implementation=pallas
            )
            return out.astype(jnp.float32).sum()

        kernels = mosaic_gpu_kernels(jax.grad(loss, argnums=(0, 1)), q, array)
    assert len(kernels) == 3  # (the forward's, the queries' and the keys' gradients')


@SIMULATED_SLOW
def test_float64_arrays_on_the_gpu_simulator_with_x64_on():
    # (In a process of its own, x64 on from its start: the simulator's threads do not see a
    # block's jax.enable_x64.)
    node = "test_a_float64_arrays_gradient_on_the_gpu_simulator"
    run_pytest("tests/test_mosaic_gpu.py", "-k", node, env={"JAX_SDPA_X64": "1"})


@pytest.mark.parametrize("case", FLOAT64)
@pytest.mark.skipif(
    not jax.config.jax_enable_x64,
    reason="x64 on from the process's start: test_float64_arrays_on_the_gpu_simulator_with_x64_on",
)
@SIMULATED_SLOW
def test_a_float64_arrays_gradient_on_the_gpu_simulator(case):
    q, k, v = qkv(np.random.default_rng(6), 1, 128, 128, 4, 2, 64, dtype=jnp.bfloat16)
    array, mod = _in_float64(case)
    grads = _causal_gradients(mod)
    got = grads(q, k, v, array, _simulated())
    want = grads(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, array)), "xla")
    assert got[3].dtype == jnp.float64  # (the array's gradient in its own dtype)
    for g, w in zip(got, want, strict=True):
        assert ref.rel_err(g, w) < 2e-2


@SIMULATED_SLOW
def test_a_tables_gradient_under_vmap_is_each_examples():
    """Examples of their own tables and inputs, and one table all share, against float64."""
    q, k, v = qkv(np.random.default_rng(5), 2, 128, 128, 4, 2, 64, dtype=jnp.bfloat16)
    table = jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32)
    examples = [jnp.stack([x, x * 0.5]) for x in (q, k, v, table)]

    def grads(q, k, v, table, implementation):
        def loss(q, k, v, table):
            out = js.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                score_mod=lambda s, b, h, i, j: s + table[i - j + 150],
                implementation=implementation,
            )
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, table)

    for axes in ((0, 0, 0, 0), (0, 0, 0, None)):
        args = [x if axis == 0 else table for x, axis in zip(examples, axes, strict=True)]
        got = jax.vmap(lambda *a: grads(*a, _simulated()), in_axes=axes)(*args)
        with enable_x64():
            wide = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), args)
            want = jax.vmap(lambda *a: grads(*a, "xla"), in_axes=axes)(*wide)
        for g, w in zip(got, want, strict=True):
            for example in range(2):
                assert ref.rel_err(g[example], w[example]) < 2e-2, axes


# Arrays read along positions (segment ids, documents, a bias per key, tables at q_idx − kv_idx), over 200
# positions: the programs' last rows and keys (padded to 256) read past the arrays' ends.
DOCUMENTS = np.arange(200)[None] // 50 + np.array([[0], [7]])  # (2, 200): 4 documents each
BIAS = np.linspace(-1.0, 1.0, 256, dtype=np.float32)
TABLE = np.linspace(-1.0, 1.0, 400, dtype=np.float32)  # (a table at q_idx − kv_idx: looped)
KEEP = np.cos(np.arange(256, dtype=np.float32))  # (key 0 kept: no row without a key)
VALID = np.stack([KEEP > 0, KEEP < 0.5])  # (2, 256): a key padding mask per sequence
DOCUMENT_BIAS = np.cos(np.arange(11, dtype=np.float32))  # (DOCUMENTS' ids: 0 to 10)
TEMPERATURES = np.array([0.5, 1.5, 2.0], np.float32)  # (per 64 queries; the fourth's clamped)
KEPT_BLOCKS = np.array([True, False, True, True])  # (keys 64 to 127 masked)
BY_BLOCK_AND_ROW = 1.5 + np.sin(np.arange(256, dtype=np.float32)).reshape(4, 64)
BLOCKS = np.array([[1, 0, 0, 0], [1, 1, 0, 1], [0, 1, 1, 0], [1, 0, 0, 1]], bool)  # (of 64 × 64)
T5 = mods.relative_position_bias(
    np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(32, 2), 32, 128
)
MATRIX = np.sin(0.37 * np.arange(200 * 200, dtype=np.float32)).reshape(200, 200)  # (not symmetric)
MATRICES = np.cos(0.11 * np.arange(2 * 4 * 200 * 200, dtype=np.float32)).reshape(2, 4, 200, 200)

POSITIONAL = {
    "segment ids": (
        dict(query_segment_ids=DOCUMENTS, key_value_segment_ids=DOCUMENTS),
        dict(q_segments=DOCUMENTS, kv_segments=DOCUMENTS),
    ),
    "document_mask and causal": (
        dict(mask_mod=mods.and_masks(mods.document_mask(DOCUMENTS), lambda b, h, i, j: j <= i)),
        dict(mask_mod=lambda b, h, i, j: (DOCUMENTS[b, i] == DOCUMENTS[b, j]) & (j <= i)),
    ),
    "a relative table": (
        dict(score_mod=lambda s, b, h, i, j: s + jnp.asarray(TABLE)[i - j + 200].astype(s.dtype)),
        dict(score_mod=lambda s, b, h, i, j: s + TABLE[i - j + 200]),
    ),
    "T5's buckets, causal": (
        dict(is_causal=True, score_mod=T5),
        dict(is_causal=True, score_mod=lambda s, *at: s + np.asarray(T5(np.float32(0), *at))),
    ),
    "a bias per key, wrapped": (
        dict(score_mod=lambda s, b, h, i, j: s + jnp.asarray(BIAS)[j - 256].astype(s.dtype)),
        dict(score_mod=lambda s, b, h, i, j: s + BIAS[j]),
    ),
    "keys kept where a vector is positive": (  # (compared: jnp.where's broadcast, NumPy axes)
        dict(mask_mod=lambda b, h, i, j: jnp.asarray(KEEP)[j] > 0),
        dict(mask_mod=lambda b, h, i, j: KEEP[j] > 0),
    ),
    "keys kept where a boolean array says": (  # (int32 in the kernel's memory, read as bool)
        dict(mask_mod=lambda b, h, i, j: jnp.asarray(VALID)[b, j]),
        dict(mask_mod=lambda b, h, i, j: VALID[b, j]),
    ),
    "a bias shorter than a tile": (  # (100 entries: read one at a time, clamped as jnp reads)
        dict(score_mod=lambda s, b, h, i, j: s + jnp.asarray(BIAS[:100])[j].astype(s.dtype)),
        dict(score_mod=lambda s, b, h, i, j: s + BIAS[np.minimum(j, 99)]),
    ),
    "a temperature per block of queries": (  # (positions divided: points looped, as vectors)
        dict(score_mod=lambda s, b, h, i, j: s * jnp.asarray(TEMPERATURES)[i // 64]),
        dict(score_mod=lambda s, b, h, i, j: s * TEMPERATURES[np.minimum(i // 64, 2)]),
    ),
    "a bias per document, read at its ids": (  # (values read at values read at positions)
        dict(
            score_mod=lambda s, b, h, i, j: (
                s + jnp.asarray(DOCUMENT_BIAS)[jnp.asarray(DOCUMENTS)[b, j]].astype(s.dtype)
            )
        ),
        dict(score_mod=lambda s, b, h, i, j: s + DOCUMENT_BIAS[DOCUMENTS[b, j]]),
    ),
    "keys kept by their block, wrapped": (  # (the jnp wrap of −4 to −1, and a comparison)
        dict(mask_mod=lambda b, h, i, j: jnp.asarray(KEPT_BLOCKS)[j // 64 - 4] | (j == 0)),
        dict(mask_mod=lambda b, h, i, j: KEPT_BLOCKS[j // 64] | (j == 0)),
    ),
    "a temperature per query, from a table of blocks": (  # (two windows along one axis)
        dict(score_mod=lambda s, b, h, i, j: s * jnp.asarray(BY_BLOCK_AND_ROW)[i // 64, i % 64]),
        dict(score_mod=lambda s, b, h, i, j: s * BY_BLOCK_AND_ROW[i // 64, i % 64]),
    ),
    "a bias per key, shifted and clipped": (  # (shift_right_arithmetic; jnp.clip's max)
        dict(score_mod=lambda s, b, h, i, j: s + jnp.asarray(BIAS)[jnp.clip((j >> 6) * 3 - 1, 0)]),
        dict(score_mod=lambda s, b, h, i, j: s + BIAS[np.clip((j >> 6) * 3 - 1, 0, None)]),
    ),
    "chunks of 48, causal": (  # (positions divided on both axes, compared: mods.chunked_causal)
        dict(mask_mod=mods.chunked_causal(48)),
        dict(mask_mod=lambda b, h, i, j: (i // 48 == j // 48) & (j <= i)),
    ),
    "blocks kept by a table of them": (  # (tiles of points along both axes, looped)
        dict(mask_mod=lambda b, h, i, j: jnp.asarray(BLOCKS)[i // 64, j // 64] | (i == j)),
        dict(mask_mod=lambda b, h, i, j: BLOCKS[i // 64, j // 64] | (i == j)),
    ),
    "a bias matrix": (  # (a 2-D window a tile; the last rows' and keys' tiles row by row)
        dict(score_mod=lambda s, b, h, i, j: s + jnp.asarray(MATRIX)[i, j].astype(s.dtype)),
        dict(score_mod=lambda s, b, h, i, j: s + MATRIX[i, j]),
    ),
    "a bias matrix per sequence and head": (  # (at one index along two axes first)
        dict(score_mod=lambda s, b, h, i, j: s + jnp.asarray(MATRICES)[b, h, i, j].astype(s.dtype)),
        dict(score_mod=lambda s, b, h, i, j: s + MATRICES[b, h, i, j]),
    ),
    "a matrix smaller than the positions": (  # (its edge tiles by rows: clamped as jnp's)
        dict(score_mod=lambda s, b, h, i, j: s + jnp.asarray(MATRIX[:100, :150])[i, j]),
        dict(score_mod=lambda s, b, h, i, j: s + MATRIX[np.minimum(i, 99), np.minimum(j, 149)]),
    ),
    "a matrix read wrapped and filled": (  # (rows −200…−1: wrapped whole; keys past it filled)
        dict(
            score_mod=lambda s, b, h, i, j: (
                s + jnp.asarray(MATRIX).at[i - 200, j + 50].get(mode="fill", fill_value=0.5)
            )
        ),
        dict(
            score_mod=lambda s, b, h, i, j: (
                s + np.where(j < 150, MATRIX[i, np.minimum(j + 50, 199)], 0.5)
            )
        ),
    ),
    "jax.nn's bias and mask arrays": (  # (read as the matrices are)
        dict(bias=jnp.asarray(MATRICES[:, :1]), mask=jnp.asarray(MATRIX[None, None] > -0.9)),
        dict(bias=MATRICES[:, :1], mask=MATRIX[None, None] > -0.9),
    ),
}


SIMULATED = ("segment ids", "keys kept where a boolean array says")  # (in the inner loop)
# (and their gradients too: jax.nn's arrays, padded to whole tiles, are read a tile at a time)
SIMULATED_WITH_GRADIENTS = ("jax.nn's bias and mask arrays",)


def _positional(case):
    ours, theirs = POSITIONAL[case]
    ours = {name: jnp.asarray(x) if name.endswith("ids") else x for name, x in ours.items()}
    return ours, theirs


@pytest.mark.parametrize(  # (the inner loop simulates one)
    "case",
    [
        case
        if case in SIMULATED + SIMULATED_WITH_GRADIENTS
        else pytest.param(case, marks=SIMULATED_SLOW)
        for case in POSITIONAL
    ],
)
def test_arrays_read_along_positions_on_the_gpu_simulator_are_the_reference(case):
    ours, theirs = _positional(case)
    q, k, v = qkv(np.random.default_rng(8), 2, 200, 200, 2, 1, 64, dtype=jnp.bfloat16)
    out = js.dot_product_attention(q, k, v, implementation=_simulated(), **ours)
    assert ref.rel_err(out, ref.attention(q, k, v, **theirs)["out"]) < 2e-2


@pytest.mark.parametrize(
    "case",
    [
        case if case in SIMULATED_WITH_GRADIENTS else pytest.param(case, marks=SIMULATED_SLOW)
        for case in POSITIONAL
    ],
)
def test_gradients_with_arrays_read_along_positions_on_the_gpu_simulator(case):
    q, k, v = qkv(np.random.default_rng(9), 2, 200, 200, 2, 1, 64, dtype=jnp.bfloat16)
    _assert_simulated_gradients(q, k, v, *_positional(case))


# (CI lowers these through siblings: T5's buckets read as the relative table does, document_mask
# and causal as the segment ids do, a temperature per block of queries in CAPTURED's case, keys
# kept by their block as the bias per document read at its ids is, the chunks as the table of
# blocks' positions are, the table of blocks in CAPTURED's table of blocks per head, the bias
# matrix as the one per sequence and head is)
LOWERED_AS_SIBLINGS = (
    "T5's buckets, causal",
    "document_mask and causal",
    "a temperature per block of queries",
    "keys kept by their block, wrapped",
    "chunks of 48, causal",
    "a bias per key, shifted and clipped",
    "blocks kept by a table of them",
    "a bias matrix",
    "a matrix smaller than the positions",
    "a matrix read wrapped and filled",
)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=pytest.mark.slow) if case in LOWERED_AS_SIBLINGS else case
        for case in POSITIONAL
    ],
)
def test_arrays_read_along_positions_lower_for_cuda(case):
    from tests.lowering import mosaic_gpu_kernels

    ours, _ = _positional(case)
    q = jnp.zeros((2, 200, 4, 64), jnp.bfloat16)
    k = jnp.zeros((2, 200, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def loss(q, k, v):
        return js.dot_product_attention(q, k, v, implementation=pallas, **ours).sum()

    kernels = mosaic_gpu_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
    assert len(kernels) == 3
    # (no derivative asks for the arrays': none added into memory; CAPTURED's add theirs)
    assert not any("red.relaxed.gpu.global.add.f" in kernel for kernel in kernels)


def test_a_bias_arrays_gradient_lowers_for_cuda_in_the_keys_kernel():
    from tests.lowering import mosaic_gpu_kernels

    q = jnp.zeros((2, 200, 4, 64), jnp.bfloat16)
    k = jnp.zeros((2, 200, 2, 64), jnp.bfloat16)
    mask = jnp.asarray(MATRIX > -0.9)
    pallas = js.Pallas(backend="mosaic_gpu")

    def loss(q, k, v, bias):
        out = js.dot_product_attention(q, k, v, bias, mask, implementation=pallas)
        return out.astype(jnp.float32).sum()

    bias = jnp.zeros((2, 1, 200, 200), jnp.bfloat16)  # (per sequence; a bfloat16 gradient)
    kernels = mosaic_gpu_kernels(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, k, bias)
    assert len(kernels) == 3
    assert sum("red.relaxed.gpu.global.add.f" in kernel for kernel in kernels) == 1


def _rounded_and_more(x):  # (floor, ceil, log1p, expm1: rewritten; round, sin, log2: lowered)
    return jnp.floor(x) + jnp.ceil(x) + jnp.log1p(x) + jnp.expm1(x) + jnp.round(x) + jnp.sin(x)


def _special(x):  # (rewritten; a captured array's gradient through atan2 is Triton's)
    inverses = jnp.arcsin(x * 0.3) + jnp.arccos(x * 0.3) + jnp.arctanh(x * 0.3)  # (|x| ≤ 2.6)
    return (
        jax.lax.erf(x)
        + jax.lax.erfc(x)
        + jnp.sinh(x)
        + jnp.cosh(x)
        - jnp.arctan(x)
        + jnp.arctan2(x, 2.0)
        + jnp.cbrt(x)
        + jnp.arcsinh(x)
        + jnp.arccosh(2.0 + x * x)
        + inverses
    )


def _gamma_and_more(x):  # (rewritten)
    x2 = x * x + 1.0
    special = jax.lax.lgamma(x2) + jax.lax.digamma(x2) + jax.lax.erf_inv(x)
    return special + jnp.tan(x) + jnp.sinc(x) + jnp.hypot(x, 2.0)


def _signs_and_more(x):  # (rewritten: conversions of booleans, nextafter by its bits)
    signs = jnp.copysign(0.5, x - 0.055) + jnp.where(jnp.signbit(x), 0.25, 0.0)  # (x ≠ 0.055)
    return signs + jnp.nextafter(x, 0.0)


POWERS = {  # (what Mosaic GPU lowers no primitive for, rewritten: rewrites.REWRITES)
    "an integer power below −1": lambda s, b, h, i, j: s * ((i - j).astype(s.dtype) + 300.0) ** -2,
    "a tile's power": lambda s, b, h, i, j: s * ((i - j).astype(s.dtype) + 300.0) ** -0.5,
    "ALiBi's slope as a power": lambda s, b, h, i, j: (
        s - 2.0 ** (-8.0 * (h + 1).astype(s.dtype) / 4) * (i - j).astype(s.dtype)
    ),
    "floor, log1p and more of a tile": lambda s, b, h, i, j: (
        s + _rounded_and_more((i - j).astype(s.dtype) * 0.01) + jnp.log2(s * s + 1.0)
    ),
    "erf, atan and more of a tile": lambda s, b, h, i, j: (
        jax.nn.gelu(s, approximate=False) + _special((i - j).astype(s.dtype) * 0.01)
    ),
    "a choice of three of a tile": lambda s, b, h, i, j: jax.lax.select_n(  # (of three cases)
        jnp.where(s < 0, 0, jnp.where(s < 1, 1, 2)), s, 2 * s, 3.0 + s
    ),
    "lgamma, erf_inv and more of a tile": lambda s, b, h, i, j: (
        s + _gamma_and_more((i - j).astype(s.dtype) * 0.001)
    ),
    "signs and nextafter of a tile": lambda s, b, h, i, j: (
        s + _signs_and_more((i - j).astype(s.dtype) * 0.01)
    ),
    "nextafter of a bfloat16 tile": lambda s, b, h, i, j: (  # (by its bits, as int16)
        s + jnp.nextafter((i - j).astype(jnp.bfloat16) * 0.01, jnp.bfloat16(0)).astype(s.dtype)
    ),
    "ndtri of a tile": lambda s, b, h, i, j: (  # (conversions of booleans, a choice of five)
        s + jax.scipy.special.ndtri(jax.nn.sigmoid((i - j).astype(s.dtype) * 0.01))
    ),
    "i0e of a tile's positions": lambda s, b, h, i, j: (  # (JAX's own decomposition)
        s + jax.scipy.special.i0e((i - j).astype(s.dtype) * 0.1)
    ),
    "the Bessel functions of a tile": lambda s, b, h, i, j: (  # (their decompositions)
        s
        + jax.scipy.special.i0e(s)
        - jax.scipy.special.i1e(s * 0.5 + 0.1)
        + 0.1 * (jax.scipy.special.i0(s * 0.1) + jax.scipy.special.i1(s * 0.1))
    ),
}
# (JAX 0.12's ndtri: its polynomials are lax.polynomial's, where those of JAX 0.11 and before
# are a scan over their coefficients, which Mosaic GPU lowers not; JAX 0.12's bessel_i1e: XLA's
# own before, which i0e's derivative takes too: documented)
JAX_0_12 = {
    "ndtri of a tile": "ndtri: JAX 0.12 and later",
    "the Bessel functions of a tile": "bessel_i1e: JAX 0.12 and later",
}


def _cases(*names):
    return [
        pytest.param(c, marks=pytest.mark.skipif(jax.__version_info__ < (0, 12), reason=why))
        if (why := JAX_0_12.get(c))
        else c
        for c in names
    ]


@pytest.mark.parametrize("case", _cases(*POWERS))
def test_powers_lower_for_cuda(case):
    from tests.lowering import mosaic_gpu_kernels

    q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def loss(q, k, v):
        mod = POWERS[case]
        out = js.dot_product_attention(q, k, v, score_mod=mod, implementation=pallas)
        return out.astype(jnp.float32).sum()

    assert len(mosaic_gpu_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)) == 3


@SIMULATED_SLOW
@pytest.mark.parametrize(
    "case",
    _cases(
        "erf, atan and more of a tile",
        "signs and nextafter of a tile",
        "nextafter of a bfloat16 tile",
        "ndtri of a tile",
        "i0e of a tile's positions",
        "the Bessel functions of a tile",
    ),
)
def test_functions_of_a_tile_with_the_mosaic_gpu_kernels_are_the_reference(case):
    q, k, v = qkv(np.random.default_rng(5), 1, 128, 128, 2, 2, 64, dtype=jnp.bfloat16)

    def grads(q, k, v, implementation):
        def loss(q, k, v):
            mod = POWERS[case]
            out = js.dot_product_attention(q, k, v, score_mod=mod, implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    got = grads(q, k, v, _simulated())
    with enable_x64():
        want = grads(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), "xla")
    for g, w, name in zip(got, want, ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(g, w) < 2e-2, name


def test_arrays_read_at_the_same_positions_combine_as_vectors():
    # ``a[kv_idx] * b[kv_idx]``: the two vectors multiplied as they are read, along the keys
    # (before, as (1, 64) arrays, which Mosaic GPU lays out no way: its layout inference failed).
    from tests.lowering import mosaic_gpu_kernels

    def score_mod(s, b, h, i, j):
        return s + (jnp.asarray(BIAS)[j] * jnp.asarray(KEEP)[j]).astype(s.dtype)

    q, k, v = qkv(np.random.default_rng(8), 2, 200, 200, 2, 1, 64, dtype=jnp.bfloat16)
    out = js.dot_product_attention(q, k, v, score_mod=score_mod, implementation=_simulated())
    want = ref.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + BIAS[j] * KEEP[j])["out"]
    assert ref.rel_err(out, want) < 2e-2
    pallas = js.Pallas(backend="mosaic_gpu")

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, score_mod=score_mod, implementation=pallas)
        return out.astype(jnp.float32).sum()

    assert len(mosaic_gpu_kernels(loss, q, k, v)) == 1  # (gradients: CAPTURED's squared bias)


@pytest.mark.parametrize(
    "read",
    [
        lambda i, j: jnp.zeros(33)[jax.lax.clz(i)],
        lambda i, j: jnp.zeros((256, 256))[j, i],
        lambda i, j: jnp.zeros((4, 256))[i // 64, j],
    ],
    ids=[
        "made by an operation windows do not follow",
        "a matrix at keys, queries",
        "a tile's own keys",
    ],
)
def test_an_array_read_at_points_the_kernel_has_no_load_for_is_refused_by_name(read):
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)

    def score_mod(score, b, h, i, j):
        return score + read(i, j).astype(score.dtype)

    pallas = js.Pallas(backend="mosaic_gpu")
    with pytest.raises(NotImplementedError, match=r"at other points.*backend=.triton."):
        jax.jit(
            lambda q: js.dot_product_attention(q, q, q, score_mod=score_mod, implementation=pallas)
        ).trace(q)


def test_a_float_remainder_is_refused_by_name_in_the_mosaic_gpu_kernel():
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def score_mod(s, b, h, i, j):
        return s + jnp.mod((i - j).astype(s.dtype), 0.7)

    with pytest.raises(NotImplementedError, match=r"remainder of floats.*backend=.triton."):
        jax.jit(
            lambda q: js.dot_product_attention(q, q, q, score_mod=score_mod, implementation=pallas)
        ).trace(q)


TOKENS = jnp.array([0, 5, 17])  # (global tokens: keys every query sees)


@pytest.mark.parametrize(
    "mods, shape",
    [
        (dict(mask_mod=lambda b, h, i, j: jnp.any(j == TOKENS) | (j <= i)), r"\(\d+, 3\)"),
        (
            dict(mask_mod=lambda b, h, i, j: jnp.any(j == 3 * jnp.arange(8)) | (j <= i)),
            r"\(\d+, 8\)",
        ),
        (
            dict(
                score_mod=lambda s, b, h, i, j: jnp.where(
                    jnp.any(s > TOKENS.astype(s.dtype)), 0.0, s
                )
            ),
            r"\(64, \d+, 3\)",
        ),
    ],
    ids=["positions against an array", "positions against 8 entries", "a tile against an array"],
)
def test_a_mod_that_makes_an_array_no_register_layout_holds_is_refused_by_name(mods, shape):
    # (Before, Mosaic GPU's own error as it lowered: "Cannot cast to layout TiledLayout(...)")
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")
    with pytest.raises(
        NotImplementedError, match=rf"makes a {shape} array.*entry by entry.*triton"
    ):
        jax.jit(lambda q: js.dot_product_attention(q, q, q, implementation=pallas, **mods)).trace(q)


def test_global_tokens_written_entry_by_entry_as_the_refusal_says_lower_for_cuda():
    from tests.lowering import mosaic_gpu_kernels

    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def mask_mod(b, h, i, j):
        return (j == TOKENS[0]) | (j == TOKENS[1]) | (j == TOKENS[2]) | (j <= i)

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, mask_mod=mask_mod, implementation=pallas)
        return out.astype(jnp.float32).sum()

    assert len(mosaic_gpu_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)) == 3


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8])
@pytest.mark.parametrize(
    "read",
    [
        lambda ids, i, j: ids[j],
        lambda ids, i, j: ids[:48][j],  # (read entry by entry: no window of a tile fits)
        lambda ids, i, j: ids[j // 64],
        lambda ids, i, j: ids.reshape(16, 16)[i // 64, j // 64],
        lambda ids, i, j: jnp.tile(ids, (256, 1))[i, j],
    ],
    ids=[
        "along positions",
        "shorter than a tile",
        "at a vector of points",
        "at tiles of points",
        "a matrix at the tile",
    ],
)
def test_an_8_bit_array_read_at_positions_or_points_is_refused_by_name(read, dtype):
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    ids = jnp.arange(256).astype(dtype)
    pallas = js.Pallas(backend="mosaic_gpu")
    with pytest.raises(
        NotImplementedError, match=rf"8-bit.*array of {jnp.dtype(dtype).name}.*int32.*triton"
    ):
        jax.jit(
            lambda q: js.dot_product_attention(
                q, q, q, mask_mod=lambda b, h, i, j: read(ids, i, j) > 3, implementation=pallas
            )
        ).trace(q)


def _made_of_literals(s, b, h, i, j):
    """Arrays the function makes (a bias per key, slopes per head): computed ahead, read."""
    bias = jnp.linspace(-1.0, 1.0, 256, dtype=jnp.float32)
    slopes = 2.0 ** -jnp.arange(1, 5, dtype=jnp.float32)
    return s + (bias[j] - slopes[h]).astype(s.dtype)


@pytest.mark.parametrize(
    "shape, keywords",
    [
        ((2, 1024, 4, 2, 128), dict(is_causal=True)),
        ((1, 512, 2, 2, 64), {}),
        ((1, 512, 2, 1, 256), dict(is_causal=True)),
        ((1, 1024, 2, 2, 128), dict(is_causal=True, local_window_size=(256, 0))),
        ((1, 256, 2, 2, 64), dict(key_length=300)),
        ((2, 256, 2, 2, 64), dict(is_causal=True, key_value_seq_lengths=jnp.array([100, 256]))),
        ((1, 512, 2, 1, 128), dict(mask_mod=_listed)),
        ((1, 256, 4, 2, 64), dict(is_causal=True, score_mod=lambda *at: _alibi(*at))),
        ((1, 256, 4, 2, 64), dict(score_mod=_made_of_literals)),
    ],
    ids=[
        "causal GQA d128",
        "no mask d64",
        "causal d256",
        "window",
        "300 keys",
        "key lengths",
        "block mask",
        "captured slopes",
        "arrays of literals",
    ],
)
def test_the_kernels_lower_for_cuda_and_their_modules_verify(shape, keywords):
    from tests.lowering import mosaic_gpu_kernels

    b, t, n, kv_heads, width = shape
    keywords = dict(keywords)
    q = jnp.zeros((b, t, n, width), jnp.bfloat16)
    k = jnp.zeros((b, keywords.pop("key_length", t), kv_heads, width), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, implementation=pallas, **keywords)
        return out.astype(jnp.float32).sum()

    kernels = mosaic_gpu_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
    assert len(kernels) == 3  # the forward kernel, the queries' and the keys' gradients
    for kernel in kernels:
        assert "wgmma" in kernel and "cp.async.bulk.tensor" in kernel  # products; TMA copies


def test_the_forward_kernels_consumers_take_turns_at_the_tensor_cores(monkeypatch):
    # Their barrier of their own: the forward kernel arrives at barriers at more places than
    # the same kernel made with the consumers not taking turns (FlashAttention-3's ping-pong).
    # (Counted in the kernel's jaxpr: JAX 0.11 cannot read its lowered module back.)
    from jax_sdpa._kernels import mosaic_gpu

    x = jnp.zeros((1, 512, 2, 128), jnp.bfloat16)
    call = functools.partial(
        js.dot_product_attention, is_causal=True, implementation=js.Pallas(backend="mosaic_gpu")
    )

    def arrivals():
        return str(jax.make_jaxpr(call)(x, x, x)).count("barrier_arrive")

    taking = arrivals()
    made = mosaic_gpu.warp_specialized
    monkeypatch.setattr(
        mosaic_gpu, "warp_specialized", lambda *a, **kw: made(*a, **(kw | {"alternate": False}))
    )
    jax.clear_caches()  # (the traces with the turns)
    not_taking = arrivals()
    jax.clear_caches()
    assert taking > not_taking > 0


# Decoding: a few queries of grouped heads packed into rows (G per key/value head), the keys
# split into chunks of 256 (small, to split 700 keys) attended in one kernel and merged.
DECODING = {
    "one query, key lengths": (
        1,
        dict(key_value_seq_lengths=jnp.array([700, 300])),
        dict(kv_lengths=np.array([700, 300])),
    ),
    "three queries, causal at the end": (
        3,
        dict(mask_mod=js.CausalMask(697)),
        dict(mask_mod=lambda b, h, i, j: j <= i + 697),
    ),
    "sinks, met by the unpacked rows": (
        1,
        dict(sinks=jnp.linspace(-1.0, 2.0, 8)),
        dict(sinks=np.linspace(-1.0, 2.0, 8)),
    ),
}


def _split_small(monkeypatch):
    from jax_sdpa import _pallas

    monkeypatch.setattr(_pallas, "SPLIT_KEYS", 256)


@pytest.mark.parametrize(  # (the inner loop simulates one)
    "case",
    [c if n == 0 else pytest.param(c, marks=SIMULATED_SLOW) for n, c in enumerate(DECODING)],
)
def test_decoding_packed_and_split_on_the_gpu_simulator_is_the_reference(case, monkeypatch):
    _split_small(monkeypatch)
    t, ours, theirs = DECODING[case]
    q, k, v = qkv(np.random.default_rng(14), 2, t, 700, 8, 2, 64, dtype=jnp.bfloat16)
    out, lse = js.dot_product_attention(
        q, k, v, implementation=_simulated(), return_residual=True, **ours
    )
    want = ref.attention(q, k, v, **theirs)
    assert ref.rel_err(out, want["out"]) < 2e-2
    assert ref.rel_err(lse, want["lse"]) < 1e-2


@pytest.mark.parametrize("case", list(DECODING))
@SIMULATED_SLOW
def test_decoding_gradients_on_the_gpu_simulator(case, monkeypatch):
    _split_small(monkeypatch)
    t, ours, theirs = DECODING[case]
    q, k, v = qkv(np.random.default_rng(15), 2, t, 700, 8, 2, 64, dtype=jnp.bfloat16)
    _assert_simulated_gradients(q, k, v, ours, theirs)


def test_a_decoding_call_lowers_for_cuda_as_one_kernel_of_packed_heads():
    # B2 S8192, 32 query heads on 8 key/value heads: one forward kernel whose queries are the
    # 8 groups' packed rows (128 a program) for each of 2 chunks of 4096 keys, read in place.
    from tests.lowering import mosaic_gpu_kernels

    q = jnp.zeros((2, 1, 32, 128), jnp.bfloat16)
    k = jnp.zeros((2, 8192, 8, 128), jnp.bfloat16)
    lengths = jnp.array([8000, 5000])
    pallas = js.Pallas(backend="mosaic_gpu")

    def call(q, k, v):
        return js.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation=pallas
        )

    def loss(q, k, v):
        return call(q, k, v).astype(jnp.float32).sum()

    # (lowered once, with the gradients: the forward kernel is the program's first)
    operands = []
    grads = jax.grad(loss, argnums=(0, 1, 2))
    assert len(mosaic_gpu_kernels(grads, q, k, k, operands=operands)) == 3
    assert "tensor<2x128x8x128xbf16>" in operands[0]  # (a sequence's packed rows, 8 groups)
    assert "tensor<2x2x4096x8x128xbf16>" in operands[0]  # (its keys: 2 chunks, in place)


SHARDED_MODS = {  # (each array's gradient added into memory: zeros made in the shard_map)
    "a table": (
        jnp.linspace(-1.0, 1.0, 512),
        lambda t, s, b, h, i, j: s + t[i - j + 256].astype(s.dtype),
    ),
    "a bias per key": (  # (read along j)
        jnp.linspace(-1.0, 1.0, 256),
        lambda t, s, b, h, i, j: s + t[j].astype(s.dtype),
    ),
}


@pytest.mark.parametrize(
    "seq_q, mod",
    [(256, None), (256, "a table"), (256, "a bias per key"), (1, None)],
    ids=["training", "a table", "a bias per key", "decoding"],
)
def test_calls_in_shard_map_with_its_default_checks_lower_for_cuda(seq_q, mod):
    # check_vma=True types each value by the mesh axes it varies over: a kernel's outputs, as
    # its inputs (JAX types a pallas_call's so, not a plgpu.kernel's: the branches of
    # platform_dependent then differed, and tracing failed).
    from jax.sharding import PartitionSpec as P

    from tests.lowering import mosaic_gpu_kernels

    mesh = abstract_mesh("cuda", (2,), ("batch",))
    q = jnp.zeros((2, seq_q, 4, 64), jnp.bfloat16)
    k = jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    array, score_mod = SHARDED_MODS.get(mod, (jnp.zeros(()), None))

    def call(q, k, v, array):
        keywords = dict(score_mod=lambda *at: score_mod(array, *at)) if mod else {}
        return js.dot_product_attention(
            q, k, v, is_causal=seq_q > 1, implementation=pallas, **keywords
        )

    specs = (P("batch"),) * 3 + (P(),)
    sharded = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=P("batch"))

    def loss(q, k, v, array):
        return sharded(q, k, v, array).astype(jnp.float32).sum()

    program = jax.grad(loss, argnums=(0, 1, 2, 3))
    kernels = mosaic_gpu_kernels(program, q, k, k, array, mesh=mesh)
    assert len(kernels) == 3
    adds = any("red.relaxed.gpu.global.add.f" in kernel for kernel in kernels)
    assert adds == (mod is not None)  # (the array's gradient, differentiated)


def test_a_decoding_call_on_an_int8_cache_in_shard_map_lowers_for_cuda():
    # The 8-bit cache's kernel (read as it lies, not dequantized first) under check_vma=True.
    from jax.sharding import PartitionSpec as P

    from tests.lowering import mosaic_gpu_kernels

    mesh = abstract_mesh("cuda", (2,), ("batch",))
    q = jnp.zeros((2, 1, 4, 64), jnp.bfloat16)
    k = jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def call(q, k, v):
        k, v = (js.quantize(x, "int8") for x in (k, v))
        return js.dot_product_attention(q, k, v, implementation=pallas)

    sharded = jax.shard_map(call, mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))
    operands = []
    assert len(mosaic_gpu_kernels(sharded, q, k, k, operands=operands, mesh=mesh)) == 1
    assert "x64xi8>" in operands[0]  # (the 8 bits, as they lie)


@pytest.mark.parametrize(
    "page, seq",
    # (pages of a block, split; 9 pages of 16, not split and no whole program of keys; blocks
    # of a page)
    [(16, 768), (16, 144), pytest.param(256, 768, marks=SIMULATED_SLOW)],
)
def test_a_paged_cache_read_by_the_kernel_on_the_gpu_simulator_is_the_paged_path(
    page, seq, monkeypatch
):
    _split_small(monkeypatch)
    rng = np.random.default_rng(16)
    key_pages, value_pages, table = paged_pool(rng, 2, seq, page, 2, 64, jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(2, 1, 8, 64)), jnp.bfloat16)
    lengths = jnp.array([seq - 68, seq // 2])
    out, lse = js.paged_attention(
        q,
        key_pages,
        value_pages,
        table,
        lengths,
        return_residual=True,
        implementation=js.Paged(kernel=_simulated()),
    )
    wide = [x.astype(jnp.float32) for x in (q, key_pages, value_pages)]
    want = js.paged_attention(*wide, table, lengths, return_residual=True)
    assert bool(jnp.isfinite(out).all())  # (the NaN page is in no table)
    assert ref.rel_err(out, want[0]) < 2e-2 and ref.rel_err(lse, want[1]) < 1e-2


@SIMULATED_SLOW
def test_a_paged_caches_gradients_on_the_gpu_simulator(monkeypatch):
    _split_small(monkeypatch)
    rng = np.random.default_rng(17)
    pool = paged_pool(rng, 2, 192, 16, 2, 64, jnp.bfloat16)  # (12 pages: 1.5 programs)
    key_pages, value_pages, table = (jnp.nan_to_num(x) for x in pool)
    q = jnp.asarray(rng.normal(size=(2, 1, 8, 64)), jnp.bfloat16)
    lengths = jnp.array([190, 100])

    def loss(q, key_pages, value_pages, implementation):
        out = js.paged_attention(
            q, key_pages, value_pages, table, lengths, implementation=implementation
        )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2))(
        q, key_pages, value_pages, js.Paged(kernel=_simulated())
    )
    wide = [x.astype(jnp.float32) for x in (q, key_pages, value_pages)]
    want = jax.grad(loss, argnums=(0, 1, 2))(*wide, None)
    for got, wanted, name in zip(grads, want, ("dq", "d_key_pages", "d_value_pages"), strict=True):
        assert ref.rel_err(got, wanted) < 2e-2, name


def test_a_ragged_batch_read_by_the_kernel_on_the_gpu_simulator_is_the_ragged_path(monkeypatch):
    # A 40-query prefill chunk (two tiles of 32 queries, 4 query heads packed with each: its
    # padding rows first), a decoding step, an idle sequence and 3 queries, one kernel; against
    # the ragged path (its tiles too) in float32.
    _split_small(monkeypatch)
    rng = np.random.default_rng(18)
    key_pages, value_pages, table = paged_pool(rng, 4, 256, 16, 2, 64, jnp.bfloat16)
    starts = jnp.array([0, 40, 41, 41, 44])
    lengths = jnp.array([200, 256, 0, 37])
    q = jnp.asarray(rng.normal(size=(46, 8, 64)), jnp.bfloat16)  # (2 rows past the last)

    def call(q, key_pages, value_pages, implementation):
        return js.ragged_paged_attention(
            *(q, key_pages, value_pages, table, lengths, starts),
            max_queries=40,
            return_residual=True,
            implementation=implementation,
        )

    out, lse = call(q, key_pages, value_pages, js.Paged(kernel=_simulated()))
    want = call(*(x.astype(jnp.float32) for x in (q, key_pages, value_pages)), None)
    assert bool(jnp.isfinite(out).all())  # (the NaN page is in no table)
    assert ref.rel_err(out, want[0]) < 2e-2
    real = np.isfinite(np.asarray(want[1]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), real)
    assert ref.rel_err(lse[real], want[1][real]) < 1e-2


def test_a_ragged_batch_lowers_for_cuda_as_one_kernel_of_packed_rows():
    # 8 decoding steps and a 256-query chunk, S 1024 (N32 K8): tiles of 32 queries (128 rows
    # over the 4 query heads a key/value head has), one a decoding step and 8 for the chunk, in
    # one kernel: its queries (tiles, 128, K, d), each tile's rows its group's packed (not
    # B · max_queries = 9 · 256 queries).
    from tests.lowering import mosaic_gpu_kernels

    pool = jnp.zeros((9 * 16, 64, 8, 128), jnp.bfloat16)
    table = jnp.arange(9 * 16, dtype=jnp.int32).reshape(9, 16)
    q = jnp.zeros((8 + 256, 32, 128), jnp.bfloat16)
    starts = jnp.array([*range(9), 264])
    lengths = jnp.full((9,), 1000)
    paged = js.Paged(kernel=js.Pallas(backend="mosaic_gpu"))

    def call(q, key_pages, value_pages):
        return js.ragged_paged_attention(
            *(q, key_pages, value_pages, table, lengths, starts),
            max_queries=256,
            implementation=paged,
        )

    operands = []
    assert len(mosaic_gpu_kernels(call, q, pool, pool, operands=operands)) == 1
    tiles = (264 + 9 * 31) // 32  # (at most: the batch's rows, each sequence's padding)
    assert operands[0].startswith(f"tensor<{tiles}x128x8x128xbf16>"), operands[0]


@pytest.mark.parametrize("page", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_a_paged_decoding_call_lowers_for_cuda_reading_the_pool_in_place(page):
    # B2 S8192 N32 K8: the forward kernel takes the whole pool and each chunk's pages; its
    # blocks are copied page by page. The backward kernels read the gathered pages.
    from tests.lowering import mosaic_gpu_kernels

    per_sequence = 8192 // page
    pool = jnp.zeros((2 * per_sequence, page, 8, 128), jnp.bfloat16)
    table = jnp.zeros((2, per_sequence), jnp.int32)
    q = jnp.zeros((2, 1, 32, 128), jnp.bfloat16)
    lengths = jnp.array([8000, 5000])
    paged = js.Paged(kernel=js.Pallas(backend="mosaic_gpu"))

    def call(q, key_pages, value_pages):
        return js.paged_attention(q, key_pages, value_pages, table, lengths, implementation=paged)

    def loss(q, key_pages, value_pages):
        return call(q, key_pages, value_pages).astype(jnp.float32).sum()

    # (lowered once, with the gradients: the forward kernel is the program's first)
    operands = []
    grads = jax.grad(loss, argnums=(0, 1, 2))
    assert len(mosaic_gpu_kernels(grads, q, pool, pool, operands=operands)) == 3
    assert f"tensor<{2 * per_sequence}x{page}x8x128xbf16>" in operands[0]  # (the pool, once)
    assert f"tensor<2x2x{4096 // page}xi32>" in operands[0]  # (each chunk's pages)


@pytest.mark.parametrize(
    "fmt, paged",
    [
        ("int8", False),
        pytest.param("float8_e4m3fn", False, marks=SIMULATED_SLOW),
        pytest.param("int8", True, marks=SIMULATED_SLOW),
    ],
)
def test_quantized_caches_read_by_the_kernel_on_the_gpu_simulator_are_the_reference(
    fmt, paged, monkeypatch
):
    # The 8 bits and the scales copied as they are, each block widened in shared memory, the
    # scales on the scores and the weights: the reference on the dequantized cache (a scale
    # dropped or misplaced fails it by orders of magnitude).
    _split_small(monkeypatch)
    rng = np.random.default_rng(18)
    lengths = jnp.array([700, 300])
    q = jnp.asarray(rng.normal(size=(2, 1, 8, 64)), jnp.bfloat16)
    if paged:
        key_pages, value_pages, table = paged_pool(rng, 2, 768, 16, 2, 64, jnp.bfloat16)
        pools = [js.quantize(x, fmt) for x in (key_pages, value_pages)]  # (a NaN page, unread)
        out, lse = js.paged_attention(
            q,
            *pools,
            table,
            lengths,
            return_residual=True,
            implementation=js.Paged(kernel=_simulated()),
        )
        wide = [x.astype(jnp.float32) for x in (q, *(p.dequantize() for p in pools))]
        want = js.paged_attention(*wide, table, lengths, return_residual=True)
    else:
        _, k, v = qkv(rng, 2, 1, 700, 8, 2, 64, dtype=jnp.bfloat16)
        caches = [js.quantize(x, fmt) for x in (k, v)]
        out, lse = js.dot_product_attention(
            q,
            *caches,
            key_value_seq_lengths=lengths,
            implementation=_simulated(),
            return_residual=True,
        )
        theirs = ref.attention(q, *(x.dequantize() for x in caches), kv_lengths=np.asarray(lengths))
        want = theirs["out"], theirs["lse"]
    assert bool(jnp.isfinite(out).all())
    assert ref.rel_err(out, want[0]) < 2e-2 and ref.rel_err(lse, want[1]) < 1e-2


@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_quantized_decoding_call_lowers_for_cuda_reading_the_8_bits_in_place(paged):
    # B2 S8192 N32 K8 int8: the forward kernel takes the 8-bit keys and values as they lie
    # (or the whole pool, once) and their scales heads first; nothing widened around it.
    from tests.lowering import mosaic_gpu_kernels

    q = jnp.zeros((2, 1, 32, 128), jnp.bfloat16)
    lengths = jnp.array([8000, 5000])
    pallas = js.Pallas(backend="mosaic_gpu")
    if paged:
        pool = js.quantize(jnp.zeros((1024, 16, 8, 128), jnp.bfloat16))
        table = jnp.zeros((2, 512), jnp.int32)
        args, cache, scale = (q, pool, pool), "tensor<1024x16x8x128xi8>", "tensor<8x1024x16xbf16>"

        def call(q, key, value):
            paged = js.Paged(kernel=pallas)
            return js.paged_attention(q, key, value, table, lengths, implementation=paged)
    else:
        k = js.quantize(jnp.zeros((2, 8192, 8, 128), jnp.bfloat16))
        # (2 chunks in place; their scales heads first)
        args, cache, scale = (q, k, k), "tensor<2x2x4096x8x128xi8>", "tensor<2x2x8x4096xbf16>"

        def call(q, key, value):
            return js.dot_product_attention(
                q, key, value, key_value_seq_lengths=lengths, implementation=pallas
            )

    operands = []
    assert len(mosaic_gpu_kernels(call, *args, operands=operands)) == 1
    types = operands[0].split(", ")
    assert types.count(cache) == 2 and types.count(scale) == 2
    assert [t for t in types if t.endswith("x8x128xbf16>")] == ["tensor<2x128x8x128xbf16>"]


@SIMULATED_SLOW
def test_a_quantized_caches_gradients_on_the_gpu_simulator(monkeypatch):
    # The kernels' on the widened cache, then the widening's: the queries' and the scales'.
    _split_small(monkeypatch)
    q, k, v = qkv(np.random.default_rng(19), 2, 1, 700, 8, 2, 64, dtype=jnp.bfloat16)
    caches = [js.quantize(x, "int8") for x in (k, v)]
    lengths = np.array([700, 300])
    d_out = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.bfloat16)

    def loss(q, key, value):
        out = js.dot_product_attention(
            q, key, value, key_value_seq_lengths=lengths, implementation=_simulated()
        )
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    d_q, d_key, d_value = jax.grad(loss, argnums=(0, 1, 2), allow_int=True)(q, *caches)
    want = ref.attention(q, *(x.dequantize() for x in caches), kv_lengths=lengths, d_out=d_out)
    assert ref.rel_err(d_q, want["dq"]) < 2e-2
    for got, cache, name in zip((d_key, d_value), caches, ("dk", "dv"), strict=True):
        d_scale = np.sum(want[name] * np.asarray(cache.values, np.float64), -1, keepdims=True)
        assert ref.rel_err(got.scale, d_scale) < 1e-2, name  # (summed in float32)


def _latent_call(paged: bool, implementation, q, latent, lengths, features):
    """A shared latent's attention (MLA): contiguous, or in pages of 16 (a table in order)."""
    if not paged:
        return js.dot_product_attention(
            q,
            latent,
            js.LatentValues(features),
            key_value_seq_lengths=lengths,
            implementation=implementation,
            return_residual=True,
        )
    batch, seq, _, width = latent.shape
    pool = latent.reshape(batch * seq // 16, 16, 1, width)
    table = jnp.arange(batch * seq // 16, dtype=jnp.int32).reshape(batch, -1)
    return js.paged_attention(
        q,
        pool,
        js.LatentValues(features),
        table,
        lengths,
        implementation=js.Paged(kernel=implementation),
        return_residual=True,
    )


@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=SIMULATED_SLOW)])
def test_a_shared_latent_read_by_the_kernel_on_the_gpu_simulator_is_the_reference(
    paged, monkeypatch
):
    # MLA: 128 query heads packed into the rows of two programs, each's two consumers holding
    # the same 64 rows, each computing half of the values' features from the latent's blocks.
    _split_small(monkeypatch)
    rng = np.random.default_rng(19)
    q = jnp.asarray(rng.normal(size=(2, 1, 128, 192)), jnp.bfloat16)
    latent = jnp.asarray(rng.normal(size=(2, 320, 1, 192)), jnp.bfloat16)
    lengths = jnp.array([300, 170])
    out, lse = _latent_call(paged, _simulated(), q, latent, lengths, 128)
    want = ref.attention(q, latent, latent[..., :128], kv_lengths=np.asarray(lengths))
    assert out.shape == (2, 1, 128, 128)
    assert ref.rel_err(out, want["out"]) < 2e-2 and ref.rel_err(lse, want["lse"]) < 1e-2


def test_a_shared_latent_with_a_block_mask_visits_only_the_listed_blocks():
    # The consumers hold the same rows: the lists are of the program's rows. NaN in the latent
    # where no tile is listed: visited, it would reach the output (0 · NaN).
    rng = np.random.default_rng(21)
    q = jnp.asarray(rng.normal(size=(1, 200, 2, 192)), jnp.bfloat16)
    latent = jnp.asarray(rng.normal(size=(1, 200, 1, 192)), jnp.bfloat16)
    unlisted = jnp.where((jnp.arange(200) >= 128)[None, :, None, None], jnp.nan, latent)
    out = js.dot_product_attention(
        q, unlisted, js.LatentValues(128), mask_mod=_listed, implementation=_simulated()
    )
    want = ref.attention(q, latent, latent[..., :128], mask_mod=_listed)["out"]
    assert bool(jnp.isfinite(out).all()) and ref.rel_err(out, want) < 2e-2


@SIMULATED_SLOW
def test_a_shared_latents_gradients_on_the_gpu_simulator(monkeypatch):
    # The backward kernels read the latent's slice as the values (a copy), its gradient added
    # to the keys'.
    _split_small(monkeypatch)
    rng = np.random.default_rng(20)
    q = jnp.asarray(rng.normal(size=(2, 1, 64, 192)), jnp.bfloat16)
    latent = jnp.asarray(rng.normal(size=(2, 320, 1, 192)), jnp.bfloat16)
    lengths = jnp.array([300, 170])

    def loss(q, latent, implementation):
        out, _ = _latent_call(False, implementation, q, latent, lengths, 128)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grads = jax.grad(loss, argnums=(0, 1))(q, latent, _simulated())
    want = jax.grad(loss, argnums=(0, 1))(q.astype(jnp.float32), latent.astype(jnp.float32), None)
    for got, wanted, name in zip(grads, want, ("dq", "d_latent"), strict=True):
        assert ref.rel_err(got, wanted) < 2e-2, name


@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_shared_latent_decoding_call_lowers_for_cuda_reading_the_latent_once(paged):
    # DeepSeek-V3's MLA decode, B2 S8192: 128 query heads against one latent head of 576
    # features, the first 512 the values. One forward kernel, whose only cache operand is the
    # latent (or its pool), as it lies: no 512-wide values beside it, nothing padded.
    from tests.lowering import mosaic_gpu_kernels

    q = jnp.zeros((2, 1, 128, 576), jnp.bfloat16)
    latent = jnp.zeros((2, 8192, 1, 576), jnp.bfloat16)
    lengths = jnp.array([8000, 5000])
    pallas = js.Pallas(backend="mosaic_gpu")

    def call(q, latent):
        return _latent_call(paged, pallas, q, latent, lengths, 512)[0]

    operands = []
    [kernel] = mosaic_gpu_kernels(call, q, latent, operands=operands)
    types = operands[0].split(", ")
    cache = "tensor<1024x16x1x576xbf16>" if paged else "tensor<2x2x4096x1x576xbf16>"
    assert [t for t in types if "bf16" in t] == ["tensor<2x128x1x576xbf16>", cache]
    # The scores once, in the first consumer (576 / 16 steps of a 64 × 64 product, in each of
    # a tile's bodies), the weights' product in both (64 / 16 steps of 64 × 256: each's half).
    # (Where the kernel is printed: JAX 0.11's bindings read back its op names alone.)
    if kernel.startswith("module"):
        steps = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.", kernel)
        steps = collections.Counter(steps)
        assert set(steps) == {"m64n64k16", "m64n256k16"}
        assert steps["m64n64k16"] / 36 == steps["m64n256k16"] / (2 * 4)


@pytest.mark.slow
def test_a_shared_latents_gradients_compile_for_hopper():
    # MLA's 576-wide heads: the backward kernels are Triton's, heads padded to 1024, on tiles
    # narrow enough for an sm_90 block's shared memory (compiled, where Triton's wheels are).
    from tests.lowering import mosaic_gpu_kernels, verified_kernels

    q = jnp.zeros((1, 1, 128, 576), jnp.bfloat16)
    latent = jnp.zeros((1, 1024, 1, 576), jnp.bfloat16)
    lengths = jnp.array([1000])

    def loss(q, latent):
        out, _ = _latent_call(False, js.Pallas(backend="mosaic_gpu"), q, latent, lengths, 512)
        return out.astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1))
    assert len(mosaic_gpu_kernels(grad, q, latent)) == 1  # (the forward)
    names = sorted(kernel.name for kernel in verified_kernels(grad, q, latent, platform="cuda"))
    assert names == ["jax_sdpa_backward_keys", "jax_sdpa_backward_queries"]
