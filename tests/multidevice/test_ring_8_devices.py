"""Ring attention on 8 simulated CPU devices (run by tests/test_ring.py in its own process).

The oracle is single-device :func:`jax_sdpa.dot_product_attention` (itself tested against a
float64 reference and ``jax.nn``): f32 forward within 1e-6, gradients within 1e-5, relative to
the largest entry.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_sdpa as js
from jax_sdpa._jax_compat import PALLAS_UNDER_SHARD_MAP
from tests.lowering import exported, verified, verified_kernels
from tests.util import abstract_mesh

assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"


# The ring's steps by the kernel: refused before JAX 0.7 (the last test says so).
KERNEL = pytest.mark.skipif(not PALLAS_UNDER_SHARD_MAP, reason="JAX 0.7+: refused before")


def mesh(shape, names):
    return jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def inputs(seed, b=2, t=64, n=4, k=2, h=8):
    gen = np.random.default_rng(seed)
    q = gen.normal(size=(b, t, n, h))
    kv = gen.normal(size=(2, b, t, k, h))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, kv[0], kv[1]))


def rel(x, ref):
    """``max |x − ref|`` relative to the largest finite ``|ref|`` (−∞ entries must match)."""
    x, ref = np.asarray(x), np.asarray(ref)
    finite = np.isfinite(ref)
    assert (np.isfinite(x) == finite).all() and (x[~finite] == ref[~finite]).all()
    return float(np.abs(x[finite] - ref[finite]).max() / np.abs(ref[finite]).max())


def check(ring, dense, args, argnums=(0, 1, 2)):
    """``ring`` against ``dense``: its outputs (``out``, or ``(out, lse)``) within 1e-6 and the
    gradients of ``⟨out, d_out⟩`` within 1e-5, relative. Each side is one compiled program, which
    returns its outputs beside its gradients (the forward pass of both is the same code)."""
    out_shape = jax.tree.leaves(jax.eval_shape(ring, *args))[0].shape
    d_out = jnp.asarray(np.random.default_rng(1).normal(size=out_shape), jnp.float32)

    def outputs_and_grads(f):
        def loss(*args):
            outputs = f(*args)
            return jnp.sum(jax.tree.leaves(outputs)[0] * d_out), outputs

        grads, outputs = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(*args)
        return jax.tree.leaves(outputs), grads

    (outputs, grads), (expected, expected_grads) = map(outputs_and_grads, (ring, dense))
    for got, want in zip(outputs, expected, strict=True):
        assert rel(got, want) <= 1e-6
    for got, want in zip(grads, expected_grads, strict=True):
        assert rel(got, want) <= 1e-5
    return outputs


MESHES = {
    "seq8": ((8,), ("seq",), {}),
    "batch2xseq4": ((2, 4), ("batch", "seq"), {"batch_axis": "batch"}),
    "seq4xheads2": ((4, 2), ("seq", "heads"), {"head_axis": "heads"}),
    "seq3": ((3,), ("seq",), {}),  # an odd ring size, for the striped half-swap
}
# Each mesh with causal and striped (the layout's point), the whole ring both ways, and an odd
# ring (48 positions, 6 chunks of 8); the random sweep (test_ring_sweep.py) crosses meshes,
# layouts, masks and mods further.
CASES = [
    ("seq8", False, "contiguous", 64),
    ("seq8", True, "striped", 64),
    ("batch2xseq4", True, "striped", 64),
    ("seq4xheads2", True, "striped", 64),
    ("seq3", True, "striped", 48),
]


@pytest.mark.parametrize("mesh_name, is_causal, layout, t", CASES)
def test_ring_matches_single_device_forward_and_gradients(mesh_name, is_causal, layout, t):
    shape, names, axes = MESHES[mesh_name]
    ring = functools.partial(
        js.ring_dot_product_attention,
        mesh=mesh(shape, names),
        seq_axis="seq",
        is_causal=is_causal,
        layout=layout,
        implementation=js.Ring(block_q=4, block_kv=4),
        **axes,
    )
    dense = functools.partial(js.dot_product_attention, is_causal=is_causal)
    check(ring, dense, inputs(0, t=t))  # GQA: 4 query heads over 2 key/value heads


def test_ring_with_bias_mask_lengths_window_and_residual():
    q, k, v = inputs(2, t=48)
    gen = np.random.default_rng(3)
    bias = jnp.asarray(gen.normal(size=(2, 4, 48, 48)), jnp.float32)
    mask = jnp.asarray(gen.random((2, 1, 48, 48)) < 0.9).at[0, 0, 5].set(False)  # a row with no key
    options = dict(
        mask=mask,
        is_causal=True,
        local_window_size=(20, 0),
        logits_soft_cap=5.0,
        query_seq_lengths=jnp.array([48, 40], jnp.int32),
        key_value_seq_lengths=jnp.array([30, 48], jnp.int32),
    )
    for layout in ("contiguous", "striped"):
        ring = functools.partial(
            js.ring_dot_product_attention,
            mesh=mesh((8,), ("seq",)),
            seq_axis="seq",
            layout=layout,
            return_residual=True,
            **options,
        )
        dense = functools.partial(js.dot_product_attention, **options, return_residual=True)
        out, lse = check(ring, dense, (q, k, v, bias), argnums=(0, 1, 2, 3))
        np.testing.assert_array_equal(np.asarray(out)[0, 5], 0)  # no allowed key: zeros
        assert np.isneginf(np.asarray(lse)[0, 5]).all()


def _compiled_text(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def test_keys_and_values_travel_by_collective_permute_never_all_gather():
    m = mesh((8,), ("seq",))
    spec = P(None, "seq", None, None)
    ring = jax.shard_map(
        functools.partial(js.ring_attention, axis_name="seq", is_causal=True),
        mesh=m,
        in_specs=(spec,) * 3,
        out_specs=spec,
    )
    args = inputs(4)
    forward = _compiled_text(ring, *args)
    backward = _compiled_text(jax.grad(lambda *a: ring(*a).sum(), argnums=(0, 1, 2)), *args)
    for text in (forward, backward):
        assert "collective-permute" in text
        assert "all-gather" not in text and "all-reduce" not in text


@pytest.mark.parametrize("layout, block_mask", [("contiguous", False), ("striped", True)])
def test_ring_attention_in_a_user_shard_map_with_its_default_checks(layout, block_mask):
    # shard_map's defaults (check_vma=True) with everything the trace of a mod meets: a
    # score_mod over a captured array, a mask_mod (or a BlockMask of it), sinks, and their
    # gradients, which sum over the devices once.
    m = mesh((8,), ("seq",))
    spec = P(None, "seq", None, None)
    q, k, v = inputs(5)
    gen = np.random.default_rng(11)
    slopes = jnp.asarray(gen.uniform(0.1, 1.0, size=4), jnp.float32)
    sinks = jnp.asarray(gen.normal(size=4), jnp.float32)
    mask_mod = lambda b, h, i, j: (j <= i) & (i - j < 40)  # noqa: E731
    if block_mask:
        mask_mod = js.create_block_mask(mask_mod, None, None, 64, 64, block_q=8, block_kv=8)

    def options(slopes, sinks):
        # What a mod's trace holds besides primitives: jax.numpy's jitted functions (where,
        # clip), a custom_jvp function (softplus), a cond, a scan (searchsorted's) and a while
        # loop, each replayed per tile; and an operation on a whole captured array (log1p),
        # computed once, ahead of the ring.
        def score_mod(s, b, h, i, j):
            s = s - slopes[h] * jnp.clip(i - j, 0, 40).astype(s.dtype)
            s = jax.lax.cond(i % 2 == 0, lambda x: x + 0.5, lambda x: x, s)
            bucket = jnp.searchsorted(jnp.array([2, 8, 32], jnp.int32), jnp.abs(i - j))
            halvings = jax.lax.while_loop(
                lambda c: c[0] > 1, lambda c: (c[0] // 2, c[1] + 1), (jnp.abs(i - j), 0)
            )[1]
            s = s - 0.1 * (bucket + halvings).astype(s.dtype)
            return jnp.where(j < 3, s, s - jax.nn.softplus(slopes[h]) - jnp.log1p(slopes)[h])

        return dict(score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)

    def local(q, k, v, slopes, sinks):
        options_ = options(slopes, sinks)
        return js.ring_attention(q, k, v, axis_name="seq", layout=layout, **options_)

    sharded = jax.shard_map(local, mesh=m, in_specs=(spec,) * 3 + (P(), P()), out_specs=spec)
    order = (lambda x: js.to_striped(x, 8)) if layout == "striped" else (lambda x: x)
    unorder = (lambda x: js.from_striped(x, 8)) if layout == "striped" else (lambda x: x)

    def ring(q, k, v, slopes, sinks):
        return unorder(sharded(order(q), order(k), order(v), slopes, sinks))

    def dense(q, k, v, slopes, sinks):
        return js.dot_product_attention(q, k, v, **options(slopes, sinks))

    check(jax.jit(ring), dense, (q, k, v, slopes, sinks), argnums=(0, 1, 2, 3, 4))


def _temp_mib(shards: int, seq: int) -> float:
    m = mesh((shards,), ("seq",))
    spec = P(None, "seq", None, None)
    ring = jax.shard_map(
        functools.partial(js.ring_attention, axis_name="seq", is_causal=True),
        mesh=m,
        in_specs=(spec,) * 3,
        out_specs=spec,
    )
    shape = jax.ShapeDtypeStruct((1, seq, 1, 64), jnp.float32)
    grad = jax.grad(lambda *a: ring(*a).sum(), argnums=(0, 1, 2))
    return (
        jax.jit(grad).lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes
        / 2**20
    )


def test_per_device_memory_falls_as_one_over_the_ring_size():
    seq = 65536
    temps = {p: _temp_mib(p, seq) for p in (2, 4, 8)}
    for p in (4, 8):
        assert temps[p] <= temps[2] * 2 / p * 1.25, temps  # ∝ 1/P, up to a fixed part


def test_striped_layout_balances_causal_work():
    seq, shards = 64, 8
    allowed = np.tril(np.ones((seq, seq), bool))
    positions = np.arange(seq)
    contiguous = positions.reshape(shards, -1)
    striped = np.asarray(js.to_striped(positions, shards, axis=0)).reshape(shards, -1)
    work = lambda rows: [int(allowed[r].sum()) for r in rows]  # noqa: E731
    assert max(work(contiguous)) / min(work(contiguous)) > 10
    assert max(work(striped)) / min(work(striped)) < 1.2
    np.testing.assert_array_equal(
        js.from_striped(js.to_striped(positions, shards, axis=0), shards, axis=0), positions
    )


@pytest.mark.parametrize("layout", ["contiguous", "striped"])
def test_ring_log_sum_exp_and_its_gradients(layout):
    # The residual is differentiable (merge_attention needs it): its cotangent joins dS.
    ring = functools.partial(
        js.ring_dot_product_attention,
        mesh=mesh((8,), ("seq",)),
        seq_axis="seq",
        is_causal=True,
        layout=layout,
        implementation=js.Ring(block_q=4, block_kv=4),
        return_residual=True,
    )
    dense = functools.partial(js.dot_product_attention, is_causal=True, return_residual=True)
    # The log-sum-exp does not depend on the values: gradients for queries and keys.
    check(lambda *a: ring(*a)[1], lambda *a: dense(*a)[1], inputs(4), argnums=(0, 1))


PREFIX = jnp.array([5, 20], jnp.int32)


def _by_batch_and_head(b, h, i, j):
    return (j < PREFIX[b]) | ((j <= i) & ((h != 3) | (i - j < 8)))


BY_BATCH_AND_HEAD = js.create_block_mask(_by_batch_and_head, 2, 4, 64, 64, block_q=8, block_kv=8)
# Built-in rules over the whole batch's ids, (B, T): each device takes its own sequences' rows.
DOCUMENTS = jnp.asarray(np.sort(np.random.default_rng(10).integers(0, 4, (2, 64)), 1), jnp.int32)
WHOLE_BATCH_RULES = js.SegmentMask(DOCUMENTS, DOCUMENTS) & js.CausalMask()


@pytest.mark.parametrize(
    "shape, names, layout, mask_mod",
    [
        ((2, 4), ("batch", "seq"), "contiguous", _by_batch_and_head),
        ((4, 2), ("seq", "heads"), "striped", _by_batch_and_head),
        ((2, 2, 2), ("batch", "seq", "heads"), "striped", BY_BATCH_AND_HEAD),
        ((2, 4), ("batch", "seq"), "striped", WHOLE_BATCH_RULES),
    ],
    ids=["batch2xseq4", "seq4xheads2", "batch2xseq2xheads2-block_mask", "batch2xseq4-rules"],
)
def test_mods_and_sinks_see_the_whole_batch_and_all_heads_when_both_are_split(
    shape, names, layout, mask_mod
):
    if isinstance(mask_mod, js.BlockMask):
        assert (mask_mod.classes == 0).any()  # some tiles are skipped
    split = {"batch": "batch", "head": "heads"}
    # With the batch or the heads over devices, a mod (or a BlockMask made for the whole batch
    # and all heads) still sees each sequence's index in the whole batch and each head's among
    # all heads, and each device takes the sinks of its own heads.
    axes = {f"{axis}_axis": name if name in names else None for axis, name in split.items()}
    q, k, v = inputs(8)
    gen = np.random.default_rng(9)
    slopes = jnp.asarray(gen.uniform(0.1, 1.0, size=4), jnp.float32)
    per_sequence = jnp.asarray(gen.normal(size=2), jnp.float32)
    sinks = jnp.asarray(gen.normal(size=4), jnp.float32)

    def options(slopes, per_sequence, sinks):
        def score_mod(s, b, h, i, j):
            return s - slopes[h] * (i - j).astype(s.dtype) + per_sequence[b]

        return dict(score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)

    def ring(q, k, v, *arrays):
        return js.ring_dot_product_attention(
            q,
            k,
            v,
            mesh=mesh(shape, names),
            seq_axis="seq",
            layout=layout,
            implementation=js.Ring(block_q=4, block_kv=4),
            **axes,
            **options(*arrays),
        )

    def dense(q, k, v, *arrays):
        return js.dot_product_attention(q, k, v, **options(*arrays))

    check(ring, dense, (q, k, v, slopes, per_sequence, sinks), argnums=(0, 1, 2, 3, 4, 5))


@pytest.mark.parametrize(
    "layout, implementation",
    [
        ("contiguous", js.Ring(block_q=4, block_kv=4)),
        ("striped", js.Ring(block_q=4, block_kv=4)),
        pytest.param(
            "contiguous", js.Pallas(block_q=16, block_kv=16, interpret=True), marks=KERNEL
        ),
        pytest.param("striped", js.Pallas(block_q=16, block_kv=16, interpret=True), marks=KERNEL),
    ],
    ids=["ring-contiguous", "ring-striped", "kernel-contiguous", "kernel-striped"],
)
def test_sigmoid_attention_and_max_scores_on_the_ring_match_a_single_device(layout, implementation):
    # The sigmoid's default bias counts the whole sequence's keys; each row's max score is over
    # the whole ring's. (The kernel's interpreter needs check_vma=False on JAX 0.10.)
    m = mesh((8,), ("seq",))
    spec, rows = P(None, "seq", None, None), P(None, "seq", None)
    q, k, v = inputs(11)
    options = dict(is_causal=True, normalizer="sigmoid", return_residual=True)

    def local(q, k, v):
        return js.ring_attention(
            q,
            k,
            v,
            axis_name="seq",
            layout=layout,
            implementation=implementation,
            return_max_scores=True,
            **options,
        )

    checked = not isinstance(implementation, js.Pallas)
    sharded = jax.shard_map(
        local, mesh=m, in_specs=(spec,) * 3, out_specs=(spec, rows, rows), check_vma=checked
    )
    striped = layout == "striped"
    order = (lambda x: js.to_striped(x, 8)) if striped else (lambda x: x)
    unorder = (lambda x: js.from_striped(x, 8)) if striped else (lambda x: x)

    def ring(q, k, v):
        return tuple(map(unorder, sharded(order(q), order(k), order(v))))

    def dense(q, k, v):
        return js.dot_product_attention(q, k, v, return_max_scores=True, **options)

    out, lse, top = check(ring, dense, (q, k, v))
    assert bool(jnp.isfinite(top).all())


def _kernel_options(slopes, sinks, documents):
    return dict(
        score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(s.dtype),
        mask_mod=lambda b, h, i, j: documents[i] == documents[j],
        sinks=sinks,
        is_causal=True,
    )


@KERNEL
@pytest.mark.parametrize("layout", ["contiguous", "striped"])
def test_ring_steps_computed_by_the_kernel_match_single_device(layout):
    # Each step's tiles by the fused kernel (in the Pallas interpreter): ALiBi over a captured
    # slope array, a document mask, sinks, GQA, and all their gradients. The interpreter of
    # JAX 0.10 slices its blocks without shard_map's varying types, so this shard_map turns its
    # check off; the kernel itself lowers under the default checks (the next test).
    m = mesh((8,), ("seq",))
    spec = P(None, "seq", None, None)
    q, k, v = inputs(7)
    gen = np.random.default_rng(3)
    slopes = jnp.asarray(gen.uniform(0.1, 1.0, size=4), jnp.float32)
    sinks = jnp.asarray(gen.normal(size=4), jnp.float32)
    documents = jnp.asarray(np.repeat(np.arange(3), 22)[:64], jnp.int32)
    kernel = js.Pallas(block_q=16, block_kv=16, interpret=True)

    def local(q, k, v, slopes, sinks):
        options = _kernel_options(slopes, sinks, documents)  # mods see global positions
        return js.ring_attention(
            q, k, v, axis_name="seq", layout=layout, implementation=kernel, **options
        )

    sharded = jax.shard_map(
        local, mesh=m, in_specs=(spec,) * 3 + (P(), P()), out_specs=spec, check_vma=False
    )
    striped = layout == "striped"
    order = (lambda x: js.to_striped(x, 8)) if striped else (lambda x: x)
    unorder = (lambda x: js.from_striped(x, 8)) if striped else (lambda x: x)

    def ring(q, k, v, slopes, sinks):
        return unorder(sharded(order(q), order(k), order(v), slopes, sinks))

    def dense(q, k, v, slopes, sinks):
        return js.dot_product_attention(q, k, v, **_kernel_options(slopes, sinks, documents))

    check(jax.jit(ring), dense, (q, k, v, slopes, sinks), argnums=(0, 1, 2, 3, 4))


@KERNEL
def test_ring_steps_by_the_kernel_lower_for_a_gpu_under_shard_maps_default_checks():
    # Lowered, not run: no GPU here. The kernel's outputs carry shard_map's varying types.
    m = abstract_mesh("cuda", (4,), ("seq",))  # a GPU's, to lower on a CPU
    spec = P(None, "seq", None, None)
    slopes = jnp.linspace(0.1, 1.0, 4, dtype=jnp.float32)
    documents = jnp.arange(1024, dtype=jnp.int32) // 128

    def local(q, k, v, sinks):
        options = _kernel_options(slopes, sinks, documents)
        return js.ring_attention(q, k, v, axis_name="seq", implementation="pallas", **options)

    ring = jax.shard_map(local, mesh=m, in_specs=(spec,) * 3 + (P(),), out_specs=spec)
    x = jax.ShapeDtypeStruct((1, 1024, 4, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
    grads = jax.grad(lambda *a: ring(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    for program, kernels in ((ring, 1), (grads, 3)):
        text = exported(program, x, x, x, sinks, platform="cuda", mesh=m)
        assert len(verified(text, "cuda")) == kernels and "collective_permute" in text


@KERNEL
def test_a_large_tables_gradient_on_the_rings_kernel_lowers_for_a_gpu():
    # The table's gradient is one output all programs add into (atomics), starting as zeros.
    m = abstract_mesh("cuda", (4,), ("seq",))  # a GPU's, to lower on a CPU
    spec = P(None, "seq", None, None)

    def local(q, k, v, table):
        def score_mod(s, b, h, i, j):
            return s + table[h, i - j + 1024].astype(s.dtype)

        return js.ring_attention(
            q, k, v, axis_name="seq", implementation="pallas", is_causal=True, score_mod=score_mod
        )

    ring = jax.shard_map(local, mesh=m, in_specs=(spec,) * 3 + (P(),), out_specs=spec)
    grads = jax.grad(lambda *a: ring(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    x = jax.ShapeDtypeStruct((1, 1024, 4, 64), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((4, 2048), jnp.float32)
    kernels = verified_kernels(grads, x, x, x, table, platform="cuda", mesh=m)
    atomics = [kernel.name for kernel in kernels if "tt.atomic_rmw" in kernel.asm]
    assert len(kernels) == 3 and atomics == ["jax_sdpa_backward_keys"]


def test_ring_steps_by_the_kernel_refuse_what_the_kernel_does_not_take():
    m = mesh((8,), ("seq",))
    spec = P(None, "seq", None, None)
    q, k, v = inputs(2)
    bias = jnp.zeros((2, 4, 8, 64), jnp.float32)  # this device's queries, all the keys

    def local(q, k, v):
        return js.ring_attention(q, k, v, bias, axis_name="seq", implementation="pallas")

    ring = jax.shard_map(local, mesh=m, in_specs=(spec,) * 3, out_specs=spec)
    message = "`ring_attention(implementation='pallas')` takes no bias"
    with pytest.raises(ValueError, match=re.escape(message)):
        ring(q, k, v)


@pytest.mark.skipif(PALLAS_UNDER_SHARD_MAP, reason="JAX before 0.7: the kernel tests above")
def test_ring_steps_by_the_kernel_before_jax_0_7_are_refused_with_the_version():
    m = mesh((8,), ("seq",))
    spec = P(None, "seq", None, None)
    q, k, v = inputs(2)

    def local(q, k, v):
        return js.ring_attention(q, k, v, axis_name="seq", implementation="pallas")

    ring = jax.shard_map(local, mesh=m, in_specs=(spec,) * 3, out_specs=spec)
    with pytest.raises(ValueError, match=f"needs JAX 0.7 or later .*JAX is {jax.__version__}"):
        ring(q, k, v)
