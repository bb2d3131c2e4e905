r"""Memory-efficient exact attention: online softmax over key blocks, with its own backward.

The dense composition materialises the ``(T, S)`` scores. This one never holds more than a
``(block_q, block_kv)`` tile per head: for each block of queries it walks the key/value blocks
with the online softmax (:mod:`jax_sdpa._online_softmax`; Milakov & Gimelshein 2018; Rabe &
Staats 2021; FlashAttention-2, Dao 2023)::

    state    = init()
    for j:  s, allowed = formula.scores(q_i, k_j, arrays_ij)   # the dense path's score steps
            state = update(state, s, allowed, v_j)             # running max, denominator, output
    out, lse = finish(state)

The backward pass (FlashAttention-2, Alg. 2) recomputes each tile's weights from the saved
log-sum-exp, :math:`P = e^{S - \mathrm{lse}}`, and uses :math:`dS = P \circ (dP - D)` with
:math:`D = \mathrm{rowsum}(dO \circ O)` less the log-sum-exp's cotangent; every other
derivative is ``jax.vjp`` of the same step functions. Gradients are carried as whole arrays
and updated tile by tile, so memory stays linear in the sequence length.

Every tile covers all heads: the ``K`` key/value heads and the ``G`` query heads that share
each of them (GQA), mapped with ``jax.vmap`` inside the loops. The sequences stay in their
``(T, N·H)`` layout — the heads flattened into each row — and each block is transposed to heads
first as it is sliced: so XLA copies blocks, never whole arrays (measured in BENCHMARKS.md), and
no ``(G, S, ·)`` copy of the keys, values or their gradients ever exists; the key/value
gradients of a tile are summed over its ``G`` query heads.

Blocks that a mask rule excludes entirely (above a causal diagonal, outside a window, past a
length) are skipped, not computed and masked; blocks it allows entirely run without evaluating
the rule; only the tiles it cuts through pay for the mask.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._formula import CallArrays, Formula, window
from jax_sdpa._heads import Result, over_heads
from jax_sdpa._masks import (
    INDEX,
    BlockMask,
    LengthMask,
    MaskRule,
    classify_blocks,
    indices,
    positions,
)
from jax_sdpa._online_softmax import State, zeros_from
from jax_sdpa._steps import accumulation_dtype, weighted_sum

# The fastest tile measured on a 2-core CPU, causal or not, forward and backward (BENCHMARKS.md):
# smaller tiles pay more per-iteration overhead than they save in cache misses.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 512


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The tile the chunked and ring implementations ask for: queries × keys (static)."""

    block_q: int = DEFAULT_BLOCK_Q
    block_kv: int = DEFAULT_BLOCK_KV


class BackwardRows(NamedTuple):
    """Per-row inputs of the backward pass, in the accumulation dtype.

    ``d_out`` the output's cotangent as ``(T, N·V)`` rows; ``delta`` = rowsum(dO ∘ O) less the
    log-sum-exp's cotangent, and ``shift``, the log-sum-exp (0 where −∞), ``(T, N)``. One
    head's block has them ``(block_q, V)``, ``(block_q,)`` and ``(block_q,)``.
    """

    d_out: jax.Array
    delta: jax.Array
    shift: jax.Array


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One call's formula and tiles, fitted to its sequences and heads (a ``nondiff_argnum``).

    Tiles are addressed by the global positions of their first query and first key
    (``q_offset``, ``kv_offset``): those are what mask rules and dropout see.
    """

    formula: Formula
    block_q: int
    block_kv: int
    heads: tuple[int, int]  # (K, G): key/value heads, query heads per key/value head

    def scores(self, q_i, k_j, arrays: CallArrays, q_offset, kv_offset):
        """Scores and allowed-mask of one head's tile: the dense path's steps.

        The scale multiplies the queries (:meth:`Formula.scaled_queries`): in the forward pass
        XLA hoists that out of the key loop, to once per query block.
        """
        q_i, formula = self.formula.scaled_queries(q_i)
        return formula.scores(q_i, k_j, arrays, q_offset, kv_offset)

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
        scores, allowed = self.scores(q_i, k_j, arrays, q_offset, kv_offset)
        drop = self.drop_at(arrays, q_offset, kv_offset)
        return online_softmax.update(
            state, scores, allowed, v_j, precision=self.formula.precision, drop=drop
        )

    def backward_tile(
        self, q_i, k_j, v_j, arrays: CallArrays, rows: BackwardRows, q_offset, kv_offset
    ):
        """One head's gradients from one tile: ``(dq_i, dk_j, dv_j, dbias_ij, dconsts)``.

        ``dconsts`` are those of the arrays the ``score_mod`` closed over (None for integers).
        """

        def tile_scores(q, k, bias, consts):
            consts = tuple(
                c if d is None else d for c, d in zip(arrays.score_consts, consts, strict=True)
            )
            tile = dataclasses.replace(arrays, bias=bias, score_consts=consts)
            return self.scores(q, k, tile, q_offset, kv_offset)

        scores, scores_vjp, allowed = jax.vjp(
            tile_scores, q_i, k_j, arrays.bias, differentiable(arrays.score_consts), has_aux=True
        )
        p = online_softmax.recompute(scores, allowed, rows.shift)  # the weights, P = e^{S − lse}
        drop = self.drop_at(arrays, q_offset, kv_offset)
        _, sum_vjp = jax.vjp(
            lambda p, v: weighted_sum(p, v, precision=self.formula.precision), drop(p), v_j
        )
        d_dropped, d_v_j = sum_vjp(rows.d_out)
        d_p = drop(d_dropped)  # dropout is diagonal: its own adjoint
        d_q_i, d_k_j, d_bias_ij, d_consts = scores_vjp(p * (d_p - rows.delta[:, None]))
        return d_q_i, d_k_j, d_v_j, d_bias_ij, d_consts

    def rows(self, i) -> tuple:
        """Query block ``i`` as ``(start, count)``."""
        return i * self.block_q, self.block_q

    def cols(self, j) -> tuple:
        """Key block ``j`` as ``(start, count)``."""
        return j * self.block_kv, self.block_kv

    def tile(self, arrays: CallArrays, i, j, rule: MaskRule | None) -> CallArrays:
        """The arrays of tile ``(i, j)`` for each head, with the rule that tile needs."""
        arrays = arrays.window(self.rows(i), self.cols(j))
        return dataclasses.replace(arrays, rule=rule).by_head(self.heads)

    def queries(self, x, i, vector: bool = False):
        """Query block ``i`` of ``(T, N·d)`` rows as ``(K, G, block_q, d)``.

        With ``vector``, of ``(T, N)`` rows as ``(K, G, block_q)``.
        """
        return _heads_first(_rows(x, i, self.block_q), self.heads, vector)

    def keys(self, x, j):
        """Block ``j`` of ``(S, K·d)`` key or value rows as ``(K, block_kv, d)``."""
        return _heads_first(_rows(x, j, self.block_kv), self.heads[:1], False)


def differentiable(consts: tuple) -> tuple:
    """The floating-point arrays among ``consts``; None in place of the others."""
    return tuple(c if jnp.issubdtype(c.dtype, jnp.inexact) else None for c in consts)


def _rows(x: jax.Array, i, block: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=0)


def _heads_first(rows: jax.Array, heads: tuple, vector: bool) -> jax.Array:
    """``(r, heads·d)`` → ``(*heads, r, d)``; with ``vector``, ``(r, heads)`` → ``(*heads, r)``."""
    split = rows.reshape(rows.shape[0], *heads, *(() if vector else (-1,)))
    return jnp.moveaxis(split, 0, len(heads))


def _rows_first(x: jax.Array, n_heads: int) -> jax.Array:
    """``(*heads, r, d)`` → ``(r, heads·d)`` and ``(*heads, r)`` → ``(r, heads)``: the inverse."""
    x = jnp.moveaxis(x, n_heads, 0)
    return x.reshape(x.shape[0], -1)


def _add_at(total: jax.Array, part: jax.Array, start: tuple) -> jax.Array:
    """``total[start : start + part.shape] += part``, in place under ``jit``."""
    start = indices(*start)
    current = lax.dynamic_slice(total, start, part.shape)
    return lax.dynamic_update_slice(total, current + part.astype(total.dtype), start)


def loop(lower, upper, body, carry):
    """``lax.fori_loop`` whose index is an :data:`~jax_sdpa._masks.INDEX`, whatever x64 says.

    Python-int bounds stay Python ints: the loop then has a known trip count, a ``scan`` that
    reverse mode can differentiate (a gradient of a gradient goes through the backward pass's
    loops); traced bounds (a mask rule's ranges) are cast alike.
    """
    if not all(isinstance(bound, int) for bound in (lower, upper)):
        lower, upper = jnp.asarray(lower, INDEX), jnp.asarray(upper, INDEX)
    return lax.fori_loop(lower, upper, lambda n, c: body(n.astype(INDEX), c), carry)


def _sweep(step, rule: MaskRule | None, reach, full_reach, offset, block: int, count: int, carry):
    """``carry = step(n, carry, tile_rule)`` over the blocks ``n`` that ``rule`` may allow.

    ``reach(rule)`` and ``full_reach(rule)`` are the global index ranges that may be, and that
    certainly are, allowed (``MaskRule.kv_range``/``kv_full_range`` or their ``q_`` twins); block
    ``n`` covers global indices ``offset + n·block`` onwards. Blocks outside the first range are
    skipped; blocks wholly inside the second run with ``tile_rule=None``, no mask to evaluate;
    the blocks in between run with the rule.
    """
    if rule is None:
        return loop(0, count, lambda n, c: step(n, c, None), carry)
    lo, hi = (x - offset for x in reach(rule))
    lo, hi = jnp.clip(lo // block, 0, count), jnp.clip(-(-hi // block), 0, count)
    full_lo, full_hi = (x - offset for x in full_reach(rule))
    full_lo = jnp.clip(-(-full_lo // block), lo, hi)
    full_hi = jnp.clip(full_hi // block, full_lo, hi)
    runs = ((lo, full_lo, rule), (full_lo, full_hi, None), (full_hi, hi, rule))
    for start, stop, tile_rule in runs:
        carry = loop(start, stop, functools.partial(step, rule=tile_rule), carry)
    return carry


def _classified(tile, classify, skip):
    """``tile(n, x, rule)`` that first reads the class of an opaque rule's tile (``classify``).

    A tile the rule excludes entirely gives ``skip(n, x)``; one it allows entirely runs without
    the rule. Rules with exact ranges (the built-in ones) are left to :func:`_sweep`. ``x`` is
    what the branches take and give: keep it small (a whole-sequence array there is copied).
    """

    def guarded(n, x, rule):
        if rule is None or not rule.opaque:
            return tile(n, x, rule)
        empty, full = classify(n, rule)

        def run(x):
            with_rule = functools.partial(tile, n, rule=rule)
            return lax.cond(full, functools.partial(tile, n, rule=None), with_rule, x)

        return lax.cond(empty, functools.partial(skip, n), run, x)

    return guarded


def _tile_class(rule: MaskRule, arrays: CallArrays, rows: tuple, cols: tuple):
    """``rule.tile_class`` of the tile ``rows × cols``, each ``(global start, count)``."""
    q_idx, kv_idx = (positions(start, count) for start, count in (rows, cols))
    batch, heads = arrays.indices()
    return rule.tile_class(q_idx, kv_idx, batch, jnp.atleast_1d(heads))


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
        return over_heads(head, tiles.heads, (state, q_i, tiles.tile(arrays, i, j, rule)), kv)

    def classify(j, rule):
        cols = (kv_offset + j * tiles.block_kv, tiles.block_kv)
        return _tile_class(rule, arrays, (tile_q, tiles.block_q), cols)

    rows = (tile_q, tile_q + tiles.block_q)
    guarded = _classified(step, classify, skip=lambda j, state: state)
    return _sweep(
        guarded,
        arrays.rule,
        lambda r: r.kv_range(*rows),
        lambda r: r.kv_full_range(*rows),
        kv_offset,
        tiles.block_kv,
        key.shape[0] // tiles.block_kv,
        state,
    )


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
        )
        q_i = tiles.queries(query, i)
        state_i = sweep_keys(tiles, q_i, key, value, arrays, state_i, i, q_offset, kv_offset)
        return State(  # in place: the state is a loop carry
            *(
                lax.dynamic_update_slice_in_dim(x, _rows_first(x_i, 2), i * tiles.block_q, axis=0)
                for x, x_i in zip(state, state_i, strict=True)
            )
        )

    return loop(0, query.shape[0] // tiles.block_q, query_block, state)


def _accumulate(tiles: Tiles, grads: tuple, tile_grads: tuple, i, j) -> tuple:
    """Adds one tile's ``(K, G, …)`` gradients into the whole ``(dq, dk, dv, dbias, dconsts)``."""
    d_query, d_key, d_value, d_bias, d_consts = grads
    d_q_i, d_k_j, d_v_j, d_bias_ij, d_consts_ij = tile_grads
    d_query = _add_at(d_query, _rows_first(d_q_i, 2), (i * tiles.block_q, 0))
    # A key/value head's tile gets the sum over the query heads that share it.
    d_key = _add_at(d_key, _rows_first(d_k_j.sum(axis=1), 1), (j * tiles.block_kv, 0))
    d_value = _add_at(d_value, _rows_first(d_v_j.sum(axis=1), 1), (j * tiles.block_kv, 0))
    if d_bias is not None:  # a bias all heads share gets the sum over them
        d_bias_ij = d_bias_ij.reshape(-1, *d_bias_ij.shape[2:])
        if d_bias.shape[0] == 1:
            d_bias_ij = d_bias_ij.sum(axis=0, keepdims=True)
        d_bias = _add_at(d_bias, d_bias_ij, window(d_bias.shape, tiles.rows(i), tiles.cols(j))[0])
    # The score_mod's arrays are shared by every head: each gets the sum over the heads.
    d_consts = jax.tree.map(lambda d, part: d + part.sum(axis=(0, 1)), d_consts, d_consts_ij)
    return d_query, d_key, d_value, d_bias, d_consts


def backward_sweep(
    tiles: Tiles,
    query,
    key,
    value,
    arrays: CallArrays,
    rows: BackwardRows,
    grads,
    q_offset,
    kv_offset,
):
    """Adds the gradients of queries ``(T, N·H)`` against keys ``(S, K·H)`` into ``grads``.

    ``grads = (dq, dk, dv, dbias, dconsts)`` has the shapes of the operands (``dbias`` None
    without a bias, ``dconsts`` those of the ``score_mod``'s floating-point arrays); ``rows`` are
    the queries' :class:`BackwardRows`.
    """

    def key_block(j, grads):
        kv = (tiles.keys(key, j), tiles.keys(value, j))
        tile_kv = kv_offset + j * tiles.block_kv

        def tile(i, _, rule):
            tile_q = q_offset + i * tiles.block_q

            def head(per_query, per_kv):
                q, rows, arrays = per_query
                return tiles.backward_tile(q, *per_kv, arrays, rows, tile_q, tile_kv)

            rows_i = BackwardRows(
                tiles.queries(rows.d_out, i),
                tiles.queries(rows.delta, i, vector=True),
                tiles.queries(rows.shift, i, vector=True),
            )
            per_query = (tiles.queries(query, i), rows_i, tiles.tile(arrays, i, j, rule))
            return over_heads(head, tiles.heads, per_query, kv)

        def classify(i, rule):
            rows = (q_offset + i * tiles.block_q, tiles.block_q)
            return _tile_class(rule, arrays, rows, (tile_kv, tiles.block_kv))

        def skip(i, _):  # a skipped tile's gradients: zeros, for the accumulators to stay out
            shapes = jax.eval_shape(functools.partial(tile, i, None, rule=None))
            return jax.tree.map(lambda x: zeros_from(query, x.dtype, x.shape), shapes)

        guarded = _classified(tile, classify, skip)

        def step(i, grads, rule):
            return _accumulate(tiles, grads, guarded(i, None, rule), i, j)

        cols = (tile_kv, tile_kv + tiles.block_kv)
        return _sweep(
            step,
            arrays.rule,
            lambda r: r.q_range(*cols),
            lambda r: r.q_full_range(*cols),
            q_offset,
            tiles.block_q,
            query.shape[0] // tiles.block_q,
            grads,
        )

    return loop(0, key.shape[0] // tiles.block_kv, key_block, grads)


def zeros_like_grads(query, key, value, arrays: CallArrays) -> tuple:
    """Gradient accumulators, in at least float32: ``(dq, dk, dv, dbias, dconsts)``."""

    def zeros(x):
        return None if x is None else zeros_from(x, accumulation_dtype(x.dtype))

    consts = tuple(map(zeros, differentiable(arrays.score_consts)))
    return (*map(zeros, (query, key, value, arrays.bias)), consts)


def grads_like(grads: tuple, query, key, value, arrays: CallArrays) -> tuple:
    """``(dq, dk, dv, darrays)`` from the accumulators, in the operands' dtypes and shapes.

    The sweeps accumulate in the flattened ``(T, N·H)`` rows; the operands may be ``(T, N, H)``.
    ``darrays`` holds the bias's and the ``score_mod`` arrays' gradients (``sinks`` are added by
    the caller, which has the rows they need).
    """
    d_query, d_key, d_value, d_bias, d_consts = jax.tree.map(
        lambda g, x: g.astype(x.dtype).reshape(x.shape),
        grads,
        (query, key, value, arrays.bias, differentiable(arrays.score_consts)),
    )
    return d_query, d_key, d_value, CallArrays(bias=d_bias, score_consts=d_consts)


def sinks_grad(sinks: jax.Array | None, lse: jax.Array, rows: BackwardRows) -> jax.Array | None:
    r"""The sinks' gradient from ``(T, N)`` rows.

    :math:`d\sigma_n = -\sum_i e^{\sigma_n - \mathrm{lse}_{in}} D_{in}`, with :math:`D` less the
    log-sum-exp's cotangent.

    A sink takes weight :math:`e^{\sigma - \mathrm{lse}}` from every row, as a key whose value
    is 0: its score's gradient is that weight times :math:`(0 - D)`.
    """
    if sinks is None:
        return None
    seen = jnp.isfinite(lse)  # a row without keys and with a −∞ sink has no weight anywhere
    weight = jnp.where(seen, jnp.exp(sinks.astype(lse.dtype)[None, :] - jnp.where(seen, lse, 0)), 0)
    return (-jnp.sum(weight * rows.delta, axis=0)).astype(sinks.dtype)


def backward_rows(out, lse, cotangents) -> BackwardRows:
    r"""The :class:`BackwardRows` of ``(T, N, V)`` outputs and their ``(T, N)`` log-sum-exp.

    ``cotangents = (d_out, d_lse)``. As :math:`\partial\,\mathrm{lse}_i / \partial s_{ij} =
    P_{ij}`, the log-sum-exp's cotangent joins the scores' gradient as
    :math:`dS = P \circ (dP - D + d\mathrm{lse})`: it is subtracted from :math:`D`.
    """
    d_out, d_lse = cotangents
    d_out = d_out.astype(accumulation_dtype(out.dtype))
    delta = jnp.sum(d_out * out.astype(d_out.dtype), axis=-1)  # D = rowsum(dO ∘ O) = rowsum(P ∘ dP)
    shift = jnp.where(jnp.isfinite(lse), lse, 0)  # rows without keys: e^{fill − 0} = 0
    return BackwardRows(d_out.reshape(d_out.shape[0], -1), delta - d_lse.astype(delta.dtype), shift)


def flat(x: jax.Array) -> jax.Array:
    """``(T, heads, d)`` → ``(T, heads·d)``: the layout the sweeps slice rows from."""
    return x.reshape(x.shape[0], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(tiles: Tiles, query, key, value, arrays: CallArrays):
    return _flash_fwd(tiles, query, key, value, arrays)[0]


def _flash_fwd(tiles: Tiles, query, key, value, arrays: CallArrays):
    """Sweeps each query block from a fresh state and finishes it in place.

    No whole-sequence state to zero, slice and write back (the ring needs one: it meets the keys
    shard by shard), and each block is normalised heads first, in the same pass as its last
    products.
    """
    queries, keys, values = flat(query), flat(key), flat(value)
    block = (*tiles.heads, tiles.block_q)

    def query_block(i, outputs):
        q_i = tiles.queries(queries, i)
        # From the rows, not the block: the block's only use is then its scores, as in the
        # backward pass, and XLA builds both passes' products alike, so that where one tile
        # covers the sequences it computes them once (BENCHMARKS.md).
        sink = None if arrays.sinks is None else arrays.sinks.reshape(*tiles.heads, 1)
        state = online_softmax.init(queries, block, (*block, value.shape[-1]), sink)
        state = sweep_keys(tiles, q_i, keys, values, arrays, state, i, 0, 0)
        return tuple(
            lax.dynamic_update_slice_in_dim(
                x, _rows_first(part, 2).reshape(-1, *x.shape[1:]), i * tiles.block_q, axis=0
            )
            for x, part in zip(outputs, online_softmax.finish(state, value.dtype), strict=True)
        )

    outputs = (
        zeros_from(queries, value.dtype, (*query.shape[:2], value.shape[-1])),
        zeros_from(queries, accumulation_dtype(query.dtype), query.shape[:2]),
    )
    out, lse = loop(0, query.shape[0] // tiles.block_q, query_block, outputs)
    return (out, lse), (query, key, value, arrays, out, lse)


def _flash_bwd(tiles: Tiles, residuals, cotangents):
    query, key, value, arrays, out, lse = residuals
    rows = backward_rows(out, lse, cotangents)
    queries, keys, values = flat(query), flat(key), flat(value)
    grads = zeros_like_grads(queries, keys, values, arrays)
    grads = backward_sweep(tiles, queries, keys, values, arrays, rows, grads, 0, 0)
    d_query, d_key, d_value, d_arrays = grads_like(grads, query, key, value, arrays)
    d_sinks = sinks_grad(arrays.sinks, lse, rows)
    return d_query, d_key, d_value, dataclasses.replace(d_arrays, sinks=d_sinks)


_flash.defvjp(_flash_fwd, _flash_bwd)


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


def _blocked(tiles: Tiles, arrays: CallArrays, seq_q: int, seq_kv: int) -> BlockMask:
    """The call's opaque rule with the class of each of its tiles, for both passes to read.

    Classifying once costs one evaluation of the rule per entry; the backward pass then reads
    the classes instead of evaluating it again. The padded keys count (the rule masks them),
    the padded queries do not (they are dropped).
    """
    batch, heads = arrays.indices()
    classes = classify_blocks(
        arrays.rule, seq_q, seq_kv, tiles.block_q, tiles.block_kv, batch, jnp.atleast_1d(heads)
    )
    # One sequence's classes, which its batch index need not pick: a batch axis of 1.
    return BlockMask(arrays.rule, classes[None], tiles.block_q, tiles.block_kv, seq_q, seq_kv)


def pad_keys(key, value, arrays: CallArrays, block: int) -> tuple:
    """``(key, value, arrays)`` with the keys padded to whole blocks, the padding masked.

    The padded keys are masked by a length rule; the bias and mask gain their columns.
    """
    seq_kv = key.shape[0]
    if seq_kv % block == 0:
        return key, value, arrays
    padding = LengthMask(None, jnp.asarray(seq_kv, INDEX))
    arrays = dataclasses.replace(
        arrays,
        rule=padding if arrays.rule is None else arrays.rule & padding,
        bias=pad_to(arrays.bias, -1, block),
        mask=pad_to(arrays.mask, -1, block, False),
    )
    return pad_to(key, 0, block), pad_to(value, 0, block), arrays


def chunked_sequence(
    formula: Formula, tiling: Tiling, query, key, value, arrays: CallArrays
) -> Result:
    """Blocked attention of one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values; per head the same results as
    :func:`jax_sdpa._attention.attention_head` (the weights are never formed). Sequences are
    padded up to whole blocks; padded keys are masked by a length rule and padded queries
    dropped.
    """
    (seq_q, heads, _), (seq_kv, kv_heads, _) = query.shape, key.shape
    block_q, block_kv = min(tiling.block_q, seq_q), min(tiling.block_kv, seq_kv)
    tiles = Tiles(formula, block_q, block_kv, (kv_heads, heads // kv_heads))
    key, value, arrays = pad_keys(key, value, arrays, block_kv)
    arrays = dataclasses.replace(
        arrays, bias=pad_to(arrays.bias, -2, block_q), mask=pad_to(arrays.mask, -2, block_q, False)
    )
    query = pad_to(query, 0, block_q)
    if arrays.rule is not None and arrays.rule.opaque:
        arrays = dataclasses.replace(arrays, rule=_blocked(tiles, arrays, seq_q, key.shape[0]))
    out, lse = _flash(tiles, query, key, value, arrays)
    return Result(out[:seq_q], lse[:seq_q], None)
