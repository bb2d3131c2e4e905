r"""Attention masks as rules on positions: which key ``kv_idx`` may query ``q_idx`` attend?

A rule is a small pytree with ``rule(q_idx, kv_idx) -> bool`` (``True`` = may attend, as in
``jax.nn`` and PyTorch). The same rule is evaluated on the whole ``(T, S)`` grid by the dense
implementation and block by block by the memory-efficient one, so a causal, windowed, padded or
packed mask never has to exist as a ``(T, S)`` array. Each rule also says which range of keys a
block of queries can possibly see (``kv_range``) and the converse (``q_range``), which lets the
blocked implementation skip blocks that are wholly masked; ``kv_full_range`` and
``q_full_range`` say which keys (queries) a whole block certainly may see, which lets it drop the
mask on those tiles.

Rules combine with ``&`` (:class:`AndMask`) and ``|`` (:class:`OrMask`), whose ranges are built
from their parts'; ``bool(rule)`` raises, so that ``a and b`` cannot silently mean ``b``. Array
fields (sequence lengths, segment ids) are pytree leaves, so rules can be ``jax.vmap``-ed over the
batch; integer fields (offsets, window sizes) are static (``metadata={"static": True}``, JAX's
dataclass convention), and an offset per sequence is an array field (``offsets``).

Every rule answers ``rule(q_idx, kv_idx)`` for broadcasting integer arrays of positions::

    >>> import jax.numpy as jnp
    >>> CausalMask()(jnp.arange(3)[:, None], jnp.arange(3)[None, :])
    Array([[ True, False, False],
           [ True,  True, False],
           [ True,  True,  True]], dtype=bool)
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Integer

from jax_sdpa._indices import INDEX, Index, positions

__all__ = [
    "AndMask",
    "CausalMask",
    "LengthMask",
    "LocalWindowMask",
    "MaskRule",
    "OrMask",
    "SegmentMask",
    "materialize_mask",
]

NO_LIMIT = 2**31 - 1


def promoted(a, b) -> tuple[Array, Array]:
    """``a`` and ``b`` in their common dtype: integers of any two, with no implicit promotion.

    (NumPy's ``promote_types``: ``jnp``'s refuses int32 with int64 under strict promotion.)
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    dtype = np.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


def rule_class(cls: type) -> type:
    """A frozen dataclass pytree: array fields are leaves, ``static=True`` fields are not."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


def static_field(default: Any = dataclasses.MISSING) -> Any:
    """A field that is part of the rule's type, not a leaf: it may set loop bounds and shapes."""
    return dataclasses.field(default=default, metadata={"static": True})


def per_sequence(*axes: str, index: bool = False) -> Any:
    """An array field with these axes for one sequence, and optionally the batch's before them.

    With exactly ``len(axes)`` axes it is shared by every sequence of a call; with the call's batch
    axes before those, each sequence has its own (:func:`with_batch`). ``index`` fields hold
    positions (lengths, offsets), kept as :data:`INDEX`.
    """
    return dataclasses.field(default=None, metadata={"axes": axes, "index": index})


class MaskRule:
    """Base of the mask rules: a predicate on (query position, key position) pairs."""

    def __call__(
        self, q_idx: Integer[Array, "..."], kv_idx: Integer[Array, "..."]
    ) -> Bool[Array, "..."]:
        """``True`` where query ``q_idx`` may attend key ``kv_idx`` (arrays broadcast)."""
        raise NotImplementedError

    def at(self, q_idx, kv_idx, batch: Index, head: Index) -> Bool[Array, "..."]:
        """``rule(q_idx, kv_idx)`` for sequence ``batch`` and query head ``head``.

        The built-in rules are the same for every head (their arrays are mapped over the batch
        beforehand); a ``FunctionMask`` (a ``mask_mod`` function) may depend on both.
        """
        return self(q_idx, kv_idx)

    @property
    def opaque(self) -> bool:
        """Whether the ranges below say nothing of the rule: tiles must evaluate it to know."""
        return False

    @property
    def per_head(self) -> bool:
        """Whether the rule may differ from one query head to another."""
        return False

    def kv_range(self, q_lo: Index, q_hi: Index) -> tuple[Index, Index]:
        """A half-open range of keys that contains every key queries ``[q_lo, q_hi)`` may see."""
        return 0, NO_LIMIT

    def q_range(self, kv_lo: Index, kv_hi: Index) -> tuple[Index, Index]:
        """A half-open range of queries that contains every query keys ``[kv_lo, kv_hi)`` serve."""
        return 0, NO_LIMIT

    def kv_full_range(self, q_lo: Index, q_hi: Index) -> tuple[Index, Index]:
        """A half-open range of keys that every query in ``[q_lo, q_hi)`` may see (maybe empty)."""
        return 0, 0

    def q_full_range(self, kv_lo: Index, kv_hi: Index) -> tuple[Index, Index]:
        """A half-open range of queries that may see every key in ``[kv_lo, kv_hi)``."""
        return 0, 0

    def visited(self, axis: str, index, sizes: tuple[int, int], batch: Index, heads):
        """The blocks along ``axis`` the rule may allow for block ``index`` of the other axis.

        A boolean ``(blocks,)`` for blocks of ``sizes = (other axis's, this axis's)``, any of
        ``heads``, read from a list the rule keeps (a :class:`~jax_sdpa.BlockMask` of those
        blocks); ``None`` where it keeps none: the loops then run between the rule's ranges.
        """
        return None

    def tile_class(self, q_idx, kv_idx, batch: Index, heads) -> tuple[Bool[Array, ""], ...]:
        """``(empty, full)``: whether no entry, or every entry, of a tile is allowed, all heads.

        The tile is ``q_idx × kv_idx``, each a run of consecutive positions (which may repeat
        its last one), for sequence ``batch`` and every query head in ``heads``. An answer may
        err only towards "partial": a tile called empty or full is so. A rule with ranges reads
        them; an ``opaque`` one is evaluated on the tile.
        """
        if self.opaque:
            heads = heads if self.per_head or heads.shape[0] == 1 else heads[:1]
            grid = q_idx[:, None], kv_idx[None, :]
            allowed = jax.vmap(lambda head: self.at(*grid, batch, head))(heads)
            return ~allowed.any(), allowed.all()
        span = q_idx.min(), q_idx.max() + 1  # a run's ends (reduced: a kernel does not slice)
        (lo, hi), (full_lo, full_hi) = self.kv_range(*span), self.kv_full_range(*span)
        start, stop = kv_idx.min(), kv_idx.max() + 1
        return (hi <= start) | (lo >= stop), (full_lo <= start) & (full_hi >= stop)

    def __and__(self, other: "MaskRule") -> "AndMask":
        return AndMask((self, other))

    def __or__(self, other: "MaskRule") -> "OrMask":
        return OrMask((self, other))

    def __bool__(self) -> bool:
        raise TypeError(
            "A mask rule has no truth value: combine rules with `&` and `|`, not `and` and `or` "
            f"(`a and b` would silently mean `b`); got {type(self).__name__}."
        )


def _shift(rule) -> Index:
    """Where query ``i`` sits: ``i + offset``, plus its sequence's own offset if given."""
    return rule.offset if rule.offsets is None else rule.offset + jnp.asarray(rule.offsets, INDEX)


@rule_class
class CausalMask(MaskRule):
    r"""Query ``i`` sees keys ``j <= i + offset``.

    ``offset = 0`` is the top-left alignment of ``jax.nn`` and PyTorch; ``offset = S - T`` aligns
    the diagonal to the bottom-right corner, as when ``T`` new queries follow ``S - T`` cached keys
    (KV-cache decoding, FlashAttention's convention). ``offsets``, an integer array ``(batch,)``,
    adds one offset per sequence (a paged cache, whose sequences have ``lengths − T`` cached keys
    each).
    """

    offset: int = static_field(0)
    offsets: Integer[Array, "*batch"] | None = per_sequence(index=True)

    def __call__(self, q_idx, kv_idx):
        return kv_idx <= q_idx + _shift(self)

    def kv_range(self, q_lo, q_hi):
        return 0, q_hi + _shift(self)

    def q_range(self, kv_lo, kv_hi):
        return kv_lo - _shift(self), NO_LIMIT

    def kv_full_range(self, q_lo, q_hi):
        return 0, q_lo + _shift(self) + 1

    def q_full_range(self, kv_lo, kv_hi):
        return kv_hi - 1 - _shift(self), NO_LIMIT


@rule_class
class LocalWindowMask(MaskRule):
    r"""Query ``i`` sees keys ``i + offset - left <= j <= i + offset + right`` (both inclusive).

    ``jax.nn``'s ``local_window_size=(left, right)``: with ``(3, 2)`` the query at position 6 sees
    keys 3 to 8. ``offset`` and ``offsets`` move the centre as :class:`CausalMask`'s move its
    diagonal.
    """

    left: int = static_field()
    right: int = static_field()
    offset: int = static_field(0)
    offsets: Integer[Array, "*batch"] | None = per_sequence(index=True)

    def __call__(self, q_idx, kv_idx):
        centre = q_idx + _shift(self)
        return (kv_idx >= centre - self.left) & (kv_idx <= centre + self.right)

    def kv_range(self, q_lo, q_hi):
        shift = _shift(self)
        return q_lo + shift - self.left, q_hi + shift + self.right

    def q_range(self, kv_lo, kv_hi):
        shift = _shift(self)
        return kv_lo - shift - self.right, kv_hi - shift + self.left

    def kv_full_range(self, q_lo, q_hi):
        shift = _shift(self)
        return q_hi - 1 + shift - self.left, q_lo + shift + self.right + 1

    def q_full_range(self, kv_lo, kv_hi):
        shift = _shift(self)
        return kv_hi - 1 - shift - self.right, kv_lo - shift + self.left + 1


@rule_class
class LengthMask(MaskRule):
    """Padding: only the first ``q_length`` queries and ``kv_length`` keys take part.

    A padded query (``i >= q_length``) sees no key at all, so its output is 0. Passed as a
    ``mask_mod``, a scalar length is shared by the batch and a ``(batch,)`` one is per sequence.
    """

    q_length: Integer[Array, "*batch"] | None = per_sequence(index=True)
    kv_length: Integer[Array, "*batch"] | None = per_sequence(index=True)

    def __call__(self, q_idx, kv_idx):
        allowed = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), bool)
        for idx, length in ((q_idx, self.q_length), (kv_idx, self.kv_length)):
            if length is not None:
                idx, length = promoted(idx, length)
                allowed = allowed & (idx < length)
        return allowed

    def kv_range(self, q_lo, q_hi):
        hi = NO_LIMIT if self.kv_length is None else self.kv_length
        if self.q_length is not None:
            hi = jnp.where(q_lo < self.q_length, hi, 0)
        return 0, hi

    def q_range(self, kv_lo, kv_hi):
        hi = NO_LIMIT if self.q_length is None else self.q_length
        if self.kv_length is not None:
            hi = jnp.where(kv_lo < self.kv_length, hi, 0)
        return 0, hi

    def kv_full_range(self, q_lo, q_hi):
        hi = NO_LIMIT if self.kv_length is None else self.kv_length
        if self.q_length is not None:
            hi = jnp.where(q_hi <= self.q_length, hi, 0)
        return 0, hi

    def q_full_range(self, kv_lo, kv_hi):
        hi = NO_LIMIT if self.q_length is None else self.q_length
        if self.kv_length is not None:
            hi = jnp.where(kv_hi <= self.kv_length, hi, 0)
        return 0, hi


@rule_class
class SegmentMask(MaskRule):
    """Packed sequences: a query sees only keys of the same segment id.

    ``q_segment_ids`` has one id per query position, ``kv_segment_ids`` one per key position.
    Passed as a ``mask_mod``, ids of shape ``(q_seq,)`` are shared by the batch and ids of shape
    ``(batch, q_seq)`` are per sequence, whatever the sizes.
    """

    q_segment_ids: Integer[Array, "*batch q_seq"] = per_sequence("q_seq")
    kv_segment_ids: Integer[Array, "*batch kv_seq"] = per_sequence("kv_seq")

    def __call__(self, q_idx, kv_idx):
        q_ids, kv_ids = promoted(self.q_segment_ids[q_idx], self.kv_segment_ids[kv_idx])
        return q_ids == kv_ids

    @property
    def opaque(self) -> bool:  # where segments start is data: a tile must look at its ids
        return True


class _Combination(MaskRule):
    """Rules combined entry by entry with ``_combine`` (``_empty`` where there are none).

    A tile's class combines its parts' (:meth:`MaskRule.tile_class`): under ``&`` a tile is
    empty if one part is and full if all are; under ``|`` the converse.
    """

    rules: tuple[MaskRule, ...]
    _combine: Callable
    _empty: bool

    def __call__(self, q_idx, kv_idx):
        return self.at(q_idx, kv_idx, 0, 0)

    @property
    def opaque(self) -> bool:
        return any(rule.opaque for rule in self.rules)

    @property
    def per_head(self) -> bool:
        return any(rule.per_head for rule in self.rules)

    def _part_classes(self, q_idx, kv_idx, batch, heads) -> tuple[list, list]:
        """Each part's ``(empty, full)`` on a tile, as two lists of booleans.

        Combined by ``&`` and ``|``, not stacked: a kernel's stack of scalars is a 0-d tensor,
        which Triton's passes do not take.
        """
        parts = [rule.tile_class(q_idx, kv_idx, batch, heads) for rule in self.rules]
        return [e for e, _ in parts], [f for _, f in parts]

    def at(self, q_idx, kv_idx, batch, head):
        shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx))
        parts = (rule.at(q_idx, kv_idx, batch, head) for rule in self.rules)
        return functools.reduce(self._combine, parts, jnp.full(shape, self._empty))


def any_of(conditions):
    """Whether any of ``conditions`` holds (False for none), by ``|``: no stack of scalars."""
    return functools.reduce(jnp.logical_or, conditions, jnp.asarray(False))


def all_of(conditions):
    """Whether all of ``conditions`` hold (True for none), by ``&``: no stack of scalars."""
    return functools.reduce(jnp.logical_and, conditions, jnp.asarray(True))


@rule_class
class AndMask(_Combination):
    """Allowed where every one of ``rules`` allows; no rules at all allows everything."""

    rules: tuple[MaskRule, ...] = ()

    _combine, _empty = staticmethod(jnp.logical_and), True

    def tile_class(self, q_idx, kv_idx, batch, heads):
        empty, full = self._part_classes(q_idx, kv_idx, batch, heads)
        return any_of(empty), all_of(full)

    def visited(self, axis, index, sizes, batch, heads):
        lists = [rule.visited(axis, index, sizes, batch, heads) for rule in self.rules]
        lists = [x for x in lists if x is not None]
        return functools.reduce(jnp.logical_and, lists) if lists else None

    def kv_range(self, q_lo, q_hi):
        return _intersect(rule.kv_range(q_lo, q_hi) for rule in self.rules)

    def q_range(self, kv_lo, kv_hi):
        return _intersect(rule.q_range(kv_lo, kv_hi) for rule in self.rules)

    def kv_full_range(self, q_lo, q_hi):
        return _intersect(rule.kv_full_range(q_lo, q_hi) for rule in self.rules)

    def q_full_range(self, kv_lo, kv_hi):
        return _intersect(rule.q_full_range(kv_lo, kv_hi) for rule in self.rules)


@rule_class
class OrMask(_Combination):
    """Allowed where any one of ``rules`` allows; no rules at all allows nothing."""

    rules: tuple[MaskRule, ...] = ()

    _combine, _empty = staticmethod(jnp.logical_or), False

    def tile_class(self, q_idx, kv_idx, batch, heads):
        empty, full = self._part_classes(q_idx, kv_idx, batch, heads)
        return all_of(empty), any_of(full)

    def kv_range(self, q_lo, q_hi):
        return _hull(rule.kv_range(q_lo, q_hi) for rule in self.rules)

    def q_range(self, kv_lo, kv_hi):
        return _hull(rule.q_range(kv_lo, kv_hi) for rule in self.rules)

    def kv_full_range(self, q_lo, q_hi):
        return _union_within(rule.kv_full_range(q_lo, q_hi) for rule in self.rules)

    def q_full_range(self, kv_lo, kv_hi):
        return _union_within(rule.q_full_range(kv_lo, kv_hi) for rule in self.rules)


def _intersect(ranges) -> tuple[Index, Index]:
    """The intersection of half-open ranges (empty when ``lo >= hi``)."""
    lo, hi = 0, NO_LIMIT
    for r_lo, r_hi in ranges:
        lo, hi = jnp.maximum(lo, r_lo), jnp.minimum(hi, r_hi)
    return lo, hi


def _hull(ranges) -> tuple[Index, Index]:
    """The smallest range that contains every one of ``ranges``: it contains their union."""
    lo, hi = NO_LIMIT, 0
    for r_lo, r_hi in ranges:
        lo, hi = jnp.minimum(lo, r_lo), jnp.maximum(hi, r_hi)
    return lo, hi


def _union_within(ranges) -> tuple[Index, Index]:
    """A range inside the union of ``ranges``: overlapping ones joined, else the longest.

    Positions are never negative, so each range starts at 0 at the lowest (which also keeps its
    length within int32).
    """
    lo, hi = 0, 0
    for r_lo, r_hi in ranges:
        r_lo = jnp.maximum(r_lo, 0)
        overlap = (r_lo <= hi) & (lo <= r_hi)
        longer = r_hi - r_lo > hi - lo
        lo = jnp.where(overlap, jnp.minimum(lo, r_lo), jnp.where(longer, r_lo, lo))
        hi = jnp.where(overlap, jnp.maximum(hi, r_hi), jnp.where(longer, r_hi, hi))
    return lo, hi


def materialize_mask(
    rule: MaskRule,
    q_len: int,
    kv_len: int,
    *,
    q_offset: Index = 0,
    kv_offset: Index = 0,
    batch: Index = 0,
    head: Index = 0,
) -> Bool[Array, "q_len kv_len"]:
    """Evaluates ``rule`` on a ``(q_len, kv_len)`` block of positions as a boolean array.

    ``batch`` and ``head`` are what a ``mask_mod`` function sees (the built-in rules ignore them).

    Examples:
        >>> materialize_mask(LocalWindowMask(1, 0), 3, 3).astype(int)
        Array([[1, 0, 0],
               [1, 1, 0],
               [0, 1, 1]], dtype=int32)
    """
    q_idx, kv_idx = positions(q_offset, q_len)[:, None], positions(kv_offset, kv_len)[None, :]
    return rule.at(q_idx, kv_idx, batch, head)
