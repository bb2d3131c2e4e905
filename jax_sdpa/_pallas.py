r"""The fused implementation: one sequence's attention as the engine's Pallas kernels.

``implementation="pallas"`` (or :class:`~jax_sdpa.Pallas` with its tunables): the chunked
implementation's computation, tile for tile, with each pass one kernel
(:mod:`jax_sdpa._kernels`): Triton on GPUs, Mosaic on TPUs, chosen by the platform the program is
lowered for; elsewhere (a CPU) the Pallas interpreter runs it, exact and slow. Its backward pass
is the kernels' (``jax.custom_vjp``): the queries' gradients, then the keys', values' and the
``score_mod``'s arrays'; the sinks' from the rows, as on every tiled path.
"""

import dataclasses
import functools

import jax

from jax_sdpa._block_mask import blocked
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result
from jax_sdpa._kernels import Pallas, Tiles, backward, fitted, forward, padded
from jax_sdpa._tiles import differentiable
from jax_sdpa._tiles_backward import backward_rows, sinks_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(tiles: Tiles, options: Pallas, query, key, value, arrays: CallArrays):
    return forward(tiles, options, query, key, value, arrays)


def _fused_fwd(tiles: Tiles, options: Pallas, query, key, value, arrays: CallArrays):
    out, lse = forward(tiles, options, query, key, value, arrays)
    return (out, lse), (query, key, value, arrays, out, lse)


def _fused_bwd(tiles: Tiles, options: Pallas, residuals: tuple, cotangents: tuple) -> tuple:
    query, key, value, arrays, out, lse = residuals
    rows = backward_rows(out, lse, cotangents)
    grads = backward(tiles, options, query, key, value, arrays, rows)
    operands = (query, key, value, differentiable(arrays.score_consts))
    d_query, d_key, d_value, d_consts = jax.tree.map(
        lambda d, x: d.astype(x.dtype), grads, operands
    )
    d_arrays = CallArrays(score_consts=d_consts, sinks=sinks_grad(arrays.sinks, lse, rows))
    return d_query, d_key, d_value, d_arrays


_fused.defvjp(_fused_fwd, _fused_bwd)


def pallas_sequence(
    formula: Formula, options: Pallas, query, key, value, arrays: CallArrays
) -> Result:
    """The fused kernels on one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values, padded to whole tiles
    (:func:`jax_sdpa._kernels.padded`); an opaque rule's tiles are classified once, for both
    passes to read.
    """
    (seq_q, _, _), value_width = query.shape, value.shape[-1]
    tiles = fitted(formula, options, query, key)
    query, key, value, arrays = padded(tiles, query, key, value, arrays)
    if arrays.rule is not None and arrays.rule.opaque:
        rule = blocked(tiles, arrays, seq_q, key.shape[0])
        arrays = dataclasses.replace(arrays, rule=rule)
    out, lse = _fused(tiles, options, query, key, value, arrays)
    return Result(out[:seq_q, :, :value_width], lse[:seq_q], None)
