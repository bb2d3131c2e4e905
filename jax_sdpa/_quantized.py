r"""Quantized KV caches: keys and values stored in 8 bits, with the scales that restore them.

A cache array ``x`` ``(..., S, K, H)`` is kept as :math:`x \approx q \cdot s`: ``q`` of 8 bits
and ``s`` a float scale, symmetric about 0 (vLLM, FlashInfer, FlashAttention-3's FP8):

* ``"int8"``: one scale per token and key/value head, :math:`s = \max_h |x_h| / 127`, and
  :math:`q = \mathrm{round}(x / s)`: each element is off by at most :math:`s/2`, a relative
  :math:`2^{-8}` of its row's largest.
* ``"float8_e4m3fn"``: one scale per key/value head, :math:`s = \max |x| / 448` over the whole
  cache (every sequence, token and feature of the head),
  and ``q`` the float8 nearest :math:`x / s`: 3 mantissa bits, a relative error of at most
  :math:`2^{-4}` per element (down to :math:`2^{-6} s`, float8's smallest normal, below which the
  error is at most :math:`2^{-10} s`). The scale is the cache's: a writer quantizes new tokens
  with it, so it must cover them (pass ``scale=`` from a calibration, as vLLM does); larger ones
  saturate at :math:`\pm 448 s`.

The attention reads ``q`` and ``s``, never a float copy of the cache: ``s`` leaves the products,
:math:`q_i \cdot (s_j k_j) = s_j (q_i \cdot k_j)` and :math:`\sum_j w_{ij} (s_j v_j) = \sum_j
(w_{ij} s_j) v_j`, so the scores are scaled after the product of the 8-bit keys and the weights
before the blend with the 8-bit values (:func:`keys_product`, :func:`values_product`: the decode
path's products and the Mosaic GPU kernel's tiles). The results are those of the dequantized
cache :math:`q \cdot s`, to float32 rounding.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from jax_sdpa import _checks

__all__ = ["Quantized", "quantize"]

Format = Literal["int8", "float8_e4m3fn"]
# The 8-bit dtype of each format, its largest value, and whether its scale is per token.
_FORMATS = {
    "int8": (jnp.int8, 127.0, True),
    "float8_e4m3fn": (jnp.float8_e4m3fn, 448.0, False),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    r"""A cache array stored as 8-bit ``values`` times a float ``scale``: :math:`x \approx q s`.

    Passed wherever a key or value cache is (decode shapes of
    :func:`~jax_sdpa.dot_product_attention`, the pools of :func:`~jax_sdpa.paged_attention`,
    the cache writers). ``shape`` and ``ndim`` are the values'; ``dtype`` is the scale's, the
    float dtype the cache stands for (the queries must have it).

    Attributes:
        values: ``(..., S, K, H)``, ``int8`` or ``float8_e4m3fn``.
        scale: ``(..., S, K, 1)`` (a scale per token and head) or ``(1, ..., 1, K, 1)`` (one per
            head, shared by the batch and the tokens: fixed when the cache is made).
    """

    values: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def format(self) -> Format:
        """``"int8"`` or ``"float8_e4m3fn"``, from the values' dtype."""
        return jnp.dtype(self.values.dtype).name

    @property
    def per_token_scale(self) -> bool:
        """Whether the format keeps a scale per token (int8), not one per head (float8)."""
        return _FORMATS[self.format][2]

    def dequantize(self, dtype=None) -> Array:
        """The float array the cache stands for, ``values · scale`` (a full copy: for checks).

        In ``dtype``, the scale's by default.
        """
        dtype = self.dtype if dtype is None else dtype
        return self.values.astype(dtype) * self.scale.astype(dtype)

    def per_token(self) -> "Quantized":
        """The same cache with its scale broadcast to one per token (free inside ``jit``)."""
        return Quantized(self.values, jnp.broadcast_to(self.scale, (*self.shape[:-1], 1)))


def quantize(x: ArrayLike, format: Format = "int8", *, scale: ArrayLike | None = None) -> Quantized:
    r"""``x`` ``(..., S, K, H)`` stored in 8 bits, symmetric: :math:`q = x / s`, rounded.

    Args:
        x: A float cache array, keys or values: ``(..., S, K, H)``.
        format: ``"int8"`` (a scale per token and head, :math:`\max_h |x| / 127`) or
            ``"float8_e4m3fn"`` (a scale per head, :math:`\max |x| / 448` over the rest).
        scale: The scale to use instead, broadcastable to the format's scale shape (for float8,
            one that covers the tokens the cache will hold: values beyond saturate).

    Returns:
        A :class:`Quantized` of ``x``'s shape whose scale has ``x``'s dtype. An all-zero row
        (or head) gets the scale 1, so that it reads back as zeros.

    Raises:
        ValueError: On an unknown format, ``x`` of rank below 3, or a scale of the wrong shape.
        TypeError: On a non-float ``x`` or ``scale``.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([[[[0.5, -1.0, 0.25]]]])  # (batch, S, K, H) = (1, 1, 1, 3)
        >>> cache = quantize(x)
        >>> cache.values[0, 0, 0], cache.scale[0, 0, 0]
        (Array([  64, -127,   32], dtype=int8), Array([0.00787402], dtype=float32))
        >>> bool(jnp.abs(cache.dequantize() - x).max() <= cache.scale.max() / 2)
        True
    """
    _checks.check_choice("format", format, tuple(_FORMATS))
    x = jnp.asarray(x)
    if x.ndim < 3:
        raise ValueError(
            f"`x` must have rank 3 or more (..., kv_seq, kv_heads, d); got shape {x.shape}."
        )
    _checks.check_float("x", x)
    dtype, largest, per_token = _FORMATS[format]
    shape = scale_shape(x.shape, per_token)
    if scale is None:
        axes = (-1,) if per_token else tuple(a for a in range(x.ndim) if a != x.ndim - 2)
        peak = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
        scale = jnp.where(peak > 0, peak / largest, 1).astype(x.dtype)
    else:
        scale = jnp.asarray(scale)
        _checks.check_float("scale", scale)
        _checks.check_broadcastable("scale", scale, shape, str(shape))
        scale = jnp.broadcast_to(scale.astype(x.dtype), shape)
    return Quantized(_stored(x, scale, dtype, largest), scale)


def keys_product(product, query, key, per_key):
    r"""``product(query, key)`` of a key block, quantized or not.

    Quantized: :math:`q \cdot (s k) = s (q \cdot k)`, the 8-bit keys in the product and
    ``per_key(scale)`` (their scales laid out along its keys) on its result.
    """
    if not isinstance(key, Quantized):
        return product(query, key)
    return product(query, key.values) * per_key(key.scale)


def values_product(product, weights, value, per_key):
    r"""``product(weights, value)`` of a value block, quantized or not.

    Quantized: :math:`\sum_j w_j (s_j v_j) = \sum_j (w_j s_j) v_j`, ``per_key(scale)`` on the
    weights and the 8-bit values in the product.
    """
    if not isinstance(value, Quantized):
        return product(weights, value)
    return product(weights * per_key(value.scale), value.values)


def per_token(cache):
    """A quantized cache with its scale broadcast to one per token; anything else as it is."""
    return cache.per_token() if isinstance(cache, Quantized) else cache


def scale_shape(shape: tuple[int, ...], per_token: bool) -> tuple[int, ...]:
    """The scale's shape for a cache of ``shape``: one per token and head, or one per head."""
    return (*shape[:-1], 1) if per_token else (*(1,) * (len(shape) - 2), shape[-2], 1)


def quantize_like(cache: Quantized, x: ArrayLike) -> Quantized:
    """New rows ``x`` ``(..., T, K, H)`` for ``cache``, in its format (float8: with its scale)."""
    x = jnp.asarray(x).astype(cache.dtype)
    if not cache.per_token_scale:  # a scale per head, fixed when the cache was made
        return Quantized(_stored(x, cache.scale, *_FORMATS[cache.format][:2]), cache.scale)
    return quantize(x, cache.format)


def _stored(x: Array, scale: Array, dtype, largest: float) -> Array:
    """:math:`x / s` in the 8-bit ``dtype``: rounded (int8) or cast (float8), clipped."""
    q = jnp.clip(x / scale, -largest, largest)
    return (jnp.round(q) if jnp.issubdtype(dtype, jnp.integer) else q).astype(dtype)
