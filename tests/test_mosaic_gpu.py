"""The Mosaic GPU kernel (``Pallas(backend="mosaic_gpu")``, Hopper): what a CPU can prove of it.

- Its forward pass on the GPU simulator (``plgpu.InterpretGPUParams``: shared memory, the three
  warpgroups, TMA copies and barriers simulated) against the float64 reference, in bfloat16:
  causal and not, GQA, windows, sinks, a ``score_mod``, sigmoid, a log-sum-exp, lengths no tile
  divides, heads that are not a power of two. Gradients go through the Triton kernels' programs
  (the Mosaic GPU backward is not written yet).
- Lowering for ``cuda`` on this CPU (Mosaic GPU's layout inference and its shared-memory check
  run then): each kernel module is then parsed and verified with Mosaic GPU's dialect. Compiling
  it to a cubin is XLA's (C++ passes a CPU jaxlib does not carry), so "lowers and verifies" is
  all this says; a device runs it (``benchmarks/bench_device.py``).

JAX 0.11 and later (the kernel's Warpgroup semantics): skipped before.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from jax_sdpa._jax_compat import MOSAIC_GPU_KERNEL
from tests import reference as ref
from tests.util import qkv

pytestmark = pytest.mark.skipif(not MOSAIC_GPU_KERNEL, reason="Mosaic GPU kernel: JAX ≥ 0.11")


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


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seq, width", [(128, 64), (200, 96)])
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


def test_sigmoid_attention_and_more_keys_than_queries_on_the_gpu_simulator():
    q, k, v = qkv(np.random.default_rng(1), 2, 64, 300, 2, 1, 64, dtype=jnp.bfloat16)
    out = js.dot_product_attention(q, k, v, normalizer="sigmoid", implementation=_simulated())
    want = ref.attention(q, k, v, normalizer="sigmoid")
    assert ref.rel_err(out, want["out"]) < 2e-2


def test_gradients_with_the_mosaic_gpu_forward_are_the_reference():
    q, k, v = qkv(np.random.default_rng(2), 1, 128, 128, 2, 1, 64, dtype=jnp.bfloat16)
    d_out = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.bfloat16)

    def loss(q, k, v):
        out = js.dot_product_attention(q, k, v, is_causal=True, implementation=_simulated())
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = ref.attention(q, k, v, is_causal=True, d_out=d_out)
    for got, name in zip(grads, ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(got, want[name]) < 3e-2, name


@pytest.mark.parametrize(
    "shape, keywords",
    [
        ((2, 1024, 4, 2, 128), dict(is_causal=True)),
        ((1, 512, 2, 2, 64), {}),
        ((1, 512, 2, 1, 256), dict(is_causal=True)),
        ((1, 1024, 2, 2, 128), dict(is_causal=True, local_window_size=(256, 0))),
    ],
    ids=["causal GQA d128", "no mask d64", "causal d256", "window"],
)
def test_the_kernel_lowers_for_cuda_and_its_module_verifies(shape, keywords):
    from tests.lowering import mosaic_gpu_kernels

    b, t, n, kv_heads, width = shape
    q = jnp.zeros((b, t, n, width), jnp.bfloat16)
    k = jnp.zeros((b, t, kv_heads, width), jnp.bfloat16)
    pallas = js.Pallas(backend="mosaic_gpu")

    def call(q, k, v):
        return js.dot_product_attention(q, k, v, implementation=pallas, **keywords)

    (kernel,) = mosaic_gpu_kernels(call, q, k, k)
    assert "wgmma" in kernel and "cp.async.bulk.tensor" in kernel  # products; TMA copies
