"""Part A: the softmax at initialisation, scaled and unscaled, as ``d_k`` grows."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa

from . import VARIANTS
from ._config import _INIT_STATISTICS, DemoConfig, _normal, scale_for


def _entropy(weights: jax.Array) -> jax.Array:
    """Row entropies of attention weights (nats); uniform over S keys gives log S."""
    return -jnp.sum(jnp.where(weights > 0, weights * jnp.log(weights), 0.0), axis=-1)


def _row_softmax(scores_row: jax.Array) -> jax.Array:
    return jax_sdpa.softmax_weights(scores_row[None, :])[0]


def _softmax_jacobian_norms(scores: jax.Array) -> jax.Array:
    """‖∂ softmax(s) / ∂ s‖_F per row, by autodiff of jax_sdpa's softmax step."""
    jacobians = jax.vmap(jax.jacfwd(_row_softmax))(scores)  # (T, S, S) = diag(p) − p pᵀ per row
    return jnp.sqrt(jnp.sum(jacobians**2, axis=(1, 2)))


@jax.jit
def _softmax_statistics(scores: jax.Array) -> dict[str, jax.Array]:
    # Scores are (init_queries, n_items) for every d_k and scale: one compilation serves all.
    weights = jax_sdpa.softmax_weights(scores)
    return {
        "std_qk": jnp.std(scores),
        "max_weight": jnp.mean(jnp.max(weights, axis=-1)),
        "entropy": jnp.mean(_entropy(weights)),
        "jacobian_norm": jnp.mean(_softmax_jacobian_norms(scores)),
        "weights": weights[: scores.shape[1]],
    }


def init_statistics(d_k: int, config: DemoConfig, *, seed: int = 0) -> dict[str, dict]:
    """Part A for one ``d_k``: statistics of the scores and of the softmax, per variant.

    ``config.init_queries`` unit-normal queries, each with its own ``config.n_items`` unit-normal
    keys, as each example of the task has its own dictionary.

    Args:
        d_k: The head dimension.
        config: The sizes.
        seed: Selects the queries and keys.

    Returns:
        ``{"unscaled": {...}, "scaled": {...}}`` with ``std_qk`` (of the scores entering the
        softmax), ``max_weight`` and ``entropy`` (row means), ``jacobian_norm`` (mean Frobenius
        norm of the softmax Jacobian) as floats and ``weights`` (a square sample of the
        weights, for plots) as an array.
    """
    rng = np.random.default_rng([_INIT_STATISTICS, seed])
    query = _normal(rng, (config.init_queries, d_k))
    keys = _normal(rng, (config.init_queries, config.n_items, d_k))
    raw = jax.vmap(lambda q, k: jax_sdpa.raw_scores(q[None, :], k)[0])(query, keys)
    stats = {
        v: _softmax_statistics(jax_sdpa.scale_scores(raw, scale_for(v, d_k))) for v in VARIANTS
    }
    return {
        v: {n: np.asarray(x) if n == "weights" else float(x) for n, x in stats[v].items()}
        for v in VARIANTS
    }
