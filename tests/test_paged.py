"""Paged caches: paged_attention against the float64 reference, and the cache writers.

The oracle gathers each sequence's pages in order and attends with the queries at the end of
its valid keys (causal per sequence), as the reference's ``mask_mod``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa as js
from jax_sdpa import _ragged as ragged_module
from tests import reference as ref


def paged_cache(rng, b, pages_per_seq, page_size, k, h, num_pages=None, dtype=jnp.float32):
    """Random pages, and a shuffled page table giving each sequence its own pages."""
    num_pages = num_pages or b * pages_per_seq + 3
    key_pages, value_pages = (
        jnp.asarray(rng.normal(size=(num_pages, page_size, k, h)), dtype) for _ in range(2)
    )
    table = rng.permutation(num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq)
    return key_pages, value_pages, jnp.asarray(table, jnp.int32)


def gathered(pages, table):
    """Each sequence's pages laid end to end: ``(B, pages · page_size, K, H)``."""
    b, n = table.shape
    return np.asarray(pages)[np.asarray(table)].reshape(b, n * pages.shape[1], *pages.shape[2:])


def expected(q, key_pages, value_pages, table, lengths, *, is_causal=True, window=None, **kw):
    keys, values = gathered(key_pages, table), gathered(value_pages, table)
    t = q.shape[1]
    lengths = np.asarray(lengths)

    def mask_mod(b, h, i, j):  # query i sits at position lengths[b] − T + i
        position = i + lengths[b] - t
        allowed = j < lengths[b]
        if is_causal:
            allowed = allowed & (j <= position)
        if window is not None:
            allowed = allowed & (j >= position - window[0]) & (j <= position + window[1])
        return allowed

    return ref.attention(q, keys, values, mask_mod=mask_mod, **kw)


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("page_size", [4, 7])
@pytest.mark.parametrize("n, k", [(4, 2), (4, 1)])
def test_paged_attention_matches_the_reference(rng, t, page_size, n, k):
    key_pages, value_pages, table = paged_cache(rng, 3, 6, page_size, k, 8)
    capacity = 6 * page_size
    lengths = jnp.array([capacity, 0, 17])  # full, empty, part of a page
    q = jnp.asarray(rng.normal(size=(3, t, n, 8)), jnp.float32)
    out, lse = js.paged_attention(
        q, key_pages, value_pages, table, lengths, return_residual=True, implementation=js.Paged(8)
    )
    want = expected(q, key_pages, value_pages, table, lengths)
    assert ref.rel_err(out, want["out"]) < 2e-6
    np.testing.assert_array_equal(np.asarray(out)[1], 0.0)  # length 0: zeros, no NaN
    np.testing.assert_allclose(lse, want["lse"], rtol=1e-5, atol=1e-6)


def test_one_new_token_equals_dot_product_attention_on_the_gathered_cache(rng):
    key_pages, value_pages, table = paged_cache(rng, 2, 5, 16, 2, 8)
    q = jnp.asarray(rng.normal(size=(2, 1, 4, 8)), jnp.float32)
    lengths = jnp.array([80, 41])
    out = js.paged_attention(q, key_pages, value_pages, table, lengths)
    dense = js.dot_product_attention(
        q,
        jnp.asarray(gathered(key_pages, table)),
        jnp.asarray(gathered(value_pages, table)),
        key_value_seq_lengths=lengths,
        implementation="xla",
    )
    np.testing.assert_allclose(out, dense, atol=2e-6)


def test_window_soft_cap_mods_and_sinks(rng):
    key_pages, value_pages, table = paged_cache(rng, 2, 4, 8, 2, 8)
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
    lengths = jnp.array([30, 19])
    slopes, sinks = rng.uniform(0.01, 0.1, size=4), rng.normal(size=4)

    def score_mod(lib):
        m = lib.asarray(slopes, dtype=lib.float32 if lib is jnp else None)
        return lambda s, b, h, i, j: s + m[h] * j.astype(s.dtype)

    out = js.paged_attention(
        q,
        key_pages,
        value_pages,
        table,
        lengths,
        local_window_size=(5, 0),
        logits_soft_cap=3.0,
        score_mod=score_mod(jnp),
        sinks=jnp.asarray(sinks, jnp.float32),
    )
    want = expected(
        q,
        key_pages,
        value_pages,
        table,
        lengths,
        window=(5, 0),
        soft_cap=3.0,
        score_mod=score_mod(np),
        sinks=sinks,
    )
    assert ref.rel_err(out, want["out"]) < 2e-6


def test_a_bfloat16_cache(rng):
    key_pages, value_pages, table = paged_cache(rng, 2, 4, 16, 2, 16, dtype=jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(2, 1, 8, 16)), jnp.bfloat16)
    out = js.paged_attention(q, key_pages, value_pages, table, jnp.array([64, 30]))
    assert out.dtype == jnp.bfloat16
    want = expected(q, key_pages, value_pages, table, [64, 30])
    assert ref.rel_err(out, want["out"]) < 1e-2


def test_lengths_past_the_pages_are_refused_or_clamped_to_the_sequences_own_pages(rng):
    key_pages, value_pages, table = paged_cache(rng, 2, 3, 4, 1, 8, num_pages=8)
    q = jnp.asarray(rng.normal(size=(2, 1, 2, 8)), jnp.float32)
    with pytest.raises(ValueError, match=re.escape("`lengths` must be at most")):
        js.paged_attention(q, key_pages, value_pages, table, jnp.array([12, 13]))
    # Under jit the lengths are clamped: pages outside a sequence's row are never read.
    others = np.setdiff1d(np.arange(8), np.asarray(table))
    key_pages = key_pages.at[others].set(jnp.nan)
    value_pages = value_pages.at[others].set(jnp.nan)
    attend = jax.jit(js.paged_attention)
    out = attend(q, key_pages, value_pages, table, jnp.array([12, 100]))
    np.testing.assert_allclose(
        out, attend(q, key_pages, value_pages, table, jnp.array([12, 12])), atol=0
    )
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"query": np.zeros((2, 2, 8))}, ValueError, "`query` must have rank 4"),
        ({"key_pages": np.zeros((6, 4, 2, 8), np.int32)}, TypeError, "`key_pages`"),
        (
            {"value_pages": np.zeros((6, 5, 2, 8), np.float32)},
            ValueError,
            "(num_pages, page_size, kv_heads)",
        ),
        ({"page_table": np.zeros((2, 3))}, TypeError, "`page_table`"),
        ({"page_table": np.zeros((3, 3), np.int32)}, ValueError, "`page_table` must have shape"),
        (
            {"lengths": np.zeros((3,), np.int32)},
            ValueError,
            "`lengths` must have shape (batch,) = (2,); got (3,).",
        ),
        ({"lengths": np.zeros((2,))}, TypeError, "`lengths`"),
        (
            {"page_table": np.array([[0, 1, 6], [2, 3, 4]], np.int32)},
            ValueError,
            "`page_table` must hold page numbers in [0, 6); got 0 to 6.",
        ),
    ],
)
def test_paged_errors(change, error, message):
    args = {
        "query": np.zeros((2, 1, 4, 8), np.float32),
        "key_pages": np.zeros((6, 4, 2, 8), np.float32),
        "value_pages": np.zeros((6, 4, 2, 8), np.float32),
        "page_table": np.zeros((2, 3), np.int32),
        "lengths": np.zeros((2,), np.int32),
    }
    with pytest.raises(error, match=re.escape(message)):
        js.paged_attention(**{**args, **change})


def test_writing_a_step_into_either_cache_then_attending_equals_the_full_sequence(rng):
    # A prompt of 9 tokens, then a step of 1 and one of 2: each step writes its keys and
    # values, then attends with its queries; the result must equal causal attention over
    # everything written so far.
    b, n, k, h, page_size = 2, 4, 2, 8, 4
    total = 12
    q_all, k_all, v_all = (
        jnp.asarray(rng.normal(size=(b, total, heads, h)), jnp.float32) for heads in (n, k, k)
    )
    cache = jnp.zeros((b, 16, k, h), jnp.float32)
    key_cache, value_cache = cache, cache
    key_pages, value_pages, table = paged_cache(rng, b, 4, page_size, k, h)
    write_paged = jax.jit(js.update_paged_cache, donate_argnums=(0, 1))
    start = 0
    for step in (9, 1, 2):
        stop = start + step
        new = (k_all[:, start:stop], v_all[:, start:stop])
        positions = jnp.full((b,), start)
        key_cache, value_cache = js.update_cache(key_cache, value_cache, *new, positions)
        key_pages, value_pages = write_paged(key_pages, value_pages, *new, table, positions)
        q = q_all[:, start:stop]
        want = js.dot_product_attention(
            q_all[:, :stop], k_all[:, :stop], v_all[:, :stop], is_causal=True
        )[:, start:]
        lengths = jnp.full((b,), stop)
        contiguous = js.dot_product_attention(
            q,
            key_cache,
            value_cache,
            key_value_seq_lengths=lengths,
            mask_mod=(lambda b_, h_, i, j, start=start: j <= i + start),
        )
        paged = js.paged_attention(q, key_pages, value_pages, table, lengths)
        np.testing.assert_allclose(contiguous, want, atol=2e-6)
        np.testing.assert_allclose(paged, want, atol=2e-6)
        start = stop


def test_page_numbers_outside_the_pool_read_zeros_and_are_never_written(rng):
    key_pages, value_pages, table = paged_cache(rng, 1, 3, 4, 1, 8, num_pages=5)
    q = jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32)
    table = table.at[0, 2].set(-1)  # no third page yet: "none"
    unused = np.setdiff1d(np.arange(5), np.asarray(table))
    key_pages = key_pages.at[unused].set(jnp.nan)
    value_pages = value_pages.at[unused].set(jnp.nan)
    out = jax.jit(js.paged_attention)(q, key_pages, value_pages, table, jnp.array([8]))
    want = expected(q, key_pages, value_pages, table.at[0, 2].set(table[0, 0]), [8])
    assert ref.rel_err(out, want["out"]) < 2e-6  # only the two pages it owns, and finite
    # Writes past the sequence's pages, or onto page "−1", are dropped.
    new = jnp.ones((1, 3, 1, 8))
    written, _ = js.update_paged_cache(
        key_pages, value_pages, new, new, table, jnp.array([7])
    )  # positions 7, 8 (page −1) and 12 (past the 3 pages)
    np.testing.assert_array_equal(written[table[0, 1], 3], 1.0)
    finite = np.isfinite(np.asarray(key_pages)).all(axis=(2, 3))
    changed = np.asarray(written != key_pages).any(axis=(2, 3)) & finite
    assert np.argwhere(changed).tolist() == [[int(table[0, 1]), 3]]
    np.testing.assert_array_equal(np.isnan(written[unused]), True)


def test_no_query_or_no_page_gives_zeros(rng):
    key_pages, value_pages, table = paged_cache(rng, 2, 3, 4, 1, 8)
    q = jnp.zeros((2, 0, 2, 8), jnp.float32)
    lengths = jnp.array([3, 5])
    out, lse = js.paged_attention(q, key_pages, value_pages, table, lengths, return_residual=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 0, 2)
    q = jnp.ones((2, 1, 2, 8), jnp.float32)
    out = js.paged_attention(q, key_pages, value_pages, table[:, :0], jnp.array([0, 0]))
    np.testing.assert_array_equal(out, 0.0)
    with pytest.raises(TypeError, match="`query`"):
        js.paged_attention(q.astype(jnp.bfloat16), key_pages, value_pages, table, jnp.array([3, 5]))


# A ragged batch: sequences with 5, 0, 1 and 3 new queries packed along one axis (a prefill
# chunk, an idle sequence, decoding steps), two padding rows past the end.
COUNTS = [5, 0, 1, 3]


def _ragged(rng, counts=COUNTS, extra=2, page_size=4):
    key_pages, value_pages, table = paged_cache(rng, len(counts), 5, page_size, 2, 8)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
    q = jnp.asarray(rng.normal(size=(sum(counts) + extra, 4, 8)), jnp.float32)
    lengths = jnp.array([17, 0, 1, 20], jnp.int32)  # each at least its new queries; 20: all
    return q, key_pages, value_pages, table, lengths, starts


@pytest.fixture(params=[None, 4, 2], ids=["tile-a-sequence", "tiles-of-2", "tiles-of-1"])
def tile_rows(request, monkeypatch):
    """A ragged batch's tiles: the default (here a sequence's queries in one), or of 2 or 1
    rows (the kernel's packed rows, over the 2 query heads a key/value head has here): a
    sequence's queries in several tiles, the padding rows first in its first."""
    if request.param is not None:
        monkeypatch.setattr("jax_sdpa._ragged.PACKED_ROWS", request.param)


def _each_sequence(q, starts, counts=COUNTS):
    """Sequence b's queries ``(1, n_b, N, H)``."""
    return [q[None, int(starts[b]) : int(starts[b]) + n] for b, n in enumerate(counts)]


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_a_ragged_batch_equals_each_sequence_attended_alone(rng, window, tile_rows):
    q, key_pages, value_pages, table, lengths, starts = _ragged(rng)
    # NaN in pages no sequence references: never read.
    unreferenced = np.setdiff1d(np.arange(key_pages.shape[0]), np.asarray(table))
    key_pages, value_pages = (p.at[unreferenced].set(jnp.nan) for p in (key_pages, value_pages))
    keywords = dict(local_window_size=window, return_residual=True)
    attend = jax.jit(functools.partial(js.ragged_paged_attention, max_queries=6, **keywords))
    out, lse = attend(q, key_pages, value_pages, table, lengths, starts)
    for b, queries in enumerate(_each_sequence(q, starts)):
        if queries.shape[1] == 0:
            continue
        pages = (key_pages, value_pages, table[b : b + 1], lengths[b : b + 1])
        want = expected(queries, *pages, window=window)
        rows = slice(int(starts[b]), int(starts[b + 1]))
        assert ref.rel_err(out[rows], want["out"][0]) < 1e-5
        np.testing.assert_allclose(lse[rows], want["lse"][0], atol=1e-5)
    np.testing.assert_array_equal(out[-2:], 0)  # the rows past the last sequence's
    assert np.isfinite(np.asarray(out)).all()


def test_a_ragged_batchs_gradients_and_mods_see_each_sequences_own_queries(rng, tile_rows):
    # A bias quadratic in the distance (so that a shifted q_idx would change each row's weights,
    # not only shift its scores), over captured slopes, written with q_idx counted from the
    # sequence's first new query (at position lengths[b] − n_b): the gradients of the queries,
    # keys and slopes equal those of each sequence attended alone by paged_attention.
    q, key_pages, value_pages, table, lengths, starts = _ragged(rng)
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, size=4), jnp.float32)
    counts = starts[1:] - starts[:-1]

    def alibi(slopes, b, count):
        def mod(s, _, h, i, j):
            return s - slopes[h] * 0.05 * ((lengths[b] - count + i - j) ** 2).astype(s.dtype)

        return mod

    def ragged(q, key_pages, slopes):
        mod = lambda s, b, h, i, j: alibi(slopes, b, counts[b])(s, b, h, i, j)  # noqa: E731
        out = js.ragged_paged_attention(
            q, key_pages, value_pages, table, lengths, starts, max_queries=5, score_mod=mod
        )
        return jnp.sum(out**2)

    def alone(q, key_pages, slopes):
        total = 0.0
        for b, queries in enumerate(_each_sequence(q, starts)):
            if queries.shape[1]:
                mod = alibi(slopes, b, COUNTS[b])
                pages = (key_pages, value_pages, table[b : b + 1], lengths[b : b + 1])
                total = total + jnp.sum(js.paged_attention(queries, *pages, score_mod=mod) ** 2)
        return total

    got = jax.grad(ragged, argnums=(0, 1, 2))(q, key_pages, slopes)
    want = jax.grad(alone, argnums=(0, 1, 2))(q, key_pages, slopes)
    for g, w in zip(got, want, strict=True):
        assert ref.rel_err(g, w) < 1e-5
    np.testing.assert_array_equal(got[0][-2:], 0)  # the padding rows: no gradient


def test_a_ragged_batchs_mask_mod_sees_each_sequences_own_queries(rng, tile_rows):
    q, key_pages, value_pages, table, lengths, starts = _ragged(rng)

    def mask_mod(b, h, i, j):  # a sequence's odd queries see only even keys
        return (i % 2 == 0) | (j % 2 == 0)

    out = js.ragged_paged_attention(
        q, key_pages, value_pages, table, lengths, starts, max_queries=6, mask_mod=mask_mod
    )
    for b, queries in enumerate(_each_sequence(q, starts)):
        if queries.shape[1]:
            pages = (key_pages, value_pages, table[b : b + 1], lengths[b : b + 1])
            alone = js.paged_attention(queries, *pages, mask_mod=mask_mod)
            assert ref.rel_err(out[int(starts[b]) : int(starts[b + 1])], alone[0]) < 1e-6


def test_a_ragged_batch_is_attended_in_tiles_each_of_one_sequence():
    # Sequences of 5, 0, 1 and 3 new queries (rows 0-4, 5, 6-8 of 11), in tiles of 4 rows
    # (128 over 32 query heads a key/value head): each sequence's padding first, so that its
    # last query ends its last tile; the tiles past the batch's all padding. At most
    # (Q + B · 3) // 4 = 5 tiles: about Q + B · 4 rows attended, not B · max_queries.
    starts = jnp.array([0, 5, 5, 6, 9], jnp.int32)
    tiles = ragged_module._Tiles.of(starts, 6, 11, 32)
    assert tiles.size == 4
    np.testing.assert_array_equal(tiles.sequence, [0, 0, 2, 3, 3])
    np.testing.assert_array_equal(tiles.own, [-3, 1, -3, -1, 3])  # (a row's q_idx: these + t)
    rows = [[-3, -2, -1, 0], [1, 2, 3, 4], [2, 3, 4, 5], [5, 6, 7, 8], [9, 10, 11, 12]]
    np.testing.assert_array_equal(tiles.rows(), rows)
    real = np.asarray(rows) >= np.asarray([0, 0, 5, 6, 99])[:, None]
    np.testing.assert_array_equal(tiles.real(), real)
    # A sequence of more than max_queries (under jit): its last max_queries rows.
    tiles = ragged_module._Tiles.of(jnp.array([0, 9], jnp.int32), 6, 9, 64)
    np.testing.assert_array_equal(tiles.rows()[tiles.real()], np.arange(3, 9))


def test_the_ragged_writer_writes_each_sequences_tokens_as_the_paged_writer_does(rng):
    key_pages, value_pages, table = paged_cache(rng, len(COUNTS), 5, 4, 2, 8)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(COUNTS)]), jnp.int32)
    positions = jnp.array([3, 7, 19, 0])  # 19: the last slot of its pages
    new = [jnp.asarray(rng.normal(size=(sum(COUNTS) + 2, 2, 8)), jnp.float32) for _ in range(2)]
    write = jax.jit(js.update_ragged_paged_cache)
    got = write(key_pages, value_pages, *new, table, positions, starts)
    want = (key_pages, value_pages)
    for b, n in enumerate(COUNTS):
        rows = [x[None, int(starts[b]) : int(starts[b]) + n] for x in new]
        want = js.update_paged_cache(*want, *rows, table[b : b + 1], positions[b : b + 1])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    # Rows before the first start or after the end belong to no sequence: never written.
    outside = jnp.array([2, 3, 4], jnp.int32)
    pages = (key_pages, value_pages)
    got = js.update_ragged_paged_cache(*pages, *new, table[:2], positions[:2], outside)
    rows = [x[2:4] for x in new]
    want = js.update_ragged_paged_cache(*pages, *rows, table[:2], positions[:2], outside - 2)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            dict(starts=jnp.array([0, 5, 5, 6])),
            ValueError,
            r"`query_starts` must have shape \(B \+ 1,\) = \(5,\); got \(4,\)",
        ),
        (
            dict(max_queries=4),
            ValueError,
            "`max_queries` must be at least each sequence's count of new queries; got 4, and a "
            "sequence with 5",
        ),
        (dict(max_queries=0), ValueError, "`max_queries` must be a positive int; got 0"),
        (dict(q_rank=4), ValueError, r"`query` must have rank 3 \(Q, N, H\), packed"),
        (dict(starts=jnp.array([0.0, 5, 5, 6, 9])), TypeError, "query_starts"),
        (dict(mask_mod=js.CausalMask()), TypeError, "`mask_mod` of ragged_paged_attention must"),
        (
            dict(lengths=jnp.array([17, 0, 1])),
            ValueError,
            r"`lengths` must have shape \(B,\) = \(4,\); got \(3,\)",
        ),
        (
            dict(keywords=dict(is_casual=False)),  # (a typo: a call that stayed causal)
            TypeError,
            "ragged_paged_attention\\(\\) got an unexpected keyword argument 'is_casual'; it takes "
            "max_queries, score_mod, mask_mod and scale, is_causal,",
        ),
        (dict(keywords=dict(bias=0.0)), TypeError, "unexpected keyword argument 'bias'"),
    ],
)
def test_ragged_errors(rng, change, error, message):
    q, key_pages, value_pages, table, lengths, starts = _ragged(rng)
    starts, lengths = change.get("starts", starts), change.get("lengths", lengths)
    q = q[None] if change.get("q_rank") == 4 else q
    with pytest.raises(error, match=message):
        js.ragged_paged_attention(
            q,
            *(key_pages, value_pages, table, lengths, starts),
            max_queries=change.get("max_queries", 6),
            mask_mod=change.get("mask_mod"),
            **change.get("keywords", {}),
        )


def test_a_ragged_batch_of_no_sequence_gives_zeros(rng):
    q, key_pages, value_pages, table, _, _ = _ragged(rng)
    empty = (table[:0], jnp.zeros((0,), jnp.int32), jnp.zeros((1,), jnp.int32))
    lists = (x.tolist() for x in (q, key_pages, value_pages))  # (as nested lists, too)
    out, lse = js.ragged_paged_attention(*lists, *empty, max_queries=3, return_residual=True)
    np.testing.assert_array_equal(out, np.zeros((q.shape[0], 4, 8)))
    np.testing.assert_array_equal(lse, np.zeros((q.shape[0], 4)))


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_a_ragged_batch_reads_quantized_pages_as_paged_attention_does(rng, fmt):
    q, key_pages, value_pages, table, lengths, starts = _ragged(rng)
    pools = [js.quantize(p, fmt) for p in (key_pages, value_pages)]
    out = js.ragged_paged_attention(q, *pools, table, lengths, starts, max_queries=5)
    for b, queries in enumerate(_each_sequence(q, starts)):
        if queries.shape[1]:
            alone = js.paged_attention(queries, *pools, table[b : b + 1], lengths[b : b + 1])
            assert ref.rel_err(out[int(starts[b]) : int(starts[b + 1])], alone[0]) < 1e-6
