"""The weighted sum, animated: one output row built term by term, the largest weight first."""

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.animation import FuncAnimation, PillowWriter

import jax_sdpa

from ._config import _ANIMATION, _normal

# One frame per term, both on screen (the animation's interval) and in the GIF (its frame rate).
_SECONDS_PER_FRAME = 0.7


def weighted_sum_example(*, n_keys: int = 6, d_k: int = 16, d_v: int = 4, seed: int = 0):
    """One query's weights over random keys (jax_sdpa's steps, scaled), and random values.

    Args:
        n_keys: The number of keys and values.
        d_k: Features of the query and the keys.
        d_v: Features of a value.
        seed: Selects the query, keys and values.

    Returns:
        NumPy arrays ``weights``, shape ``(n_keys,)``, and ``value``, shape ``(n_keys, d_v)``.
    """
    rng = np.random.default_rng([_ANIMATION, seed])
    query = _normal(rng, (1, d_k))
    key = _normal(rng, (n_keys, d_k))
    value = _normal(rng, (n_keys, d_v))
    scores = jax_sdpa.scale_scores(jax_sdpa.raw_scores(query, key), jax_sdpa.default_scale(d_k))
    return np.asarray(jax_sdpa.softmax_weights(scores)[0]), value


def running_sums(weights, value) -> tuple[np.ndarray, np.ndarray]:
    r"""One output row built term by term, :math:`o = \sum_j w_j v_j`, the largest weight first.

    Each partial sum is :func:`jax_sdpa.weighted_sum` of the weights with all but the ``k``
    largest set to 0: the ``S + 1`` rows of such weights go through it as ``S + 1`` queries, so
    the animation shows the library's sums.

    Args:
        weights: One query's attention weights, shape ``(S,)``.
        value: Values, shape ``(S, d_v)``.

    Returns:
        ``order`` ``(S,)``, the keys by decreasing weight, and the ``S + 1`` partial sums
        ``(S + 1, d_v)``: 0, then each with one more term; the last is the output row.

    Examples:
        >>> order, sums = running_sums(np.array([0.25, 0.75]), np.array([[0.0, 4.0], [4.0, 0.0]]))
        >>> order, sums
        (array([1, 0]), array([[0., 0.],
               [3., 0.],
               [3., 1.]], dtype=float32))
    """
    weights = np.asarray(weights)
    order = np.argsort(-weights, kind="stable")
    rank = np.argsort(order)  # how many weights come before each
    kept = rank < np.arange(len(weights) + 1)[:, None]  # (S + 1, S): row k keeps the k largest
    return order, np.asarray(jax_sdpa.weighted_sum(np.where(kept, weights, 0.0), value))


def weighted_sum_animation(weights, value, *, labels=None):
    """An animation of :func:`jax_sdpa.demo.running_sums`: frame ``k`` adds the ``k``-th term.

    Left, the weights, those added so far in blue and the one being added in orange. Right, the
    value vectors (grey), the one being added (orange) and its share ``w_j v_j`` (dashed), the
    partial sum (blue) and the output row it converges to (black rings).

    Args:
        weights: One query's attention weights, shape ``(S,)``.
        value: Values, shape ``(S, d_v)``.
        labels: Optional names of the ``S`` keys.

    Returns:
        The figure (close it when done) and its ``matplotlib.animation.FuncAnimation`` of
        ``S + 1`` frames.
    """
    weights, value = np.asarray(weights), np.asarray(value)
    order, sums = running_sums(weights, value)
    n_keys, d_v = value.shape
    labels = [f"k{j}" for j in range(n_keys)] if labels is None else list(labels)
    features = np.arange(d_v)

    fig, (ax_w, ax_v) = plt.subplots(1, 2, figsize=(8, 2.8), width_ratios=(1, 1.6))
    bars = ax_w.bar(range(n_keys), weights, color="lightgrey")
    ax_w.set_xticks(range(n_keys), labels, fontsize=8)
    ax_w.set(ylim=(0, 1), title="weights $w_j$")
    for j in range(n_keys):
        ax_v.plot(features, value[j], color="grey", alpha=0.3, linewidth=1)
    ax_v.plot(features, sums[-1], "o", color="k", fillstyle="none", markersize=11, label="output")
    (value_line,) = ax_v.plot([], [], color="tab:orange", linewidth=1, label="$v_j$")
    (term_line,) = ax_v.plot([], [], "--", color="tab:orange", label="$w_j v_j$, added")
    (sum_line,) = ax_v.plot([], [], "o-", color="tab:blue", linewidth=2, label="partial sum")
    ax_v.set_xticks(features)
    ax_v.set_xlabel("feature")
    ax_v.legend(fontsize=8, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()

    def draw(k):
        for rank, j in enumerate(order):
            bars[j].set_color(
                "tab:orange" if rank == k - 1 else "tab:blue" if rank < k else "lightgrey"
            )
        added = order[k - 1] if k else None
        nothing = np.full(d_v, np.nan)
        value_line.set_data(features, nothing if added is None else value[added])
        term_line.set_data(features, nothing if added is None else sums[k] - sums[k - 1])
        sum_line.set_data(features, sums[k])
        title = "" if added is None else f": + {weights[added]:.2f} · v({labels[added]})"
        ax_v.set_title(f"sum of {k} of {n_keys} terms{title}", fontsize=10)
        return [*bars, value_line, term_line, sum_line]

    return fig, FuncAnimation(fig, draw, frames=n_keys + 1, interval=1000 * _SECONDS_PER_FRAME)


def save_weighted_sum_gif(path, weights, value, *, labels=None):
    """Writes :func:`jax_sdpa.demo.weighted_sum_animation` as a GIF, one frame per term.

    Args:
        path: The GIF file to write (with Pillow).
        weights: One query's attention weights, shape ``(S,)``.
        value: Values, shape ``(S, d_v)``.
        labels: Optional names of the ``S`` keys.

    Returns:
        ``path``, as a ``pathlib.Path``.
    """
    fig, animation = weighted_sum_animation(weights, value, labels=labels)
    animation.save(path, writer=PillowWriter(fps=1 / _SECONDS_PER_FRAME), dpi=80)
    plt.close(fig)
    return Path(path)
