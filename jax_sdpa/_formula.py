r"""What one call computes: a static :class:`Formula` and the per-call arrays it reads.

.. math:: \mathrm{out} = \mathrm{dropout}\big(\mathrm{softmax}_{\text{mask}}(
    \mathrm{mod}(\mathrm{cap}(\text{scale} \cdot Q K^\top) + \text{bias}))\big)\, V

(the softmax over the keys and, with sinks, one more logit per head for a key without a value)

:meth:`Formula.scores` is the score side of that formula for any block of queries and keys
(the whole matrix is one block): the dense head calls it once, every tile of the chunked and ring
implementations once per tile, forward and backward, so that they cannot drift apart.
:class:`CallArrays` carries everything else a call brings besides the queries, keys and values
(bias, mask, mask rule, dropout keys, and the batch and head index of each row), one pytree that
is mapped over batch and heads and cut into tiles whole.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float

from jax_sdpa import _checks
from jax_sdpa._indices import Index, indices, positions
from jax_sdpa._masks import MaskRule
from jax_sdpa._online_softmax import NORMALIZERS, SOFTMAX, Normalization
from jax_sdpa._steps import (
    default_scale,
    dropout_weights,
    raw_scores,
    scale_scores,
    soft_cap_scores,
)


@dataclasses.dataclass(frozen=True)
class Formula:
    """The static part of the formula: hashable, so it can key ``jax.jit``'s cache.

    Attributes:
        scale: Factor on the raw scores.
        soft_cap: If set, scores become ``cap · tanh(scores / cap)`` before the bias.
        dropout_rate: Probability of dropping a weight (applied where a dropout key is given).
        precision: ``jax.lax`` precision of the two matrix products.
        score_mod: A user's ``score_mod(score, batch, head, q_idx, kv_idx)``, closure-converted:
            it takes the arrays it closed over (``CallArrays.score_consts``) after the five
            scalars.
        normalizer: ``"softmax"``, or ``"sigmoid"``: each weight ``σ(score + b)`` on its own,
            ``b`` the call's ``CallArrays.sigmoid_bias``.
    """

    scale: float
    soft_cap: float | None = None
    dropout_rate: float = 0.0
    precision: Any = None
    score_mod: Callable | None = None
    normalizer: Normalization = SOFTMAX

    @classmethod
    def of(
        cls,
        d_k: int,
        scale=None,
        logits_soft_cap=None,
        dropout_rate=0.0,
        precision=None,
        normalizer="softmax",
        score_mod=None,
        **_,
    ) -> "Formula":
        """A call's formula from its keywords, checked: the scale is ``1/√d_k`` by default.

        ``score_mod`` is the user's function as a program of its arrays
        (:func:`jax_sdpa._user_functions.convert`).
        """
        _checks.check_range("dropout_rate", dropout_rate, 0.0, 1.0)
        _checks.check_choice("normalizer", normalizer, tuple(NORMALIZERS))
        if logits_soft_cap is not None:
            logits_soft_cap = _checks.static_float("logits_soft_cap", logits_soft_cap)
            if not logits_soft_cap > 0:
                raise ValueError(f"`logits_soft_cap` must be positive; got {logits_soft_cap}.")
        return cls(
            scale=default_scale(d_k) if scale is None else _checks.static_float("scale", scale),
            soft_cap=logits_soft_cap,
            dropout_rate=float(dropout_rate),
            precision=precision,
            normalizer=NORMALIZERS[normalizer],
            score_mod=score_mod,
        )

    def scores(
        self,
        query: Float[Array, "q d_k"],
        key: Float[Array, "kv d_k"],
        arrays: "CallArrays",
        q_offset: Index = 0,
        kv_offset: Index = 0,
    ) -> tuple[Float[Array, "q kv"], Bool[Array, "#q #kv"] | None]:
        """Scores of a block of queries against a block of keys, and which of them are allowed.

        raw scores → scale → optional soft cap → + bias → optional ``score_mod``; the mask is the
        given array AND the rule evaluated at the block's global positions (``q_offset``,
        ``kv_offset``) AND, with a bias or a ``score_mod``, "the score is not −∞". ``None`` when
        nothing is masked.
        """
        raw = raw_scores(query, key, precision=self.precision)
        return self.logits(raw, arrays, q_offset, kv_offset)

    def logits(
        self,
        raw: Float[Array, "q kv"],
        arrays: "CallArrays",
        q_offset: Index = 0,
        kv_offset: Index = 0,
    ) -> tuple[Float[Array, "q kv"], Bool[Array, "#q #kv"] | None]:
        """:meth:`scores` from the raw products ``q · k`` of the block, however they were formed.

        ``kv_offset`` is the block's first key position, or every key's (``(kv,)``: keys
        gathered from anywhere in the sequence: the selected-keys path of :mod:`jax_sdpa._decode`).
        """
        scores = scale_scores(raw, self.scale)
        if self.soft_cap is not None:
            scores = soft_cap_scores(scores, self.soft_cap)
        q_idx = positions(q_offset, raw.shape[0])
        kv_idx = kv_offset if jnp.ndim(kv_offset) else positions(kv_offset, raw.shape[1])
        scores, mask = self.biased(scores, arrays, q_idx, kv_idx)
        if arrays.rule is not None:
            batch, head = arrays.indices()
            allowed = arrays.rule.at(q_idx[:, None], kv_idx[None, :], batch, head)
            mask = allowed if mask is None else mask & allowed
        return scores, mask

    def biased(
        self, scores: Array, arrays: "CallArrays", q_idx: Array, kv_idx: Array
    ) -> tuple[Array, Array | None]:
        """The capped scores with the bias added and ``score_mod`` applied, and their mask.

        The mask is the mask array AND, with a bias or a ``score_mod``, "the score is not −∞"
        (``None`` when nothing is masked).
        """
        mask = arrays.mask
        if arrays.bias is not None:
            scores = scores + arrays.bias.astype(scores.dtype)
            finite = scores != -jnp.inf  # a −∞ bias masks its key exactly
            mask = finite if mask is None else mask & finite
        if self.score_mod is not None:
            # The mod sees 0, not −∞, where the bias masked (no NaN in its gradient there), and
            # a −∞ it returns masks too.
            safe = scores if mask is None else jnp.where(mask, scores, 0)
            scores = self._modified(safe, arrays, q_idx, kv_idx)
            finite = scores != -jnp.inf
            mask = finite if mask is None else mask & finite
        return scores, mask

    def scaled_queries(self, query: Array) -> tuple[Array, "Formula"]:
        """``(queries, formula)`` where the scale multiplies the queries, not the scores.

        In float32 and wider that is ``T·d`` products instead of ``T·S`` (XLA hoists it out of
        a loop over keys); in a 16-bit dtype it would round the queries, so there the formula
        keeps its scale, as on the dense path.
        """
        if jnp.finfo(query.dtype).bits < 32:
            return query, self
        return query * jnp.asarray(self.scale, query.dtype), dataclasses.replace(self, scale=1.0)

    def folded_scale(self, arrays: "CallArrays") -> float | None:
        """The scale, where the logits are the raw scores times it and nothing else, else None.

        So they are under the softmax with a positive scale and no soft cap, bias or
        ``score_mod``: a kernel then folds the scale into its exponentials
        (:meth:`~jax_sdpa._online_softmax.Softmax.block`).
        """
        plain = self.soft_cap is None and arrays.bias is None and self.score_mod is None
        return self.scale if plain and self.normalizer is SOFTMAX and self.scale > 0 else None

    def _modified(self, scores: Array, arrays: "CallArrays", q_idx: Array, kv_idx: Array) -> Array:
        """``score_mod`` applied to every entry of a block (``jax.vmap`` over rows and columns)."""
        batch, head = arrays.indices()

        def entry(score, q, kv):
            return self.score_mod(score, batch, head, q, kv, *arrays.score_consts)

        if jnp.ndim(scores) == 0:  # one entry (a bias or mask array a kernel reads: read_by_mod)
            return entry(scores, q_idx, kv_idx).astype(scores.dtype)
        grid = jax.vmap(jax.vmap(entry, in_axes=(0, None, 0)), in_axes=(0, 0, None))
        return grid(scores, q_idx, kv_idx).astype(scores.dtype)

    def drop(
        self, weights: Array, dropout_rng: Array | None, q_offset: Index = 0, kv_offset: Index = 0
    ) -> Array:
        """Dropout of a block of weights (none without a key): the same mask at any tiling."""
        if dropout_rng is None:
            return weights
        return dropout_weights(
            weights, dropout_rng, rate=self.dropout_rate, q_offset=q_offset, kv_offset=kv_offset
        )


def block_of(shape: tuple, q_block: tuple, kv_block: tuple) -> tuple[tuple, tuple]:
    """Start and size of a tile, ``q_block = (start, count)`` × ``kv_block``, in a bias or mask.

    The array is ``(..., t, s)``, its ``t`` and ``s`` axes full or 1 (broadcast): a broadcast
    axis stays at 0 and 1.
    """
    (row, n_rows), (col, n_cols) = q_block, kv_block
    full_rows, full_cols = shape[-2] > 1, shape[-1] > 1
    start = (0,) * (len(shape) - 2) + (row if full_rows else 0, col if full_cols else 0)
    return indices(*start), shape[:-2] + (n_rows if full_rows else 1, n_cols if full_cols else 1)


def _per_head(x: Array | None, groups: tuple[int, int]) -> Array | None:
    """``(N, ...)`` → ``(K, G, ...)``; a leading 1 (shared by all heads) → ``(1, 1, ...)``."""
    if x is None:
        return None
    return x.reshape((groups if x.shape[0] > 1 else (1, 1)) + x.shape[1:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CallArrays:
    """The per-call arrays besides query, key and value: one pytree, passed whole.

    Batched (as the front end builds it) every leaf leads with the batch axes, each full or 1
    (shared); per sequence, ``bias`` and ``mask`` are ``(N or 1, T or 1, S or 1)``, the dropout
    keys ``(N or 1,)`` and ``head`` ``(N,)``; per head, all of them lose that axis.

    Attributes:
        bias: Added to the scores.
        mask: ``True`` = may attend.
        rule: A :class:`~jax_sdpa.MaskRule` on global positions (causal, window, lengths, …).
        dropout_rng: The dropout key of each head, or one key for all (``None``: no dropout).
        batch: The index of each sequence in the (flattened) batch, and
        head: the index of each query head: what functions of positions (score and mask
            functions) are given besides the query and key positions.
        score_consts: The arrays the ``score_mod`` closed over (or what it computes from them
            alone), shared by every sequence and head.
        sinks: One logit per query head for a virtual key without a value (attention sinks).
        sigmoid_bias: With the sigmoid normaliser, the bias ``b`` of each query head (per
            sequence: ``−log S`` counts its keys).
        fixed_consts: For each of ``score_consts``, whether no derivative asks for its
            gradient (the kernels' backward then computes none: :func:`~jax_sdpa._tiles.
            differentiable`); empty where none is known fixed. Static.
    """

    bias: Array | None = None
    mask: Array | None = None
    rule: MaskRule | None = None
    dropout_rng: Array | None = None
    batch: Array | None = None
    head: Array | None = None
    score_consts: tuple = ()
    sinks: Array | None = None
    sigmoid_bias: Array | None = None
    fixed_consts: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def indices(self) -> tuple[Array | int, Array | int]:
        """``(batch, head)`` of one head's arrays (0 and 0 where they are not tracked)."""
        return (0 if self.batch is None else self.batch), (0 if self.head is None else self.head)

    def by_head(self, groups: tuple[int, int]) -> "CallArrays":
        """The per-sequence arrays with ``(K, G)`` leading every leaf, or ``(1, 1)`` if shared.

        ``K`` key/value heads each serve ``G`` query heads (:func:`jax_sdpa._heads.over_heads`);
        the rule and the batch index are the same for every head.
        """
        shared = (self.rule, self.batch, self.score_consts)
        rule, batch, score_consts = jax.tree.map(lambda x: jnp.expand_dims(x, (0, 1)), shared)
        return CallArrays(
            bias=_per_head(self.bias, groups),
            mask=_per_head(self.mask, groups),
            rule=rule,
            dropout_rng=_per_head(self.dropout_rng, groups),
            batch=batch,
            head=_per_head(self.head, groups),
            score_consts=score_consts,
            sinks=_per_head(self.sinks, groups),
            sigmoid_bias=_per_head(self.sigmoid_bias, groups),
            fixed_consts=self.fixed_consts,
        )

    def block(self, q_block: tuple, kv_block: tuple) -> "CallArrays":
        """The arrays of queries ``q_block = (start, count)`` against keys ``kv_block``."""

        def cut(x):
            return (
                None if x is None else lax.dynamic_slice(x, *block_of(x.shape, q_block, kv_block))
            )

        return dataclasses.replace(self, bias=cut(self.bias), mask=cut(self.mask))


def read_by_mod(
    formula: Formula, arrays: CallArrays, batch: tuple[int, ...], whole: int | None = None
) -> tuple[Formula, CallArrays]:
    """A batched call's bias and mask arrays read by a ``score_mod``, as a kernel reads a mod's.

    The mod reads each array at ``[b, h, q_idx, kv_idx]`` (its broadcast axes left out, ``b``
    the sequence's index along each of the ``batch`` axes) and computes :meth:`Formula.biased`
    entry by entry with the user's ``score_mod`` after them, as every path does, returning −∞
    where that masks. The arrays join the mod's, shared by the batch; the bias's gradient
    is theirs. With ``whole``, their positions' axes of at least ``whole`` are padded to whole
    multiples of it (:func:`_whole_tiles`).
    """
    given = [
        None if x is None else _kept(_whole_tiles(x, whole), batch)
        for x in (arrays.bias, arrays.mask)
    ]
    squeezed = tuple(kept for kept, _ in filter(None, given))
    if not squeezed:
        return formula, arrays
    readers = [None if x is None else x[1] for x in given]
    count = len(squeezed)  # (the mod closes over no array: it would keep this trace's)

    def score_mod(score, b, h, q_idx, kv_idx, *consts):
        own = iter(consts[:count])
        bias, mask = (
            None if read is None else read(next(own), b, h, q_idx, kv_idx) for read in readers
        )
        entry = CallArrays(bias, mask, batch=b, head=h, score_consts=consts[count:])
        scores, allowed = formula.biased(score, entry, q_idx, kv_idx)
        return scores if allowed is None else jnp.where(allowed, scores, -jnp.inf)

    consts = squeezed + arrays.score_consts  # (none is known fixed yet: fixed_consts is empty)
    return dataclasses.replace(formula, score_mod=score_mod), dataclasses.replace(
        arrays, bias=None, mask=None, score_consts=consts
    )


def _whole_tiles(x: Array, whole: int | None) -> Array:
    """``x`` with its positions' axes of at least ``whole`` padded to whole multiples of it.

    So that a kernel's tiles of ``whole`` positions lie inside the array: Mosaic GPU reads a
    tile inside a matrix in one load, one past its end row by row, entry by entry where the keys
    leave it. A shorter axis (a decoding call's few queries) stays: padded, it would grow more
    than twice. What the padding holds is never used: the positions past the call's lengths
    are masked.
    """
    if whole is None:
        return x
    pad = [(0, -n % whole if n >= whole else 0) for n in x.shape[-2:]]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + pad) if any(after for _, after in pad) else x


def _kept(x: Array, batch: tuple[int, ...]) -> tuple[Array, Callable]:
    """``x`` with its axes of 1 left out, shared by the batch, and ``read(kept, b, h, q, kv)``.

    ``read`` takes the entry at the sequence's index ``b`` along each of the ``batch`` axes, at
    head ``h`` and at positions ``q``, ``kv``, along the axes kept.
    """
    kept = [axis for axis, n in enumerate(x.shape) if n > 1]

    def read(array, b, h, q_idx, kv_idx):
        at = [b // math.prod(batch[i + 1 :]) % n for i, n in enumerate(batch)] + [h, q_idx, kv_idx]
        return array[tuple(at[axis] for axis in kept)]

    shape = tuple(x.shape[axis] for axis in kept)
    return x.reshape((1,) * len(batch) + shape), read
