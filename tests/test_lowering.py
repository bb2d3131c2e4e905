"""The fused kernel lowers, and its kernel modules verify (and compile for a GPU), for the shapes
and options users have: a matrix, each case lowered for ``cuda`` (Triton) and ``tpu`` (Mosaic;
in CI a few only through a sibling, :data:`TPU_AS`), forward and forward+backward (every
gradient: queries, keys, values and the floating-point arrays a call closes over), each kernel
module inside checked by :func:`tests.lowering.verified_kernels`.

No device runs here: that the modules verify (and, for a GPU, compile to a cubin) is not that
they run correctly; the interpreter's values are checked against the float64 reference in
``tests/test_pallas.py``, the behaviour tests and the sweep, and ``benchmarks/bench_device.py
--smoke`` runs this matrix on a GPU.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest

import jax_sdpa as js
from jax_sdpa._jax_compat import DECOMPOSITIONS
from tests.lowering import exported, verified_kernels
from tests.matrix import CASES, TPU_CANNOT, call, gradients
from tests.profile import PROFILE

pytestmark = pytest.mark.x64_sampled  # lowering is the same program under x64


# Summed by atomic adds into memory (Triton's), a table's gradient: more entries than one-hot
# sums take.
ATOMICS = {name for name in CASES if name.startswith(("relative positions", "a bias"))}
# Every case's kernels are verified; these (and in the thorough profile all) are also compiled
# for sm_90 (3 s a kernel on this CPU): lengths that no tile divides and query lengths (which
# failed on an H200 before), the largest shared memory (d = 256), an array's gradient as
# atomics.
COMPILED = {
    "T = S = 65, causal",
    "query lengths",
    "d = 256",
    "relative positions, a large captured table",
}

# The inner loop verifies the cases that failed on an H200 before (lengths not a multiple of the
# tile, query lengths) and the one a TPU failed to lower; CI verifies them all.
INNER_LOOP = {"T = S = 65, causal", "query lengths", "documents over a (B, T) array"}
# Mosaic lowers a case for a TPU as it lowers its sibling here (the same rules at another length
# or width, an option alone that another case takes with more): CI lowers these for cuda only,
# the thorough profile for both.
TPU_AS = {
    "T = S = 63": "T = S = 65, causal",
    "T = S = 1000, causal": "T = S = 65, causal",
    "T = S = 1024, causal": "T = S = 65, causal",
    "T = S = 4095, causal": "T = S = 65, causal",
    "T = 1000, S = 63": "T = 65, S = 63",
    "T = 63, S = 1000, bottom-right causal": "T = 1, S = 4095, bottom-right causal",
    "key lengths": "both lengths, causal",
    "window": "window, bottom-right causal, T ≠ S",
    "MHA": "MQA",
    "d = 64": "d = 80",
    "d = 96": "d = 80",
    "d_k = 128, d_v = 64": "d_k = 96, d_v = 256",
    "sigmoid": "sigmoid, max scores",
    "ALiBi, a small captured array": "ALiBi, documents and sinks",
    "block mask of documents": "block mask of a band",
    "T = S = 1": "T = S = 1000",
    "query lengths": "both lengths, causal",
    "segment ids": "documents over a (B, T) array",
    "softmax, max scores": "sigmoid, max scores",
    "a band": "block mask of a band",
}
ON_TPU = set(CASES) - TPU_CANNOT - (set() if PROFILE == "thorough" else set(TPU_AS))
MATRIX = [
    pytest.param(platform, name, marks=[] if name in INNER_LOOP else [pytest.mark.slow])
    for name in CASES
    for platform in ("cuda", "tpu")
    if platform == "cuda" or name in ON_TPU
]
FORWARD = ["jax_sdpa_forward"]
BACKWARD = ["jax_sdpa_backward_keys", "jax_sdpa_backward_queries"]


def test_each_case_lowered_for_cuda_only_has_its_sibling_lowered_for_a_tpu():
    assert set(TPU_AS) <= set(CASES) - TPU_CANNOT
    assert set(TPU_AS.values()) <= set(CASES) - TPU_CANNOT - set(TPU_AS)


@pytest.mark.parametrize("platform, name", MATRIX)
def test_every_kernel_module_verifies_forward_and_backward(platform, name):
    case = CASES[name]
    compile = name in COMPILED or PROFILE == "thorough"
    inputs = case.inputs()
    both = verified_kernels(gradients(case, "pallas"), *inputs, platform=platform, compile=compile)
    # The forward kernel; the backward pass has its own two (queries; keys and values). A call
    # with no gradient, one kernel: the inner loop's cases (the forward is the gradient's).
    assert sorted(kernel.name for kernel in both) == sorted(FORWARD + BACKWARD)
    if name in INNER_LOOP:
        forward = verified_kernels(call(case, "pallas"), *inputs, platform=platform, compile=False)
        assert [kernel.name for kernel in forward] == FORWARD
    atomics = [kernel.name for kernel in both if "tt.atomic_rmw" in kernel.asm]
    assert atomics == (["jax_sdpa_backward_keys"] if name in ATOMICS else [])


def test_an_arrays_gradient_of_a_side_no_block_has_is_added_into_memory():
    # 200 entries, one a key: fewer than one-hot sums take, but no Triton block has a side that
    # is not a power of two, so its programs add it into memory at its points.
    bias = jnp.linspace(-1.0, 1.0, 200)
    q = jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)

    def loss(q, k, v, bias):
        def biased(score, b, h, i, j):
            return score + bias[j].astype(score.dtype)

        out = js.dot_product_attention(q, k, v, score_mod=biased, implementation="pallas")
        return out.astype(jnp.float32).sum()

    program = jax.grad(loss, argnums=(0, 1, 2, 3))
    kernels = verified_kernels(program, q, q, q, bias, platform="cuda", compile=False)
    atomics = [kernel.name for kernel in kernels if "tt.atomic_rmw" in kernel.asm]
    assert atomics == ["jax_sdpa_backward_keys"]


def test_a_table_no_derivative_asks_for_has_no_gradient_computed():
    # A relative table the call closes over, differentiated or not: its gradient (atomic adds
    # into memory) only where a derivative asks for it.
    table = jnp.linspace(-1.0, 1.0, 300)
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

    def loss(q, table):
        def relative(score, b, h, i, j):
            return score + table[i - j + 150].astype(score.dtype)

        out = js.dot_product_attention(q, q, q, score_mod=relative, implementation="pallas")
        return out.astype(jnp.float32).sum()

    for argnums, atomics in (((0,), []), ((0, 1), ["jax_sdpa_backward_keys"])):
        program = jax.grad(loss, argnums=argnums)
        kernels = verified_kernels(program, q, table, platform="cuda", compile=False)
        assert [kernel.name for kernel in kernels if "tt.atomic_rmw" in kernel.asm] == atomics


def test_erf_erfc_and_round_which_triton_lowers_no_primitive_for_are_computed_in_its_kernels():
    # jax.nn.gelu(approximate=False) of the scores (erfc, and jnp.array's copy), erf and round
    # of a bias per key: the Triton programs compute them as rewrites.py does; before, each
    # failed to lower ("Unimplemented primitive in Pallas Triton lowering: erf").
    bias = jnp.linspace(-2.0, 2.0, 128)
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

    def loss(q, k, v, bias):
        def mod(score, b, h, i, j):
            bias_j = jax.lax.erf(bias[j]) + jnp.round(bias[j] * 4)
            return jax.nn.gelu(score, approximate=False) + bias_j.astype(score.dtype)

        out = js.dot_product_attention(q, k, v, score_mod=mod, implementation="pallas")
        return out.astype(jnp.float32).sum()

    program = jax.grad(loss, argnums=(0, 1, 2, 3))
    kernels = verified_kernels(program, q, q, q, bias, platform="cuda", compile=False)
    assert len(kernels) == 3


def test_global_tokens_compared_with_each_key_lower_in_triton_where_they_are_a_power_of_two():
    # jnp.any(kv_idx == tokens): a (keys, tokens) array, which the Mosaic GPU kernel refuses and
    # sends here (tests/test_mosaic_gpu.py); Triton's blocks have sides that are powers of two.
    tokens = jnp.array([0, 5, 17, 30])
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        def mask_mod(b, h, i, j):
            return jnp.any(j == tokens) | (j <= i)

        out = js.dot_product_attention(q, k, v, mask_mod=mask_mod, implementation="pallas")
        return out.astype(jnp.float32).sum()

    program = jax.grad(loss, argnums=(0, 1, 2))
    assert len(verified_kernels(program, q, q, q, platform="cuda", compile=False)) == 3


def test_the_bessel_functions_which_triton_lowers_no_primitive_for_are_computed_in_its_kernels():
    # JAX's own decompositions, their equations rewritten (rewrites.REWRITES); before, each
    # failed to lower ("Unimplemented primitive in Pallas Triton lowering: bessel_i0e"). i0e
    # of a bias per key, not differentiated; from JAX 0.12 (bessel_i1e's decomposition, which
    # i0e's derivative takes too) i0e and i1e of the scores.
    bias = jnp.linspace(-10.0, 10.0, 128)
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        def mod(score, b, h, i, j):
            score = score + jax.scipy.special.i0e(bias[j]).astype(score.dtype)
            if "bessel_i1e" in DECOMPOSITIONS:
                return score + jax.scipy.special.i0e(score) - jax.scipy.special.i1e(score)
            return score

        out = js.dot_product_attention(q, k, v, score_mod=mod, implementation="pallas")
        return out.astype(jnp.float32).sum()

    program = jax.grad(loss, argnums=(0, 1, 2))
    assert len(verified_kernels(program, q, q, q, platform="cuda", compile=False)) == 3


@pytest.mark.parametrize("causal", [True, False])
def test_on_a_gpu_the_kernels_read_and_write_the_callers_layout_in_place(causal):
    # BTNH in, BTNH out: each program reads its head's rows where they lie (a strided block), so
    # no transpose and no pad of the sequences around the kernels (FlashAttention and cuDNN take
    # strides too). The one per-call pass left is GQA's sum of each group's key gradients.
    q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)

    def attend(q, k, v):
        out = js.dot_product_attention(q, k, v, is_causal=causal, implementation="pallas")
        return out.astype(jnp.float32).sum()

    def ops(program, platform):
        text = exported(program, q, kv, kv, platform=platform)
        return collections.Counter(re.findall(r"\bstablehlo\.([a-z_]+)", text))

    for program in (attend, jax.grad(attend, argnums=(0, 1, 2))):
        gpu = ops(program, "cuda")
        assert gpu["custom_call"] >= 1 and gpu["transpose"] == gpu["pad"] == 0, gpu
        # (a TPU's blocks end in two whole axes: there the heads go first, around the call)
        assert ops(program, "tpu")["transpose"] > 0


def test_a_call_traces_tritons_kernel_once_for_cuda_and_rocm():
    # lax.platform_dependent joins equal branches: Triton's, Mosaic TPU's and the interpreter's
    # kernels, each traced once (Triton's was traced for cuda and for rocm, four in all).
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    call = lambda q: js.dot_product_attention(q, q, q, implementation="pallas")  # noqa: E731
    assert str(jax.make_jaxpr(call)(q)).count("pallas_call[") == 3
