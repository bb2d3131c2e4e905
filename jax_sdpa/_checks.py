"""Argument checks shared by the public entry points.

They run on static shapes and dtypes at trace time and raise ``ValueError`` (shape, rank, value)
or ``TypeError`` (dtype) with one sentence: the argument in backticks, what was expected, what was
given. Never ``assert``: asserts vanish under ``python -O`` and print nothing useful.
"""

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np


def check_float(name: str, x) -> None:
    """``x`` must have a floating-point dtype."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`{name}` must have a floating-point dtype; got {x.dtype}.")


def check_integer(name: str, x) -> None:
    """``x`` must have an integer dtype."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"`{name}` must have an integer dtype; got {x.dtype}.")


def check_same_dtype(names: Sequence[str], arrays: Sequence) -> None:
    """All ``arrays`` must share one dtype (no silent promotion)."""
    dtypes = [x.dtype for x in arrays]
    if len(set(dtypes)) > 1:
        given = ", ".join(f"`{n}` {d}" for n, d in zip(names, dtypes, strict=True))
        raise TypeError(
            f"{', '.join(f'`{n}`' for n in names)} must have the same dtype "
            f"(cast them, or pass `dtype=`); got {given}."
        )


def check_ndim(name: str, x, ndims: Sequence[int], what: str) -> None:
    """``x.ndim`` must be one of ``ndims``; ``what`` names the axes, e.g. ``(seq, dim)``."""
    if x.ndim not in ndims:
        expected = " or ".join(str(n) for n in ndims)
        raise ValueError(f"`{name}` must have rank {expected} {what}; got shape {x.shape}.")


def check_equal(what: str, names: tuple[str, str], values: tuple) -> None:
    """Two sizes that must agree, e.g. the key and value sequence lengths."""
    a, b = values
    if a != b:
        raise ValueError(
            f"`{names[0]}` and `{names[1]}` must have the same {what}; got {a} and {b}."
        )


def check_shape(name: str, x, shape: tuple[int, ...], what: str) -> None:
    """``x.shape`` must be exactly ``shape``."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {what} = {tuple(shape)}; got {tuple(x.shape)}.")


def check_broadcastable(name: str, x, target: tuple[int, ...], what: str) -> None:
    """``x`` (rank at most ``len(target)``) must broadcast to ``target``, dim by dim 1 or equal."""
    shape = tuple(x.shape)
    padded = (1,) * (len(target) - len(shape)) + shape
    if len(shape) > len(target) or any(
        s not in (1, t) for s, t in zip(padded, target, strict=True)
    ):
        raise ValueError(f"`{name}` must broadcast to {what} = {tuple(target)}; got {shape}.")


def check_range(name: str, value, lo: float, hi: float, *, hi_open: bool = True) -> None:
    """A concrete number in ``[lo, hi)`` (or ``[lo, hi]``)."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be a Python number; got {type(value).__name__}.")
    if not (lo <= value < hi if hi_open else lo <= value <= hi):
        bracket = ")" if hi_open else "]"
        raise ValueError(f"`{name}` must be in [{lo}, {hi}{bracket}; got {value}.")


def check_choice(name: str, value, choices: Sequence) -> None:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}; got {value!r}.")


def check_positive_int(name: str, value) -> None:
    """A Python int ≥ 1 (a static size: a length, a tile)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be a positive int; got {value!r}.")
    if value < 1:
        raise ValueError(f"`{name}` must be a positive int; got {value!r}.")


STRIPED = "for layout='striped' (two chunks per device)"


def check_equal_parts(name: str, length: int, parts: int, what: str, where: str) -> None:
    """The one rule of sharding a sequence (or batch, or heads): ``parts`` equal parts.

    With ``layout="striped"`` each device holds two chunks, so a ring of ``P`` devices needs
    ``2P`` chunks; ``where`` says which mesh axis or layout asks for the parts.
    """
    if length % parts:
        raise ValueError(
            f"`{name}` must split its {what} into {parts} equal parts {where}; got {what} {length}."
        )


def check_heads(heads: int, kv_heads: int) -> None:
    """GQA: the query heads must be a whole number of groups, one per key/value head."""
    if heads % kv_heads:
        raise ValueError(
            f"The number of query heads must be a multiple of the key/value heads; got "
            f"{heads} query heads and {kv_heads} key/value heads."
        )


def static_float(name: str, value) -> float:
    """A Python number (static under ``jax.jit``), e.g. ``scale``."""
    if isinstance(value, (bool, str)):
        raise TypeError(f"`{name}` must be a Python float; got {type(value).__name__}.")
    try:
        return float(value)
    except TypeError:
        raise TypeError(
            f"`{name}` must be a Python float (a static value); got {type(value).__name__}."
        ) from None
