"""Rules on rows that are not one query each: grouped heads packed into rows, ragged padding.

Each wraps or extends the position rules of :mod:`jax_sdpa._masks` for the rows a kernel or a
batch lays out: :class:`PackedRows` for a tile's rows that hold several query heads at each
position (GQA decoding on the fused kernel), :class:`QueriesFrom` for the rows that pad a ragged
batch's sequences before their own queries.
"""

import jax.numpy as jnp
from jaxtyping import Array, Integer

from jax_sdpa._indices import Index
from jax_sdpa._masks import NO_LIMIT, MaskRule, per_sequence, promoted, rule_class, static_field


@rule_class
class PackedRows(MaskRule):
    """``rule`` on rows that each hold ``group`` query heads: row ``r`` is position ``r // group``.

    A key/value head's query heads packed into one tile's rows (GQA decoding,
    :mod:`jax_sdpa._pallas`), position by position: a rule the same for every head, asked of
    rows, answers for their positions; its ranges of rows hold every row of their positions.
    """

    rule: MaskRule
    group: int = static_field()

    def __call__(self, q_idx, kv_idx):
        return self.at(q_idx, kv_idx, 0, 0)

    def at(self, q_idx, kv_idx, batch, head):
        # (over the whole block first: a kernel holds positions that way, its rows' vectors not)
        rows = jnp.broadcast_to(q_idx, jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)))
        return self.rule.at(rows // self.group, kv_idx, batch, head)

    @property
    def opaque(self) -> bool:
        return self.rule.opaque

    def _positions(self, lo, hi) -> tuple[Index, Index]:
        """The positions of rows ``[lo, hi)``."""
        return lo // self.group, -(-hi // self.group)

    def _rows(self, lo, hi) -> tuple[Index, Index]:
        """The rows of positions ``[lo, hi)``, within int32 (:data:`NO_LIMIT` stays one)."""
        most = NO_LIMIT // self.group
        return tuple(
            jnp.where(x >= most, NO_LIMIT, jnp.maximum(x, -most) * self.group) for x in (lo, hi)
        )

    def kv_range(self, q_lo, q_hi):
        return self.rule.kv_range(*self._positions(q_lo, q_hi))

    def kv_full_range(self, q_lo, q_hi):
        return self.rule.kv_full_range(*self._positions(q_lo, q_hi))

    def q_range(self, kv_lo, kv_hi):
        return self._rows(*self.rule.q_range(kv_lo, kv_hi))

    def q_full_range(self, kv_lo, kv_hi):
        return self._rows(*self.rule.q_full_range(kv_lo, kv_hi))


@rule_class
class QueriesFrom(MaskRule):
    """Only the queries from position ``first`` on see keys; those before it see none.

    (The rows a ragged batch pads each sequence's own with, before them:
    :func:`~jax_sdpa.ragged_paged_attention`.) ``first`` is per sequence.
    """

    first: Integer[Array, "*batch"] = per_sequence(index=True)

    def __call__(self, q_idx, kv_idx):
        q_idx, first = promoted(q_idx, self.first)
        shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx))
        return jnp.broadcast_to(q_idx >= first, shape)

    def kv_range(self, q_lo, q_hi):
        return 0, jnp.where(q_hi > self.first, NO_LIMIT, 0)

    def q_range(self, kv_lo, kv_hi):
        return self.first, NO_LIMIT

    def kv_full_range(self, q_lo, q_hi):
        return 0, jnp.where(q_lo >= self.first, NO_LIMIT, 0)

    def q_full_range(self, kv_lo, kv_hi):
        return self.first, NO_LIMIT
