r"""The tile engine's backward pass: gradients recomputed tile by tile from the log-sum-exp.

FlashAttention-2, Alg. 2: each tile's weights are recomputed from the saved log-sum-exp,
:math:`P = e^{S - \mathrm{lse}}`, and :math:`dS = P \circ (dP - D)` with
:math:`D = \mathrm{rowsum}(dO \circ O)` less the log-sum-exp's cotangent; the four products
are written out, :math:`dV = P^\top dO`, :math:`dP = dO\,V^\top`, :math:`dQ = dS\,K`,
:math:`dK = dS^\top Q`, and the steps between raw scores and weights (scale, soft cap, bias,
``score_mod``) are differentiated by ``jax.vjp`` of the same step functions
(:meth:`jax_sdpa._tiles.Tiles.backward_tile`).
Gradients are carried as whole arrays and updated tile by tile, so memory stays linear in the
sequence length; the key/value gradients of a tile are summed over its ``G`` query heads.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jax_sdpa._formula import CallArrays, block_of
from jax_sdpa._heads import over_heads
from jax_sdpa._online_softmax import Normalization, zeros_from
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._sweeps import Blocks, guarded, loop, sweep
from jax_sdpa._tiles import (
    BackwardRows,
    Tiles,
    add_at,
    differentiable,
    flat,
    listed_blocks,
    rows_first,
)


def _accumulate(tiles: Tiles, grads: tuple, tile_grads: tuple, i, j) -> tuple:
    """Adds one tile's ``(K, G, …)`` gradients into the whole ``(dq, dk, dv, dbias, dconsts)``."""
    d_query, d_key, d_value, d_bias, d_consts = grads
    d_q_i, d_k_j, d_v_j, d_bias_ij, d_consts_ij = tile_grads
    d_query = add_at(d_query, rows_first(d_q_i, 2), (i * tiles.block_q, 0))
    # A key/value head's tile gets the sum over the query heads that share it.
    d_key = add_at(d_key, rows_first(d_k_j.sum(axis=1), 1), (j * tiles.block_kv, 0))
    d_value = add_at(d_value, rows_first(d_v_j.sum(axis=1), 1), (j * tiles.block_kv, 0))
    if d_bias is not None:  # a bias all heads share gets the sum over them
        d_bias_ij = d_bias_ij.reshape(-1, *d_bias_ij.shape[2:])
        if d_bias.shape[0] == 1:
            d_bias_ij = d_bias_ij.sum(axis=0, keepdims=True)
        start, _ = block_of(d_bias.shape, tiles.q_block(i), tiles.kv_block(j))
        d_bias = add_at(d_bias, d_bias_ij, start)
    # The score_mod's arrays are shared by every head: each gets the sum over the heads.
    d_consts = jax.tree.map(lambda d, part: d + part.sum(axis=(0, 1)), d_consts, d_consts_ij)
    return d_query, d_key, d_value, d_bias, d_consts


def backward_sweep(
    tiles: Tiles,
    query,
    key,
    value,
    arrays: CallArrays,
    row_terms: BackwardRows,
    grads,
    q_offset,
    kv_offset,
):
    """Adds the gradients of queries ``(T, N·H)`` against keys ``(S, K·H)`` into ``grads``.

    ``grads = (dq, dk, dv, dbias, dconsts)`` has the shapes of the operands (``dbias`` None
    without a bias, ``dconsts`` those of the ``score_mod``'s floating-point arrays);
    ``row_terms`` are the queries' :class:`~jax_sdpa._tiles.BackwardRows`.
    """

    def key_block(j, grads):
        kv = (tiles.keys(key, j), tiles.keys(value, j))
        tile_kv = kv_offset + j * tiles.block_kv

        def tile(i, _, rule):
            tile_q = q_offset + i * tiles.block_q

            def head(per_query, per_kv):
                q, terms, arrays = per_query
                return tiles.backward_tile(q, *per_kv, arrays, terms, tile_q, tile_kv)

            terms_i = BackwardRows(
                tiles.queries(row_terms.d_out, i),
                tiles.queries(row_terms.delta, i, vector=True),
                tiles.queries(row_terms.shift, i, vector=True),
            )
            per_query = (tiles.queries(query, i), terms_i, tiles.tile(arrays, i, j, rule))
            return over_heads(head, tiles.groups, per_query, kv)

        def skip(i, _):  # a skipped tile's gradients: zeros, for the accumulators to stay out
            shapes = jax.eval_shape(functools.partial(tile, i, None, rule=None))
            return jax.tree.map(lambda x: zeros_from(query, x.dtype, x.shape), shapes)

        blocks = Blocks("q", q_offset, tiles.block_q, query.shape[0] // tiles.block_q)
        guarded_tile = guarded(tile, skip, arrays, blocks, (tile_kv, tiles.block_kv))

        def step(i, grads, rule):
            return _accumulate(tiles, grads, guarded_tile(i, None, rule), i, j)

        lists = listed_blocks(tiles, arrays, "q", j, (q_offset, kv_offset), blocks.count)
        return sweep(step, arrays.rule, blocks, (tile_kv, tile_kv + tiles.block_kv), grads, lists)

    return loop(0, key.shape[0] // tiles.block_kv, key_block, grads)


def zeros_like_grads(query, key, value, arrays: CallArrays) -> tuple:
    """Gradient accumulators, in at least float32: ``(dq, dk, dv, dbias, dconsts)``."""

    def zeros(x):
        return None if x is None else zeros_from(x, accumulation_dtype(x.dtype))

    consts = tuple(map(zeros, differentiable(arrays)))
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
        (query, key, value, arrays.bias, differentiable(arrays)),
    )
    return d_query, d_key, d_value, CallArrays(bias=d_bias, score_consts=d_consts)


def sinks_grad(
    sinks: jax.Array | None, lse: jax.Array, row_terms: BackwardRows
) -> jax.Array | None:
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
    return (-jnp.sum(weight * row_terms.delta, axis=0)).astype(sinks.dtype)


def backward_rows(out, lse, cotangents, normalizer: Normalization) -> BackwardRows:
    """The :class:`BackwardRows` of ``(T, N, V)`` outputs and their ``(T, N)`` log-sum-exp.

    ``cotangents = (d_out, d_lse, …)``; the rows' term of the scores' gradient is the
    normaliser's (:meth:`~jax_sdpa._online_softmax.Softmax.delta`).
    """
    d_out, d_lse = cotangents[:2]  # the max scores' (a third output) are not differentiated
    d_out = d_out.astype(accumulation_dtype(out.dtype))
    seen = jnp.isfinite(lse)
    shift = jnp.where(seen, lse, 0)  # rows without keys: e^{fill − 0} = 0
    delta = normalizer.delta(d_out, out, d_lse.astype(d_out.dtype), shift, seen)
    return BackwardRows(d_out.reshape(d_out.shape[0], -1), delta, shift)


def backward(tiles: Tiles, residuals: tuple, cotangents: tuple) -> tuple:
    """The gradients of one sequence's ``(out, lse)`` from its residuals, on one device.

    ``residuals = (query, key, value, arrays, out, lse)``, the sequences whole numbers of
    tiles; returns ``(dq, dk, dv, darrays)``: a ``jax.custom_vjp``'s backward rule.
    """
    query, key, value, arrays, out, lse = residuals
    row_terms = backward_rows(out, lse, cotangents, tiles.formula.normalizer)
    queries, keys, values = flat(query), flat(key), flat(value)
    grads = zeros_like_grads(queries, keys, values, arrays)
    grads = backward_sweep(tiles, queries, keys, values, arrays, row_terms, grads, 0, 0)
    d_query, d_key, d_value, d_arrays = grads_like(grads, query, key, value, arrays)
    d_sinks = sinks_grad(arrays.sinks, lse, row_terms)
    return d_query, d_key, d_value, dataclasses.replace(d_arrays, sinks=d_sinks)


def define_vjp(fn, fwd, bwd) -> None:
    """``fn.defvjp(fwd, bwd)`` for a call's ``jax.custom_vjp``, with JAX's symbolic zeros.

    ``fwd`` gets the primals' values, its :class:`~jax_sdpa._formula.CallArrays`' ``score_mod``
    arrays that no derivative perturbs marked fixed (a table closed over and not
    differentiated, an array the mod makes of literals: ``fixed_consts``), whose gradients the
    backward then computes nowhere (a kernel's atomic adds, a sweep's accumulators); ``bwd``
    the cotangents, an output's that nothing reads (a ``SymbolicZero``) as zeros.
    """

    def primals(*args):
        def value(arg):
            values = jax.tree.map(_value, arg, is_leaf=_is_primal)
            if not isinstance(arg, CallArrays):
                return values
            fixed = tuple(not p.perturbed for p in arg.score_consts)
            return dataclasses.replace(values, fixed_consts=fixed)

        return fwd(*map(value, args))

    def zero(c):
        return jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c

    def cotangents(*args):
        *rest, outs = args
        return bwd(*rest, tuple(map(zero, outs)))

    fn.defvjp(primals, cotangents, symbolic_zeros=True)


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _value(x):
    return x.value if _is_primal(x) else x
