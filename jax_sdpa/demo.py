r"""Why attention divides by √d_k, measured.

Run ``python -m jax_sdpa.demo [--out DIR] [--quick] [--seeds N]``.

**Part A, at initialisation.** With unit-variance queries and keys, :math:`q \cdot k` has variance
:math:`d_k`. Unscaled, the scores grow like :math:`\sqrt{d_k}`, the softmax saturates towards
one-hot, and its Jacobian :math:`\mathrm{diag}(p) - p p^\top` — the factor every gradient through
the attention weights is multiplied by — shrinks. Scaled by :math:`1/\sqrt{d_k}`, all of it stays
put as ``d_k`` grows (Vaswani et al. 2017, §3.2.1 and footnote 4).

**Part B, training.** A retrieval task that attention must solve: each example is a dictionary
of 16 random items with random values and a query that is one of the items plus noise; the
target is that item's value. The model learns :math:`W_q` and :math:`W_k` (initialised so that
projected features have unit variance) and computes, per example,
``weighted_sum(softmax_weights(scale_scores(raw_scores(x W_q, X W_k), scale)), V)`` — jax_sdpa's
steps, ``jax.vmap``-ed over the batch — with ``scale = 1/√d_k`` or ``scale = 1``, trained by
Optax's Adam, several seeds averaged. Part A's scores have the same shape as the model's at
initialisation: 16 keys per query.

The demo prints a table, writes PNG plots and ``results.json`` to ``--out``.
"""

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa

__all__ = ["DemoConfig", "init_statistics", "run", "train", "main"]

VARIANTS = ("unscaled", "scaled")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes of the experiment (``quick`` shrinks the training, not the task)."""

    d_ks: tuple[int, ...] = (16, 64, 256, 1024)
    seeds: int = 3
    steps: int = 300
    log_every: int = 10
    n_items: int = 16  # dictionary size: keys per query
    d_v: int = 16
    batch: int = 64  # examples (dictionary + query) per step
    noise: float = 0.5
    learning_rate: float = 1e-3
    init_queries: int = 512

    @classmethod
    def quick(cls, seeds: int = 3) -> "DemoConfig":
        """A run of a few seconds for the test suite: the same task, fewer and smaller runs."""
        return cls(d_ks=(16, 64, 256), seeds=seeds, steps=150, log_every=25)


def _key(seed) -> jax.Array:
    """A PRNG key; XLA's RngBitGenerator compiles several times faster than Threefry on CPU."""
    return jax.random.key(seed, impl="rbg")


def scale_for(variant: str, d_k: int) -> float:
    """``1/√d_k`` for the scaled model, ``1`` for the unscaled one."""
    return jax_sdpa.default_scale(d_k) if variant == "scaled" else 1.0


# --- Part A: the softmax at initialisation ----------------------------------------------------


def _entropy(weights: jax.Array) -> jax.Array:
    """Row entropies of attention weights (nats); uniform over S keys gives log S."""
    return -jnp.sum(jnp.where(weights > 0, weights * jnp.log(weights), 0.0), axis=-1)


def _softmax_jacobian_norms(scores: jax.Array) -> jax.Array:
    """‖∂ softmax(s) / ∂ s‖_F per row, by autodiff of jax_sdpa's softmax step."""
    row_softmax = lambda s: jax_sdpa.softmax_weights(s[None, :])[0]  # noqa: E731
    jacobians = jax.vmap(jax.jacfwd(row_softmax))(scores)  # (T, S, S) = diag(p) − p pᵀ per row
    return jnp.sqrt(jnp.sum(jacobians**2, axis=(1, 2)))


@jax.jit
def _init_statistics(query: jax.Array, keys: jax.Array, scale: float) -> dict[str, jax.Array]:
    # Each query against its own keys, as each example of the task has its own dictionary.
    raw = jax.vmap(lambda q, k: jax_sdpa.raw_scores(q[None, :], k)[0])(query, keys)
    scores = jax_sdpa.scale_scores(raw, scale)
    weights = jax_sdpa.softmax_weights(scores)
    return {
        "std_qk": jnp.std(scores),
        "max_weight": jnp.mean(jnp.max(weights, axis=-1)),
        "entropy": jnp.mean(_entropy(weights)),
        "jacobian_norm": jnp.mean(_softmax_jacobian_norms(scores)),
        "weights": weights[: keys.shape[1]],
    }


def init_statistics(d_k: int, config: DemoConfig, *, seed: int = 0) -> dict[str, dict]:
    """Part A for one ``d_k``: statistics of the scores and of the softmax, per variant.

    ``init_queries`` unit-normal queries, each with its own ``n_items`` unit-normal keys. Returns
    ``{"unscaled": {...}, "scaled": {...}}`` with ``std_qk`` (of the scores entering the
    softmax), ``max_weight`` and ``entropy`` (row means), ``jacobian_norm`` (mean Frobenius
    norm of the softmax Jacobian) and ``weights`` (a square sample of the weights, for plots).
    """
    rng_q, rng_k = jax.random.split(_key(seed))
    query = jax.random.normal(rng_q, (config.init_queries, d_k))
    keys = jax.random.normal(rng_k, (config.init_queries, config.n_items, d_k))
    stats = {v: _init_statistics(query, keys, scale_for(v, d_k)) for v in VARIANTS}
    return {
        v: {n: np.asarray(x) if n == "weights" else float(x) for n, x in stats[v].items()}
        for v in VARIANTS
    }


# --- Part B: learning to retrieve ---------------------------------------------------------------


def _batch(rng: jax.Array, d_k: int, config: DemoConfig):
    """Examples: a dictionary (items X, values V) each, a noisy copy of one item, its value."""
    rng_x, rng_v, rng_j, rng_n = jax.random.split(rng, 4)
    items = jax.random.normal(rng_x, (config.batch, config.n_items, d_k))
    values = jax.random.normal(rng_v, (config.batch, config.n_items, config.d_v))
    picks = jax.random.randint(rng_j, (config.batch,), 0, config.n_items)
    rows = jnp.arange(config.batch)
    noise = config.noise * jax.random.normal(rng_n, (config.batch, d_k))
    return items[rows, picks] + noise, items, values, values[rows, picks]


def _attend(params, query_input, items, values, scale):
    """One example through jax_sdpa's steps: the query x W_q against the keys X W_k."""
    scores = jax_sdpa.raw_scores((query_input @ params["w_q"])[None, :], items @ params["w_k"])
    weights = jax_sdpa.softmax_weights(jax_sdpa.scale_scores(scores, scale))
    return jax_sdpa.weighted_sum(weights, values)[0], weights[0]


def _loss(params, batch, scale):
    """Mean squared error of the retrieved values, and the attention weights ``(batch, items)``."""
    inputs, items, values, targets = batch
    out, weights = jax.vmap(_attend, in_axes=(None, 0, 0, 0, None))(
        params, inputs, items, values, scale
    )
    return jnp.mean((out - targets) ** 2), weights


def _init_params(rng: jax.Array, d_k: int) -> dict[str, jax.Array]:
    # N(0, 1/d_k) entries: projected features keep unit variance, so q·k has variance d_k.
    rng_q, rng_k = jax.random.split(rng)
    std = 1.0 / math.sqrt(d_k)
    return {
        "w_q": std * jax.random.normal(rng_q, (d_k, d_k)),
        "w_k": std * jax.random.normal(rng_k, (d_k, d_k)),
    }


def train(d_k: int, config: DemoConfig, *, progress=None) -> dict[str, dict[str, np.ndarray]]:
    """Part B for one ``d_k``: both variants and all seeds in one program (``jax.vmap``).

    Each seed starts both variants from the same parameters and sees the same data. Returns, per
    variant, per-seed arrays: ``loss``, ``entropy`` (mean row entropy of the weights) and
    ``grad_norm_wq``/``grad_norm_wk``, each averaged over every ``log_every`` steps (shape
    ``(seeds, logs)``), ``eval_loss`` on held-out batches after training (``(seeds,)``) and
    ``steps`` (the middle step of each logged stretch).
    """
    import optax

    optimizer = optax.adam(config.learning_rate)

    def step(carry, rng, scale):
        params, opt_state = carry
        batch = _batch(rng, d_k, config)
        (loss, weights), grads = jax.value_and_grad(_loss, has_aux=True)(params, batch, scale)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        logs = {
            "loss": loss,
            "entropy": jnp.mean(_entropy(weights)),
            "grad_norm_wq": jnp.linalg.norm(grads["w_q"]),
            "grad_norm_wk": jnp.linalg.norm(grads["w_k"]),
        }
        return (optax.apply_updates(params, updates), opt_state), logs

    def run_one(carry, rngs, scale):
        return jax.lax.scan(lambda c, r: step(c, r, scale), carry, rngs)

    @jax.jit
    def run_chunk(carry, rngs, scales):
        # One logged point per chunk: the mean over its steps.
        carry, logs = jax.vmap(run_one)(carry, rngs, scales)
        return carry, jax.tree.map(lambda x: x.mean(axis=1), logs)

    @jax.jit
    def start(seeds):
        params = jax.vmap(lambda s: _init_params(_key(s), d_k))(seeds)
        split = lambda s: jax.random.split(_key(10_000 + s), config.steps)  # noqa: E731
        return (params, jax.vmap(optimizer.init)(params)), jax.vmap(split)(seeds)

    @jax.jit
    def evaluate(params, scales):
        def loss_on(i):  # held-out batches, from keys the training never uses
            batch = _batch(_key(20_000 + i), d_k, config)
            return jax.vmap(lambda p, s: _loss(p, batch, s)[0])(params, scales)

        return jnp.mean(jax.lax.map(loss_on, jnp.arange(8)), axis=0)

    # One row per (variant, seed): the variant sets the scale, the seed the init and the data.
    seeds = jnp.tile(jnp.arange(config.seeds), len(VARIANTS))
    scales = jnp.repeat(jnp.array([scale_for(v, d_k) for v in VARIANTS]), config.seeds)
    carry, data_rngs = start(seeds)
    chunks = config.steps // config.log_every
    history = []
    for i in range(chunks):
        rngs = data_rngs[:, i * config.log_every : (i + 1) * config.log_every]
        carry, logs = run_chunk(carry, rngs, scales)
        history.append(logs)
        if progress is not None:
            progress.update(config.log_every * len(VARIANTS))
    logs = {k: np.stack([np.asarray(h[k]) for h in history], axis=1) for k in history[0]}

    logs["eval_loss"] = np.asarray(evaluate(carry[0], scales))
    return {
        variant: {
            k: x.reshape(len(VARIANTS), config.seeds, *x.shape[1:])[i] for k, x in logs.items()
        }
        | {"steps": (np.arange(chunks) + 0.5) * config.log_every}
        for i, variant in enumerate(VARIANTS)
    }


# --- the whole demo -----------------------------------------------------------------------------


def run(config: DemoConfig, *, show_progress: bool = True) -> dict:
    """Parts A and B for every ``d_k``: the content of ``results.json``, and curves for plots."""
    from tqdm import tqdm

    results: dict = {"d_k": list(config.d_ks), "config": dataclasses.asdict(config)}
    curves: dict = {}
    for variant in VARIANTS:
        results[variant] = {}
    for d_k in config.d_ks:
        for variant, stats in init_statistics(d_k, config).items():
            curves[(d_k, variant)] = {"init_weights": stats.pop("weights")}
            for name, value in stats.items():
                results[variant].setdefault(name, []).append(value)
    total = len(config.d_ks) * len(VARIANTS) * (config.steps // config.log_every) * config.log_every
    with tqdm(total=total, desc="training", unit="step", disable=not show_progress) as progress:
        for d_k in config.d_ks:
            progress.set_postfix(d_k=d_k)
            for variant, out in train(d_k, config, progress=progress).items():
                curves[(d_k, variant)].update(out)
                r = results[variant]
                r.setdefault("final_loss", []).append(float(out["eval_loss"].mean()))
                r.setdefault("final_loss_std", []).append(float(out["eval_loss"].std()))
                r.setdefault("final_entropy", []).append(float(out["entropy"][:, -1].mean()))
                r.setdefault("grad_norm_wq", []).append(float(out["grad_norm_wq"].mean()))
                r.setdefault("grad_norm_wk", []).append(float(out["grad_norm_wk"].mean()))
                r.setdefault("loss_curve", []).append(out["loss"].mean(0).tolist())
                r.setdefault("entropy_curve", []).append(out["entropy"].mean(0).tolist())
    results["steps"] = curves[(config.d_ks[0], VARIANTS[0])]["steps"].tolist()
    results["loss_ratio_unscaled_over_scaled"] = [
        u / s
        for u, s in zip(
            results["unscaled"]["final_loss"], results["scaled"]["final_loss"], strict=True
        )
    ]
    return {"results": results, "curves": curves}


def format_table(results: dict) -> str:
    """The printed summary: one row per d_k, unscaled / scaled for each metric."""
    u, s = results["unscaled"], results["scaled"]
    columns = [
        ("std(q·k)", "std_qk", "{:.2f}"),
        ("max weight", "max_weight", "{:.3f}"),
        ("entropy", "entropy", "{:.2f}"),
        ("‖J_softmax‖", "jacobian_norm", "{:.3f}"),
        ("‖∇W_q‖", "grad_norm_wq", "{:.3g}"),
        ("final loss", "final_loss", "{:.4f}"),
    ]
    header = ["d_k"] + [f"{title} unscaled / scaled" for title, _, _ in columns] + ["loss ratio"]
    rows = []
    for i, d_k in enumerate(results["d_k"]):
        cells = [str(d_k)]
        for _, name, fmt in columns:
            cells.append(f"{fmt.format(u[name][i])} / {fmt.format(s[name][i])}")
        cells.append(f"{results['loss_ratio_unscaled_over_scaled'][i]:.1f}×")
        rows.append(cells)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), separator, *map(line, rows)])


def plot(run_output: dict, out_dir: Path) -> list[Path]:
    """Loss curves, entropy curves, gradient norms vs d_k, and weight heatmaps, as PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, curves = run_output["results"], run_output["curves"]
    d_ks, steps = results["d_k"], results["steps"]
    colors = {"unscaled": "tab:red", "scaled": "tab:blue"}
    paths = []

    for metric, ylabel, name in [
        ("loss", "training loss (MSE)", "loss_curves.png"),
        ("entropy", "mean softmax entropy (nats)", "entropy.png"),
    ]:
        fig, axes = plt.subplots(
            1, len(d_ks), figsize=(4 * len(d_ks), 3.2), sharey=metric == "entropy"
        )
        for ax, d_k in zip(np.atleast_1d(axes), d_ks, strict=True):
            for variant in VARIANTS:
                values = curves[(d_k, variant)][metric]
                ax.plot(steps, values.mean(0), color=colors[variant], label=variant)
                ax.fill_between(
                    steps, values.min(0), values.max(0), color=colors[variant], alpha=0.2
                )
            ax.set_title(f"d_k = {d_k}")
            ax.set_xlabel("step")
            if metric == "loss":
                ax.set_yscale("log")
        np.atleast_1d(axes)[0].set_ylabel(ylabel)
        np.atleast_1d(axes)[0].legend()
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (name, title) in zip(
        axes,
        [
            ("jacobian_norm", "‖softmax Jacobian‖_F at init"),
            ("grad_norm_wq", "mean ‖∇W_q‖ in training"),
        ],
        strict=True,
    ):
        for variant in VARIANTS:
            ax.plot(d_ks, results[variant][name], "o-", color=colors[variant], label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("d_k")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    paths.append(out_dir / "gradient_norms.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, len(d_ks), figsize=(3.2 * len(d_ks), 6.2), squeeze=False)
    for row, variant in enumerate(VARIANTS):
        for col, d_k in enumerate(d_ks):
            ax = axes[row, col]
            image = ax.imshow(
                curves[(d_k, variant)]["init_weights"], vmin=0, vmax=1, cmap="viridis"
            )
            ax.set_title(f"{variant}, d_k = {d_k}")
            ax.set_xlabel("key")
        axes[row, 0].set_ylabel("query")
    fig.suptitle(
        "softmax weights of the same random q, k: before (unscaled) and after scaling by 1/√d_k"
    )
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    paths.append(out_dir / "weights_heatmaps.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point; returns the results dictionary written to ``results.json``."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_sdpa.demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=Path("demo_out"), help="output folder (default: demo_out)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few-second run (d_k ≤ 256, 150 steps)"
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="training seeds to average (default: 3)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1; got {args.seeds}")
    config = DemoConfig.quick(args.seeds) if args.quick else DemoConfig(seeds=args.seeds)

    start = time.perf_counter()
    output = run(config, show_progress=not args.no_progress)
    results = output["results"]
    results["wall_time_s"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    paths = plot(output, args.out)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))

    print(
        f"\nWhy scale by 1/√d_k — {config.seeds} seeds, {config.steps} Adam steps, queries of "
        f"{config.n_items} items with noise {config.noise}:\n"
    )
    print(format_table(results))
    print(
        "\nstd(q·k) (of the scores entering the softmax), max weight, entropy and ‖J_softmax‖ are "
        f"measured at initialisation on {config.init_queries} unit-normal queries, each with "
        f"{config.n_items} keys (uniform entropy = {math.log(config.n_items):.2f}). ‖∇W_q‖ is the "
        "mean over training: larger unscaled, because unscaled scores grow with |W_q|·|W_k|, while "
        "the softmax Jacobian they pass through shrinks. Final loss is the held-out MSE averaged "
        "over seeds."
    )
    print(
        f"\nwrote {', '.join(p.name for p in paths)} and results.json to {args.out}/ "
        f"in {results['wall_time_s']:.1f} s"
    )
    return results


if __name__ == "__main__":
    main()
