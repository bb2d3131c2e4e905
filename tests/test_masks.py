import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_sdpa as js
from jax_sdpa._row_rules import PackedRows, QueriesFrom
from tests.profile import examples


def grid(t, s):
    return np.arange(t)[:, None], np.arange(s)[None, :]


def test_causal_top_left_and_bottom_right():
    np.testing.assert_array_equal(
        js.materialize_mask(js.CausalMask(), 2, 4), [[1, 0, 0, 0], [1, 1, 0, 0]]
    )
    # Bottom-right: 2 new queries after 2 cached keys see the cache and themselves.
    np.testing.assert_array_equal(
        js.materialize_mask(js.CausalMask(offset=2), 2, 4), [[1, 1, 1, 0], [1, 1, 1, 1]]
    )


def test_local_window_matches_jax_nn_docstring_example():
    # jax.nn: with (3, 2) the token at position 6 attends to positions 3..8.
    row = np.asarray(js.materialize_mask(js.LocalWindowMask(3, 2), 10, 10))[6]
    np.testing.assert_array_equal(np.flatnonzero(row), [3, 4, 5, 6, 7, 8])


def test_length_and_segment_masks():
    m = js.materialize_mask(js.LengthMask(jnp.array(2), jnp.array(3)), 3, 4)
    np.testing.assert_array_equal(m, [[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    seg = js.SegmentMask(jnp.array([0, 0, 1]), jnp.array([0, 1, 1, 1]))
    np.testing.assert_array_equal(
        js.materialize_mask(seg, 3, 4), [[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1]]
    )


def test_and_combines_rules():
    both = js.CausalMask() & js.LocalWindowMask(1, 0)
    np.testing.assert_array_equal(
        js.materialize_mask(both, 4, 4),
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]],
    )
    assert bool(js.materialize_mask(js.AndMask(()), 2, 2).all())


def test_rules_are_pytrees_that_vmap_over_batch():
    rule = js.LengthMask(jnp.array([1, 3]), jnp.array([2, 1]))
    masks = jax.vmap(lambda r: js.materialize_mask(r, 3, 3))(rule)
    np.testing.assert_array_equal(masks[0], [[1, 1, 0], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(masks[1], [[1, 0, 0], [1, 0, 0], [1, 0, 0]])
    leaves = jax.tree.leaves(js.CausalMask(3) & js.LocalWindowMask(1, 2))
    assert leaves == []  # offsets and window sizes are static
    # Offsets per sequence are leaves: sequence b's queries sit at positions offsets[b] + i.
    rule = js.CausalMask(offsets=jnp.array([0, 2]))
    masks = jax.vmap(lambda r: js.materialize_mask(r, 2, 4))(rule)
    np.testing.assert_array_equal(masks[0], [[1, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(masks[1], [[1, 1, 1, 0], [1, 1, 1, 1]])


@settings(max_examples=examples("ranges"), deadline=None)
@given(
    t=st.integers(1, 12),
    s=st.integers(1, 12),
    offset=st.integers(-6, 6),
    left=st.integers(0, 5),
    right=st.integers(0, 5),
    q_len=st.integers(0, 12),
    kv_len=st.integers(0, 12),
    block=st.integers(1, 5),
    group=st.integers(2, 4),
)
def test_property_block_ranges_are_sound(t, s, offset, left, right, q_len, kv_len, block, group):
    # kv_range / q_range may over-approximate (blocks are then masked) but never cut an allowed key.
    rules = [
        js.CausalMask(offset),
        js.LocalWindowMask(left, right, offset),
        js.LengthMask(jnp.array(q_len), jnp.array(kv_len)),
        js.CausalMask(offset) & js.LengthMask(None, jnp.array(kv_len)),
        js.CausalMask(offset) | js.LocalWindowMask(left, right, -offset),
        js.LocalWindowMask(left, 0, offset) | js.LocalWindowMask(0, right, offset + 3),
        js.LengthMask(jnp.array(q_len), None)
        | (js.CausalMask(offset) & js.LocalWindowMask(left, right)),
        js.OrMask(()),
        QueriesFrom(jnp.array(q_len)) & js.CausalMask(offset),
        # Offsets per sequence (a leaf: one sequence's, once mapped over the batch).
        js.CausalMask(1, jnp.array(offset - 1))
        & js.LocalWindowMask(left, right, 0, jnp.array(offset)),
    ]
    # Rows that each hold `group` query heads (packed GQA): row r is position r // group.
    packed = [PackedRows(rule, group) for rule in (rules[1], rules[4], rules[-1])]
    for rule, rows in zip((rules[1], rules[4], rules[-1]), packed, strict=True):
        np.testing.assert_array_equal(
            js.materialize_mask(rows, t, s),
            np.asarray(js.materialize_mask(rule, -(-t // group), s))[np.arange(t) // group],
        )
    for rule in rules + packed:
        allowed = np.asarray(js.materialize_mask(rule, t, s))
        for lo in range(0, t, block):
            hi = min(lo + block, t)
            r_lo, r_hi = (int(x) for x in rule.kv_range(lo, hi))
            cols = np.flatnonzero(allowed[lo:hi].any(axis=0))
            assert all(r_lo <= c < r_hi for c in cols), (rule, lo, hi, r_lo, r_hi, cols)
        for lo in range(0, s, block):
            hi = min(lo + block, s)
            r_lo, r_hi = (int(x) for x in rule.q_range(lo, hi))
            rows = np.flatnonzero(allowed[:, lo:hi].any(axis=1))
            assert all(r_lo <= r < r_hi for r in rows), (rule, lo, hi, r_lo, r_hi, rows)
        # The full ranges may under-approximate (those tiles keep their mask) but never overstate.
        for lo in range(0, t, block):
            hi = min(lo + block, t)
            f_lo, f_hi = (int(x) for x in rule.kv_full_range(lo, hi))
            assert allowed[lo:hi, max(f_lo, 0) : max(min(f_hi, s), 0)].all(), (
                rule,
                lo,
                hi,
                f_lo,
                f_hi,
            )
        for lo in range(0, s, block):
            hi = min(lo + block, s)
            f_lo, f_hi = (int(x) for x in rule.q_full_range(lo, hi))
            assert allowed[max(f_lo, 0) : max(min(f_hi, t), 0), lo:hi].all(), (
                rule,
                lo,
                hi,
                f_lo,
                f_hi,
            )


def test_rule_definitions_match_numpy():
    i, j = grid(7, 9)
    cases = [
        (js.CausalMask(), j <= i),
        (js.CausalMask(2), j <= i + 2),
        (js.LocalWindowMask(2, 1), (j >= i - 2) & (j <= i + 1)),
        (js.LengthMask(jnp.array(5), None), np.broadcast_to(i < 5, (7, 9))),
    ]
    for rule, expected in cases:
        np.testing.assert_array_equal(js.materialize_mask(rule, 7, 9), expected)


def test_or_combines_rules_and_no_rule_allows_nothing():
    either = js.LocalWindowMask(0, 0) | js.CausalMask(-2)  # the diagonal, or 2+ steps back
    np.testing.assert_array_equal(
        js.materialize_mask(either, 4, 4),
        [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
    )
    assert not bool(js.materialize_mask(js.OrMask(()), 2, 2).any())


def test_rules_refuse_to_be_truth_values():
    # `a and b` would silently evaluate to `b`: rules combine with & and | only.
    with pytest.raises(TypeError, match="combine rules with `&` and `|`"):
        js.CausalMask() and js.LocalWindowMask(2, 0)  # noqa: B018
    with pytest.raises(TypeError, match="no truth value"):
        bool(js.LengthMask(jnp.array(3), None))
