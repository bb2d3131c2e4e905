"""The public functions' keywords, in groups, written once (:mod:`jax_sdpa._dot_product`).

The TypedDicts type the overloads', the sharded ring's and the ragged cache's ``**keywords``;
the functions still spell their keywords out (``tests/test_signatures.py`` keeps both in step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypedDict

from jax import lax
from jaxtyping import ArrayLike

from jax_sdpa._masks import MaskRule
from jax_sdpa._tunables import Paged, Pallas, Ring

CausalAlignment = Literal["top_left", "bottom_right"]
Normalizer = Literal["softmax", "sigmoid"]


# The keyword vocabulary, in groups, written once for the overloads and **keywords. The functions
# themselves still spell their keywords out: flax linen passes an `attention_fn` only the
# keywords `inspect.signature` shows, and tests/test_signatures.py keeps both in step.
class _Formula(TypedDict, total=False):
    """What each score becomes before the softmax, and the precision of the two products."""

    scale: float | None
    logits_soft_cap: float | None
    score_mod: Callable | None
    mask_mod: Callable | MaskRule | None
    sinks: ArrayLike | None
    normalizer: Normalizer
    sigmoid_bias: ArrayLike | float | None
    precision: lax.PrecisionLike


class _Masks(TypedDict, total=False):
    """The built-in masks that need no array."""

    is_causal: bool
    causal_alignment: CausalAlignment
    local_window_size: int | tuple[int, int] | None


class _Lengths(TypedDict, total=False):
    """Each sequence's lengths (the ring's are global, and its sharded call places them)."""

    query_seq_lengths: ArrayLike | None
    key_value_seq_lengths: ArrayLike | None


class _Segments(TypedDict, total=False):
    """Packed sequences (not on the ring)."""

    query_segment_ids: ArrayLike | None
    key_value_segment_ids: ArrayLike | None


class _Flax(TypedDict, total=False):
    """Flax's ``attention_fn`` keywords: dropout, dtypes, the module to sow the weights into."""

    broadcast_dropout: bool
    dropout_rng: ArrayLike | None
    dropout_rate: float
    deterministic: bool
    dtype: Any
    module: Any
    force_fp32_for_softmax: bool


class _FlaxAccepted(TypedDict, total=False):
    """Flax keywords that only :func:`dot_product_attention` takes, so that linen passes them."""

    qk_attn_weights_einsum: Callable | None
    attn_weights_value_einsum: Callable | None


class WeightsKeywords(_Formula, _Masks, _Lengths, _Segments, _Flax):
    """The keywords of :func:`dot_product_attention_weights`."""


class _Selection(TypedDict, total=False):
    """The keys each query attends to, gathered (only :func:`dot_product_attention`)."""

    key_indices: ArrayLike | None


class Keywords(WeightsKeywords, _FlaxAccepted, _Selection):
    """:func:`dot_product_attention`'s keywords but ``return_residual`` and ``implementation``."""


class RingKeywords(_Formula, _Masks, total=False):
    """What :func:`jax_sdpa.ring_dot_product_attention` passes on to :func:`ring_attention`."""

    implementation: Ring | Pallas | Literal["pallas"] | None


class PagedKeywords(TypedDict, total=False):
    """What :func:`jax_sdpa.ragged_paged_attention` passes on to :func:`paged_attention`."""

    scale: float | None
    is_causal: bool
    local_window_size: int | tuple[int, int] | None
    logits_soft_cap: float | None
    sinks: ArrayLike | None
    normalizer: Normalizer
    sigmoid_bias: ArrayLike | float | None
    return_residual: bool
    return_max_scores: bool
    implementation: Paged | None
