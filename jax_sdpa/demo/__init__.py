r"""Why attention divides by √d_k, measured.

Run ``python -m jax_sdpa.demo [--out DIR] [--quick] [--seeds N]``.

**Part A, at initialisation.** With unit-variance queries and keys, :math:`q \cdot k` has variance
:math:`d_k`. Unscaled, the scores grow like :math:`\sqrt{d_k}`, the softmax saturates towards
one-hot, and its Jacobian :math:`\mathrm{diag}(p) - p p^\top` — the factor every gradient through
the attention weights is multiplied by — shrinks. Scaled by :math:`1/\sqrt{d_k}`, all of it stays
put as ``d_k`` grows (Vaswani et al. 2017, §3.2.1 and footnote 4).

**Part B, training.** A retrieval task that attention must solve: each example is a dictionary
of 16 random items :math:`x_j \in \mathbb{R}^{d_\text{model}}` with random values and a query that
is one of the items plus noise; the target is that item's value. The task is the same for every
``d_k``; only the head dimension changes. The model learns
:math:`W_q, W_k \in \mathbb{R}^{d_\text{model} \times d_k}`, initialised so that projected features
have about unit variance: :math:`q \cdot k` then has a variance of about :math:`1.25\, d_k` (the
query is an item plus noise), near Part A's :math:`d_k`. Per example, with jax_sdpa's steps
``jax.vmap``-ed over the batch, it computes ::

    weighted_sum(softmax_weights(scale_scores(raw_scores(x W_q W_kᵀ, X), scale)), V)

with ``scale = 1/√d_k`` or ``scale = 1``, trained by Optax's Adam. Those raw scores are the
textbook :math:`(x W_q) \cdot (x_j W_k)`, grouped as :math:`(x W_q W_k^\top) \cdot x_j`: the same
numbers for one product by :math:`W_k^\top` per example instead of one by :math:`W_k` per item.
For one ``d_k``, every seed and both variants are one program: the training loop is a ``lax.scan``,
``jax.vmap``-ed over the variants (the scale) and the seeds (the initial parameters and the order
of the batches), compiled once by ``jax.jit``. Each ratio between the variants is taken seed by
seed and reported as its median and range over the seeds. The ratio of the gradient norms
:math:`\|\nabla W_q\|` is reported divided by :math:`\sqrt{d_k}`: the scores are
:math:`c\, (x W_q) \cdot k` with :math:`c` the scale, so the chain rule puts :math:`c` into
:math:`\nabla W_q`, and unscaled over scaled that factor alone is :math:`\sqrt{d_k}`, whatever the
softmax does (a constant factor that Adam's normalised steps ignore anyway). What remains stays
of order 1: averaged over a batch, the gradient through the softmax does not vanish, though the
typical example's does (notebook 02, section 4); the loss ratio shows what that costs.

**The weighted sum, animated.** ``weighted_sum.gif`` builds one output row term by term,
:math:`o = \sum_j w_j v_j`, the largest weight first, each partial sum computed by
:func:`jax_sdpa.weighted_sum`.

The demo prints two tables and writes PNG plots, the GIF and ``results.json`` to ``--out``.

One module per part: the sizes (``_config``), Part A (``_initialisation``), Part B
(``_training``), the run and its tables (``_report``), the figures (``_figures``), the animation
(``_animation``) and the command line (``__main__``). The package imports a module only when
one of its names is first used (:pep:`562`), so ``import jax_sdpa.demo`` and
``from jax_sdpa.demo import DemoConfig`` need neither Optax, tqdm nor Matplotlib, which the
modules that use them import at their top.
"""

import importlib
import typing
from typing import Literal

# Defined here rather than in _config: Sphinx reads a name's #: description only from the module
# the API page documents it in.

#: A variant's name: ``"unscaled"`` (scores times 1) or ``"scaled"`` (times 1/√d_k).
Variant = Literal["unscaled", "scaled"]

#: The two models compared, whose raw scores are multiplied by 1 and by :math:`1/\sqrt{d_k}`.
VARIANTS: tuple[Variant, ...] = typing.get_args(Variant)

# Each module and the public names it defines, in the order of the API page.
_NAMES_BY_MODULE = {
    "_config": ("DemoConfig", "scale_for", "spread"),
    "_initialisation": ("init_statistics",),
    "_training": ("Batches", "draw_examples", "init_params", "batch_order", "train_model", "train"),
    "_report": ("run", "format_tables"),
    "_figures": ("plot_median_and_range", "figures", "plot"),
    "_animation": (
        "weighted_sum_example",
        "running_sums",
        "weighted_sum_animation",
        "save_weighted_sum_gif",
    ),
    "__main__": ("main",),
}
_MODULE_OF = {name: module for module, names in _NAMES_BY_MODULE.items() for name in names}

__all__ = ["VARIANTS", "Variant", *_MODULE_OF]


def __getattr__(name: str):
    """Imports the module that defines a public ``name`` and returns the name's object."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # later look-ups find it without coming here
    return value


def __dir__() -> list[str]:
    """The module's attributes, the public names not imported yet included."""
    return sorted({*globals(), *__all__})
