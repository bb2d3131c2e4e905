r"""Batched, multi-head attention: the single-head composition ``jax.vmap``-ed over heads and batch.

Shape letters (as ``jax.nn.dot_product_attention``)::

    B = batch size (any number of leading batch axes is accepted; also none: TNH)
    T = query length                S = key/value length
    N = query heads                 K = key/value heads, G = N // K query heads share one
    H = query/key features (d_k)    V = value features (d_v)

Query head ``n`` uses key/value head ``n // G`` (GQA; MQA when ``K = 1``): the query is reshaped
to ``(T, K, G, H)`` and vmapped twice, so keys and values are never copied ``G`` times.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float

from jax_sdpa import _checks
from jax_sdpa._attention import attention_head, by_head, per_query_head, split_group_axis
from jax_sdpa._chunked import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q, chunked_attention_sequence
from jax_sdpa._masks import AndMask, CausalMask, LengthMask, LocalWindowMask, MaskRule, SegmentMask
from jax_sdpa._ring import Layout, ring_attention_sequence
from jax_sdpa._steps import accumulation_dtype, default_scale, dropout_weights

__all__ = ["dot_product_attention", "dot_product_attention_weights", "ring_attention"]

Implementation = Literal["xla", "chunked", "cudnn"]
# implementation=None: on CPU the chunked path was measured at least as fast as the dense one at
# every benchmark size, forward and backward (BENCHMARKS.md), so it is the default there. On
# accelerators (not measured here) fused dense kernels are fast while the scores of the call,
# B·N·T·S floats, stay small: dense up to this many, chunked above.
_DENSE_MAX_SCORES = 2**24
CausalAlignment = Literal["top_left", "bottom_right"]


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call: hashable, so it can key ``jax.jit``'s cache."""

    scale: float
    soft_cap: float | None
    dropout_rate: float
    precision: Any
    output: Literal["attention", "attention_and_weights", "weights"]
    implementation: Literal["xla", "chunked", "ring"]
    block_q: int
    block_kv: int
    axis_name: Any = None  # the ring's: named mesh axis, its size, and the sequence layout
    shards: int = 1
    layout: Layout = "contiguous"


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["query", "key", "value", "bias", "mask", "rule", "dropout_rngs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class _Inputs:
    """Checked and normalised arguments of one call (a pytree, so it can enter ``jax.jit``)."""

    query: Array
    key: Array
    value: Array
    bias: Array | None
    mask: Array | None
    rule: MaskRule | None
    dropout_rngs: Array | None


def _over_heads(head: Callable, query, key, value, bias, mask, rule, rngs):
    """Maps a single-head function ``head`` over the heads of one sequence.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values give ``(T, N, V)`` outputs, a
    ``(T, N)`` log-sum-exp and ``(N, ...)`` weights; each key/value head serves its
    ``G = N // K`` query heads (:func:`per_query_head`).
    """
    seq, heads, _ = query.shape
    grouped = (key.shape[1], heads // key.shape[1])  # (K, G)
    each = per_query_head(
        lambda q, k, v, b, m, r: head(q, k, v, b, m, rule, r),
        1, *(by_head(x, grouped) for x in (bias, mask, rngs)),
    )  # fmt: skip
    query = jnp.moveaxis(query.reshape(seq, *grouped, -1), 0, 2)  # (K, G, T, H)
    out = each(query, jnp.moveaxis(key, 1, 0), jnp.moveaxis(value, 1, 0))
    out, lse, weights = jax.tree.map(lambda x: x.reshape(heads, *x.shape[2:]), out)
    # (N, T, V) → (T, N, V) and (N, T) → (T, N), the layout of jax.nn.
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(lse, 0, 1), weights


def _over_batch(sequence: Callable, query, key, value, bias, mask, rule, rngs):
    """Maps ``sequence`` (one sequence, all heads) over every leading batch axis (``jax.vmap``)."""
    if query.ndim == 3:
        return sequence(query, key, value, bias, mask, rule, rngs)
    (bias, b_ax), (mask, m_ax), (rngs, r_ax) = map(split_group_axis, (bias, mask, rngs))
    inner = functools.partial(_over_batch, sequence)
    return jax.vmap(inner, in_axes=(0, 0, 0, b_ax, m_ax, 0, r_ax))(
        query, key, value, bias, mask, rule, rngs
    )


@functools.partial(jax.jit, static_argnames=("config",))
def _run(inputs: _Inputs, *, config: _Config):
    """The jitted batched computation: ``(out, logsumexp, weights)``, heads moved into place."""
    if 0 in (inputs.query.shape[-3], inputs.key.shape[-3]):
        return _without_positions(inputs, config.output)
    options = dict(
        scale=config.scale,
        soft_cap=config.soft_cap,
        dropout_rate=config.dropout_rate,
        precision=config.precision,
    )
    blocks = {"block_q": config.block_q, "block_kv": config.block_kv}
    if config.implementation == "chunked":
        sequence = functools.partial(chunked_attention_sequence, **options, **blocks)
    elif config.implementation == "ring":
        ring = {"axis_name": config.axis_name, "shards": config.shards, "layout": config.layout}
        sequence = functools.partial(ring_attention_sequence, **options, **blocks, **ring)
    else:
        head = functools.partial(attention_head, **options)
        if config.output == "weights":
            head = functools.partial(_dropped_weights_head, head, config.dropout_rate)
        sequence = functools.partial(_over_heads, head)
    fields = (getattr(inputs, f.name) for f in dataclasses.fields(inputs))
    out, lse, weights = _over_batch(sequence, *fields)
    if config.output == "weights":
        return weights
    return (
        out,
        lax.stop_gradient(lse),
        (weights if config.output == "attention_and_weights" else None),
    )


def _without_positions(inputs: _Inputs, output: str):
    """``T = 0`` or ``S = 0``: no query, or no key to attend to — rows of 0 with log-sum-exp −∞."""
    *batch, seq_q, heads, _ = inputs.query.shape
    dtype = accumulation_dtype(inputs.query.dtype)
    weights = jnp.zeros((*batch, heads, seq_q, inputs.key.shape[-3]), dtype)
    if output == "weights":
        return weights
    out = jnp.zeros((*batch, seq_q, heads, inputs.value.shape[-1]), inputs.value.dtype)
    lse = jnp.full((*batch, seq_q, heads), -jnp.inf, dtype)
    return out, lse, (weights if output == "attention_and_weights" else None)


def _dropped_weights_head(head, rate, query, key, value, bias, mask, rule, rng):
    """The weights after dropout, as flax's ``dot_product_attention_weights`` returns them."""
    out, lse, weights = head(query, key, value, bias, mask, rule, None)
    if rng is not None:
        weights = dropout_weights(weights, rng, rate=rate)
    return out, lse, weights


def _static_float(name: str, value) -> float:
    """A Python number (static under ``jax.jit``), e.g. ``scale``."""
    if isinstance(value, (bool, str)):
        raise TypeError(f"`{name}` must be a Python float; got {type(value).__name__}.")
    try:
        return float(value)
    except TypeError:
        raise TypeError(
            f"`{name}` must be a Python float (a static value); got {type(value).__name__}."
        ) from None


def _squeeze_leading_ones(x: Array, ndim: int) -> Array:
    """Drops extra leading size-1 axes (e.g. a 4-D mask for unbatched TNH inputs)."""
    extra = x.ndim - ndim
    if extra > 0 and all(s == 1 for s in x.shape[:extra]):
        return x.reshape(x.shape[extra:])
    return x


def _prepare(
    query,
    key,
    value,
    bias,
    mask,
    *,
    is_causal,
    query_seq_lengths,
    key_value_seq_lengths,
    local_window_size,
    causal_alignment,
    scale,
    logits_soft_cap,
    precision,
    output,
    implementation,
    block_q,
    block_kv,
    query_segment_ids=None,
    key_value_segment_ids=None,
    dropout_rng=None,
    dropout_rate=0.0,
    broadcast_dropout=True,
    deterministic=True,
    dtype=None,
    ring=None,
) -> tuple[_Inputs, _Config]:
    """Checks every argument (raising on the first problem) and puts them in canonical form.

    With ``ring = (axis_name, shards, layout)`` the arrays are one device's shards of a sequence
    ``shards`` times longer: bias and mask span all its keys, masks use global positions.
    """
    shards = 1 if ring is None else ring[1]
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if dtype is not None:
        query, key, value = query.astype(dtype), key.astype(dtype), value.astype(dtype)
    layout = {
        "query": "(batch, q_seq, heads, d_k)",
        "key": "(batch, kv_seq, kv_heads, d_k)",
        "value": "(batch, kv_seq, kv_heads, d_v)",
    }
    for name, x in zip(layout, (query, key, value), strict=True):
        if x.ndim < 3:
            raise ValueError(
                f"`{name}` must have rank 4 {layout[name]} or rank 3 without batch; "
                f"got shape {x.shape}."
            )
        _checks.check_float(name, x)
    _checks.check_same_dtype(("query", "key", "value"), (query, key, value))
    batch_shape = query.shape[:-3]
    for name, x in (("key", key), ("value", value)):
        _checks.check_equal("batch shape", ("query", name), (batch_shape, x.shape[:-3]))
    *_, seq_q, heads, d_k = query.shape
    *_, seq_kv, kv_heads, _ = key.shape
    _checks.check_equal("feature size d_k", ("query", "key"), (d_k, key.shape[-1]))
    _checks.check_equal("length kv_seq", ("key", "value"), (seq_kv, value.shape[-3]))
    _checks.check_equal("number of heads kv_heads", ("key", "value"), (kv_heads, value.shape[-2]))
    if heads % kv_heads:
        raise ValueError(
            f"The number of query heads must be a multiple of the key/value heads; got "
            f"{heads} query heads and {kv_heads} key/value heads."
        )

    logits_shape = (*batch_shape, heads, seq_q, seq_kv * shards)
    logits_what = f"({'batch, ' * len(batch_shape)}heads, q_seq, kv_seq)"

    def per_logit(name, x):  # bias / mask → rank len(batch) + 3, each axis 1 or full
        x = _squeeze_leading_ones(jnp.asarray(x), len(logits_shape))
        _checks.check_broadcastable(name, x, logits_shape, logits_what)
        return x.reshape((1,) * (len(logits_shape) - x.ndim) + x.shape)

    if bias is not None:
        bias = per_logit("bias", bias)
        _checks.check_float("bias", bias)
    if mask is not None:
        mask = per_logit("mask", mask)
        mask = mask if mask.dtype == bool else mask != 0  # flax masks are float: nonzero = keep

    _checks.check_choice("causal_alignment", causal_alignment, ("top_left", "bottom_right"))
    offset = 0 if causal_alignment == "top_left" else (seq_kv - seq_q) * shards
    rules: list[MaskRule] = []
    if is_causal:
        rules.append(CausalMask(offset))
    if local_window_size is not None:
        window = (
            (local_window_size, local_window_size)
            if isinstance(local_window_size, int)
            else tuple(local_window_size)
        )
        if len(window) != 2 or any(not isinstance(w, int) or w < 0 for w in window):
            raise ValueError(
                "`local_window_size` must be a non-negative int or a pair (left, right) of them; "
                f"got {local_window_size!r}."
            )
        rules.append(LocalWindowMask(*window, offset=offset))

    def per_batch(name, x, seq=None):  # lengths: batch_shape; segment ids: batch_shape + (seq,)
        extra = () if seq is None else (seq,)
        x = _squeeze_leading_ones(jnp.asarray(x), len(batch_shape) + len(extra))
        dims = ["batch"] * bool(batch_shape) + ["seq"] * bool(extra)
        _checks.check_shape(name, x, (*batch_shape, *extra), f"({', '.join(dims)})")
        _checks.check_integer(name, x)
        return x

    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        rules.append(
            LengthMask(
                None
                if query_seq_lengths is None
                else per_batch("query_seq_lengths", query_seq_lengths),
                None
                if key_value_seq_lengths is None
                else per_batch("key_value_seq_lengths", key_value_seq_lengths),
            )
        )
    if query_segment_ids is not None or key_value_segment_ids is not None:
        if key_value_segment_ids is None and seq_q == seq_kv:
            key_value_segment_ids = query_segment_ids
        if query_segment_ids is None or key_value_segment_ids is None:
            raise ValueError(
                "`query_segment_ids` and `key_value_segment_ids` must both be given when "
                f"q_seq != kv_seq; got q_seq {seq_q} and kv_seq {seq_kv}."
            )
        rules.append(
            SegmentMask(
                per_batch("query_segment_ids", query_segment_ids, seq_q),
                per_batch("key_value_segment_ids", key_value_segment_ids, seq_kv),
            )
        )
    rule = AndMask(tuple(rules)) if rules else None

    _checks.check_range("dropout_rate", dropout_rate, 0.0, 1.0)
    rngs = None
    if dropout_rate > 0 and not deterministic:
        if dropout_rng is None:
            raise ValueError(
                "`dropout_rng` must be a PRNG key when `dropout_rate` > 0 and `deterministic` is "
                f"False; got None (dropout_rate={dropout_rate})."
            )
        if broadcast_dropout:  # one mask for every batch element and head, as flax
            rngs = jnp.reshape(dropout_rng, (1,) * (len(batch_shape) + 1) + jnp.shape(dropout_rng))
        else:
            count = math.prod(batch_shape) * heads
            rngs = jax.random.split(dropout_rng, count)
            rngs = rngs.reshape(*batch_shape, heads, *rngs.shape[1:])
    if implementation is None:
        scores = math.prod(batch_shape) * heads * seq_q * seq_kv
        small = jax.default_backend() != "cpu" and scores <= _DENSE_MAX_SCORES
        implementation = "xla" if output != "attention" or small else "chunked"
    if implementation == "chunked" and output != "attention":
        raise ValueError(
            "`implementation='chunked'` never forms the attention weights, which `module` (sown "
            "weights) needs; use implementation=None or 'xla'."
        )
    for name, block in (("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"`{name}` must be a positive int; got {block!r}.")
    config = _Config(
        scale=default_scale(d_k) if scale is None else _static_float("scale", scale),
        soft_cap=_soft_cap(logits_soft_cap),
        dropout_rate=float(dropout_rate),
        precision=precision,
        output=output,
        implementation=implementation,
        block_q=block_q,
        block_kv=block_kv,
        **({} if ring is None else dict(zip(("axis_name", "shards", "layout"), ring, strict=True))),
    )
    return _Inputs(query, key, value, bias, mask, rule, rngs), config


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
    implementation: Implementation | None = None,
    return_residual: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    logits_soft_cap: float | None = None,
    query_segment_ids: ArrayLike | None = None,
    key_value_segment_ids: ArrayLike | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
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
) -> Float[Array, "*batch q_seq heads d_v"] | tuple[Array, Array]:
    r"""Scaled dot-product attention over heads and batch; a drop-in for ``jax.nn``'s.

    .. math:: \mathrm{Attention}(Q, K, V) = \mathrm{softmax}\Big(
        \text{scale} \cdot Q K^\top + \text{bias}\Big)_{\text{mask}} V

    computed for each head by :func:`jax_sdpa.attention`'s steps, ``jax.vmap``-ed over heads and
    batch. Every call that ``jax.nn.dot_product_attention`` accepts means the same here, with one
    documented difference: a query with no allowed key (fully masked, padded, or a bias row of
    −∞) outputs **zeros** with zero gradients, as PyTorch, FlashAttention and FlexAttention do,
    where ``jax.nn`` outputs the mean of the values (zeros only past ``query_seq_lengths``, NaN
    for the −∞ bias row).

    Args:
        query: ``(B, T, N, H)``, or ``(T, N, H)``, or any number of leading batch axes.
        key: ``(B, S, K, H)`` with ``N % K == 0`` (GQA: query head ``n`` uses key/value head
            ``n // (N // K)``).
        value: ``(B, S, K, V)``; ``V`` may differ from ``H``.
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
        implementation: ``"xla"``: the dense computation, which forms the ``(T, S)`` scores;
            ``"chunked"``: exact attention in memory linear in ``T`` (online softmax over key
            blocks, its own backward, wholly masked blocks skipped); ``None``: chunked on CPU (the
            faster there at every size measured), dense on accelerators while ``B·N·T·S ≤ 2^24``
            and wherever the weights are needed; ``"cudnn"`` hands the call to
            ``jax.nn.dot_product_attention(implementation="cudnn")`` on a GPU.
        return_residual: Also return the log-sum-exp of each row's scores, shape ``(B, T, N)``, in
            at least float32 (``jax.nn`` returns it in the input dtype); −∞ for a row with no key.
        causal_alignment: ``"top_left"`` (``jax.nn``, PyTorch) or ``"bottom_right"`` (the last
            query sees the last key: KV-cache decoding, FlashAttention). Shifts the window too.
        logits_soft_cap: If set, scores become ``cap · tanh(scores / cap)`` before the bias.
        query_segment_ids: ``(B, T)`` integers for packed sequences: a query sees only keys with
            the same id.
        key_value_segment_ids: ``(B, S)``; defaults to ``query_segment_ids`` when ``S == T``.
        block_q: Queries per tile of the chunked implementation.
        block_kv: Keys per tile of the chunked implementation.
        broadcast_dropout: Use one dropout mask for every batch element and head (flax).
        dropout_rng: PRNG key for dropout.
        dropout_rate: Probability of dropping an attention weight, in ``[0, 1)``.
        deterministic: If True, no dropout (flax's evaluation mode).
        dtype: Cast ``query``, ``key`` and ``value`` to this dtype first (flax's ``dtype``).
        precision: ``jax.lax`` precision of the two matrix products.
        module: A flax module; if given, the weights ``(B, N, T, S)`` are sown into its
            intermediates as ``"attention_weights"`` (flax's ``sow_weights=True``).
        force_fp32_for_softmax: Accepted for flax; the softmax always runs in at least float32.
        qk_attn_weights_einsum: Accepted for flax; must be None (custom einsums are not supported).
        attn_weights_value_einsum: Accepted for flax; must be None.

    Returns:
        The output with the query's shape but ``V`` features, in the input dtype; with
        ``return_residual``, the pair ``(out, logsumexp)``.

    Raises:
        ValueError: On shapes that do not fit together, or values out of range.
        TypeError: On non-float inputs, mixed dtypes, or non-integer lengths and segment ids.

    Examples:
        >>> import jax
        >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 5, 4, 8))
        >>> dot_product_attention(q, k, v, is_causal=True).shape
        (2, 5, 4, 8)
    """
    for name, fn in (
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
    ):
        if fn is not None:
            raise ValueError(
                f"`{name}` must be None: jax_sdpa computes its own products; got {fn!r}."
            )
    del force_fp32_for_softmax  # always true here
    if implementation == "cudnn":
        return _cudnn(
            query,
            key,
            value,
            bias,
            mask,
            scale=scale,
            is_causal=is_causal,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size,
            return_residual=return_residual,
            beyond_jax_nn={
                "causal_alignment": causal_alignment != "top_left",
                "logits_soft_cap": logits_soft_cap is not None,
                "query_segment_ids": query_segment_ids is not None,
                "key_value_segment_ids": key_value_segment_ids is not None,
                "dropout_rate": dropout_rate > 0 and not deterministic,
                "module": module is not None,
                "dtype": dtype is not None,
            },
        )
    _checks.check_choice("implementation", implementation, (None, "xla", "chunked", "cudnn"))
    inputs, config = _prepare(
        query,
        key,
        value,
        bias,
        mask,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        causal_alignment=causal_alignment,
        query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids,
        dropout_rng=dropout_rng,
        dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout,
        deterministic=deterministic,
        dtype=dtype,
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        precision=precision,
        output="attention" if module is None else "attention_and_weights",
        implementation=implementation,
        block_q=block_q,
        block_kv=block_kv,
    )
    out, lse, weights = _run(inputs, config=config)
    if module is not None:
        _sow(module, weights)
    return (out, lse) if return_residual else out


def _soft_cap(cap) -> float | None:
    if cap is None:
        return None
    cap = _static_float("logits_soft_cap", cap)
    if not cap > 0:
        raise ValueError(f"`logits_soft_cap` must be positive; got {cap}.")
    return cap


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
    query_segment_ids: ArrayLike | None = None,
    key_value_segment_ids: ArrayLike | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: ArrayLike | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: lax.PrecisionLike = None,
    module: Any = None,
) -> Float[Array, "*batch heads q_seq kv_seq"]:
    """The attention weights of :func:`dot_product_attention`, shape ``(B, N, T, S)``.

    Same arguments and meaning; as flax's ``dot_product_attention_weights``, dropout (if active)
    is applied to the returned weights, and ``module`` sows them before dropout. Rows with no
    allowed key are all zero.

    Examples:
        >>> import jax
        >>> q, k = jax.random.normal(jax.random.key(0), (2, 1, 5, 4, 8))
        >>> w = dot_product_attention_weights(q, k, is_causal=True)
        >>> w.shape, bool(abs(w.sum(-1) - 1).max() < 1e-6)
        ((1, 4, 5, 5), True)
    """
    query, key = jnp.asarray(query), jnp.asarray(key)
    inputs, config = _prepare(
        query,
        key,
        key[..., :0],  # no values: the weights do not depend on them
        bias,
        mask,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        causal_alignment=causal_alignment,
        query_segment_ids=query_segment_ids,
        key_value_segment_ids=key_value_segment_ids,
        dropout_rng=dropout_rng,
        dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout,
        deterministic=deterministic,
        dtype=dtype,
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        precision=precision,
        output="weights",
        implementation="xla",
        block_q=DEFAULT_BLOCK_Q,
        block_kv=DEFAULT_BLOCK_KV,
    )
    weights = _run(inputs, config=config)
    if module is not None:  # flax sows the weights before dropout
        undropped = dataclasses.replace(inputs, dropout_rngs=None)
        _sow(module, weights if inputs.dropout_rngs is None else _run(undropped, config=config))
    return weights


def _cudnn(query, key, value, bias, mask, *, beyond_jax_nn: dict[str, bool], **kwargs):
    """``implementation="cudnn"``: jax.nn's fused cuDNN kernel, where a GPU has it."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(
            f"`implementation='cudnn'` needs a CUDA GPU with cuDNN; JAX's backend is {backend!r}. "
            "Use implementation=None or 'xla'."
        )
    used = [name for name, on in beyond_jax_nn.items() if on]
    if used:
        raise ValueError(
            f"`implementation='cudnn'` supports only jax.nn's arguments; got {', '.join(used)}."
        )
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if kwargs[name] is not None:
            kwargs[name] = jnp.asarray(kwargs[name], jnp.int32)
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, implementation="cudnn", **kwargs
    )


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
    layout: Layout = "contiguous",
    return_residual: bool = False,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
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
    way. :func:`jax_sdpa.ring_dot_product_attention` does the sharding for you.

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
        block_q: Queries per tile; the largest divisor of the local run length not above it.
        block_kv: Keys per tile; likewise.
        precision: As in :func:`dot_product_attention`.
        layout: ``"contiguous"``: device ``p`` holds positions ``[p·L, (p+1)·L)``;
            ``"striped"``: the sequence in ``2P`` chunks, device ``p`` holding chunks ``p`` and
            ``2P−1−p`` (see :func:`jax_sdpa.to_striped`), which balances causal work.
        return_residual: Also return this device's log-sum-exp, ``(B, T/P, N)``.

    Returns:
        This device's output shard ``(B, T/P, N, V)``, or ``(out, logsumexp)``.

    References:
        Liu, Zaharia & Abbeel, Ring Attention with Blockwise Transformers for Near-Infinite
        Context, 2023. Brandon et al., Striped Attention, 2023.
    """
    shards = lax.axis_size(axis_name)
    _checks.check_choice("layout", layout, ("contiguous", "striped"))
    if layout == "striped":
        for name, x in (("query", query), ("key", key)):
            if jnp.shape(x)[-3] % 2:
                raise ValueError(
                    f"`{name}` must have an even local length for layout='striped' (two chunks "
                    f"per device); got {jnp.shape(x)[-3]}."
                )
    inputs, config = _prepare(
        query,
        key,
        value,
        bias,
        mask,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        causal_alignment=causal_alignment,
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        precision=precision,
        output="attention",
        implementation="ring",
        block_q=block_q,
        block_kv=block_kv,
        ring=(axis_name, shards, layout),
    )
    out, lse, _ = _run(inputs, config=config)
    return (out, lse) if return_residual else out
