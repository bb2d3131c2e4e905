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
length) are skipped, not computed and masked.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Key

from jax_sdpa._attention import score_block, split_group_axis
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

# A (256, 512) float32 score tile is 512 KiB: half of a 1 MiB L2 cache (see BENCHMARKS.md).
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_KV = 512


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """The static part of one call: the formula's options and the tiling (a ``nondiff_argnum``)."""

    scale: float
    soft_cap: float | None
    dropout_rate: float
    precision: Any
    block_q: int
    block_kv: int

    def scores(self, q_i, k_j, bias_ij, mask_ij, rule, i, j):
        """Scores and allowed-mask of tile ``(i, j)`` for one head: the dense path's steps."""
        return score_block(
            q_i, k_j, bias_ij, mask_ij, rule,
            scale=self.scale, soft_cap=self.soft_cap, precision=self.precision,
            q_offset=i * self.block_q, kv_offset=j * self.block_kv,
        )  # fmt: skip

    def drop(self, x, rng, i, j):
        """Dropout of tile ``(i, j)``: the mask the dense path draws at the same positions."""
        if rng is None:
            return x
        offsets = {"q_offset": i * self.block_q, "kv_offset": j * self.block_kv}
        return dropout_weights(x, rng, rate=self.dropout_rate, **offsets)

    def forward_tile(self, carry, q_i, k_j, v_j, bias_ij, mask_ij, rule, rng, i, j):
        """One online-softmax update of one head's running ``(max, denominator, output)``."""
        row_max, denom, acc = carry
        masked, allowed = _masked(*self.scores(q_i, k_j, bias_ij, mask_ij, rule, i, j))
        new_max = jnp.maximum(row_max, masked.max(axis=-1))
        p = _exp_scores(masked, allowed, new_max)
        correction = jnp.exp(row_max - new_max)
        denom = correction * denom + p.sum(axis=-1)
        update = weighted_sum(self.drop(p, rng, i, j), v_j, precision=self.precision)
        return new_max, denom, correction[:, None] * acc + update

    def backward_tile(
        self, q_i, k_j, v_j, bias_ij, mask_ij, rule, rng, d_out_i, delta_i, lse_i, i, j
    ):
        """One head's gradients from tile ``(i, j)``: ``(dq_i, dk_j, dv_j, dbias_ij)``."""
        scores, scores_vjp, allowed = jax.vjp(
            lambda q, k, b: self.scores(q, k, b, mask_ij, rule, i, j),
            q_i,
            k_j,
            bias_ij,
            has_aux=True,
        )
        masked, allowed = _masked(scores, allowed)
        p = _exp_scores(masked, allowed, lse_i)  # the weights, P = e^{S − lse}
        _, sum_vjp = jax.vjp(
            lambda p, v: weighted_sum(p, v, precision=self.precision), self.drop(p, rng, i, j), v_j
        )
        d_dropped, d_v_j = sum_vjp(d_out_i)
        d_p = self.drop(d_dropped, rng, i, j)  # dropout is diagonal: its own adjoint
        d_q_i, d_k_j, d_bias_ij = scores_vjp(p * (d_p - delta_i[:, None]))
        return d_q_i, d_k_j, d_v_j, d_bias_ij

    def window(self, shape, i, j):
        """Start and size of tile ``(i, j)`` in a ``(g, t, s)`` array (``t``, ``s`` full or 1)."""
        full_rows, full_cols = shape[1] > 1, shape[2] > 1
        start = (0, i * self.block_q if full_rows else 0, j * self.block_kv if full_cols else 0)
        return start, (
            shape[0],
            self.block_q if full_rows else 1,
            self.block_kv if full_cols else 1,
        )

    def tile(self, x, i, j):
        """Tile ``(i, j)`` of a per-group bias or mask (broadcast axes stay broadcast)."""
        return None if x is None else lax.dynamic_slice(x, *self.window(x.shape, i, j))


def _rows(x: Array, i, block: int, axis: int = 0) -> Array:
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _add_at(total: Array, part: Array, start: tuple) -> Array:
    """``total[start : start + part.shape] += part``, in place under ``jit``."""
    current = lax.dynamic_slice(total, start, part.shape)
    return lax.dynamic_update_slice(total, current + part.astype(total.dtype), start)


def _block_range(rule: MaskRule | None, bounds, block: int, count: int):
    """Blocks ``[lo, hi)`` of size ``block`` covering the index range ``bounds(rule)``."""
    if rule is None:
        return 0, count
    lo, hi = bounds(rule)
    return jnp.clip(lo // block, 0, count), jnp.clip(-(-hi // block), 0, count)


def _per_head(fn, n_mapped: int, bias_ij, mask_ij, rngs):
    """``fn(*mapped, bias_ij, mask_ij, rng)`` mapped over the group's heads.

    The first ``n_mapped`` arguments always carry the head axis; the bias, mask and dropout keys
    carry it unless the whole group shares them (a leading axis of size 1).
    """
    (bias_ij, b_ax), (mask_ij, m_ax), (rngs, r_ax) = map(split_group_axis, (bias_ij, mask_ij, rngs))
    mapped = jax.vmap(fn, in_axes=(0,) * n_mapped + (b_ax, m_ax, r_ax))
    return lambda *args: mapped(*args, bias_ij, mask_ij, rngs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(blocks: _Blocks, query, key, value, bias, mask, rule, rngs):
    return _forward(blocks, query, key, value, bias, mask, rule, rngs)


def _forward(blocks: _Blocks, query, key, value, bias, mask, rule, rngs):
    """``(out, lse)`` of a group ``(G, T, H)`` whose ``T``, ``S`` are whole numbers of blocks."""
    groups, n_q, n_kv = (
        query.shape[0],
        query.shape[1] // blocks.block_q,
        key.shape[0] // blocks.block_kv,
    )
    acc_dtype = accumulation_dtype(query.dtype)

    def query_block(i):
        q_i = _rows(query, i, blocks.block_q, axis=1)

        def step(j, carry):
            k_j, v_j = _rows(key, j, blocks.block_kv), _rows(value, j, blocks.block_kv)
            update = _per_head(
                lambda carry, q_i, bias_ij, mask_ij, rng: blocks.forward_tile(
                    carry, q_i, k_j, v_j, bias_ij, mask_ij, rule, rng, i, j
                ),
                2, blocks.tile(bias, i, j), blocks.tile(mask, i, j), rngs,
            )  # fmt: skip
            return update(carry, q_i)

        init = (
            jnp.full((groups, blocks.block_q), large_negative(acc_dtype)),
            jnp.zeros((groups, blocks.block_q), acc_dtype),
            jnp.zeros((groups, blocks.block_q, value.shape[1]), acc_dtype),
        )
        lo, hi = _block_range(
            rule,
            lambda r: r.kv_range(i * blocks.block_q, (i + 1) * blocks.block_q),
            blocks.block_kv,
            n_kv,
        )
        row_max, denom, acc = lax.fori_loop(lo, hi, step, init)
        return jax.vmap(_normalize)(acc, denom).astype(value.dtype), _logsumexp(row_max, denom)

    out, lse = lax.map(query_block, jnp.arange(n_q))  # (n_q, G, block_q, ·)
    return _unblock(out), _unblock(lse)


def _unblock(x: Array) -> Array:
    """``(n_blocks, G, block, ...)`` → ``(G, n_blocks · block, ...)``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _flash_fwd(blocks, query, key, value, bias, mask, rule, rngs):
    out, lse = _forward(blocks, query, key, value, bias, mask, rule, rngs)
    return (out, lse), (query, key, value, bias, mask, rule, rngs, out, lse)


def _flash_bwd(blocks: _Blocks, residuals, cotangents):
    query, key, value, bias, mask, rule, rngs, out, lse = residuals
    d_out = cotangents[0]  # the log-sum-exp leaves with stop_gradient: no cotangent to pass on
    n_q, n_kv = query.shape[1] // blocks.block_q, key.shape[0] // blocks.block_kv
    acc_dtype = accumulation_dtype(query.dtype)
    d_out = d_out.astype(acc_dtype)
    delta = jnp.sum(d_out * out.astype(acc_dtype), axis=-1)  # D = rowsum(dO ∘ O) = rowsum(P ∘ dP)
    shift = jnp.where(jnp.isfinite(lse), lse, 0)  # rows without keys have no allowed entry anyway

    def key_block(j, grads):
        k_j, v_j = _rows(key, j, blocks.block_kv), _rows(value, j, blocks.block_kv)

        def step(i, grads):
            d_query, d_key, d_value, d_bias = grads
            rows = functools.partial(_rows, i=i, block=blocks.block_q, axis=1)
            tile_grads = _per_head(
                lambda q_i, d_out_i, delta_i, lse_i, bias_ij, mask_ij, rng: blocks.backward_tile(
                    q_i, k_j, v_j, bias_ij, mask_ij, rule, rng, d_out_i, delta_i, lse_i, i, j
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

        lo, hi = _block_range(
            rule,
            lambda r: r.q_range(j * blocks.block_kv, (j + 1) * blocks.block_kv),
            blocks.block_q,
            n_q,
        )
        return lax.fori_loop(lo, hi, step, grads)

    def zeros(x):
        return None if x is None else jnp.zeros(x.shape, accumulation_dtype(x.dtype))

    grads = lax.fori_loop(0, n_kv, key_block, tuple(map(zeros, (query, key, value, bias))))
    primals = (query, key, value, bias)
    d_query, d_key, d_value, d_bias = (
        None if g is None else g.astype(x.dtype) for g, x in zip(grads, primals, strict=True)
    )
    return d_query, d_key, d_value, d_bias, None, None, None


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
