r"""The fused implementation: one sequence's attention as the engine's Pallas kernels.

``implementation="pallas"`` (or :class:`~jax_sdpa.Pallas` with its tunables): the chunked
implementation's computation, tile for tile, with each pass one kernel
(:mod:`jax_sdpa._kernels`): Triton on GPUs, Mosaic on TPUs, chosen by the platform the program is
lowered for; elsewhere (a CPU) the Pallas interpreter runs it, exact and slow. Its backward pass
is the kernels' (``jax.custom_vjp``): the queries' gradients, then the keys', values' and the
``score_mod``'s arrays'; the sinks' from the rows, as on every tiled path.
"""

import functools

import jax

from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result
from jax_sdpa._kernels.calls import backward, forward
from jax_sdpa._kernels.fitting import block_lists, fitted, for_inputs, padded
from jax_sdpa._tiles import Tiles, differentiable
from jax_sdpa._tiles_backward import backward_rows, sinks_grad
from jax_sdpa._tunables import Pallas


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(tiles: Tiles, tunables: Pallas, query, key, value, arrays: CallArrays, lists):
    return forward(tiles, tunables, query, key, value, arrays, lists=lists)


def _fused_fwd(tiles: Tiles, tunables: Pallas, query, key, value, arrays: CallArrays, lists):
    out, lse, top = forward(tiles, tunables, query, key, value, arrays, lists=lists)
    return (out, lse, top), (query, key, value, arrays, lists, out, lse)


def _fused_bwd(tiles: Tiles, tunables: Pallas, residuals: tuple, cotangents: tuple) -> tuple:
    query, key, value, arrays, lists, out, lse = residuals
    rows = backward_rows(out, lse, cotangents, tiles.formula.normalizer)
    grads = backward(tiles, tunables, query, key, value, arrays, rows, lists=lists)
    operands = (query, key, value, differentiable(arrays.score_consts))
    d_query, d_key, d_value, d_consts = jax.tree.map(
        lambda d, x: d.astype(x.dtype), grads, operands
    )
    d_arrays = CallArrays(score_consts=d_consts, sinks=sinks_grad(arrays.sinks, lse, rows))
    return d_query, d_key, d_value, d_arrays, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def pallas_sequence(
    formula: Formula, tunables: Pallas, query, key, value, arrays: CallArrays
) -> Result:
    """The fused kernels on one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values, padded to whole tiles
    (:func:`jax_sdpa._kernels.fitting.padded`). An opaque rule is a block mask's classes, made once
    (or read, :func:`jax_sdpa._kernels.fitting.block_lists`), and listed: the kernels visit only
    the blocks it does not exclude.
    """
    (seq_q, _, _), value_width = query.shape, value.shape[-1]
    tunables = for_inputs(tunables, query, key, value)
    tiles = fitted(formula, tunables, query, key)
    query, key, value, arrays = padded(tiles, tunables, query, key, value, arrays)
    arrays, lists = block_lists(tiles, tunables, arrays, seq_q, key.shape[0])
    out, lse, top = _fused(tiles, tunables, query, key, value, arrays, lists)
    return Result(out[:seq_q, :, :value_width], lse[:seq_q], None, top[:seq_q])
