r"""The public front end: bind the arguments once, dispatch to an implementation, return.

:func:`dot_product_attention` (a drop-in for ``jax.nn.dot_product_attention`` and a flax
``attention_fn``), :func:`dot_product_attention_weights` (flax's) and :func:`ring_attention` (one
sequence over the devices of a mesh axis) check their arguments with
:func:`jax_sdpa._arguments.bind` and run the implementation it chooses from the table in
:mod:`jax_sdpa._implementations`: ``"xla"`` maps the dense single-head composition over heads
and batch (``jax.vmap``); ``"chunked"`` runs the online softmax over tiles that cover all heads,
with its own backward; ``"decode"`` reads a long key/value cache in chunks for a few queries
(``"paged"`` through a page table, :mod:`jax_sdpa._paged`); ``"selected"`` gathers each
query's listed keys; ``"pallas"`` runs the tiles as fused kernels; the ring passes the tiles'
keys from device to device; ``"cudnn"`` hands the call to ``jax.nn``'s fused kernel.

Shape letters (as ``jax.nn.dot_product_attention``)::

    B = batch size (any number of leading batch axes is accepted; also none: TNH)
    T = query length                S = key/value length
    N = query heads                 K = key/value heads, G = N // K query heads share one
    H = query/key features (d_k)    V = value features (d_v)

Query head ``n`` uses key/value head ``n // G`` (GQA; MQA when ``K = 1``): keys and values are
never copied ``G`` times.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float

from jax_sdpa._arguments import bind
from jax_sdpa._implementations import Implementation, check_implementation, run
from jax_sdpa._keywords import CausalAlignment, Keywords, Normalizer, RingKeywords
from jax_sdpa._masks import MaskRule
from jax_sdpa._ring_spec import Layout
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._tunables import Chunked, Decode, Pallas, Ring, Selected

if TYPE_CHECKING:  # Python 3.10's typing has no Unpack; typing_extensions is no dependency
    from typing_extensions import Unpack

__all__ = ["dot_product_attention", "dot_product_attention_weights", "ring_attention"]


@overload
def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: Literal[False] = False,
    return_max_scores: Literal[False] = False,
    implementation: Implementation | Chunked | Decode | Selected | Pallas | None = None,
    **keywords: Unpack[Keywords],
) -> Array: ...


@overload
def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: Literal[True],
    return_max_scores: Literal[False] = False,
    implementation: Implementation | Chunked | Decode | Selected | Pallas | None = None,
    **keywords: Unpack[Keywords],
) -> tuple[Array, Array]: ...


@overload
def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: bool = False,
    return_max_scores: Literal[True],
    implementation: Implementation | Chunked | Decode | Selected | Pallas | None = None,
    **keywords: Unpack[Keywords],
) -> tuple[Array, ...]: ...


def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation | Chunked | Decode | Selected | Pallas | None = None,
    return_residual: bool = False,
    return_max_scores: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    logits_soft_cap: float | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | MaskRule | None = None,
    sinks: ArrayLike | None = None,
    normalizer: Normalizer = "softmax",
    sigmoid_bias: ArrayLike | float | None = None,
    key_indices: ArrayLike | None = None,
    query_segment_ids: ArrayLike | None = None,
    key_value_segment_ids: ArrayLike | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: ArrayLike | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: lax.PrecisionLike = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Callable | None = None,
    attn_weights_value_einsum: Callable | None = None,
) -> Float[Array, "*batch q_seq heads d_v"] | tuple[Array, ...]:
    r"""Scaled dot-product attention over heads and batch; a drop-in for ``jax.nn``'s.

    .. math:: \mathrm{Attention}(Q, K, V) = \mathrm{softmax}\Big(
        \text{scale} \cdot Q K^\top + \text{bias}\Big)_{\text{mask}} V

    computed for each head as :func:`jax_sdpa.attention` does. ``"xla"`` maps those steps over
    heads and batch with ``jax.vmap``; the tiled paths (``"chunked"``, ``"decode"``) map the heads
    inside each tile, and the batch with ``jax.vmap`` (``"chunked"``: with ``lax.map``, one
    sequence at a time, when a mask rule's tiles are classified from data). Every call that
    ``jax.nn.dot_product_attention`` accepts means the same here, with one documented difference:
    a query with no allowed key (fully masked, padded, or a bias row of −∞) outputs **zeros** with
    zero gradients, as PyTorch, FlashAttention and FlexAttention do, where ``jax.nn`` outputs the
    mean of the values (zeros only past ``query_seq_lengths``, NaN for the −∞ bias row).

    Args:
        query: ``(B, T, N, H)``, or ``(T, N, H)``, or any number of leading batch axes.
        key: ``(B, S, K, H)`` with ``N % K == 0`` (GQA: query head ``n`` uses key/value head
            ``n // (N // K)``), or a quantized cache (:func:`~jax_sdpa.quantize`), which the
            ``"decode"`` and ``"selected"`` implementations read.
        value: ``(B, S, K, V)``; ``V`` may differ from ``H``. Quantized, or not, as ``key``.
            Or :class:`~jax_sdpa.LatentValues` ``(V)``: the values are ``key[..., :V]`` (MLA's
            shared latent cache), read once with the keys on the decode paths.
        bias: Additive bias broadcastable to ``(B, N, T, S)`` (rank ≤ 4 is left-padded), added
            to the scaled scores.
        mask: Mask broadcastable to ``(B, N, T, S)``; ``True`` (or nonzero, as flax) = may attend.
        scale: Factor on ``Q Kᵀ``; ``None`` means ``1/√H``.
        is_causal: Query ``i`` attends keys ``j <= i`` (shifted by ``S - T`` when
            ``causal_alignment="bottom_right"``).
        query_seq_lengths: ``(B,)`` integers; queries at or past the length output 0.
        key_value_seq_lengths: ``(B,)`` integers; keys at or past the length are masked.
        local_window_size: ``(left, right)`` inclusive window around the diagonal, or an int for
            both.
        implementation: A name, or an implementation's tunables (:class:`~jax_sdpa.Chunked`,
            :class:`~jax_sdpa.Decode`, :class:`~jax_sdpa.Pallas`, …). ``"xla"``: the dense
            computation, which forms the ``(T, S)`` scores;
            ``"chunked"``: exact attention in memory linear in ``T`` (online softmax over key
            blocks, its own backward, wholly masked blocks skipped); ``"decode"``: a few queries
            against a long cache, keys split into chunks and read once as they lie (forward only:
            its gradient is the chunked path's); ``None``: on a GPU (sm_80 or later), cuDNN
            first where its result is ours (float16 or bfloat16, ``d_k = d_v ≤ 128``, no array
            mask, bias, lengths or ``precision``, a window only with a causal mask and ``T = S``,
            no log-sum-exp returned, no outer derivative); then decode for ``N·T ≤ 64``
            query rows against ``S ≥ 1024`` keys, else chunked on CPU (the faster there at every
            size measured), dense on accelerators while ``B·N·T·S ≤ 2^24``; dense wherever the
            weights are needed, and under ``jax.jvp``/``jax.jacfwd`` of the call (the other
            paths have their own backward pass, reverse mode only: asked for, they raise a
            ``TypeError``); ``"cudnn"`` hands the call to
            ``jax.nn.dot_product_attention(implementation="cudnn")`` on a GPU.
        return_residual: Also return the log-sum-exp of each row's scores, shape ``(B, T, N)``, in
            at least float32 (``jax.nn`` returns it in the input dtype); −∞ for a row with no key.
            Differentiable (not with ``"cudnn"``, whose backward drops it);
            :func:`jax_sdpa.merge_attention` joins such pairs.
        return_max_scores: Also return each row's largest logit, ``(B, T, N)`` in at least
            float32: the max of the scores the normaliser sees (after scale, soft cap, bias and
            ``score_mod``) over the keys the row may attend, −∞ for a row with none; not the
            sinks'. Not differentiated (a statistic to watch, as FlexAttention's
            ``AuxRequest(max_scores=True)``, or to clip: :func:`jax_sdpa.qk_clip`).
        causal_alignment: ``"top_left"`` (``jax.nn``, PyTorch) or ``"bottom_right"`` (the last
            query sees the last key: KV-cache decoding, FlashAttention). Shifts the window too.
        logits_soft_cap: If set, scores become ``cap · tanh(scores / cap)`` before the bias.
        score_mod: ``score_mod(score, batch, head, q_idx, kv_idx) -> score`` on scalars (the
            library maps it over every entry): a new logit from the one the softmax would see
            (after scale, soft cap and bias), the sequence's index in the batch, the query head
            and the global positions. Gradients reach the arrays it closes over.
        mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` on scalars (``True`` = may
            attend), a :class:`~jax_sdpa.MaskRule`, or a :class:`~jax_sdpa.BlockMask` from
            :func:`~jax_sdpa.create_block_mask` (its tiles classified ahead); ANDed with every
            other mask argument.
        sinks: ``(N,)``, one logit per query head for a virtual key without a value that joins
            every row's softmax (attention sinks); the log-sum-exp includes it.
        normalizer: ``"softmax"``, or ``"sigmoid"``: each weight :math:`\sigma(s + b)` on its
            own, rows not normalised (sigmoid attention, :func:`~jax_sdpa.sigmoid_weights`);
            the residual is then the log of each row's total weight, and ``sinks`` are refused.
        sigmoid_bias: The sigmoid's :math:`b`, a scalar or one per query head ``(N,)``; by
            default :math:`-\log S`, ``S`` the sequence's keys (its ``key_value_seq_lengths``
            if given; masks do not change it), so that a row of near-zero scores sums to about
            1. A constant: no gradient reaches it.
        key_indices: ``(B, T, k)`` integers: query ``t`` attends only to the keys it lists
            (DeepSeek Sparse Attention's top-k), gathered, not masked: its cost is that of
            ``k`` keys (``implementation="selected"``; :class:`~jax_sdpa.Selected`). Shared by
            the heads; repeats count once; the call's masks and mods still apply. Refused out
            of ``[0, S)`` when concrete; under ``jit`` such an index is masked.
        query_segment_ids: ``(B, T)`` integers for packed sequences: a query sees only keys with
            the same id.
        key_value_segment_ids: ``(B, S)``; defaults to ``query_segment_ids`` when ``S == T``.
        broadcast_dropout: Use one dropout mask for every batch element and head (flax).
        dropout_rng: PRNG key for dropout.
        dropout_rate: Probability of dropping an attention weight, in ``[0, 1)``.
        deterministic: If True, no dropout (flax's evaluation mode).
        dtype: Cast ``query``, ``key`` and ``value`` to this dtype first (flax's ``dtype``).
        precision: ``jax.lax`` precision of the two matrix products.
        module: A flax module; if given, the weights ``(B, N, T, S)`` are sown into its
            intermediates as ``"attention_weights"`` (flax's ``sow_weights=True``).
        force_fp32_for_softmax: The sown weights in at least float32, as flax sows them (which
            also rounds float64 to float32; here float64 stays); without it, in the inputs'
            dtype. The softmax itself always runs in at least float32.
        qk_attn_weights_einsum: Accepted for flax; must be None (custom einsums are not supported).
        attn_weights_value_einsum: Accepted for flax; must be None.

    Returns:
        The output with the query's shape but ``V`` features, in the input dtype; with
        ``return_residual``, the pair ``(out, logsumexp)``; with ``return_max_scores`` too,
        ``(out, logsumexp, max_scores)``, and alone ``(out, max_scores)``.

    Raises:
        ValueError: On shapes that do not fit together, or values out of range.
        TypeError: On non-float inputs, mixed dtypes, or non-integer lengths and segment ids.

    Examples:
        >>> import jax
        >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 5, 4, 8))
        >>> dot_product_attention(q, k, v, is_causal=True).shape
        (2, 5, 4, 8)
    """
    check_implementation(implementation, typing.get_args(Implementation))
    inputs, config = bind(
        **locals(), output="attention" if module is None else "attention_and_weights"
    )
    result = run(inputs, config=config)
    if module is not None:
        _sow(module, _as_flax(result.weights, inputs.query.dtype, force_fp32_for_softmax))
    return result.returned(return_residual, return_max_scores)


def _as_flax(weights: Array, dtype, force_fp32_for_softmax: bool) -> Array:
    """The weights in flax's dtype: the inputs', or at least float32 if it forces the softmax.

    Computed in at least float32 either way, they are rounded once.
    """
    return weights.astype(accumulation_dtype(dtype) if force_fp32_for_softmax else dtype)


def _sow(module, weights: Array) -> None:
    """Stores the weights where flax's own attention puts them (linen or nnx)."""
    from flax import nnx  # only reached with a flax module, so flax is installed

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def dot_product_attention_weights(
    query: ArrayLike,
    key: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    causal_alignment: CausalAlignment = "top_left",
    logits_soft_cap: float | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | MaskRule | None = None,
    sinks: ArrayLike | None = None,
    normalizer: Normalizer = "softmax",
    sigmoid_bias: ArrayLike | float | None = None,
    query_segment_ids: ArrayLike | None = None,
    key_value_segment_ids: ArrayLike | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: ArrayLike | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: lax.PrecisionLike = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
) -> Float[Array, "*batch heads q_seq kv_seq"]:
    """The attention weights of :func:`dot_product_attention`, shape ``(B, N, T, S)``.

    Same arguments and meaning; as flax's ``dot_product_attention_weights``, dropout (if active)
    is applied to the returned weights, and ``module`` sows them before dropout. Rows with no
    allowed key are all zero. The weights have the inputs' dtype, as flax's (computed in at
    least float32), or with ``force_fp32_for_softmax`` at least float32.

    Examples:
        >>> import jax
        >>> q, k = jax.random.normal(jax.random.key(0), (2, 1, 5, 4, 8))
        >>> w = dot_product_attention_weights(q, k, is_causal=True)
        >>> w.shape, bool(abs(w.sum(-1) - 1).max() < 1e-6)
        ((1, 4, 5, 5), True)
    """
    value = jnp.asarray(key)[..., :0]  # no values: the weights do not depend on them
    inputs, config = bind(**locals(), output="weights", implementation="xla")
    weights = run(inputs, config=config).weights
    as_flax = functools.partial(
        _as_flax, dtype=inputs.query.dtype, force_fp32_for_softmax=force_fp32_for_softmax
    )
    if module is not None:  # flax sows the weights before dropout
        arrays = dataclasses.replace(inputs.arrays, dropout_rng=None)
        undropped = dataclasses.replace(inputs, arrays=arrays)
        dropout = inputs.arrays.dropout_rng is not None
        _sow(module, as_flax(run(undropped, config=config).weights if dropout else weights))
    return as_flax(weights)


@overload
def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: Literal[False] = False,
    return_max_scores: Literal[False] = False,
    axis_name: Any,
    layout: Layout = "contiguous",
    batch_axis: Any = None,
    head_axis: Any = None,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    **keywords: Unpack[RingKeywords],
) -> Array: ...


@overload
def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: Literal[True],
    return_max_scores: Literal[False] = False,
    axis_name: Any,
    layout: Layout = "contiguous",
    batch_axis: Any = None,
    head_axis: Any = None,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    **keywords: Unpack[RingKeywords],
) -> tuple[Array, Array]: ...


@overload
def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    return_residual: bool = False,
    return_max_scores: Literal[True],
    axis_name: Any,
    layout: Layout = "contiguous",
    batch_axis: Any = None,
    head_axis: Any = None,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    **keywords: Unpack[RingKeywords],
) -> tuple[Array, ...]: ...


def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    axis_name: Any,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    causal_alignment: CausalAlignment = "top_left",
    logits_soft_cap: float | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | MaskRule | None = None,
    sinks: ArrayLike | None = None,
    normalizer: Normalizer = "softmax",
    sigmoid_bias: ArrayLike | float | None = None,
    layout: Layout = "contiguous",
    batch_axis: Any = None,
    head_axis: Any = None,
    return_residual: bool = False,
    return_max_scores: bool = False,
    implementation: Ring | Pallas | Literal["pallas"] | None = None,
    precision: lax.PrecisionLike = None,
) -> Array | tuple[Array, Array]:
    r"""Attention over one sequence sharded along the mesh axis ``axis_name``: ring attention.

    Call it inside ``jax.shard_map`` on each device's shards: ``query`` ``(B, T/P, N, H)``,
    ``key`` and ``value`` ``(B, S/P, K, ·)``, where ``P`` is the size of ``axis_name``. Each
    device keeps its queries while the key/value shards travel round the ring (``ppermute``),
    combined with the chunked path's online softmax; no device ever holds all the keys. The
    result is this device's shard of :func:`dot_product_attention` on the whole sequence, with the
    same meaning for every argument accepted here (masks use global positions; a query with no
    allowed key outputs zeros), and the backward pass rotates the key/value gradients the same
    way. :func:`jax_sdpa.ring_dot_product_attention` does the sharding for you. It works under
    ``shard_map``'s default checks (``check_vma=True``), mods and sinks included.

    Args:
        query: This device's queries, ``(B, T/P, N, H)`` (or ``(T/P, N, H)``).
        key: This device's keys, ``(B, S/P, K, H)``; GQA as in :func:`dot_product_attention`.
        value: This device's values, ``(B, S/P, K, V)``.
        bias: Broadcastable to ``(B, N, T/P, S)``: this device's query rows against *all* keys,
            in the order of the sharded key axis (device 0's keys first).
        mask: Like ``bias``; ``True`` = may attend.
        axis_name: The ``shard_map`` axis the sequence is split over.
        scale: As in :func:`dot_product_attention`.
        is_causal: As there, with global positions: blocks wholly in the future are skipped.
        query_seq_lengths: Global query lengths, ``(B,)``.
        key_value_seq_lengths: Global key/value lengths, ``(B,)``.
        local_window_size: As in :func:`dot_product_attention`, in global positions.
        causal_alignment: As in :func:`dot_product_attention`, for the global lengths.
        logits_soft_cap: As in :func:`dot_product_attention`.
        score_mod: As in :func:`dot_product_attention`, with global positions (and, given
            ``batch_axis`` and ``head_axis``, global batch and head indices).
        mask_mod: Likewise.
        sinks: As in :func:`dot_product_attention`, for this device's query heads.
        normalizer: As in :func:`dot_product_attention`.
        sigmoid_bias: As in :func:`dot_product_attention` (``S`` counts the whole sequence's
            keys), for this device's query heads.
        implementation: :class:`~jax_sdpa.Ring`, its tiles, or None for its defaults;
            ``"pallas"`` or :class:`~jax_sdpa.Pallas` for each step's tiles computed by the
            fused kernel (``Ring(kernel=Pallas(...))``).
        precision: As in :func:`dot_product_attention`.
        layout: ``"contiguous"``: device ``p`` holds positions ``[p·L, (p+1)·L)``;
            ``"striped"``: the sequence in ``2P`` chunks, device ``p`` holding chunks ``p`` and
            ``2P−1−p`` (see :func:`jax_sdpa.to_striped`), which balances causal work.
        batch_axis: The mesh axis the (leading) batch axis is split over, if any: the mods and
            a :class:`~jax_sdpa.BlockMask` then see each sequence's index in the whole batch.
        head_axis: The mesh axis the query and key/value heads are split over, if any: the mods
            then see each head's index among all heads (``sinks`` are this device's heads').
        return_residual: Also return this device's log-sum-exp, ``(B, T/P, N)`` (differentiable).
        return_max_scores: Also return this device's rows' largest logits, ``(B, T/P, N)``, as
            in :func:`dot_product_attention` (over the whole ring's keys).

    Returns:
        This device's output shard ``(B, T/P, N, V)``, or with the statistics asked for, as
        :func:`dot_product_attention` returns them.

    References:
        Liu, Zaharia & Abbeel, Ring Attention with Blockwise Transformers for Near-Infinite
        Context, 2023. Brandon et al., Striped Attention, 2023.
    """
    implementation = Pallas() if implementation == "pallas" else implementation
    check_implementation(implementation, ("ring", "pallas"), by_name=False)
    if isinstance(implementation, Pallas):
        implementation = Ring(kernel=implementation)
    implementation = implementation or "ring"
    inputs, config = bind(**locals(), output="attention")
    return run(inputs, config=config).returned(return_residual, return_max_scores)
