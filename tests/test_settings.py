"""The settings users run: x64 on or off gives the same results, and forward-mode derivatives.

With ``jax_enable_x64`` on, float32 inputs stay float32 and every feature gives what it gives
with x64 off, to float32 rounding (the inner loop's behaviour tests also run with x64 on:
CI's pass under the newest JAX, ``.ci/run``). ``jax.jvp`` and ``jax.jacfwd`` work on the default implementation; the
implementations with their own backward pass have reverse mode only, and say so.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from jax_sdpa._jax_compat import PALLAS_UNDER_SHARD_MAP
from tests import reference as ref
from tests.profile import X64
from tests.util import RING_SECOND_ORDER, enable_x64, qkv

# Everything that classifies tiles or reads indices: a mask_mod over captured ids, segment ids,
# a window, lengths, sinks and a score_mod over a captured table.
DOCUMENTS = np.sort(np.random.default_rng(3).integers(0, 3, size=(2, 40)), axis=1)


def _everything(q, k, v, slopes, implementation):
    documents = jnp.asarray(DOCUMENTS, jnp.int32)
    options = dict(
        mask_mod=lambda b, h, i, j: (documents[b, i] == documents[b, j]) | (j < 2),
        score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j).astype(s.dtype),
        is_causal=True,
        local_window_size=(20, 0),
        key_value_seq_lengths=jnp.array([40, 31], jnp.int32),
        sinks=jnp.array([0.3, -1.0, 0.0, 2.0], jnp.float32),
        return_residual=True,
    )
    if implementation == "paged":
        pages = (x.reshape(-1, 4, *x.shape[2:]) for x in (k, v))  # each sequence: 10 pages of 4
        table = jnp.arange(20, dtype=jnp.int32).reshape(2, 10)
        del options["key_value_seq_lengths"], options["is_causal"]
        lengths = jnp.array([40, 31], jnp.int32)
        return js.paged_attention(
            q[:, -3:], *pages, table, lengths, implementation=js.Paged(8), **options
        )
    tiles = {"xla": "xla", "chunked": js.Chunked(16, 8), "decode": js.Decode(8)}
    if implementation == "decode":
        q = q[:, -3:]
        options["causal_alignment"] = "bottom_right"
    return js.dot_product_attention(q, k, v, implementation=tiles[implementation], **options)


@pytest.mark.slow  # compiles every implementation twice; CI runs it
@pytest.mark.x64_off
@pytest.mark.skipif(X64, reason="in a run with x64 on, off is on")
@pytest.mark.parametrize("implementation", ["xla", "chunked", "decode", "paged"])
def test_x64_on_gives_what_x64_off_gives_in_float32(rng, implementation):
    q, k, v = qkv(rng, 2, 40, 40, 4, 2, 8)
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, size=4), jnp.float32)
    d_out = rng.normal(size=(2, 3 if implementation in ("decode", "paged") else 40, 4, 8))

    def run():
        def loss(q, k, v, slopes):
            out, lse = _everything(q, k, v, slopes, implementation)
            return jnp.sum(out * jnp.asarray(d_out, jnp.float32)), (out, lse)

        grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, slopes)
        assert out.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in grads)
        return out, lse, grads

    off = run()
    with enable_x64():
        on = run()
    for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_issues_x64_repro_runs():
    with enable_x64():
        q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 63, 4, 16)), jnp.float32)
        k = jnp.asarray(np.random.default_rng(1).standard_normal((1, 48, 2, 16)), jnp.float32)
        out = js.dot_product_attention(
            q,
            k,
            k,
            implementation=js.Chunked(block_q=16, block_kv=8),
            mask_mod=lambda b, h, i, j: i >= j,
        )
    expected = ref.attention(q, k, k, is_causal=True)["out"]
    np.testing.assert_allclose(out, expected, atol=2e-6)


# --- forward mode ---------------------------------------------------------------------------


def _central_difference(f, x, tangent, step=1e-6):
    """``f``'s derivative along ``tangent`` at ``x``, by the float64 reference."""
    x, tangent = np.asarray(x, np.float64), np.asarray(tangent, np.float64)
    return (f(x + step * tangent) - f(x - step * tangent)) / (2 * step)


@pytest.mark.parametrize(
    "transform", ["jvp", "jit(jvp)", "jvp(vmap)", "jacfwd"], ids=lambda name: name
)
def test_forward_mode_on_the_default_implementation(rng, transform):
    # implementation=None picks the chunked path on this CPU (and decode for this shape):
    # under forward mode it takes the dense path, which has one.
    q, k, v = qkv(rng, 1, 2, 1500, 2, 1, 4)
    tangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    f = functools.partial(js.dot_product_attention, key=k, value=v, is_causal=True)
    want = _central_difference(lambda x: ref.attention(x, k, v, is_causal=True)["out"], q, tangent)
    if transform == "jvp":
        got = jax.jvp(f, (q,), (tangent,))[1]
    elif transform == "jit(jvp)":
        got = jax.jit(lambda q, t: jax.jvp(f, (q,), (t,))[1])(q, tangent)
    elif transform == "jvp(vmap)":
        got = jax.jvp(jax.vmap(f), (q[None],), (tangent[None],))[1][0]
    else:
        jacobian = jax.jacfwd(f)(q)  # (out shape) + (q shape)
        got = jnp.tensordot(jacobian, tangent, axes=q.ndim)
    assert ref.rel_err(got, want) < 1e-4


@pytest.mark.parametrize("implementation", ["chunked", "decode", "ring"])
def test_an_implementation_without_forward_mode_says_so(rng, implementation):
    q, k, v = qkv(rng, 1, 4, 8, 2, 1, 4)
    if implementation == "ring":
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
        f = functools.partial(js.ring_dot_product_attention, mesh=mesh, seq_axis="seq")
    else:
        f = functools.partial(js.dot_product_attention, implementation=implementation)
    asked = (
        "`ring_attention`" if implementation == "ring" else f"`implementation={implementation!r}`"
    )
    message = (
        f"{asked} has no forward-mode derivative (jax.jvp, jax.jacfwd): its backward pass is its "
        "own (jax.custom_vjp); dot_product_attention(implementation='xla') has one."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        jax.jvp(lambda q: f(q, k, v), (q,), (q,))


@pytest.mark.parametrize(
    "path",
    [
        "kernel",
        pytest.param(
            "ring on the kernel",
            marks=pytest.mark.skipif(
                not PALLAS_UNDER_SHARD_MAP, reason="refused before JAX 0.7 (tests/multidevice)"
            ),
        ),
    ],
)
@pytest.mark.parametrize("second", ["hessian", "jvp of grad", "grad of grad"])
def test_the_kernel_without_second_derivatives_says_so(rng, second, path):
    # Its backward pass is Pallas kernels, which JAX does not differentiate; without this check
    # JAX fails inside its own batching or linearization of the kernels, naming neither.
    q, k, v = qkv(rng, 1, 16, 16, 2, 1, 16)
    kernel = js.Pallas(16, 16, interpret=True)
    if path == "kernel":
        attend = functools.partial(js.dot_product_attention, value=v, implementation=kernel)
        asked = "`implementation='pallas'`"
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
        spec = jax.sharding.PartitionSpec(None, "seq")
        attend = jax.shard_map(
            lambda q, k: js.ring_attention(q, k, v, axis_name="seq", implementation=kernel),
            mesh=mesh,
            in_specs=(spec, spec),
            out_specs=spec,
            check_vma=False,  # (the interpreter's needs, docs/guides/kernels.md: not the kernel's)
        )
        asked = "`ring_attention`"

    def total(q, k):
        return attend(q, k).sum()

    seconds = {
        "hessian": lambda: jax.hessian(total)(q, k),
        "jvp of grad": lambda: jax.jvp(lambda k: jax.grad(total)(q, k), (k,), (k,)),
        "grad of grad": lambda: jax.grad(lambda q: jnp.sum(jax.grad(total)(q, k) ** 2))(q),
    }
    message = f"{asked} has no second derivatives (jax.hessian, a jvp or grad"
    with pytest.raises(TypeError, match=re.escape(message)):
        seconds[second]()
    jax.grad(total)(q, k)  # one derivative: its own backward pass


@pytest.mark.slow  # compile-bound (second derivatives of three paths); CI runs it
@pytest.mark.parametrize(
    "implementation",
    [
        "chunked",
        "decode",
        pytest.param(
            "ring",
            marks=pytest.mark.skipif(
                not RING_SECOND_ORDER, reason="JAX 0.6's shard_map check fails its own transpose"
            ),
        ),
    ],
)
def test_forward_over_reverse_and_reverse_over_reverse_work_on_the_custom_vjp_paths(
    rng, implementation
):
    # jax.hessian is jacfwd(jacrev(f)): forward mode over the path's own backward; a jvp in the
    # keys of a gradient in the queries likewise; a gradient of a gradient goes through the
    # backward pass's loops (whose trip counts are known with no mask and whole tiles).
    q, k, v = qkv(rng, 1, 4, 4, 2, 1, 2)
    tangent = jnp.asarray(rng.normal(size=k.shape), jnp.float32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))

    def total(q, k, implementation):
        if implementation == "ring":
            out = js.ring_dot_product_attention(q, k, v, mesh=mesh, seq_axis="seq")
        else:
            tiles = {"chunked": js.Chunked(2, 2), "decode": js.Decode(2), "xla": "xla"}
            out = js.dot_product_attention(q, k, v, implementation=tiles[implementation])
        return jnp.sum(out * jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))

    @functools.partial(jax.jit, static_argnums=0)  # (one program each: compiled once)
    def second_orders(impl):
        hessian = jax.hessian(total)(q, k, impl)
        mixed = jax.jvp(lambda k: jax.grad(total)(q, k, impl), (k,), (tangent,))[1]
        grad_of_grad = jax.grad(lambda q: jnp.sum(jax.grad(total)(q, k, impl) ** 2))(q)
        return hessian, mixed, grad_of_grad

    for got, want in zip(second_orders(implementation), second_orders("xla"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
