"""Decoding on the fused kernels: grouped query heads packed into rows, the keys split.

A few queries (``T·G`` rows at most ``PACKED_ROWS``) of grouped heads are packed: each
key/value head's ``G`` query heads fill one tile's rows, row ``t·G + g`` at position ``t``
(``PackedRows`` answers the call's rule there), so that each key is read once for its group.
A few queries' keys are split into chunks attended on their own in one kernel and merged
("flash-decoding"). Checked in the Pallas interpreter against the float64 reference, output,
log-sum-exp and gradients, with chunks made small to split short sequences; on the Mosaic GPU
kernel in ``tests/test_mosaic_gpu.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from jax_sdpa import _pallas
from tests import reference as ref
from tests.util import enable_x64, paged_pool, qkv

INTERPRET = js.Pallas(block_q=16, block_kv=16, interpret=True)
S = 300  # keys: five chunks of 64 (the last padded)
LENGTHS = np.array([300, 77])
DOCUMENTS = jnp.arange(S) // 100  # (the one query sits at position 0)
BIAS = np.sin(np.arange(2 * 2 * S)).reshape(2, 1, 2, S)  # (per sequence and query, by key)
KEPT = np.arange(8 * S).reshape(1, 8, 1, S) % 7 != 3  # (per head, by key)


def _ends_causal(t):
    """Causal with the queries at the end of the keys (FlashAttention's decoding convention)."""
    return lambda b, h, i, j: j <= i + S - t


# (T, N, K, ours, theirs, packed, split)
CASES = {
    "one query, lengths": (
        1,
        8,
        2,
        dict(key_value_seq_lengths=jnp.asarray(LENGTHS)),
        dict(kv_lengths=LENGTHS),
        True,
        True,
    ),
    "three queries, causal at the end": (
        3,
        8,
        2,
        dict(mask_mod=js.CausalMask(S - 3)),
        dict(mask_mod=_ends_causal(3)),
        True,
        True,
    ),
    "a window, heads not grouped": (
        2,
        4,
        4,
        dict(mask_mod=js.LocalWindowMask(40, 0, S - 2)),
        dict(mask_mod=lambda b, h, i, j: (j <= i + S - 2) & (j >= i + S - 2 - 40)),
        False,
        True,
    ),
    "sigmoid (a bias per head): not packed": (
        2,
        8,
        2,
        dict(normalizer="sigmoid"),
        dict(normalizer="sigmoid"),
        False,
        True,
    ),
    "a score_mod: not packed": (
        1,
        8,
        2,
        dict(score_mod=lambda s, b, h, i, j: s - 0.1 * h.astype(s.dtype)),
        dict(score_mod=lambda s, b, h, i, j: s - 0.1 * h),
        False,
        True,
    ),
    "a bias and a mask array (a score_mod's): split, not packed": (
        2,
        8,
        2,
        dict(bias=jnp.asarray(BIAS, jnp.float32), mask=jnp.asarray(KEPT)),
        dict(bias=BIAS, mask=KEPT),
        False,
        True,
    ),
    "sinks (per head, met once unpacked): packed and split": (
        1,
        8,
        2,
        dict(sinks=jnp.linspace(-1.0, 1.0, 8)),
        dict(sinks=np.linspace(-1.0, 1.0, 8)),
        True,
        True,
    ),
    "documents (an opaque rule): neither": (
        1,
        8,
        2,
        dict(mask_mod=lambda b, h, i, j: DOCUMENTS[i] == DOCUMENTS[j]),
        dict(mask_mod=lambda b, h, i, j: np.asarray(DOCUMENTS)[i] == np.asarray(DOCUMENTS)[j]),
        False,
        False,
    ),
    "128 rows (a program's, past a consumer's): packed and split": (
        16,
        8,
        1,
        dict(mask_mod=js.CausalMask(S - 16)),
        dict(mask_mod=_ends_causal(16)),
        True,
        True,
    ),
    "more rows than a tile: neither": (
        70,
        8,
        2,
        dict(is_causal=True),
        dict(is_causal=True),
        False,
        False,
    ),
}


# The inner loop (`-m "not slow"`, as CI runs it with x64 off and under the newest JAX on) runs
# the first two cases, and the paged and ragged ones below are sampled the same way; the whole
# suite runs them all.
SAMPLED = pytest.mark.slow


@pytest.mark.parametrize(
    "case", [c if n < 2 else pytest.param(c, marks=SAMPLED) for n, c in enumerate(CASES)]
)
def test_decoding_calls_packed_and_split_are_the_reference(case, monkeypatch):
    t, heads, kv_heads, ours, theirs, packs, splits = CASES[case]
    monkeypatch.setattr(_pallas, "SPLIT_KEYS", 64)
    monkeypatch.setattr(_pallas, "CHUNK_MULTIPLE", 64)
    calls = []
    sequence = _pallas._sequence

    def spy(formula, tunables, query, keys, *rest):
        calls.append((query.shape, keys[0].shape))
        return sequence(formula, tunables, query, keys, *rest)

    monkeypatch.setattr(_pallas, "_sequence", spy)
    q, k, v = qkv(np.random.default_rng(3), 2, t, S, heads, kv_heads, 32)

    def loss(q, k, v, implementation):
        out, lse = js.dot_product_attention(
            q, k, v, implementation=implementation, return_residual=True, **ours
        )
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), (out, lse)

    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, INTERPRET)
    (query_shape, key_shape), group = calls[0], heads // kv_heads
    assert query_shape == ((t * group, kv_heads, 32) if packs else (t, heads, 32))
    assert key_shape == ((64 if splits else S), kv_heads, 32)

    want = ref.attention(q, k, v, **theirs)
    finite = np.isfinite(want["lse"])
    assert ref.rel_err(out, want["out"]) < 1e-5
    assert ref.rel_err(np.where(finite, lse, 0), np.where(finite, want["lse"], 0)) < 1e-5
    with enable_x64():
        wide = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        want_grads, _ = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*wide, "xla")
    for got, wanted, name in zip(grads, want_grads, ("dq", "dk", "dv"), strict=True):
        assert ref.rel_err(got, wanted) < 1e-5, name


@pytest.mark.parametrize("page", [16, pytest.param(128, marks=SAMPLED)])
def test_a_paged_cache_through_the_kernel_is_the_paged_path(page, monkeypatch):
    monkeypatch.setattr(_pallas, "SPLIT_KEYS", 128)
    rng = np.random.default_rng(4)
    # (heads 64 wide: the kernels read the pages chunk by chunk, each chunk's gathered here)
    key_pages, value_pages, table = paged_pool(rng, 2, 400, page, 2, 64)
    q = jnp.asarray(rng.normal(size=(2, 2, 8, 64)), jnp.float32)
    lengths = jnp.array([380, 150])

    def call(q, key_pages, value_pages, implementation):
        return js.paged_attention(
            q,
            key_pages,
            value_pages,
            table,
            lengths,
            return_residual=True,
            implementation=implementation,
        )

    def loss(*args):
        return jnp.sum(call(*args)[0] ** 2)

    chunks = []
    on_pages = _pallas._on_pages
    monkeypatch.setattr(
        _pallas, "_on_pages", lambda *a: chunks.append(a[3].table.shape) or on_pages(*a)
    )
    kernel = js.Paged(kernel=INTERPRET)
    (out, lse), want = (call(q, key_pages, value_pages, x) for x in (kernel, None))
    assert chunks[0] == (128 // page,)  # (whole chunks of 128 keys, split, their pages read)
    assert ref.rel_err(out, want[0]) < 1e-5 and ref.rel_err(lse, want[1]) < 1e-5
    pools = [jnp.nan_to_num(x) for x in (key_pages, value_pages)]  # (finite, for gradients)
    grads, want_grads = (jax.grad(loss, (0, 1, 2))(q, *pools, x) for x in (kernel, None))
    names = ("dq", "d_key_pages", "d_value_pages")
    for got, wanted, name in zip(grads, want_grads, names, strict=True):
        assert ref.rel_err(got, wanted) < 1e-5, name


def test_a_page_number_outside_the_pool_reads_a_page_of_the_sequence():
    # Past the length the table may hold anything: the kernel reads the sequence's first page
    # in its place, never another's (a wrapped -1 would read the spare page, NaN).
    rng = np.random.default_rng(5)
    key_pages, value_pages, table = paged_pool(rng, 1, 128, 16, 1, 32)
    # A block of 64 keys, 64 … 127, holds valid keys (64 … 69) and the pages past them.
    table = table.at[0, 5:].set(jnp.array([-1, 99, 9], jnp.int32))  # (the pool: pages 0 … 8)
    q = jnp.asarray(rng.normal(size=(1, 1, 2, 32)), jnp.float32)
    lengths = jnp.array([70])
    # (under jit: concrete page numbers outside the pool are refused)
    ours = jax.jit(js.paged_attention, static_argnames="implementation")(
        q,
        key_pages,
        value_pages,
        table,
        lengths,
        implementation=js.Paged(kernel=js.Pallas(block_kv=64, interpret=True)),
    )
    keys, values = (x[table[0, :5]].reshape(1, 80, 1, 32) for x in (key_pages, value_pages))
    want = ref.attention(q, keys, values, kv_lengths=np.array([70]))["out"]
    assert ref.rel_err(ours, want) < 1e-5


def test_the_paged_kernel_is_a_pallas_kernel_or_none():
    with pytest.raises(TypeError, match=r"`Paged.kernel` must be None or a Pallas\(...\)"):
        js.Paged(kernel="pallas")


@SAMPLED
@pytest.mark.parametrize("tile_rows", [None, 8])
def test_a_ragged_batch_through_the_kernel_is_the_ragged_path(tile_rows, monkeypatch):
    # Two decoding steps and a 5-token chunk (with an empty sequence), the causal mask at each
    # sequence's end; the padding rows before each sequence's own see no key. In tiles of a
    # sequence's queries (by default) or of 2 (8 rows over 4 query heads a key/value head).
    if tile_rows is not None:
        monkeypatch.setattr("jax_sdpa._ragged.PACKED_ROWS", tile_rows)
    rng = np.random.default_rng(6)
    key_pages, value_pages, table = paged_pool(rng, 4, 256, 16, 2, 32)
    pools = [jnp.nan_to_num(x) for x in (key_pages, value_pages)]
    starts = jnp.array([0, 1, 6, 6, 7])
    lengths = jnp.array([200, 256, 0, 37])
    q = jnp.asarray(rng.normal(size=(7, 8, 32)), jnp.float32)

    def call(q, key_pages, value_pages, implementation):
        return js.ragged_paged_attention(
            q,
            key_pages,
            value_pages,
            table,
            lengths,
            starts,
            max_queries=5,
            implementation=implementation,
            return_residual=True,
        )

    def loss(*args):
        return jnp.sum(call(*args)[0] ** 2)

    kernel = js.Paged(kernel=INTERPRET)
    (out, lse), want = (call(q, *pools, x) for x in (kernel, None))
    assert ref.rel_err(out, want[0]) < 1e-5
    assert np.array_equal(np.isfinite(lse), np.isfinite(want[1]))
    grads, want_grads = (jax.grad(loss, (0, 1, 2))(q, *pools, x) for x in (kernel, None))
    for got, wanted in zip(grads, want_grads, strict=True):
        assert ref.rel_err(got, wanted) < 1e-5


@SAMPLED
def test_the_paged_kernel_has_no_forward_mode_nor_second_derivatives_and_says_so():
    rng = np.random.default_rng(7)
    key_pages, value_pages, table = paged_pool(rng, 1, 64, 16, 2, 32)
    q = jnp.asarray(rng.normal(size=(1, 1, 8, 32)), jnp.float32)
    lengths = jnp.array([50])

    def call(q, implementation):
        return js.paged_attention(
            q, key_pages, value_pages, table, lengths, implementation=implementation
        ).sum()

    kernel = js.Paged(kernel=INTERPRET)
    with pytest.raises(TypeError, match="has no forward-mode derivative.*a Paged without"):
        jax.jvp(lambda q: call(q, kernel), (q,), (q,))
    with pytest.raises(TypeError, match="has no second derivatives.*a Paged without `kernel`"):
        jax.hessian(lambda q: call(q, kernel))(q)
    jax.jvp(lambda q: call(q, None), (q,), (q,))  # (the pure-JAX path has both)
    jax.hessian(lambda q: call(q, None))(q)


@pytest.mark.parametrize(
    "heads, kv_heads, seq_kv",
    [(4, 4, S), pytest.param(8, 2, S, marks=SAMPLED), (8, 2, 60)],
    ids=["split", "packed and split", "packed"],
)
def test_decoding_meets_the_sinks_once_and_gives_their_gradient(
    heads, kv_heads, seq_kv, monkeypatch
):
    # Split keys meet the sinks once, after the chunks are merged; packed rows meet each query
    # head's sink once they are unpacked (the kernel runs without them).
    monkeypatch.setattr(_pallas, "SPLIT_KEYS", 64)
    monkeypatch.setattr(_pallas, "CHUNK_MULTIPLE", 64)
    calls, sequence = [], _pallas._sequence

    def spy(formula, tunables, query, keys, arrays, *rest):
        calls.append((query.shape[0], keys[0].shape[0], arrays.sinks is None))
        return sequence(formula, tunables, query, keys, arrays, *rest)

    monkeypatch.setattr(_pallas, "_sequence", spy)
    q, k, v = qkv(np.random.default_rng(8), 2, 1, seq_kv, heads, kv_heads, 32)
    sinks = jnp.linspace(-1.0, 2.0, heads)
    lengths = np.minimum(LENGTHS, seq_kv)
    if seq_kv < 64:  # (and a sequence of no key, a head with no sink)
        sinks, lengths = sinks.at[0].set(-jnp.inf), np.array([seq_kv, 0])

    def loss(sinks, implementation):
        out = js.dot_product_attention(
            q,
            k,
            v,
            sinks=sinks,
            key_value_seq_lengths=jnp.asarray(lengths),
            implementation=implementation,
        )
        return jnp.sum(out**2)

    (got, d_got), (want, d_want) = (jax.value_and_grad(loss)(sinks, x) for x in (INTERPRET, "xla"))
    rows, keys, without_sinks = calls[0]
    assert rows == heads // kv_heads and keys == min(64, seq_kv) and without_sinks
    assert abs(got - want) < 1e-5 * abs(want)
    assert ref.rel_err(d_got, d_want) < 1e-5


@SAMPLED
def test_paged_keys_and_rows_padded_to_tiles_larger_than_a_program():
    # Tiles of 256 rows and 512 keys (a program of the Mosaic GPU kernel's is 128): 1,152 keys
    # and 300 queries are padded to whole tiles, none lost.
    rng = np.random.default_rng(9)
    key_pages, value_pages, table = (jnp.nan_to_num(x) for x in paged_pool(rng, 1, 1152, 16, 1, 64))
    q = jnp.asarray(rng.normal(size=(1, 300, 2, 64)), jnp.float32)
    lengths = jnp.array([1100])
    kernel = js.Paged(kernel=js.Pallas(block_q=256, block_kv=512, interpret=True))

    def loss(q, key_pages, value_pages, implementation):
        out = js.paged_attention(
            q, key_pages, value_pages, table, lengths, implementation=implementation
        )
        return jnp.sum(out**2)

    (got, grads), (want, want_grads) = (
        jax.value_and_grad(loss, (0, 1, 2))(q, key_pages, value_pages, x) for x in (kernel, None)
    )
    assert abs(got - want) < 1e-5 * abs(want)
    for g, w in zip(grads, want_grads, strict=True):
        assert ref.rel_err(g, w) < 1e-5


@pytest.mark.parametrize(
    "fmt, paged",
    [
        ("int8", False),
        pytest.param("float8_e4m3fn", False, marks=SAMPLED),
        pytest.param("int8", True, marks=SAMPLED),
    ],
)
def test_quantized_caches_through_the_kernel_are_the_decode_paths(fmt, paged, monkeypatch):
    # 8-bit caches: read as they are by the Mosaic GPU kernel (tests/test_mosaic_gpu.py),
    # widened first for the others (here the interpreter); the gradients of the queries and
    # of the scales through the widening.
    monkeypatch.setattr(_pallas, "SPLIT_KEYS", 128)
    rng = np.random.default_rng(8)
    lengths = jnp.array([17, 0] if paged else [380, 150])  # (paged: a sequence of no key)
    q = jnp.asarray(rng.normal(size=(2, 2, 8, 64)), jnp.float32)
    if paged:
        *pools, table = paged_pool(rng, 2, 400, 16, 2, 64)  # (a NaN page, in no table)
        caches = [js.quantize(x, fmt) for x in pools]

        def call(q, key, value, kernel):
            implementation = js.Paged(kernel=kernel)
            return js.paged_attention(
                q, key, value, table, lengths, return_residual=True, implementation=implementation
            )
    else:
        _, k, v = qkv(rng, 2, 2, 400, 8, 2, 64)
        caches = [js.quantize(x, fmt) for x in (k, v)]

        def call(q, key, value, kernel):
            return js.dot_product_attention(
                q,
                key,
                value,
                key_value_seq_lengths=lengths,
                is_causal=True,
                causal_alignment="bottom_right",
                return_residual=True,
                implementation=kernel,
            )

    def loss(q, key, value, kernel):
        out, lse = call(q, key, value, kernel)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), (out, lse)

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True, allow_int=True)
    (d_q, d_key, d_value), (out, lse) = grad(q, *caches, INTERPRET)
    (want_q, want_key, want_value), want = grad(q, *caches, None)  # (the decode path's)
    assert ref.rel_err(out, want[0]) < 1e-5 and np.array_equal(
        np.isfinite(lse), np.isfinite(want[1])
    )
    finite = np.isfinite(want[1])
    assert ref.rel_err(np.where(finite, lse, 0), np.where(finite, want[1], 0)) < 1e-5
    assert ref.rel_err(d_q, want_q) < 1e-5
    for got, wanted in ((d_key, want_key), (d_value, want_value)):
        assert ref.rel_err(got.scale, wanted.scale) < 1e-4
        # (integers have no gradient; float8 its own, in float8, mostly below its range here)
        assert (
            got.values.dtype
            == wanted.values.dtype
            == {"int8": jax.dtypes.float0}.get(fmt, jnp.float8_e4m3fn)
        )


def test_a_quantized_shared_latent_cache_through_the_kernel_is_the_decode_paths():
    # MLA's cache quantized: the values the keys' first features, their scales the keys'.
    rng = np.random.default_rng(10)
    q, k, _ = qkv(rng, 2, 1, 200, 8, 1, 96)
    key = js.quantize(k)
    lengths = jnp.array([200, 57])
    out, want = (
        js.dot_product_attention(
            q,
            key,
            js.LatentValues(64),
            key_value_seq_lengths=lengths,
            implementation=implementation,
        )
        for implementation in (INTERPRET, None)
    )
    assert out.shape == (2, 1, 8, 64) and ref.rel_err(out, want) < 1e-5
