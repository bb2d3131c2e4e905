"""Part B: learning to retrieve, every seed and both variants of a ``d_k`` as one program."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jax_sdpa

from . import VARIANTS
from ._config import _EXAMPLES, _ORDER, _PARAMS, DemoConfig, _normal, scale_for
from ._initialisation import _entropy


class Batches(NamedTuple):
    """Examples of the task, stacked: a leading ``(batches, batch)`` pair of axes on each field."""

    #: ``(..., d_model)``, a noisy copy of one item of the dictionary.
    queries: np.ndarray
    #: ``(..., n_items, d_model)``, the dictionary's items.
    items: np.ndarray
    #: ``(..., n_items, d_v)``, the dictionary's values.
    values: np.ndarray
    #: ``(..., d_v)``, the value of the item the query copies.
    targets: np.ndarray


def _draw_batches(rng: np.random.Generator, n_batches: int, config: DemoConfig) -> Batches:
    """``n_batches`` batches of ``config.batch`` examples, each with its own dictionary."""
    shape = (n_batches, config.batch)
    items = _normal(rng, (*shape, config.n_items, config.d_model))
    values = _normal(rng, (*shape, config.n_items, config.d_v))
    picks = rng.integers(config.n_items, size=(*shape, 1, 1))
    noise = config.noise * _normal(rng, (*shape, config.d_model))
    return Batches(
        queries=np.take_along_axis(items, picks, axis=2)[:, :, 0] + noise,
        items=items,
        values=values,
        targets=np.take_along_axis(values, picks, axis=2)[:, :, 0],
    )


@functools.lru_cache(maxsize=1)
def draw_examples(config: DemoConfig) -> tuple[Batches, Batches]:
    """The training batches and the held-out batches.

    Drawn once and shared by every ``d_k``, seed and variant: the items live in ``d_model``
    dimensions whatever the head dimension, so every run faces the same task.

    Args:
        config: The sizes.

    Returns:
        ``config.steps`` training batches and ``config.eval_batches`` held-out ones.
    """
    rng_train, rng_held_out = np.random.default_rng([_EXAMPLES, 0]).spawn(2)
    return (
        _draw_batches(rng_train, config.steps, config),
        _draw_batches(rng_held_out, config.eval_batches, config),
    )


def init_params(seed: int, d_k: int, config: DemoConfig) -> dict[str, np.ndarray]:
    """Initial ``W_q`` and ``W_k``, ``(d_model, d_k)``, with ``N(0, 1/d_model)`` entries.

    Projected unit-variance features then have about unit variance too. A key is an item, of
    unit variance, but a query is an item plus noise, of variance ``1 + noise²``: ``q·k`` has a
    variance of about ``(1 + noise²) · d_k``, 1.25 · ``d_k`` by default, near Part A's ``d_k``.

    Args:
        seed: Selects the parameters.
        d_k: The head dimension.
        config: The sizes.

    Returns:
        ``{"w_q": ..., "w_k": ...}``.
    """
    rng = np.random.default_rng([_PARAMS, seed])
    std = np.float32(1.0 / math.sqrt(config.d_model))
    shape = (config.d_model, d_k)
    return {"w_q": std * _normal(rng, shape), "w_k": std * _normal(rng, shape)}


def batch_order(seed: int, config: DemoConfig) -> np.ndarray:
    """The order in which a seed's runs see the training batches.

    Args:
        seed: Selects the order.
        config: The sizes.

    Returns:
        A permutation of ``range(config.steps)``.
    """
    return np.random.default_rng([_ORDER, seed]).permutation(config.steps)


def _attend(params, query_input, items, values, scale, normalizer: str):
    """One example through jax_sdpa's steps: its output row, weights ``(n_items,)``, top logit.

    The raw scores are ``raw_scores(x W_q W_kᵀ, X)``, where the textbook writes
    ``raw_scores(x W_q, X W_k)``: the same numbers, as (x W_q)·(x_j W_k) = (x W_q W_kᵀ)·x_j,
    regrouped so that each example multiplies by W_kᵀ once instead of each of its items by W_k,
    which at d_k = 1024 was most of the training's time.
    """
    query = query_input @ params["w_q"]
    scores = jax_sdpa.scale_scores(
        jax_sdpa.raw_scores((query @ params["w_k"].T)[None, :], items), scale
    )
    if normalizer == "sigmoid":
        weights = jax_sdpa.sigmoid_weights(scores)
    else:
        weights = jax_sdpa.softmax_weights(scores)
    return jax_sdpa.weighted_sum(weights, values)[0], weights[0], scores.max()


def _loss(params, batch: Batches, scale, normalizer: str = "softmax"):
    """Mean squared error of the retrieved values, the weights ``(batch, items)``, the top logit."""
    out, weights, top = jax.vmap(_attend, in_axes=(None, 0, 0, 0, None, None))(
        params, batch.queries, batch.items, batch.values, scale, normalizer
    )
    return jnp.mean((out - batch.targets) ** 2), (weights, lax.stop_gradient(top.max()))


def _clipped(params, top, threshold):
    """QK-Clip of the single head's projections, ``(d_model, d_k)`` each."""
    w_q, w_k = jax_sdpa.qk_clip(
        params["w_q"][:, None], params["w_k"][:, None], top[None], threshold=threshold
    )
    return {"w_q": w_q[:, 0], "w_k": w_k[:, 0]}


def train_model(
    params: dict[str, jax.Array],
    *,
    scale: float | jax.Array,
    order: jax.Array,
    batches: Batches,
    held_out: Batches,
    config: DemoConfig,
) -> dict[str, jax.Array]:
    """One model: an Adam step on each of ``batches``, in ``order``, as one ``lax.scan``.

    Pure and unbatched: :func:`jax_sdpa.demo.train` ``jax.vmap``-s it over variants and seeds.

    Args:
        params: Initial ``w_q`` and ``w_k``, as :func:`jax_sdpa.demo.init_params` draws them.
        scale: The factor on the raw scores (a scalar, traced under ``jax.vmap``).
        order: Indices into ``batches``, one per step.
        batches: The training batches.
        held_out: The batches the trained model is scored on.
        config: The sizes (``learning_rate`` and ``log_every`` here).

    Returns:
        ``loss``, ``entropy`` (mean row entropy of the weights) and
        ``grad_norm_wq``/``grad_norm_wk``, each averaged over every ``log_every`` steps (shape
        ``(steps // log_every,)``), ``max_logit`` (the largest logit of each stretch), and
        ``eval_loss``, the mean loss of the trained model on the ``held_out`` batches.
    """
    optimizer = optax.adam(config.learning_rate)

    def step(carry, index):
        params, opt_state = carry
        batch = jax.tree.map(lambda x: x[index], batches)
        (loss, (weights, top)), grads = jax.value_and_grad(_loss, has_aux=True)(
            params, batch, scale, config.normalizer
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        logs = {
            "loss": loss,
            "entropy": jnp.mean(_entropy(weights)),
            "grad_norm_wq": jnp.linalg.norm(grads["w_q"]),
            "grad_norm_wk": jnp.linalg.norm(grads["w_k"]),
            "max_logit": top,
        }
        params = optax.apply_updates(params, updates)
        if config.qk_clip is not None:  # MuonClip: the step's largest logit, after its update
            params = _clipped(params, top, config.qk_clip)
        return (params, opt_state), logs

    (params, _), logs = jax.lax.scan(step, (params, optimizer.init(params)), order)
    stretches = jax.tree.map(lambda x: x.reshape(-1, config.log_every), logs)
    logs = jax.tree.map(lambda x: x.mean(axis=1), stretches)
    logs["max_logit"] = stretches["max_logit"].max(axis=1)
    held_out_losses = jax.vmap(lambda batch: _loss(params, batch, scale, config.normalizer)[0])(
        held_out
    )
    return logs | {"eval_loss": jnp.mean(held_out_losses)}


@functools.partial(jax.jit, static_argnames="config")
def _train_seeds_and_variants(params, orders, scales, batches, held_out, *, config: DemoConfig):
    """``train_model`` for every seed (outer ``vmap``: its ``params`` and ``order``) and scale."""

    def one_seed(params, order):
        # Both variants of a seed start from the same parameters and see the same batches.
        return jax.vmap(
            lambda scale: train_model(
                params,
                scale=scale,
                order=order,
                batches=batches,
                held_out=held_out,
                config=config,
            )
        )(scales)

    return jax.vmap(one_seed)(params, orders)


def train(d_k: int, config: DemoConfig) -> dict[str, dict[str, np.ndarray]]:
    """Part B for one ``d_k``: both variants and all seeds as one compiled program.

    Seed ``s`` starts from ``init_params(s, d_k, config)`` and sees ``draw_examples(config)``'s
    training batches in ``batch_order(s, config)``.

    Args:
        d_k: The head dimension.
        config: The sizes.

    Returns:
        Per variant, :func:`jax_sdpa.demo.train_model`'s outputs stacked over seeds
        (``(seeds, steps // log_every)``; ``eval_loss``: ``(seeds,)``) and ``steps`` (the
        middle step of each logged stretch).
    """
    seeds = range(config.seeds)
    params = jax.tree.map(lambda *x: np.stack(x), *(init_params(s, d_k, config) for s in seeds))
    orders = np.stack([batch_order(s, config) for s in seeds])
    scales = np.array([scale_for(v, d_k) for v in VARIANTS], dtype=np.float32)
    logs = jax.device_get(
        _train_seeds_and_variants(params, orders, scales, *draw_examples(config), config=config)
    )
    steps = (np.arange(config.steps // config.log_every) + 0.5) * config.log_every
    return {
        variant: {name: x[:, i] for name, x in logs.items()} | {"steps": steps}
        for i, variant in enumerate(VARIANTS)
    }
