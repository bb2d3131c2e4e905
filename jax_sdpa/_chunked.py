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

The unit of work is a *group*: the ``G`` query heads that share one key/value head (GQA). They
are processed together, tile by tile, and their key/value gradients are summed inside each tile,
so no ``(G, S, ·)`` copy of the keys, values or their gradients ever exists.

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

from jax_sdpa._attention import per_head, score_block
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
    """The static part of one call: the formula's options and the tiling (a ``nondiff_argnum``).

    Tiles are addressed by the global positions of their first query and first key
    (``q_at``, ``kv_at``): those are what mask rules and dropout see.
    """

    scale: float
    soft_cap: float | None
    dropout_rate: float
    precision: Any
    block_q: int
    block_kv: int

    def scores(self, q_i, k_j, bias_ij, mask_ij, rule, q_at, kv_at):
        """Scores and allowed-mask of one head's tile: the dense path's steps.

        In float32 and wider the scale multiplies the ``(block_q, d)`` queries instead of the
        ``(block_q, block_kv)`` scores: a ``d / block_kv`` fraction of the work. In a 16-bit dtype
        that would round the queries, so there the scores are scaled, as in the dense path.
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
        """Start and size of tile ``(i, j)`` in a ``(g, t, s)`` bias or mask."""
        return window(shape, (i * self.block_q, self.block_q), (j * self.block_kv, self.block_kv))

    def tile(self, x, i, j):
        """Tile ``(i, j)`` of a per-group bias or mask (broadcast axes stay broadcast)."""
        return None if x is None else lax.dynamic_slice(x, *self.window(x.shape, i, j))


def window(shape, rows: tuple, cols: tuple):
    """Start and size of ``rows = (start, count)`` × ``cols`` in a ``(g, t, s)`` bias or mask.

    Its ``t`` and ``s`` axes are either full or 1 (broadcast): a broadcast axis stays at 0 and 1.
    """
    (row, n_rows), (col, n_cols) = rows, cols
    full_rows, full_cols = shape[1] > 1, shape[2] > 1
    start = (0, row if full_rows else 0, col if full_cols else 0)
    return start, (shape[0], n_rows if full_rows else 1, n_cols if full_cols else 1)


def _rows(x: Array, i, block: int, axis: int = 0) -> Array:
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


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


def initial_state(query: Array, value_dim: int) -> tuple[Array, Array, Array]:
    """The online softmax before any key: ``(row max = fill, denominator = 0, output = 0)``.

    Computed from the ``(G, T, H)`` queries (:func:`_zeros_from`), not built from constants.
    """
    dtype = accumulation_dtype(query.dtype)
    zeros = _zeros_from(query, dtype, query.shape[:-1])
    output = _zeros_from(query, dtype, query.shape[:-1] + (value_dim,))
    return zeros + large_negative(dtype), zeros, output


def forward_sweep(blocks: _Blocks, query, key, value, bias, mask, rule, rngs, state, q_at, kv_at):
    """Updates the online-softmax ``state`` of queries ``(G, T, H)`` with keys ``(S, H)``.

    ``T`` and ``S`` are whole numbers of blocks; the queries start at global position ``q_at``,
    the keys at ``kv_at``; bias and mask are ``(g, t, s)`` for exactly these queries and keys.
    """
    n_q, n_kv = query.shape[1] // blocks.block_q, key.shape[0] // blocks.block_kv

    def query_block(i, state):
        q_i = _rows(query, i, blocks.block_q, axis=1)
        q_lo = q_at + i * blocks.block_q

        def step(j, carry, tile_rule):
            k_j, v_j = _rows(key, j, blocks.block_kv), _rows(value, j, blocks.block_kv)
            kv_lo = kv_at + j * blocks.block_kv
            update = per_head(
                lambda carry, q_i, bias_ij, mask_ij, rng: blocks.forward_tile(
                    carry, q_i, k_j, v_j, bias_ij, mask_ij, tile_rule, rng, q_lo, kv_lo
                ),
                2, blocks.tile(bias, i, j), blocks.tile(mask, i, j), rngs,
            )  # fmt: skip
            return update(carry, q_i)

        rows = (q_lo, q_lo + blocks.block_q)
        state_i = jax.tree.map(lambda x: _rows(x, i, blocks.block_q, axis=1), state)
        state_i = _sweep(
            step, rule, lambda r: r.kv_range(*rows), lambda r: r.kv_full_range(*rows),
            kv_at, blocks.block_kv, n_kv, state_i,
        )  # fmt: skip
        put = functools.partial(
            lax.dynamic_update_slice_in_dim, start_index=i * blocks.block_q, axis=1
        )
        return jax.tree.map(put, state, state_i)  # in place: the state is a loop carry

    return lax.fori_loop(0, n_q, query_block, state)


def finish(state, dtype) -> tuple[Array, Array]:
    """``(out, lse)`` from a final online-softmax state; a row that met no key gives 0 and −∞."""
    row_max, denom, acc = state
    return jax.vmap(_normalize)(acc, denom, row_max).astype(dtype), _logsumexp(row_max, denom)


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
    """Adds the gradients of queries ``(G, T, H)`` against keys ``(S, H)`` into ``grads``.

    ``grads = (dq, dk, dv, dbias)`` has the shapes of the operands (``dbias`` None without a
    bias); ``delta`` is rowsum(dO ∘ O) and ``shift`` the log-sum-exp (0 where −∞).
    """
    n_q, n_kv = query.shape[1] // blocks.block_q, key.shape[0] // blocks.block_kv

    def key_block(j, grads):
        k_j, v_j = _rows(key, j, blocks.block_kv), _rows(value, j, blocks.block_kv)
        kv_lo = kv_at + j * blocks.block_kv

        def step(i, grads, tile_rule):
            d_query, d_key, d_value, d_bias = grads
            rows = functools.partial(_rows, i=i, block=blocks.block_q, axis=1)
            q_lo = q_at + i * blocks.block_q
            tile_grads = per_head(
                lambda q_i, d_out_i, delta_i, lse_i, bias_ij, mask_ij, rng: blocks.backward_tile(
                    q_i, k_j, v_j, bias_ij, mask_ij, tile_rule, rng, d_out_i, delta_i, lse_i,
                    q_lo, kv_lo,
                ),
                4, blocks.tile(bias, i, j), blocks.tile(mask, i, j), rngs,
            )  # fmt: skip
            d_q_i, d_k_j, d_v_j, d_bias_ij = tile_grads(
                rows(query), rows(d_out), rows(delta), rows(shift)
            )
            d_query = _add_at(d_query, d_q_i, (0, i * blocks.block_q, 0))
            d_key = _add_at(d_key, d_k_j.sum(axis=0), (j * blocks.block_kv, 0))  # heads share k_j
            d_value = _add_at(d_value, d_v_j.sum(axis=0), (j * blocks.block_kv, 0))
            if d_bias is not None:  # a bias the group shares gets the sum over its heads
                if d_bias.shape[0] == 1:
                    d_bias_ij = d_bias_ij.sum(axis=0, keepdims=True)
                d_bias = _add_at(d_bias, d_bias_ij, blocks.window(d_bias.shape, i, j)[0])
            return d_query, d_key, d_value, d_bias

        cols = (kv_lo, kv_lo + blocks.block_kv)
        return _sweep(
            step, rule, lambda r: r.q_range(*cols), lambda r: r.q_full_range(*cols),
            q_at, blocks.block_q, n_q, grads,
        )  # fmt: skip

    return lax.fori_loop(0, n_kv, key_block, grads)


def zeros_like_grads(*operands):
    """Gradient accumulators, in at least float32, for operands that may be None."""
    return tuple(
        None if x is None else _zeros_from(x, accumulation_dtype(x.dtype)) for x in operands
    )


def grads_in_dtypes(grads, operands) -> tuple:
    """The accumulated gradients cast back to their operands' dtypes (None stays None)."""
    return tuple(
        None if g is None else g.astype(x.dtype) for g, x in zip(grads, operands, strict=True)
    )


def backward_inputs(out, lse, d_out):
    """``(dO, D, shift)``: the cotangent in the accumulation dtype, rowsum(dO ∘ O), the lse or 0."""
    d_out = d_out.astype(accumulation_dtype(out.dtype))
    delta = jnp.sum(d_out * out.astype(d_out.dtype), axis=-1)  # D = rowsum(dO ∘ O) = rowsum(P ∘ dP)
    return d_out, delta, jnp.where(jnp.isfinite(lse), lse, 0)  # rows without keys: e^{fill − 0} = 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(blocks: _Blocks, query, key, value, bias, mask, rule, rngs):
    return _flash_fwd(blocks, query, key, value, bias, mask, rule, rngs)[0]


def _flash_fwd(blocks, query, key, value, bias, mask, rule, rngs):
    state = initial_state(query, value.shape[1])
    state = forward_sweep(blocks, query, key, value, bias, mask, rule, rngs, state, 0, 0)
    out, lse = finish(state, value.dtype)
    return (out, lse), (query, key, value, bias, mask, rule, rngs, out, lse)


def _flash_bwd(blocks: _Blocks, residuals, cotangents):
    query, key, value, bias, mask, rule, rngs, out, lse = residuals
    # The log-sum-exp leaves with stop_gradient: only the output's cotangent is passed on.
    d_out, delta, shift = backward_inputs(out, lse, cotangents[0])
    grads = backward_sweep(
        blocks, query, key, value, bias, mask, rule, rngs, d_out, delta, shift,
        zeros_like_grads(query, key, value, bias), 0, 0,
    )  # fmt: skip
    return (*grads_in_dtypes(grads, (query, key, value, bias)), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x: Array, axis: int, multiple: int, value=0) -> Array:
    """Pads ``axis`` to a multiple of ``multiple`` (an axis of size 1 is broadcast: left alone)."""
    extra = -x.shape[axis] % multiple
    if extra == 0 or x.shape[axis] == 1:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def chunked_attention_group(
    query: Float[Array, "groups q_seq d_k"],
    key: Float[Array, "kv_seq d_k"],
    value: Float[Array, "kv_seq d_v"],
    bias: Float[Array, "#groups #q_seq #kv_seq"] | None,
    mask: Bool[Array, "#groups #q_seq #kv_seq"] | None,
    rule: MaskRule | None,
    dropout_rngs: Key[Array, " #groups"] | None,
    *,
    scale: float,
    soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    precision: Any = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
) -> tuple[Float[Array, "groups q_seq d_v"], Float[Array, "groups q_seq"], None]:
    """Blocked attention for the query heads that share one key/value head: ``(out, lse, None)``.

    Per head the same results as :func:`jax_sdpa._attention.attention_head` (the weights are
    never formed); this is what :func:`jax_sdpa.dot_product_attention` ``jax.vmap``-s over
    key/value heads and batch for ``implementation="chunked"``. Sequences are padded up to whole
    blocks; padded keys are masked by a length rule and padded queries dropped.
    """
    seq_q, seq_kv = query.shape[1], key.shape[0]
    blocks = _Blocks(
        scale=scale, soft_cap=soft_cap, dropout_rate=dropout_rate, precision=precision,
        block_q=min(block_q, seq_q), block_kv=min(block_kv, seq_kv),
    )  # fmt: skip
    if seq_kv % blocks.block_kv:
        pad_rule = LengthMask(None, jnp.asarray(seq_kv))
        rule = pad_rule if rule is None else AndMask((rule, pad_rule))
    query = _pad_to(query, 1, blocks.block_q)
    key, value = (_pad_to(x, 0, blocks.block_kv) for x in (key, value))
    if bias is not None:
        bias = _pad_to(_pad_to(bias, 1, blocks.block_q), 2, blocks.block_kv)
    if mask is not None:
        mask = _pad_to(_pad_to(mask, 1, blocks.block_q, False), 2, blocks.block_kv, False)
    out, lse = _flash(blocks, query, key, value, bias, mask, rule, dropout_rngs)
    return out[:, :seq_q], lse[:, :seq_q], None
