"""The demo's figures: curves and sweeps over ``d_k``, median and range over seeds, heatmaps."""

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from . import VARIANTS
from ._config import spread

_COLORS = {"unscaled": "tab:red", "scaled": "tab:blue"}


def plot_median_and_range(ax, x, per_seed, *, color: str, label: str | None = None, fmt="-"):
    """Draws the median over seeds as a line and their range, min to max, as a shaded band.

    Args:
        ax: The Matplotlib axes to draw on.
        x: Positions along the horizontal axis, shape ``(n,)``.
        per_seed: One row per seed, shape ``(seeds, n)``.
        color: Of the line and, lighter, of the band.
        label: The line's legend entry.
        fmt: The line's Matplotlib format string, such as ``"o-"``.
    """
    stats = spread(per_seed, axis=0)
    ax.plot(x, stats["median"], fmt, color=color, label=label)
    ax.fill_between(x, stats["min"], stats["max"], color=color, alpha=0.2)


def _ratio_per_seed(results: dict, name: str) -> np.ndarray:
    """A ratio of ``results``, shape ``(seeds, d_ks)``."""
    return np.array([r["per_seed"] for r in results["ratios"][name]]).T


def _d_k_axis(ax):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("d_k")


def _training_curves(results: dict, curves: dict, metric: str, ylabel: str):
    """One panel per ``d_k``: a training log of each variant against the step."""
    d_ks, steps = results["d_k"], results["steps"]
    fig, axes = plt.subplots(
        1,
        len(d_ks),
        figsize=(4 * len(d_ks), 3.2),
        sharey=metric == "entropy",
        squeeze=False,
        layout="constrained",
    )
    for ax, d_k in zip(axes[0], d_ks, strict=True):
        for variant in VARIANTS:
            per_seed = curves[(d_k, variant)][metric]
            plot_median_and_range(ax, steps, per_seed, color=_COLORS[variant], label=variant)
        ax.set_title(f"d_k = {d_k}")
        ax.set_xlabel("step")
        if metric == "loss":
            ax.set_yscale("log")
    axes[0, 0].set_ylabel(f"{ylabel}\nmedian and range over seeds")
    axes[0, 0].legend()
    return fig


def _gradient_norms(results: dict):
    """The softmax Jacobian at initialisation, and the ``‖∇W_q‖`` ratio divided by ``√d_k``."""
    d_ks = results["d_k"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    for variant in VARIANTS:
        jacobian_norms = results[variant]["jacobian_norm"]
        axes[0].plot(d_ks, jacobian_norms, "o-", color=_COLORS[variant], label=variant)
    grad_ratios = _ratio_per_seed(results, "grad_norm_wq_over_sqrt_dk")
    plot_median_and_range(axes[1], d_ks, grad_ratios, color="tab:purple", fmt="o-")
    axes[1].axhline(1.0, color="grey", linestyle=":")
    axes[0].set(title="‖softmax Jacobian‖_F at init", yscale="log")
    axes[1].set_title("mean ‖∇W_q‖ in training,\nunscaled / scaled ÷ √d_k")
    for ax in axes:
        _d_k_axis(ax)
    axes[0].legend()
    return fig


def _final_loss(results: dict):
    """The held-out loss of each variant after training, and their ratio."""
    d_ks = results["d_k"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    for variant in VARIANTS:
        per_seed = np.array(results[variant]["final_loss_per_seed"]).T
        plot_median_and_range(
            axes[0], d_ks, per_seed, color=_COLORS[variant], label=variant, fmt="o-"
        )
    loss_ratios = _ratio_per_seed(results, "loss")
    plot_median_and_range(axes[1], d_ks, loss_ratios, color="tab:purple", fmt="o-")
    axes[0].set_title("held-out loss after training")
    axes[1].set_title("loss ratio unscaled / scaled")
    for ax in axes:
        _d_k_axis(ax)
        ax.set_yscale("log")
    axes[0].legend()
    return fig


def _weights_heatmaps(results: dict, curves: dict):
    """The softmax weights at initialisation, one row per variant, one column per ``d_k``."""
    d_ks = results["d_k"]
    fig, axes = plt.subplots(
        2, len(d_ks), figsize=(3.2 * len(d_ks), 6.2), squeeze=False, layout="constrained"
    )
    for row, variant in enumerate(VARIANTS):
        for col, d_k in enumerate(d_ks):
            ax = axes[row, col]
            weights = curves[(d_k, variant)]["init_weights"]
            image = ax.imshow(weights, vmin=0, vmax=1, cmap="viridis")
            ax.set_title(f"{variant}, d_k = {d_k}")
            axes[-1, col].set_xlabel("key")
        axes[row, 0].set_ylabel("query")
    fig.suptitle(
        "softmax weights of the same random q, k: before (unscaled) and after scaling by 1/√d_k"
    )
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    return fig


def figures(run_output: dict) -> dict:
    """The demo's figures: curves and sweeps over ``d_k`` (median and range over seeds), heatmaps.

    Args:
        run_output: What :func:`jax_sdpa.demo.run` returns.

    Returns:
        Matplotlib figures by file name, ``loss_curves.png``, ``entropy.png`` (curves per
        ``d_k``), ``gradient_norms.png`` (the softmax Jacobian at initialisation and the
        ``‖∇W_q‖`` ratio divided by ``√d_k``), ``final_loss.png`` (held-out losses and their
        ratio) and ``weights_heatmaps.png`` (the weights at initialisation).
    """
    results, curves = run_output["results"], run_output["curves"]
    return {
        "loss_curves.png": _training_curves(results, curves, "loss", "training loss (MSE)"),
        "entropy.png": _training_curves(results, curves, "entropy", "mean softmax entropy (nats)"),
        "gradient_norms.png": _gradient_norms(results),
        "final_loss.png": _final_loss(results),
        "weights_heatmaps.png": _weights_heatmaps(results, curves),
    }


def plot(run_output: dict, out_dir) -> list:
    """Writes :func:`jax_sdpa.demo.figures` as PNG files.

    Args:
        run_output: What :func:`jax_sdpa.demo.run` returns.
        out_dir: An existing folder (a string or a path).

    Returns:
        The ``pathlib.Path`` of each file written, one per figure.
    """
    paths = []
    for name, fig in figures(run_output).items():
        paths.append(Path(out_dir) / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
