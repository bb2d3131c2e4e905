"""The demo's sizes and the helpers every part shares (its two variants are the package's)."""

import dataclasses

import numpy as np

import jax_sdpa

from . import VARIANTS, Variant


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes of the experiment (:meth:`quick` shrinks the training, not the task).

    Attributes:
        d_ks: The head dimensions compared, one compiled training program each.
        seeds: Training runs per variant and ``d_k``: initial parameters and batch order.
        steps: Adam steps per run, a multiple of ``log_every``.
        log_every: Training logs are averaged over stretches of this many steps.
        d_model: Features of an item (and of the query) before projection.
        n_items: Dictionary size: keys per query.
        d_v: Features of a value.
        batch: Examples (dictionary and query) per step.
        noise: Standard deviation of the noise added to the query's item.
        learning_rate: Adam's learning rate.
        eval_batches: Held-out batches on which the trained models are scored.
        init_queries: Queries (each with its own keys) measured at initialisation.
        normalizer: How scores become weights in training: ``"softmax"`` (the lesson), or
            ``"sigmoid"``, :func:`jax_sdpa.sigmoid_weights` with its default bias ``−log n_items``
            (notebook 07).
        qk_clip: If set, QK-Clip's threshold τ: after each step the projections are rescaled
            so that the step's largest logit would be at most τ (:func:`jax_sdpa.qk_clip`).
    """

    d_ks: tuple[int, ...] = (16, 64, 256, 1024)
    seeds: int = 8
    steps: int = 300
    log_every: int = 10
    d_model: int = 64
    n_items: int = 16
    d_v: int = 16
    batch: int = 64
    noise: float = 0.5
    learning_rate: float = 1e-3
    eval_batches: int = 8
    init_queries: int = 512
    normalizer: str = "softmax"
    qk_clip: float | None = None

    def __post_init__(self):
        if not (
            isinstance(self.d_ks, tuple)
            and self.d_ks
            and all(isinstance(d_k, int) and d_k > 0 for d_k in self.d_ks)
        ):
            raise ValueError(
                f"`d_ks` must be a non-empty tuple of positive integers; got {self.d_ks!r}."
            )
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("d_ks", "noise", "normalizer", "qk_clip"):
                continue
            if not value > 0:
                raise ValueError(f"`{field.name}` must be positive; got {value}.")
        if self.normalizer not in ("softmax", "sigmoid"):
            raise ValueError(
                f"`normalizer` must be 'softmax' or 'sigmoid'; got {self.normalizer!r}."
            )
        if self.qk_clip is not None and not self.qk_clip > 0:
            raise ValueError(f"`qk_clip` must be positive or None; got {self.qk_clip}.")
        if self.noise < 0:
            raise ValueError(f"`noise` must be at least 0; got {self.noise}.")
        if self.steps % self.log_every:
            raise ValueError(
                f"`steps` must be a multiple of `log_every` = {self.log_every}; got {self.steps}."
            )

    @classmethod
    def quick(cls, seeds: int = 3) -> "DemoConfig":
        """A short run for the test suite: the same task, fewer ``d_k``, seeds and steps.

        Args:
            seeds: Training runs per variant and ``d_k``.

        Returns:
            ``d_ks = (16, 64, 256)``, 150 steps logged every 25, the other sizes as by default.
        """
        return cls(d_ks=(16, 64, 256), seeds=seeds, steps=150, log_every=25)


# Random inputs come from NumPy, drawn before the compiled programs run: on a CPU, XLA took
# longer to compile jax.random's generators than the training step, and to run them than to train
# at d_k ≤ 256. Each use has a stream of its own, np.random.default_rng([use, seed]).
_INIT_STATISTICS, _EXAMPLES, _PARAMS, _ORDER, _ANIMATION = range(5)


def _normal(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


def scale_for(variant: Variant, d_k: int) -> float:
    """The factor a variant multiplies its raw scores by.

    Args:
        variant: ``"unscaled"`` or ``"scaled"``.
        d_k: The head dimension.

    Returns:
        ``1/√d_k`` (:func:`jax_sdpa.default_scale`) for ``"scaled"``, ``1.0`` for ``"unscaled"``.

    Raises:
        ValueError: If ``variant`` is neither.
    """
    match variant:
        case "scaled":
            return jax_sdpa.default_scale(d_k)
        case "unscaled":
            return 1.0
    raise ValueError(f"`variant` must be one of {VARIANTS}; got {variant!r}.")


def spread(per_seed, *, axis: int = 0) -> dict:
    """The median over seeds and their range.

    Args:
        per_seed: One entry (or row) per seed along ``axis``.
        axis: The axis of the seeds.

    Returns:
        The ``"median"``, ``"min"`` and ``"max"`` over ``axis``, as plain Python numbers for a
        1-D ``per_seed`` and as nested lists otherwise, ready for JSON either way.

    Examples:
        >>> spread([3.0, 1.0, 2.0])
        {'median': 2.0, 'min': 1.0, 'max': 3.0}
        >>> spread([[1.0, 10.0], [3.0, 30.0]])["median"]
        [2.0, 20.0]
    """
    per_seed = np.asarray(per_seed)
    return {
        name: reduce(per_seed, axis=axis).tolist()
        for name, reduce in (("median", np.median), ("min", np.min), ("max", np.max))
    }
