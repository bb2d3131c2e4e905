r"""The tile engine: attention one ``(block_q, block_kv)`` tile at a time, forward and backward.

Every tiled implementation (chunked, decode, the ring, the kernels' tile body) is built from what
this module and :mod:`jax_sdpa._tiles_backward` hold, and imports them, never each other. A
tile's scores are the dense path's score steps (:meth:`jax_sdpa._formula.Formula.scores`); a
sweep over key blocks folds them into the online softmax (:mod:`jax_sdpa._online_softmax`;
Milakov & Gimelshein 2018; Rabe & Staats 2021; FlashAttention-2, Dao 2023)::

    for j:  s, allowed = formula.scores(q_i, k_j, arrays_ij)       # the dense path's score steps
            state = formula.normalizer.update(state, s, allowed, v_j)  # running max, ℓ, output

Every tile covers all heads: the ``K`` key/value heads and the ``G`` query heads that share
each of them (GQA), mapped with ``jax.vmap`` inside the loops. The sequences stay in their
``(T, N·H)`` layout — the heads flattened into each row — and each block is transposed to heads
first as it is sliced: so XLA copies blocks, never whole arrays (measured in BENCHMARKS.md), and
no ``(G, S, ·)`` copy of the keys, values or their gradients ever exists.

Blocks that a mask rule excludes entirely (above a causal diagonal, outside a window, past a
length) are skipped, not computed and masked; blocks it allows entirely run without evaluating
the rule; only the tiles it cuts through pay for the mask (the loops: :mod:`jax_sdpa._sweeps`).
Sequences that tiles do not divide are padded (:func:`pad_to`, :func:`pad_keys`), the padded
keys masked by a length rule.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import over_heads
from jax_sdpa._indices import INDEX, at_start, indices, listed
from jax_sdpa._masks import LengthMask, MaskRule
from jax_sdpa._online_softmax import Block, State, add
from jax_sdpa._quantized import keys_product, values_product
from jax_sdpa._steps import accumulation_dtype, cast_product, raw_scores
from jax_sdpa._sweeps import Blocks, guarded, loop, sweep


class BackwardRows(NamedTuple):
    """Per-row inputs of the backward pass, in the accumulation dtype (but a kernel's ``d_out``).

    ``d_out`` the output's cotangent as ``(T, N·V)`` rows (a kernel reads it in the values'
    dtype, which the products cast it to); ``delta`` = rowsum(dO ∘ O) less the
    log-sum-exp's cotangent, and ``shift``, the log-sum-exp (0 where −∞), ``(T, N)``. One
    head's block has them ``(block_q, V)``, ``(block_q,)`` and ``(block_q,)``.
    """

    d_out: jax.Array
    delta: jax.Array
    shift: jax.Array


class TileGradient(NamedTuple):
    """One tile's backward pass before its last products (:meth:`Tiles.tile_gradient`).

    ``weights`` :math:`P` (dropped out), ``d_raw`` the raw scores' gradient :math:`dS`, both
    ``(block_q, block_kv)``; ``queries`` as the raw scores met them, ``scaled`` where the scale
    multiplied them; the bias's and the ``score_mod`` arrays' gradients.
    """

    weights: jax.Array
    d_raw: jax.Array
    queries: jax.Array
    scaled: bool
    d_bias: jax.Array | None
    d_consts: tuple


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One call's formula and tiles, fitted to its sequences and heads (a ``nondiff_argnum``).

    Tiles are addressed by the global positions of their first query and first key
    (``q_offset``, ``kv_offset``): those are what mask rules and dropout see.
    """

    formula: Formula
    block_q: int
    block_kv: int
    groups: tuple[int, int]  # (K, G): key/value heads, query heads per key/value head
    fused: bool = False  # the tiles are a Pallas kernel's: no hints to XLA's scheduler there
    # How a kernel forms the tiles' matrix products, as :func:`~jax_sdpa._steps.cast_product`
    # (None where it forms none: then the steps' own products).
    product: Callable | None = None

    def raw(self, q_i, k_j) -> tuple:
        """``(queries, formula, raw)``: one head's tile up to its raw scores ``queries · k_j``.

        Where the scale can multiply the queries (:meth:`Formula.scaled_queries`), ``queries``
        are scaled and ``formula`` the rest: in the forward pass XLA hoists that out of the key
        loop, to once per query block.
        """
        q_i, formula = self.formula.scaled_queries(q_i)
        if self.product is not None:
            product = functools.partial(self.product, "td,sd->ts", dtype=q_i.dtype)
            return q_i, formula, keys_product(product, q_i, k_j, _along_keys)
        return q_i, formula, raw_scores(q_i, k_j, precision=formula.precision)

    def drop_at(self, arrays: CallArrays, q_offset, kv_offset):
        """Dropout of this tile's weights: the mask the dense path draws at the same positions."""
        return functools.partial(
            self.formula.drop,
            dropout_rng=arrays.dropout_rng,
            q_offset=q_offset,
            kv_offset=kv_offset,
        )

    def forward_tile(self, state: State, q_i, k_j, v_j, arrays: CallArrays, q_offset, kv_offset):
        """One online-softmax update of one head's state by one tile."""
        block = self.forward_block(state, q_i, k_j, arrays, q_offset, kv_offset)
        return self.add_block(state, block, v_j, arrays, q_offset, kv_offset)

    def forward_block(self, state: State, q_i, k_j, arrays: CallArrays, q_offset, kv_offset):
        """A tile's block of weights as one head's state meets it (:class:`Block`).

        A kernel's folds a plain scale into its exponentials (:meth:`Formula.folded_scale`).
        """
        _, formula, raw = self.raw(q_i, k_j)
        fold = self._fold(formula, arrays)
        if fold:
            formula = dataclasses.replace(formula, scale=1.0)
        scores, allowed = formula.logits(raw, arrays, q_offset, kv_offset)
        return formula.normalizer.block(
            state, scores, allowed, bias=arrays.sigmoid_bias, top_first=not self.fused, **fold
        )

    def _fold(self, formula: Formula, arrays: CallArrays) -> dict:
        """The normaliser's keywords: ``{"scale": s}`` where a kernel's tiles fold the scale.

        (Into their exponentials, :meth:`Formula.folded_scale`.) Else ``{}``, as in XLA's tiles.
        """
        scale = formula.folded_scale(arrays) if self.fused else None
        return {} if scale is None else {"scale": scale}

    def add_block(self, state: State, block: Block, v_j, arrays: CallArrays, q_offset, kv_offset):
        """One head's state after a tile's ``block`` of weights meets the values ``v_j``."""
        drop = self.drop_at(arrays, q_offset, kv_offset)
        onto = None if self.product is None else self._onto
        return add(state, block, v_j, precision=self.formula.precision, drop=drop, onto=onto)

    def _onto(self, acc, weights, value):
        """``acc`` plus the weighted sum of the values, the kernel's product adding into it."""
        product = functools.partial(self.product, "ts,sd->td", dtype=value.dtype, onto=acc)
        return values_product(product, weights, value, _along_keys)

    def tile_gradient(
        self, q_i, k_j, v_j, arrays: CallArrays, row_terms: BackwardRows, q_offset, kv_offset
    ) -> TileGradient:
        r"""One head's tile's backward pass up to its last two products (:class:`TileGradient`).

        The steps between the raw scores and the weights are differentiated by ``jax.vjp``; the
        weights' gradient is :math:`dP = dO\,V^\top`. Each float32 operand of a product is cast
        to the dtype of the inputs it meets, as the forward pass casts the weights to the
        values', and the sums are accumulated in at least float32: so 16-bit inputs keep 16-bit
        matrix units in a kernel, whose products take one dtype.
        """
        q_scaled, formula, raw = self.raw(q_i, k_j)

        def tile_logits(raw, bias, consts):
            consts = tuple(
                c if d is None else d for c, d in zip(arrays.score_consts, consts, strict=True)
            )
            tile = dataclasses.replace(arrays, bias=bias, score_consts=consts)
            return formula.logits(raw, tile, q_offset, kv_offset)

        scores, logits_vjp, allowed = jax.vjp(
            tile_logits, raw, arrays.bias, differentiable(arrays), has_aux=True
        )
        # The weights: P = e^{S − lse} (a kernel's from the raw scores, its scale folded), or
        # the sigmoid's.
        fold = self._fold(formula, arrays)
        p = formula.normalizer.recompute(
            raw if fold else scores, allowed, row_terms.shift, arrays.sigmoid_bias, **fold
        )
        drop = self.drop_at(arrays, q_offset, kv_offset)
        d_p = drop(self._product("td,sd->ts", row_terms.d_out, v_j, v_j.dtype))  # self-adjoint
        d_scores = formula.normalizer.score_gradient(p, d_p, row_terms.delta)
        d_raw, d_bias, d_consts = logits_vjp(d_scores)
        scaled = formula is not self.formula  # the scale multiplied the queries
        return TileGradient(drop(p), d_raw, q_scaled, scaled, d_bias, d_consts)

    def query_gradient(self, grad: TileGradient, k_j, dtype):
        r"""A tile's queries' gradient :math:`dQ = dS\,K` (times the scale where it scaled them)."""
        d_q_i = self._product("ts,sd->td", grad.d_raw, k_j, dtype)
        if grad.scaled:
            d_q_i = d_q_i * jnp.asarray(self.formula.scale, d_q_i.dtype)
        return d_q_i

    def key_gradients(self, grad: TileGradient, d_out, dtypes: tuple) -> tuple:
        r"""A tile's keys' and values' gradients, :math:`dK = dS^\top Q`, :math:`dV = P^\top dO`.

        ``dtypes``: the keys' and the values'.
        """
        d_k_j = self._product("ts,td->sd", grad.d_raw, grad.queries, dtypes[0])
        d_v_j = self._product("ts,td->sd", grad.weights, d_out, dtypes[1])
        return d_k_j, d_v_j

    def backward_tile(
        self, q_i, k_j, v_j, arrays: CallArrays, row_terms: BackwardRows, q_offset, kv_offset
    ):
        r"""One head's gradients from one tile: ``(dq_i, dk_j, dv_j, dbias_ij, dconsts)``.

        ``dconsts`` are those of the arrays the ``score_mod`` closed over (None for integers).
        FlashAttention's four products, :math:`dV = P^\top dO`, :math:`dP = dO\,V^\top`,
        :math:`dQ = dS\,K`, :math:`dK = dS^\top Q`, around the differentiated steps
        (:meth:`tile_gradient`).
        """
        grad = self.tile_gradient(q_i, k_j, v_j, arrays, row_terms, q_offset, kv_offset)
        d_q_i = self.query_gradient(grad, k_j, q_i.dtype)
        d_k_j, d_v_j = self.key_gradients(grad, row_terms.d_out, (q_i.dtype, v_j.dtype))
        return d_q_i, d_k_j, d_v_j, grad.d_bias, grad.d_consts

    def _product(self, spec: str, a, b, dtype):
        """A backward product: :func:`~jax_sdpa._steps.cast_product`, or the kernel's."""
        product = self.product or cast_product
        return product(spec, a, b, dtype, precision=self.formula.precision)

    def q_block(self, i) -> tuple:
        """Query block ``i`` as ``(start, count)``."""
        return i * self.block_q, self.block_q

    def kv_block(self, j) -> tuple:
        """Key block ``j`` as ``(start, count)``."""
        return j * self.block_kv, self.block_kv

    def tile(self, arrays: CallArrays, i, j, rule: MaskRule | None) -> CallArrays:
        """The arrays of tile ``(i, j)`` for each head, with the rule that tile needs."""
        arrays = arrays.block(self.q_block(i), self.kv_block(j))
        return dataclasses.replace(arrays, rule=rule).by_head(self.groups)

    def queries(self, x, i, vector: bool = False):
        """Query block ``i`` of ``(T, N·d)`` rows as ``(K, G, block_q, d)``.

        With ``vector``, of ``(T, N)`` rows as ``(K, G, block_q)``.
        """
        return _heads_first(_rows(x, i, self.block_q), self.groups, vector)

    def keys(self, x, j):
        """Block ``j`` of ``(S, K·d)`` key or value rows as ``(K, block_kv, d)``."""
        return _heads_first(_rows(x, j, self.block_kv), self.groups[:1], False)


def _along_keys(scale: jax.Array) -> jax.Array:
    """A block's ``(L,)`` quantized keys' or values' scales along a tile's keys, ``(1, L)``.

    In the products' accumulation dtype (a kernel's tile may take its keys and values as
    :class:`~jax_sdpa.Quantized` blocks, whose 16-bit scales Mosaic GPU does not promote).
    """
    return scale.astype(accumulation_dtype(scale.dtype))[None, :]


def differentiable(arrays: CallArrays) -> tuple:
    """The ``score_mod``'s arrays whose gradients are computed; None in place of the others.

    The floating-point ones, but those no derivative asks for (``arrays.fixed_consts``).
    """
    consts = arrays.score_consts
    fixed = arrays.fixed_consts or (False,) * len(consts)
    return tuple(
        None if f or not jnp.issubdtype(c.dtype, jnp.inexact) else c
        for c, f in zip(consts, fixed, strict=True)
    )


def _rows(x: jax.Array, i, block: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=0)


def _heads_first(rows: jax.Array, groups: tuple, vector: bool) -> jax.Array:
    """``(r, N·d)`` → ``(*groups, r, d)``; with ``vector``, ``(r, N)`` → ``(*groups, r)``."""
    split = rows.reshape(rows.shape[0], *groups, *(() if vector else (-1,)))
    return jnp.moveaxis(split, 0, len(groups))


def rows_first(x: jax.Array, n_heads: int) -> jax.Array:
    """``(*heads, r, d)`` → ``(r, heads·d)`` and ``(*heads, r)`` → ``(r, heads)``: the inverse."""
    x = jnp.moveaxis(x, n_heads, 0)
    return x.reshape(x.shape[0], -1)


def add_at(total: jax.Array, part: jax.Array, start: tuple) -> jax.Array:
    """``total[start : start + part.shape] += part``, in place under ``jit``."""
    start = indices(*start)
    current = lax.dynamic_slice(total, start, part.shape)
    return lax.dynamic_update_slice(total, current + part.astype(total.dtype), start)


def listed_blocks(tiles: Tiles, arrays: CallArrays, axis: str, block, offsets, count: int):
    """The ``axis`` blocks a block mask lists for ``block`` of the other axis, or None.

    As :func:`~jax_sdpa._indices.listed` gives them. Read where the ``axis`` tiles are the
    mask's blocks, the other axis's tiles lie within its blocks, and both axes start at
    position 0 (the chunked and decode paths; a ring's shards start elsewhere and keep the
    ranges' loops).
    """
    if arrays.rule is None or not at_start(offsets):
        return None
    sizes = (tiles.block_q, tiles.block_kv) if axis == "kv" else (tiles.block_kv, tiles.block_q)
    batch, heads = arrays.indices()
    visited = arrays.rule.visited(axis, block, sizes, batch, jnp.atleast_1d(heads))
    return None if visited is None or visited.shape[0] != count else listed(visited)


def sweep_keys(
    tiles: Tiles, q_i, key, value, arrays: CallArrays, state: State, i, q_offset, kv_offset
):
    """Updates the heads-first state of query block ``i``, ``q_i``, with keys ``(S, K·H)``.

    ``S`` is a whole number of blocks; the sweep's queries start at global position
    ``q_offset``, its keys at ``kv_offset``; bias and mask are ``(N, t, s)`` for all the
    queries of the sweep and exactly these keys.
    """
    tile_q = q_offset + i * tiles.block_q

    def step(j, state, rule):
        tile_kv = kv_offset + j * tiles.block_kv

        def head(per_query, per_kv):
            state, q, arrays = per_query
            return tiles.forward_tile(state, q, *per_kv, arrays, tile_q, tile_kv)

        kv = (tiles.keys(key, j), tiles.keys(value, j))
        return over_heads(head, tiles.groups, (state, q_i, tiles.tile(arrays, i, j, rule)), kv)

    blocks = Blocks("kv", kv_offset, tiles.block_kv, key.shape[0] // tiles.block_kv)
    step = guarded(step, lambda j, state: state, arrays, blocks, (tile_q, tiles.block_q))
    lists = listed_blocks(tiles, arrays, "kv", i, (q_offset, kv_offset), blocks.count)
    return sweep(step, arrays.rule, blocks, (tile_q, tile_q + tiles.block_q), state, lists)


def forward_sweep(
    tiles: Tiles, query, key, value, arrays: CallArrays, state: State, q_offset, kv_offset
):
    """Updates the online-softmax ``state`` of queries ``(T, N·H)`` with keys ``(S, K·H)``.

    ``T`` and ``S`` are whole numbers of blocks; the queries start at global position
    ``q_offset``, the keys at ``kv_offset``; bias and mask are ``(N, t, s)`` for exactly these
    queries and keys; the state is ``(T, N)``, ``(T, N)``, ``(T, N·V)`` rows.
    """

    def query_block(i, state):
        state_i = State(
            tiles.queries(state.row_max, i, vector=True),
            tiles.queries(state.denom, i, vector=True),
            tiles.queries(state.acc, i),
            tiles.queries(state.top, i, vector=True),
        )
        q_i = tiles.queries(query, i)
        state_i = sweep_keys(tiles, q_i, key, value, arrays, state_i, i, q_offset, kv_offset)
        return State(  # in place: the state is a loop carry
            *(
                lax.dynamic_update_slice_in_dim(x, rows_first(x_i, 2), i * tiles.block_q, axis=0)
                for x, x_i in zip(state, state_i, strict=True)
            )
        )

    return loop(0, query.shape[0] // tiles.block_q, query_block, state)


def pad_to(x: jax.Array | None, axis: int, multiple: int, value=0) -> jax.Array | None:
    """Pads ``axis`` to a multiple of ``multiple`` (an axis of size 1 is broadcast: left alone)."""
    if x is None:
        return None
    extra = -x.shape[axis] % multiple
    if extra == 0 or x.shape[axis] == 1:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def masked_past(arrays: CallArrays, length, queries: bool = False) -> CallArrays:
    """``arrays`` whose rule also masks the keys (``queries``) at ``length`` and on: padding."""
    length = jnp.asarray(length, INDEX)
    padding = LengthMask(length, None) if queries else LengthMask(None, length)
    return dataclasses.replace(
        arrays, rule=padding if arrays.rule is None else arrays.rule & padding
    )


def pad_keys(key, value, arrays: CallArrays, block: int, offset=0) -> tuple:
    """``(key, value, arrays)`` with the keys padded to whole blocks, the padding masked.

    ``key`` and ``value`` are arrays or pytrees of them (a :class:`~jax_sdpa.Quantized` cache
    whose scale is one per token), padded alike.

    The padded keys are masked by a length rule (at global positions: the keys start at
    ``offset``); the bias and mask gain their columns.
    """
    seq_kv = key.shape[0]
    if seq_kv % block == 0:
        return key, value, arrays
    arrays = dataclasses.replace(
        masked_past(arrays, offset + seq_kv),
        bias=pad_to(arrays.bias, -1, block),
        mask=pad_to(arrays.mask, -1, block, False),
    )
    key, value = (jax.tree.map(lambda x: pad_to(x, 0, block), x) for x in (key, value))
    return key, value, arrays


def flat(x: jax.Array) -> jax.Array:
    """``(T, heads, d)`` → ``(T, heads·d)``: the layout the sweeps slice rows from."""
    return x.reshape(x.shape[0], -1)
