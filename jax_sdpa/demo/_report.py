"""The whole demo, Parts A and B for every ``d_k``, and its printed tables."""

import dataclasses
import math

import numpy as np
from tqdm import tqdm

from . import VARIANTS
from ._config import DemoConfig, spread
from ._initialisation import init_statistics
from ._training import train

# The training measures the variants are compared by: one number per seed, from one variant's
# part of `train`'s output.
_PER_SEED_MEASURES = {
    "loss": lambda out: out["eval_loss"],
    "grad_norm_wq": lambda out: out["grad_norm_wq"].mean(axis=1),
}


def _ratios(runs: dict, d_k: int) -> dict[str, np.ndarray]:
    """Unscaled over scaled, seed by seed, for each of ``_PER_SEED_MEASURES``."""
    ratio = {n: m(runs["unscaled"]) / m(runs["scaled"]) for n, m in _PER_SEED_MEASURES.items()}
    # W_q reaches the loss only through the scores c·(x W_q)·k, so the chain rule puts the scale c
    # into ∇W_q: unscaled over scaled, that factor alone is √d_k, whatever the softmax does, and
    # Adam, whose steps are gradients divided by their running size, ignores it anyway. Divided
    # out, what remains is built from the gradient with respect to the scaled scores, what the
    # softmax passes back: the part Part A's Jacobian is about.
    return {
        "loss": ratio["loss"],
        "grad_norm_wq_over_sqrt_dk": ratio["grad_norm_wq"] / math.sqrt(d_k),
    }


def run(config: DemoConfig, *, show_progress: bool = True) -> dict:
    """Parts A and B for every ``d_k``: the content of ``results.json``, and curves for plots.

    Args:
        config: The sizes.
        show_progress: Show a progress bar over the ``d_k`` trained.

    Returns:
        ``{"results": ..., "curves": ...}``. ``results`` holds ``d_k``, ``steps`` (of the
        logs), ``config`` and, per variant and ``d_k``, Part A's statistics, ``final_loss``
        (held-out loss, median over seeds) with ``final_loss_per_seed``, ``grad_norm_wq`` (mean
        over training, median over seeds) and median curves; ``ratios`` holds, per ``d_k``,
        unscaled over scaled of the held-out loss (``loss``) and of ``‖∇W_q‖`` divided by
        ``√d_k`` (``grad_norm_wq_over_sqrt_dk``), each as its :func:`jax_sdpa.demo.spread`
        over seeds with ``per_seed``. ``curves`` maps ``(d_k, variant)`` to
        :func:`jax_sdpa.demo.train`'s output for it and the weights at initialisation.
    """
    results: dict = {"d_k": list(config.d_ks), "config": dataclasses.asdict(config)}
    results |= {variant: {} for variant in VARIANTS}
    results["ratios"] = {}
    curves: dict = {}
    for d_k in config.d_ks:
        for variant, stats in init_statistics(d_k, config).items():
            curves[(d_k, variant)] = {"init_weights": stats.pop("weights")}
            for name, value in stats.items():
                results[variant].setdefault(name, []).append(value)
    for d_k in tqdm(config.d_ks, desc="training (d_k)", disable=not show_progress):
        runs = train(d_k, config)
        for variant, out in runs.items():
            curves[(d_k, variant)].update(out)
            r = results[variant]
            r.setdefault("final_loss", []).append(float(np.median(out["eval_loss"])))
            r.setdefault("final_loss_per_seed", []).append(out["eval_loss"].tolist())
            r.setdefault("final_entropy", []).append(float(np.median(out["entropy"][:, -1])))
            grad_norm_wq = _PER_SEED_MEASURES["grad_norm_wq"](out)
            r.setdefault("grad_norm_wq", []).append(float(np.median(grad_norm_wq)))
            r.setdefault("loss_curve", []).append(np.median(out["loss"], axis=0).tolist())
            r.setdefault("entropy_curve", []).append(np.median(out["entropy"], axis=0).tolist())
        for name, per_seed in _ratios(runs, d_k).items():
            entry = spread(per_seed) | {"per_seed": per_seed.tolist()}
            results["ratios"].setdefault(name, []).append(entry)
    results["steps"] = curves[(config.d_ks[0], VARIANTS[0])]["steps"].tolist()
    return {"results": results, "curves": curves}


def _format_spread(stats: dict[str, float], fmt: str) -> str:
    """``median (min–max)``."""
    return f"{fmt.format(stats['median'])} ({fmt.format(stats['min'])}–{fmt.format(stats['max'])})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), separator, *map(line, rows)])


def format_tables(results: dict) -> str:
    """The printed summary of a run.

    Args:
        results: ``run(config)["results"]``, or ``results.json`` read back.

    Returns:
        Two Markdown tables, Part A with ``unscaled / scaled`` per statistic and Part B with
        each held-out loss and ratio as ``median (min–max)`` over seeds.
    """
    u, s = results["unscaled"], results["scaled"]
    init_columns = [
        ("std(q·k)", "std_qk", "{:.2f}"),
        ("max weight", "max_weight", "{:.3f}"),
        ("entropy", "entropy", "{:.2f}"),
        ("‖J_softmax‖", "jacobian_norm", "{:.3f}"),
    ]
    init_rows = [
        [str(d_k)]
        + [f"{fmt.format(u[name][i])} / {fmt.format(s[name][i])}" for _, name, fmt in init_columns]
        for i, d_k in enumerate(results["d_k"])
    ]
    init_header = ["d_k"] + [f"{title} unscaled / scaled" for title, _, _ in init_columns]

    def losses(variant, i):
        return _format_spread(spread(results[variant]["final_loss_per_seed"][i]), "{:.2g}")

    ratio_columns = [
        ("loss ratio unscaled / scaled", "loss"),
        ("‖∇W_q‖ ratio unscaled / scaled ÷ √d_k", "grad_norm_wq_over_sqrt_dk"),
    ]

    def ratio(name, i):
        return _format_spread(results["ratios"][name][i], "{:.3g}") + "×"

    train_header = ["d_k", "held-out loss unscaled", "held-out loss scaled"]
    train_header += [title for title, _ in ratio_columns]
    train_rows = [
        [str(d_k), losses("unscaled", i), losses("scaled", i)]
        + [ratio(name, i) for _, name in ratio_columns]
        for i, d_k in enumerate(results["d_k"])
    ]
    return "\n".join(
        [
            "At initialisation:",
            _table(init_header, init_rows),
            "",
            f"After training, median (min–max) over {results['config']['seeds']} seeds:",
            _table(train_header, train_rows),
        ]
    )
