"""Block masks: a mask's tiles classified once, then reused by every call that needs it.

The chunked and ring implementations skip the tiles a mask excludes entirely and drop the mask
on the tiles it allows entirely. For the built-in rules they read that from the rules' ranges;
a ``mask_mod`` function has none, so a call classifies its tiles by evaluating it on every
entry once, in the forward pass (the backward pass reads the classes). A
:class:`~jax_sdpa.BlockMask` does that evaluation ahead, once for all the layers of a model
that share the mask, as PyTorch FlexAttention's ``create_block_mask`` does.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Integer

from jax_sdpa import _checks
from jax_sdpa._formula import CallArrays
from jax_sdpa._indices import INDEX, Index, indices, listed, positions
from jax_sdpa._masks import AndMask, MaskRule, rule_class, static_field
from jax_sdpa._tiles import Tiles
from jax_sdpa._tunables import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q
from jax_sdpa._user_functions import function_mask

EMPTY, PARTIAL, FULL = 0, 1, 2  # a tile's class in a BlockMask


@rule_class
class BlockMask(MaskRule):
    """A rule with the class of each of its tiles computed once (:func:`create_block_mask`).

    ``classes[batch, head, i, j]`` (``batch`` indexes the flattened batch) is ``EMPTY`` (0: the
    rule allows no entry of query block ``i`` × key block ``j``; the chunked and ring paths skip
    it), ``FULL`` (2: every entry; they compute it without evaluating the rule) or ``PARTIAL``
    (1: they evaluate ``rule`` there). Its batch and head axes may be 1, shared by all. Any
    entry is ``rule``'s answer.
    """

    rule: MaskRule
    classes: Integer[Array, "batch heads q_blocks kv_blocks"]  # shared: read at the batch index
    block_q: int = static_field()
    block_kv: int = static_field()
    q_len: int = static_field()
    kv_len: int = static_field()

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: Integer[ArrayLike, "batch heads q_blocks"],
        kv_indices: Integer[ArrayLike, "batch heads q_blocks listed"],
        *,
        q_len: int,
        kv_len: int,
        block_q: int = DEFAULT_BLOCK_Q,
        block_kv: int = DEFAULT_BLOCK_KV,
        mask_mod=None,
    ) -> "BlockMask":
        """The mask that allows, for each query block, exactly the key blocks it lists.

        FlexAttention's ``BlockMask.from_kv_blocks``: query block ``i`` of sequence ``b`` and
        head ``h`` attends the key blocks ``kv_indices[b, h, i, :kv_num_blocks[b, h, i]]``
        (repeats count once); with a ``mask_mod``, only the entries of those blocks it allows.
        The chunked path then loops over each query block's list, so its cost is that of the
        blocks listed (NSA's selected blocks, MoBA's chosen chunks).

        Args:
            kv_num_blocks: ``(batch or 1, heads or 1, q_blocks)`` integers in ``[0, listed]``.
            kv_indices: ``(batch or 1, heads or 1, q_blocks, listed)`` key block numbers, in
                ``[0, kv_blocks)`` where counted (refused otherwise when concrete; under ``jit``
                such an entry lists nothing).
            q_len: The calls' queries per sequence.
            kv_len: The calls' keys per sequence.
            block_q: Queries per block; give the chunked path the same tiles (its defaults
                are these defaults).
            block_kv: Keys per block.
            mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` within the listed blocks,
                or a :class:`~jax_sdpa.MaskRule` (a block mask's ``rule``).

        Raises:
            ValueError: On shapes that do not fit the blocks, or listed blocks out of range.
            TypeError: On non-integer lists.

        Examples:
            >>> import jax.numpy as jnp
            >>> counts = jnp.array([[[1, 2]]])  # query block 0 lists one key block, 1 two
            >>> lists = jnp.array([[[[1, 0], [0, 1]]]])
            >>> mask = BlockMask.from_kv_blocks(counts, lists, q_len=4, kv_len=4,
            ...                                 block_q=2, block_kv=2)
            >>> mask.classes[0, 0]
            Array([[0, 2],
                   [2, 2]], dtype=int8)
        """
        counts, lists = jnp.asarray(kv_num_blocks), jnp.asarray(kv_indices)
        for name, x in (("kv_num_blocks", counts), ("kv_indices", lists)):
            _checks.check_integer(name, x)
        for name, size in dict(
            q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv
        ).items():
            _checks.check_positive_int(name, size)
        q_blocks, kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
        _checks.check_ndim("kv_indices", lists, (4,), "(batch, heads, q_blocks, listed)")
        _checks.check_shape(
            "kv_indices",
            lists,
            (*lists.shape[:2], q_blocks, lists.shape[3]),
            "(batch, heads, q_blocks, listed)",
        )
        _checks.check_shape("kv_num_blocks", counts, lists.shape[:3], "(batch, heads, q_blocks)")
        counted = (
            jnp.arange(lists.shape[3], dtype=counts.dtype).reshape(1, 1, 1, -1) < counts[..., None]
        )
        try:
            stray = bool(jnp.any(counted & ((lists < 0) | (lists >= kv_blocks))))
            most = (int(jnp.min(counts, initial=0)), int(jnp.max(counts, initial=0)))
        except jax.errors.ConcretizationTypeError:  # under jit: such entries list nothing
            stray, most = False, (0, 0)
        if most[0] < 0 or most[1] > lists.shape[3]:
            raise ValueError(
                f"`kv_num_blocks` must count in [0, {lists.shape[3]}] (the `kv_indices` listed "
                f"per query block); got {most[0]} to {most[1]}."
            )
        if stray:
            raise ValueError(
                f"`kv_indices` must hold key blocks in [0, {kv_blocks}) where counted by "
                "`kv_num_blocks`; got one outside."
            )
        # A stray entry lands in the extra last column, dropped.
        column = jnp.where(counted & (lists >= 0) & (lists < kv_blocks), lists, kv_blocks)
        grid = jnp.zeros((*lists.shape[:3], kv_blocks + 1), bool)
        places = tuple(jnp.indices(lists.shape)[:3]) + (column,)
        listed = grid.at[places].set(True)[..., :kv_blocks]

        def allowed(batch, head, q_idx, kv_idx):
            table = listed[batch if listed.shape[0] > 1 else 0, head if listed.shape[1] > 1 else 0]
            inside = table[q_idx // block_q, kv_idx // block_kv]
            if mask_mod is None:
                return inside
            if isinstance(mask_mod, MaskRule):
                return inside & mask_mod.at(q_idx, kv_idx, batch, head)
            return inside & mask_mod(batch, head, q_idx, kv_idx)

        classes = jnp.where(listed, FULL if mask_mod is None else PARTIAL, EMPTY).astype(jnp.int8)
        return cls(function_mask(allowed), classes, block_q, block_kv, q_len, kv_len)

    def to_kv_blocks(self) -> tuple[Array, Array]:
        """``(kv_num_blocks, kv_indices)``: each query block's key blocks that are not empty.

        ``kv_indices[..., i, :kv_num_blocks[..., i]]`` lists them in order; the rest of the row
        holds the others. :meth:`from_kv_blocks` of these and the mask's rule attends as this
        mask does; its listed blocks are all partial (which of them were full is not kept).
        """
        return listed(self.classes != EMPTY)

    @property
    def opaque(self) -> bool:
        return True

    @property
    def per_head(self) -> bool:
        return self.rule.per_head

    def __call__(self, q_idx, kv_idx):
        return self.rule(q_idx, kv_idx)

    def at(self, q_idx, kv_idx, batch, head):
        return self.rule.at(q_idx, kv_idx, batch, head)

    # The rule's own ranges still bound the loops (a causal part keeps its triangle).
    def kv_range(self, q_lo, q_hi):
        return self.rule.kv_range(q_lo, q_hi)

    def q_range(self, kv_lo, kv_hi):
        return self.rule.q_range(kv_lo, kv_hi)

    def kv_full_range(self, q_lo, q_hi):
        return self.rule.kv_full_range(q_lo, q_hi)

    def q_full_range(self, kv_lo, kv_hi):
        return self.rule.q_full_range(kv_lo, kv_hi)

    def visited(self, axis, index, sizes, batch, heads):
        """The listed blocks, where the ``axis`` tiles are the mask's blocks.

        The other axis's tile ``index`` must lie in one block: its size divides the block's
        (decode's few queries in one query block).
        """
        own, other = (
            (self.block_kv, self.block_q) if axis == "kv" else (self.block_q, self.block_kv)
        )
        if sizes[1] != own or other % sizes[0]:
            return None
        block = index * sizes[0] // other
        classes = self._classes(batch, heads)
        along = classes[:, block, :] if axis == "kv" else classes[:, :, block]
        return (along != EMPTY).any(axis=0)

    def _classes(self, batch, heads):
        """``classes[batch]`` (or ``[0]``, shared) of ``heads`` (or the one for all heads)."""
        classes = self.classes[batch if self.classes.shape[0] > 1 else 0]
        return classes if classes.shape[0] == 1 else classes[heads]

    def tile_class(self, q_idx, kv_idx, batch, heads):
        """Read from ``classes[batch]`` (or ``[0]``, shared): ``(heads, q_blocks, kv_blocks)``.

        The tile may cover several blocks, or parts of them: it is empty (full) if every block
        it touches is.
        """
        classes = self._classes(batch, heads)
        first_q, q_seen = _touched(q_idx, self.block_q, classes.shape[1])
        first_kv, kv_seen = _touched(kv_idx, self.block_kv, classes.shape[2])
        size = (classes.shape[0], q_seen.size, kv_seen.size)
        touched = lax.dynamic_slice(classes, indices(0, first_q, first_kv), size)
        seen = (q_seen[:, None] & kv_seen[None, :])[None]
        return jnp.all((touched == EMPTY) | ~seen), jnp.all((touched == FULL) | ~seen)


def _touched(idx, block: int, count: int) -> tuple[Array, Array]:
    """``(first, seen)``: the blocks a run of positions touches are ``first + n`` where ``seen``.

    ``seen`` has a static size, the most blocks a run of ``idx.size`` positions can touch.
    """
    size = min(-(-idx.size // block) + 1, count)
    lo, hi = idx.min() // block, idx.max() // block + 1  # a run: its ends (no slice in a kernel)
    first = jnp.clip(lo, 0, count - size)
    blocks = positions(first, size)
    return first, (blocks >= lo) & (blocks < hi)


# Tiles classified per step of the loop that builds a BlockMask: the step holds this many
# entries of the mask at most, whatever the sequence lengths.
_ENTRIES_PER_STEP = 2**22


def classify_blocks(
    rule: MaskRule, q_len: int, kv_len: int, block_q: int, block_kv: int, batch: Index, heads
) -> Integer[Array, "heads q_blocks kv_blocks"]:
    """The :class:`BlockMask` classes of one sequence, ``(len(heads) or 1, q_blocks, kv_blocks)``.

    Tiles are classified with :meth:`MaskRule.tile_class`, a few at a time: the mask is never
    held whole. Positions past ``q_len`` (``kv_len``) in the last blocks are not looked at.
    """
    heads = heads if rule.per_head else heads[:1]
    q_blocks, kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)

    def tile(ij):
        i, j = jnp.divmod(ij, kv_blocks)
        q_idx = jnp.minimum(positions(i * block_q, block_q), q_len - 1)
        kv_idx = jnp.minimum(positions(j * block_kv, block_kv), kv_len - 1)
        empty, full = jax.vmap(lambda h: rule.tile_class(q_idx, kv_idx, batch, h[None]))(heads)
        return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)

    per_step = max(1, _ENTRIES_PER_STEP // (heads.size * block_q * block_kv))
    classes = lax.map(tile, positions(0, q_blocks * kv_blocks), batch_size=per_step)
    return classes.T.reshape(heads.size, q_blocks, kv_blocks)


def create_block_mask(
    mask_mod,
    batch: int | None,
    heads: int | None,
    q_len: int,
    kv_len: int,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
) -> BlockMask:
    """Classifies the ``(block_q, block_kv)`` tiles of ``mask_mod`` once, for many calls.

    The result is a pytree (it can enter and leave ``jax.jit``) to pass as ``mask_mod=`` to
    :func:`~jax_sdpa.dot_product_attention` and the ring functions, where it means exactly
    ``mask_mod``. Building it evaluates ``mask_mod`` on every entry, a few tiles at a time: no
    ``(q_len, kv_len)`` array is ever held. Calls read each tile's class instead of evaluating
    it again; they may use other tiles (``block_q``, ``block_kv``), at the cost of precision
    where their tiles straddle these.

    Args:
        mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` of scalars (``True`` = may
            attend), or a built-in :class:`~jax_sdpa.MaskRule` without batch axes.
        batch: The batch size of the calls (the flattened batch), or ``None`` where the mask is
            the same for every sequence (refused if ``mask_mod`` reads its ``batch``).
        heads: The number of query heads, or ``None`` where the mask is the same for every head
            (refused if ``mask_mod`` reads its ``head``).
        q_len: Queries per sequence (a ring's whole sequence).
        kv_len: Keys per sequence.
        block_q: Queries per tile; by default the chunked implementation's.
        block_kv: Keys per tile.

    Returns:
        A :class:`~jax_sdpa.BlockMask` whose ``classes`` is an ``int8`` array
        ``(batch or 1, heads or 1, q_blocks, kv_blocks)``: 0 where the tile is empty (skipped),
        2 where it is full (computed without the mask), 1 where the mask must be evaluated.
        The head axis is 1 also where ``mask_mod`` does not read its head.

    Examples:
        >>> causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 6, 6,
        ...                            block_q=2, block_kv=2)
        >>> causal.classes[0, 0]
        Array([[1, 0, 0],
               [2, 1, 0],
               [2, 2, 1]], dtype=int8)

    References:
        Dong, Feng, Guessous, Liang & He, Flex Attention: A Programming Model for Generating
        Optimized Attention Kernels, 2024 (PyTorch's ``create_block_mask`` and ``BlockMask``).
    """
    rule = mask_mod if isinstance(mask_mod, MaskRule) else function_mask(mask_mod)
    for name, size, reads in (
        ("heads", heads, rule.per_head),
        ("batch", batch, getattr(rule, "uses_batch", False)),
    ):
        if size is None and reads:
            raise ValueError(
                f"`{name}` must be given: `mask_mod` reads its {name} argument, so one "
                f"classification cannot stand for every {name}; got None."
            )
    batch, heads = (1 if size is None else size for size in (batch, heads))
    sizes = dict(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
    for name, size in (sizes | dict(block_q=block_q, block_kv=block_kv)).items():
        _checks.check_positive_int(name, size)
    block_q, block_kv = min(block_q, q_len), min(block_kv, kv_len)
    head_index = jnp.arange(heads, dtype=INDEX)

    def sequence(b):
        return classify_blocks(rule, q_len, kv_len, block_q, block_kv, b, head_index)

    classes = lax.map(sequence, jnp.arange(batch, dtype=INDEX))
    return BlockMask(rule, classes, block_q, block_kv, q_len, kv_len)


def blocked(
    tiles: Tiles, arrays: CallArrays, seq_q: int, seq_kv: int, *, any_blocks: bool = False
) -> CallArrays:
    """``arrays`` with an opaque rule as a block mask's classes, for both passes to read.

    The rule becomes a :class:`BlockMask` of these tiles, the class of each of its tiles kept;
    a rule with exact ranges (or none) is left as it is. Classifying once costs one evaluation
    of the rule per entry; the backward pass then reads the classes instead of evaluating it
    again. The padded keys count (the rule masks them), the padded queries do not (they are
    dropped). Where the rule is a :class:`BlockMask` made with these tiles for these lengths,
    it holds these classes already: they are read, and with ``any_blocks`` (kernels that read
    each tile's class at any blocks: :meth:`BlockMask.tile_class`) so are those of one made
    with any blocks, which it keeps. (Where keys were padded, the rule is the mask and their
    length rule: it is classified.)
    """
    rule, (batch, heads) = arrays.rule, arrays.indices()
    if rule is None or not rule.opaque:
        return arrays
    heads = jnp.atleast_1d(heads)
    (mask,) = rule.rules if isinstance(rule, AndMask) and len(rule.rules) == 1 else (rule,)
    blocks = (tiles.block_q, tiles.block_kv)
    made = isinstance(mask, BlockMask) and (mask.q_len, mask.kv_len) == (seq_q, seq_kv)
    if made and (any_blocks or (mask.block_q, mask.block_kv) == blocks):
        blocks, classes = (mask.block_q, mask.block_kv), mask._classes(batch, heads)
    else:
        classes = classify_blocks(rule, seq_q, seq_kv, *blocks, batch, heads)
    # One sequence's classes, which its batch index need not pick: a batch axis of 1.
    mask = BlockMask(rule, classes[None], *blocks, seq_q, seq_kv)
    return dataclasses.replace(arrays, rule=mask)
