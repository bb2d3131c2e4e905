r"""Memory-efficient exact attention: online softmax over key blocks, with its own backward.

The dense composition materialises the ``(T, S)`` scores. This one never holds more than a
``(block_q, block_kv)`` tile per head: for each block of queries it walks the key/value blocks,
keeping per query a running max :math:`m`, a running denominator :math:`\ell` and an
un-normalised output :math:`\tilde o` (Milakov & Gimelshein 2018; Rabe & Staats 2021;
FlashAttention-2, Dao 2023)::

    s      = score_block(q_i, k_j, ...)              # the dense path's score steps, on a tile
    m_new  = max(m, rowmax(s))                       # running max
    p      = exp(s − m_new)        (masked → 0)      # the dense softmax's numerator, same code
    ℓ      = e^{m − m_new} ℓ + rowsum(p)
    õ      = e^{m − m_new} õ + weighted_sum(p, v_j)
    out    = õ / ℓ,   lse = m + log ℓ

The backward pass (FlashAttention-2, Alg. 2) recomputes each tile's weights from the saved
log-sum-exp, :math:`P = e^{S - \mathrm{lse}}`, and uses :math:`dS = P \circ (dP - D)` with
:math:`D = \mathrm{rowsum}(dO \circ O)`; every other derivative is ``jax.vjp`` of the same step
functions. Gradients are carried as whole arrays and updated tile by tile, so memory stays
linear in the sequence length.

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
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Key

from jax_sdpa._attention import by_head, per_query_head, score_block
from jax_sdpa._masks import AndMask, LengthMask, MaskRule
from jax_sdpa._steps import (
    _exp_scores,
    _logsumexp,
    _masked,
    _normalize,
    accumulation_dtype,
    dropout_weights,
    large_negative,
    weighted_sum,
)

# The fastest tile measured on a 2-core CPU, causal or not, forward and backward (BENCHMARKS.md):
# smaller tiles pay more per-iteration overhead than they save in cache misses.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 512


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """The static part of one call: the formula's options, the heads and the tiling.

    A ``nondiff_argnum``. Tiles are addressed by the global positions of their first query and
    first key (``q_at``, ``kv_at``): those are what mask rules and dropout see.
    """

    scale: float
    soft_cap: float | None
    dropout_rate: float
    precision: Any
    block_q: int
    block_kv: int
    heads: tuple[int, int]  # (K, G): key/value heads, query heads per key/value head

    def scores(self, q_i, k_j, bias_ij, mask_ij, rule, q_at, kv_at):
        """Scores and allowed-mask of one head's tile: the dense path's steps.

        In float32 and wider the scale multiplies the ``(block_q, d)`` queries instead of the
        ``(block_q, block_kv)`` scores (in the forward pass XLA hoists that out of the key loop,
        to once per query block); in a 16-bit dtype that would round the queries, so there it
        multiplies the scores, as on the dense path.
        """
        scale = self.scale
        if jnp.finfo(q_i.dtype).bits >= 32:
            q_i, scale = q_i * jnp.asarray(scale, q_i.dtype), 1.0
        return score_block(
            q_i, k_j, bias_ij, mask_ij, rule,
            scale=scale, soft_cap=self.soft_cap, precision=self.precision,
            q_offset=q_at, kv_offset=kv_at,
        )  # fmt: skip

    def drop(self, x, rng, q_at, kv_at):
        """Dropout of a tile: the mask the dense path draws at the same positions."""
        if rng is None:
            return x
        return dropout_weights(x, rng, rate=self.dropout_rate, q_offset=q_at, kv_offset=kv_at)

    def forward_tile(self, carry, q_i, k_j, v_j, bias_ij, mask_ij, rule, rng, q_at, kv_at):
        """One online-softmax update of one head's running ``(max, denominator, output)``."""
        row_max, denom, acc = carry
        masked = _masked(*self.scores(q_i, k_j, bias_ij, mask_ij, rule, q_at, kv_at))
        new_max = jnp.maximum(row_max, masked.max(axis=-1))
        # Until a row meets its first allowed key, its max stays at the fill and p counts masked
        # entries as 1; the correction e^{fill − real max} = 0 erases them when it does.
        p = _exp_scores(masked, new_max)
        correction = jnp.exp(row_max - new_max)
        denom = correction * denom + p.sum(axis=-1)
        update = weighted_sum(self.drop(p, rng, q_at, kv_at), v_j, precision=self.precision)
        return new_max, denom, correction[:, None] * acc + update

    def backward_tile(
        self, q_i, k_j, v_j, bias_ij, mask_ij, rule, rng, d_out_i, delta_i, lse_i, q_at, kv_at
    ):
        """One head's gradients from one tile: ``(dq_i, dk_j, dv_j, dbias_ij)``."""
        scores, scores_vjp, allowed = jax.vjp(
            lambda q, k, b: self.scores(q, k, b, mask_ij, rule, q_at, kv_at),
            q_i, k_j, bias_ij, has_aux=True,
        )  # fmt: skip
        p = _exp_scores(_masked(scores, allowed), lse_i)  # the weights, P = e^{S − lse}
        _, sum_vjp = jax.vjp(
            lambda p, v: weighted_sum(p, v, precision=self.precision),
            self.drop(p, rng, q_at, kv_at), v_j,
        )  # fmt: skip
        d_dropped, d_v_j = sum_vjp(d_out_i)
        d_p = self.drop(d_dropped, rng, q_at, kv_at)  # dropout is diagonal: its own adjoint
        d_q_i, d_k_j, d_bias_ij = scores_vjp(p * (d_p - delta_i[:, None]))
        return d_q_i, d_k_j, d_v_j, d_bias_ij

    def window(self, shape, i, j):
        """Start and size of tile ``(i, j)`` in a ``(K, G, t, s)`` bias or mask."""
        return window(shape, (i * self.block_q, self.block_q), (j * self.block_kv, self.block_kv))

    def tile(self, x, i, j):
        """Tile ``(i, j)`` of a bias or mask (broadcast axes stay broadcast)."""
        return None if x is None else lax.dynamic_slice(x, *self.window(x.shape, i, j))

    def queries(self, x, i, vector: bool = False):
        """Query block ``i`` of ``(T, N·d)`` rows as ``(K, G, block_q, d)``.

        With ``vector``, of ``(T, N)`` rows as ``(K, G, block_q)``.
        """
        return _heads_first(_rows(x, i, self.block_q), self.heads, vector)

    def keys(self, x, j):
        """Block ``j`` of ``(S, K·d)`` key or value rows as ``(K, block_kv, d)``."""
        return _heads_first(_rows(x, j, self.block_kv), self.heads[:1], False)


def window(shape, rows: tuple, cols: tuple):
    """Start and size of ``rows = (start, count)`` × ``cols`` in a ``(..., t, s)`` bias or mask.

    Its ``t`` and ``s`` axes are either full or 1 (broadcast): a broadcast axis stays at 0 and 1.
    """
    (row, n_rows), (col, n_cols) = rows, cols
    full_rows, full_cols = shape[-2] > 1, shape[-1] > 1
    start = (0,) * (len(shape) - 2) + (row if full_rows else 0, col if full_cols else 0)
    return start, shape[:-2] + (n_rows if full_rows else 1, n_cols if full_cols else 1)


def _rows(x: Array, i, block: int) -> Array:
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=0)


def _heads_first(rows: Array, heads: tuple, vector: bool) -> Array:
    """``(r, heads·d)`` → ``(*heads, r, d)``; with ``vector``, ``(r, heads)`` → ``(*heads, r)``."""
    split = rows.reshape(rows.shape[0], *heads, *(() if vector else (-1,)))
    return jnp.moveaxis(split, 0, len(heads))


def _rows_first(x: Array, n_heads: int) -> Array:
    """``(*heads, r, d)`` → ``(r, heads·d)`` and ``(*heads, r)`` → ``(r, heads)``: the inverse."""
    x = jnp.moveaxis(x, n_heads, 0)
    return x.reshape(x.shape[0], -1)


def _add_at(total: Array, part: Array, start: tuple) -> Array:
    """``total[start : start + part.shape] += part``, in place under ``jit``."""
    current = lax.dynamic_slice(total, start, part.shape)
    return lax.dynamic_update_slice(total, current + part.astype(total.dtype), start)


def _sweep(step, rule: MaskRule | None, reach, full_reach, at, block: int, count: int, carry):
    """``carry = step(n, carry, tile_rule)`` over the blocks ``n`` that ``rule`` may allow.

    ``reach(rule)`` and ``full_reach(rule)`` are the global index ranges that may be, and that
    certainly are, allowed (``MaskRule.kv_range``/``kv_full_range`` or their ``q_`` twins); block
    ``n`` covers global indices ``at + n·block`` onwards. Blocks outside the first range are
    skipped; blocks wholly inside the second run with ``tile_rule=None``, no mask to evaluate;
    the blocks in between run with the rule.
    """
    if rule is None:
        return lax.fori_loop(0, count, lambda n, c: step(n, c, None), carry)
    lo, hi = (x - at for x in reach(rule))
    lo, hi = jnp.clip(lo // block, 0, count), jnp.clip(-(-hi // block), 0, count)
    full_lo, full_hi = (x - at for x in full_reach(rule))
    full_lo = jnp.clip(-(-full_lo // block), lo, hi)
    full_hi = jnp.clip(full_hi // block, full_lo, hi)
    runs = ((lo, full_lo, rule), (full_lo, full_hi, None), (full_hi, hi, rule))
    for start, stop, tile_rule in runs:
        carry = lax.fori_loop(start, stop, functools.partial(step, tile_rule=tile_rule), carry)
    return carry


def _zeros_from(x: Array, dtype, shape: tuple | None = None) -> Array:
    """Zeros of ``shape`` (``x``'s by default) computed from ``x``, whatever it holds (−∞ biases).

    Under ``jax.shard_map`` a loop carry must vary over devices as its updates do
    (``check_vma``); zeros computed from a varying array vary too, on every JAX version. One
    element of ``x`` is enough for that, and its broadcast costs no pass over ``x``.
    """
    first = jnp.isnan(x.reshape(-1)[0]).astype(dtype) * 0
    return jnp.broadcast_to(first, x.shape if shape is None else shape)


def initial_state(query: Array, rows: tuple, output: tuple) -> tuple[Array, Array, Array]:
    """The online softmax before any key: ``(row max = fill, denominator = 0, output = 0)``.

    Of shapes ``rows``, ``rows`` and ``output`` — ``(T, N)`` and ``(T, N·V)`` for the rows of a
    whole sequence, ``(K, G, block_q)`` and ``(K, G, block_q, V)`` for one block, heads first —
    computed from the queries (:func:`_zeros_from`), not built from constants.
    """
    dtype = accumulation_dtype(query.dtype)
    zeros = _zeros_from(query, dtype, rows)
    return zeros + large_negative(dtype), zeros, _zeros_from(query, dtype, output)


def sweep_keys(blocks: _Blocks, q_i, key, value, bias, mask, rule, rngs, state_i, i, q_at, kv_at):
    """Updates the heads-first state of query block ``i``, ``q_i``, with keys ``(S, K·H)``.

    ``S`` is a whole number of blocks; the block's queries start at global position
    ``q_at + i·block_q``, the keys at ``kv_at``; bias and mask are ``(K, G, t, s)`` for all the
    queries of the sweep and exactly these keys.
    """
    q_lo = q_at + i * blocks.block_q

    def step(j, carry, tile_rule):
        kv_lo = kv_at + j * blocks.block_kv
        update = per_query_head(
            lambda carry, q_i, k_j, v_j, bias_ij, mask_ij, rng: blocks.forward_tile(
                carry, q_i, k_j, v_j, bias_ij, mask_ij, tile_rule, rng, q_lo, kv_lo
            ),
            2, blocks.tile(bias, i, j), blocks.tile(mask, i, j), rngs,
        )  # fmt: skip
        return update(carry, q_i, blocks.keys(key, j), blocks.keys(value, j))

    rows = (q_lo, q_lo + blocks.block_q)
    return _sweep(
        step, rule, lambda r: r.kv_range(*rows), lambda r: r.kv_full_range(*rows),
        kv_at, blocks.block_kv, key.shape[0] // blocks.block_kv, state_i,
    )  # fmt: skip


def forward_sweep(blocks: _Blocks, query, key, value, bias, mask, rule, rngs, state, q_at, kv_at):
    """Updates the online-softmax ``state`` of queries ``(T, N·H)`` with keys ``(S, K·H)``.

    ``T`` and ``S`` are whole numbers of blocks; the queries start at global position ``q_at``,
    the keys at ``kv_at``; bias and mask are ``(K, G, t, s)`` for exactly these queries and keys;
    the state is ``(T, N)``, ``(T, N)``, ``(T, N·V)`` rows.
    """

    def query_block(i, state):
        row_max, denom, acc = state
        state_i = (
            blocks.queries(row_max, i, vector=True),
            blocks.queries(denom, i, vector=True),
            blocks.queries(acc, i),
        )
        state_i = sweep_keys(
            blocks, blocks.queries(query, i), key, value, bias, mask, rule, rngs, state_i, i,
            q_at, kv_at,
        )  # fmt: skip
        return tuple(  # in place: the state is a loop carry
            lax.dynamic_update_slice_in_dim(x, _rows_first(x_i, 2), i * blocks.block_q, axis=0)
            for x, x_i in zip(state, state_i, strict=True)
        )

    return lax.fori_loop(0, query.shape[0] // blocks.block_q, query_block, state)


def finish(state, dtype) -> tuple[Array, Array]:
    """``(out, lse)`` from a final online-softmax state; a row that met no key gives 0 and −∞.

    Any layout of rows: ``(..., r)`` maxima and denominators with ``(..., r·V)`` or
    ``(..., r, V)`` outputs give ``(..., r, V)`` and ``(..., r)``.
    """
    row_max, denom, acc = state
    rows = (row_max.size, -1)
    out = _normalize(acc.reshape(rows), denom.reshape(-1), row_max.reshape(-1))
    return out.reshape(*row_max.shape, -1).astype(dtype), _logsumexp(row_max, denom)


def backward_sweep(
    blocks: _Blocks,
    query,
    key,
    value,
    bias,
    mask,
    rule,
    rngs,
    d_out,
    delta,
    shift,
    grads,
    q_at,
    kv_at,
):
    """Adds the gradients of queries ``(T, N·H)`` against keys ``(S, K·H)`` into ``grads``.

    ``grads = (dq, dk, dv, dbias)`` has the shapes of the operands (``dbias`` None without a
    bias); ``d_out`` is ``(T, N·V)``, ``delta`` = rowsum(dO ∘ O) and ``shift``, the log-sum-exp
    (0 where −∞), are ``(T, N)``.
    """
    n_q, n_kv = query.shape[0] // blocks.block_q, key.shape[0] // blocks.block_kv

    def key_block(j, grads):
        k_j, v_j = blocks.keys(key, j), blocks.keys(value, j)
        kv_lo = kv_at + j * blocks.block_kv

        def step(i, grads, tile_rule):
            d_query, d_key, d_value, d_bias = grads
            q_lo = q_at + i * blocks.block_q
            tile_grads = per_query_head(
                lambda q_i, d_out_i, delta_i, lse_i, k_j, v_j, bias_ij, mask_ij, rng: (
                    blocks.backward_tile(
                        q_i, k_j, v_j, bias_ij, mask_ij, tile_rule, rng, d_out_i, delta_i,
                        lse_i, q_lo, kv_lo,
                    )
                ),
                4, blocks.tile(bias, i, j), blocks.tile(mask, i, j), rngs,
            )  # fmt: skip
            d_q_i, d_k_j, d_v_j, d_bias_ij = tile_grads(
                blocks.queries(query, i), blocks.queries(d_out, i),
                blocks.queries(delta, i, vector=True), blocks.queries(shift, i, vector=True),
                k_j, v_j,
            )  # fmt: skip
            d_query = _add_at(d_query, _rows_first(d_q_i, 2), (i * blocks.block_q, 0))
            # A key/value head's tile gets the sum over the query heads that share it.
            d_key = _add_at(d_key, _rows_first(d_k_j.sum(axis=1), 1), (j * blocks.block_kv, 0))
            d_value = _add_at(d_value, _rows_first(d_v_j.sum(axis=1), 1), (j * blocks.block_kv, 0))
            if d_bias is not None:  # a bias all heads share gets the sum over them
                shared = tuple(axis for axis in (0, 1) if d_bias.shape[axis] == 1)
                d_bias_ij = d_bias_ij.sum(axis=shared, keepdims=True)
                d_bias = _add_at(d_bias, d_bias_ij, blocks.window(d_bias.shape, i, j)[0])
            return d_query, d_key, d_value, d_bias

        cols = (kv_lo, kv_lo + blocks.block_kv)
        return _sweep(
            step, rule,
            lambda r: r.q_range(*cols), lambda r: r.q_full_range(*cols),
            q_at, blocks.block_q, n_q, grads,
        )  # fmt: skip

    return lax.fori_loop(0, n_kv, key_block, grads)


def zeros_like_grads(*operands):
    """Gradient accumulators, in at least float32, for operands that may be None."""
    return tuple(
        None if x is None else _zeros_from(x, accumulation_dtype(x.dtype)) for x in operands
    )


def grads_like(grads, operands) -> tuple:
    """The accumulated gradients in their operands' dtypes and shapes (None stays None).

    The sweeps accumulate in the flattened ``(T, N·H)`` rows; the operands may be ``(T, N, H)``.
    """
    return tuple(
        None if g is None else g.astype(x.dtype).reshape(x.shape)
        for g, x in zip(grads, operands, strict=True)
    )


def backward_inputs(out, lse, d_out):
    """``(dO, D, shift)`` for ``(T, N, V)`` outputs.

    The cotangent in the accumulation dtype, as ``(T, N·V)`` rows; D = rowsum(dO ∘ O) and the
    log-sum-exp or 0, ``(T, N)``.
    """
    d_out = d_out.astype(accumulation_dtype(out.dtype))
    delta = jnp.sum(d_out * out.astype(d_out.dtype), axis=-1)  # D = rowsum(dO ∘ O) = rowsum(P ∘ dP)
    shift = jnp.where(jnp.isfinite(lse), lse, 0)  # rows without keys: e^{fill − 0} = 0
    return d_out.reshape(d_out.shape[0], -1), delta, shift


def flat(x: Array) -> Array:
    """``(T, heads, d)`` → ``(T, heads·d)``: the layout the sweeps slice rows from."""
    return x.reshape(x.shape[0], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(blocks: _Blocks, query, key, value, bias, mask, rule, rngs):
    return _flash_fwd(blocks, query, key, value, bias, mask, rule, rngs)[0]


def _flash_fwd(blocks, query, key, value, bias, mask, rule, rngs):
    """Sweeps each query block from a fresh state and finishes it in place.

    No whole-sequence state to zero, slice and write back (the ring needs one: it meets the keys
    shard by shard), and each block is normalised heads first, in the same pass as its last
    products.
    """
    queries, keys, values = flat(query), flat(key), flat(value)
    block = (*blocks.heads, blocks.block_q)

    def query_block(i, outputs):
        q_i = blocks.queries(queries, i)
        # From the rows, not the block: the block's only use is then its scores, as in the
        # backward pass, and XLA builds both passes' products alike, so that where one tile
        # covers the sequences it computes them once (BENCHMARKS.md).
        state = initial_state(queries, block, (*block, value.shape[-1]))
        state = sweep_keys(blocks, q_i, keys, values, bias, mask, rule, rngs, state, i, 0, 0)
        return tuple(
            lax.dynamic_update_slice_in_dim(
                x, _rows_first(part, 2).reshape(-1, *x.shape[1:]), i * blocks.block_q, axis=0
            )
            for x, part in zip(outputs, finish(state, value.dtype), strict=True)
        )

    outputs = (
        _zeros_from(queries, value.dtype, (*query.shape[:2], value.shape[-1])),
        _zeros_from(queries, accumulation_dtype(query.dtype), query.shape[:2]),
    )
    out, lse = lax.fori_loop(0, query.shape[0] // blocks.block_q, query_block, outputs)
    return (out, lse), (query, key, value, bias, mask, rule, rngs, out, lse)


def _flash_bwd(blocks: _Blocks, residuals, cotangents):
    query, key, value, bias, mask, rule, rngs, out, lse = residuals
    # The log-sum-exp leaves with stop_gradient: only the output's cotangent is passed on.
    d_out, delta, shift = backward_inputs(out, lse, cotangents[0])
    queries, keys, values = flat(query), flat(key), flat(value)
    grads = backward_sweep(
        blocks, queries, keys, values, bias, mask, rule, rngs, d_out, delta, shift,
        zeros_like_grads(queries, keys, values, bias), 0, 0,
    )  # fmt: skip
    return (*grads_like(grads, (query, key, value, bias)), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x: Array, axis: int, multiple: int, value=0) -> Array:
    """Pads ``axis`` to a multiple of ``multiple`` (an axis of size 1 is broadcast: left alone)."""
    extra = -x.shape[axis] % multiple
    if extra == 0 or x.shape[axis] == 1:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def chunked_attention_sequence(
    query: Float[Array, "q_seq heads d_k"],
    key: Float[Array, "kv_seq kv_heads d_k"],
    value: Float[Array, "kv_seq kv_heads d_v"],
    bias: Float[Array, "#heads #q_seq #kv_seq"] | None,
    mask: Bool[Array, "#heads #q_seq #kv_seq"] | None,
    rule: MaskRule | None,
    dropout_rngs: Key[Array, " #heads"] | None,
    *,
    scale: float,
    soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    precision: Any = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
) -> tuple[Float[Array, "q_seq heads d_v"], Float[Array, "q_seq heads"], None]:
    """Blocked attention of one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    Per head the same results as :func:`jax_sdpa._attention.attention_head` (the weights are
    never formed); this is what :func:`jax_sdpa.dot_product_attention` ``jax.vmap``-s over
    batch for ``implementation="chunked"``. Sequences are padded up to whole blocks; padded
    keys are masked by a length rule and padded queries dropped.
    """
    (seq_q, heads, _), (seq_kv, kv_heads, _) = query.shape, key.shape
    blocks = _Blocks(
        scale=scale, soft_cap=soft_cap, dropout_rate=dropout_rate, precision=precision,
        block_q=min(block_q, seq_q), block_kv=min(block_kv, seq_kv),
        heads=(kv_heads, heads // kv_heads),
    )  # fmt: skip
    if seq_kv % blocks.block_kv:
        pad_rule = LengthMask(None, jnp.asarray(seq_kv))
        rule = pad_rule if rule is None else AndMask((rule, pad_rule))
    query = _pad_to(query, 0, blocks.block_q)
    key, value = (_pad_to(x, 0, blocks.block_kv) for x in (key, value))
    bias, mask, dropout_rngs = (by_head(x, blocks.heads) for x in (bias, mask, dropout_rngs))
    if bias is not None:
        bias = _pad_to(_pad_to(bias, 2, blocks.block_q), 3, blocks.block_kv)
    if mask is not None:
        mask = _pad_to(_pad_to(mask, 2, blocks.block_q, False), 3, blocks.block_kv, False)
    out, lse = _flash(blocks, query, key, value, bias, mask, rule, dropout_rngs)
    return out[:seq_q], lse[:seq_q], None
