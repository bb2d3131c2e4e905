"""Binding a public call: every argument checked and put in canonical form, once.

:func:`bind` takes the keyword arguments of a public function as they were given and hands each
to the small checker that owns it (query/key/value, caches and pages in
:mod:`~jax_sdpa._shapes`; per-logit bias and mask, the mask rule, the
dropout keys, the formula, the ring); each keyword and its default is written in one
checker, which ignores the others (``**_``); the dropout keys take the rate from the formula.
The result is one :class:`~jax_sdpa._call.Inputs` pytree and one static
:class:`~jax_sdpa._call.Config`, with the implementation chosen from the table.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa import _checks, _shapes
from jax_sdpa._batch_axes import shared, with_batch
from jax_sdpa._block_mask import BlockMask
from jax_sdpa._call import Config, Inputs, Output
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._implementations import choose
from jax_sdpa._indices import Index, positions
from jax_sdpa._masks import AndMask, CausalMask, LengthMask, LocalWindowMask, MaskRule, SegmentMask
from jax_sdpa._online_softmax import SIGMOID
from jax_sdpa._ring_spec import RingSpec
from jax_sdpa._shapes import Shapes
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._user_functions import INDEX_ARGUMENT, convert, function_mask, vary, varying_axes


def bind(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    output: Output,
    implementation=None,
    page_table=None,
    first_positions=None,
    return_max_scores=False,
    **keywords,
) -> tuple[Inputs, Config]:
    """Checks every argument of a public call (raising on the first problem) and bundles them.

    ``keywords`` are the public function's other arguments, by name. With a ``page_table``,
    ``key`` and ``value`` are pools of pages (:func:`~jax_sdpa.paged_attention`), and each
    sequence's first query is at ``first_positions`` ``(batch,)``, by default its lengths less
    its queries: its last positions.
    """
    _flax_only(**keywords)
    ring = _ring_spec(query, key, **keywords)
    if page_table is None:
        query, key, value, shapes = _shapes.query_key_value(query, key, value, ring, **keywords)
        diagonal = (_causal_offset(shapes, **keywords), None)
    else:
        query, key, value, page_table, lengths, shapes = _shapes.pages(
            query, key, value, page_table, **keywords
        )
        keywords = dict(keywords, key_value_seq_lengths=lengths)
        diagonal = (0, lengths - shapes.seq_q if first_positions is None else first_positions)
    score_mod, score_consts = _score_mod(shapes, query.dtype, **keywords)
    formula = Formula.of(query.shape[-1], **dict(keywords, score_mod=score_mod))
    first_sequence = _first(ring, "batch_axis", math.prod(shapes.batch))
    arrays = CallArrays(
        bias=_per_logit("bias", bias, shapes),
        mask=_per_logit("mask", mask, shapes),
        rule=_mask_rule(shapes, diagonal, first_sequence, **keywords),
        dropout_rng=_dropout_rng(shapes, formula.dropout_rate, **keywords),
        batch=_index(shapes.batch, first_sequence),
        head=_index(
            (1,) * len(shapes.batch) + (shapes.heads,), _first(ring, "head_axis", shapes.heads)
        ),
        score_consts=score_consts,
        sinks=_sinks(shapes, **keywords),
        sigmoid_bias=_sigmoid_bias(shapes, formula, accumulation_dtype(query.dtype), **keywords),
    )
    key_indices = _shapes.key_indices(shapes, **keywords)
    inputs = _varying_together(Inputs(query, key, value, arrays, page_table, key_indices), ring)
    returned = dict(
        max_scores=bool(return_max_scores), residual=bool(keywords.get("return_residual"))
    )
    config = Config(formula, output, ring=ring, **returned)
    return inputs, choose(inputs, config, implementation)


def _varying_together(inputs: Inputs, ring: RingSpec | None) -> Inputs:
    """Every array of the call varying over the mesh axes any of them varies over, and the ring's.

    Inside ``jax.shard_map`` (with its default ``check_vma=True``) values are typed by the axes
    they vary over, and every tile mixes all the call's arrays with positions that vary over
    the ring: casting them all once (free at run time) lets loop carries and the gradients of
    shared arrays (sinks, the mods' tables) vary as their updates do, summed over the devices
    once, by the cast's transpose. Outside ``shard_map`` there are no such axes.
    """
    axes = varying_axes(inputs) | (frozenset() if ring is None else ring.axes)
    return jax.tree.map(lambda x: vary(x, axes), inputs)


def _index(shape: tuple[int, ...], first: Index = 0) -> jax.Array:
    """``first, first + 1, …`` over the last axis of ``shape`` (the rest 1) or over all of it."""
    return positions(first, math.prod(shape)).reshape(shape)


def _first(ring: RingSpec | None, axis: str, count: int) -> Index:
    """The global index of this device's first sequence (or head), ``count`` on each device.

    On a ring whose batch (heads) are split over the mesh axis ``ring.batch_axis``
    (``ring.head_axis``), the mods see the index in the whole batch, not in this device's part.
    """
    name = None if ring is None else getattr(ring, axis)
    return 0 if name is None else lax.axis_index(name) * count


def _flax_only(qk_attn_weights_einsum=None, attn_weights_value_einsum=None, **_) -> None:
    """Flax's custom einsums: accepted as keywords, refused unless None."""
    for name, fn in (
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
    ):
        if fn is not None:
            raise ValueError(
                f"`{name}` must be None: jax_sdpa computes its own products; got {fn!r}."
            )


def _ring_spec(
    query, key, axis_name=None, layout="contiguous", batch_axis=None, head_axis=None, **_
) -> RingSpec | None:
    """The ring of a ``ring_attention`` call (``None`` off a ring)."""
    if axis_name is None:
        return None
    _checks.check_choice("layout", layout, ("contiguous", "striped"))
    if layout == "striped":
        for name, x in (("query", query), ("key", key)):
            _checks.check_equal_parts(name, jnp.shape(x)[-3], 2, "local sequence", _checks.STRIPED)
    split = {name: axis for name, axis in (("batch", batch_axis), ("head", head_axis)) if axis}
    sizes = {f"{name}_shards": _axis_size(f"{name}_axis", axis) for name, axis in split.items()}
    shards = _axis_size("axis_name", axis_name)
    return RingSpec(axis_name, shards, layout, batch_axis, head_axis, **sizes)


def _axis_size(name: str, axis) -> int:
    """The size of mesh axis ``axis`` of the enclosing ``jax.shard_map``, checked."""
    try:
        return lax.axis_size(axis)
    except NameError:
        axes = jax.sharding.get_abstract_mesh().axis_names
        if not axes:
            raise ValueError(
                f"`{name}` must name an axis of an enclosing `jax.shard_map`: ring_attention "
                f"runs only inside one; got {axis!r} outside any."
            ) from None
        raise ValueError(
            f"`{name}` must name an axis of the enclosing `jax.shard_map` {axes}; got {axis!r}."
        ) from None


def _squeeze_leading_ones(x: jax.Array, ndim: int) -> jax.Array:
    """Drops extra leading size-1 axes (e.g. a 4-D mask for unbatched TNH inputs)."""
    extra = x.ndim - ndim
    if extra > 0 and all(s == 1 for s in x.shape[:extra]):
        return x.reshape(x.shape[extra:])
    return x


def _per_logit(name: str, x, shapes: Shapes) -> jax.Array | None:
    """A bias or mask of rank ``len(batch) + 3``, each axis 1 or full; a mask becomes boolean."""
    if x is None:
        return None
    target, letters = shapes.per_logit()
    x = _squeeze_leading_ones(jnp.asarray(x), len(target))
    _checks.check_broadcastable(name, x, target, letters)
    x = x.reshape((1,) * (len(target) - x.ndim) + x.shape)
    if name == "bias":
        _checks.check_float(name, x)
        return x
    return x if x.dtype == bool else x != 0  # flax masks are float: nonzero = keep


def _per_batch(name: str, x, shapes: Shapes, seq: int | None = None) -> jax.Array:
    """Lengths ``(batch)`` or segment ids ``(batch, seq)``: integers, exactly that shape."""
    extra = () if seq is None else (seq,)
    x = _squeeze_leading_ones(jnp.asarray(x), len(shapes.batch) + len(extra))
    dims = ["batch"] * bool(shapes.batch) + ["seq"] * bool(extra)
    _checks.check_shape(name, x, (*shapes.batch, *extra), f"({', '.join(dims)})")
    _checks.check_integer(name, x)
    return x


def _causal_offset(shapes: Shapes, causal_alignment="top_left", **_) -> int:
    """The causal diagonal's (and the window's) offset: 0 top left, ``S − T`` bottom right."""
    _checks.check_choice("causal_alignment", causal_alignment, ("top_left", "bottom_right"))
    return 0 if causal_alignment == "top_left" else (shapes.seq_kv - shapes.seq_q) * shapes.shards


def _mask_rule(
    shapes: Shapes, diagonal: tuple[int, jax.Array | None], first_sequence: Index = 0, **keywords
) -> MaskRule | None:
    """The mask rules a call asks for, as one :class:`~jax_sdpa.AndMask` (``None``: none).

    ``diagonal``: the causal diagonal's (and the window's) offset, and one per sequence or None
    (a paged call's); ``first_sequence``: this device's first sequence, on a ring that splits
    the batch.
    """
    rules = [
        *_diagonal_rules(diagonal, **keywords),
        *_length_rules(shapes, **keywords),
        *_segment_rules(shapes, **keywords),
    ]
    if keywords.get("mask_mod") is not None:
        rules.append(_mask_mod(shapes, keywords["mask_mod"]))
    if not rules:
        return None
    sizes = {"q_seq": shapes.seq_q * shapes.shards, "kv_seq": shapes.seq_kv * shapes.shards}
    whole = None
    if shapes.batch_shards > 1:
        whole = (shapes.batch[0] * shapes.batch_shards, *shapes.batch[1:])
    return with_batch(AndMask(tuple(rules)), shapes.batch, sizes, whole, first_sequence)


def _diagonal_rules(diagonal, is_causal=False, local_window_size=None, **_) -> list[MaskRule]:
    """The causal mask and the local window, about the diagonal ``(offset, offsets)``."""
    offset, offsets = diagonal
    rules: list[MaskRule] = [CausalMask(offset, offsets)] if is_causal else []
    if local_window_size is not None:
        rules.append(LocalWindowMask(*_window(local_window_size), offset, offsets))
    return rules


def _length_rules(
    shapes: Shapes, query_seq_lengths=None, key_value_seq_lengths=None, **_
) -> list[MaskRule]:
    """Each sequence's lengths, as one rule (or none)."""
    lengths = {
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
    }
    if all(x is None for x in lengths.values()):
        return []
    per_batch = (None if x is None else _per_batch(n, x, shapes) for n, x in lengths.items())
    return [LengthMask(*per_batch)]


def _segment_rules(
    shapes: Shapes, query_segment_ids=None, key_value_segment_ids=None, **_
) -> list[MaskRule]:
    """Packed sequences' segment ids, as one rule (or none)."""
    if query_segment_ids is None and key_value_segment_ids is None:
        return []
    if key_value_segment_ids is None and shapes.seq_q == shapes.seq_kv:
        key_value_segment_ids = query_segment_ids
    if query_segment_ids is None or key_value_segment_ids is None:
        raise ValueError(
            "`query_segment_ids` and `key_value_segment_ids` must both be given when "
            f"q_seq != kv_seq; got q_seq {shapes.seq_q} and kv_seq {shapes.seq_kv}."
        )
    return [
        SegmentMask(
            _per_batch("query_segment_ids", query_segment_ids, shapes, shapes.seq_q),
            _per_batch("key_value_segment_ids", key_value_segment_ids, shapes, shapes.seq_kv),
        )
    ]


def _mask_mod(shapes: Shapes, mask_mod) -> MaskRule:
    """A function of ``(batch, head, q_idx, kv_idx)`` as a rule; a block mask checked."""
    if isinstance(mask_mod, BlockMask):
        _check_block_mask(shapes, mask_mod)
    return mask_mod if isinstance(mask_mod, MaskRule) else function_mask(mask_mod)


def _check_block_mask(shapes: Shapes, block_mask: BlockMask) -> None:
    """A :class:`~jax_sdpa.BlockMask` must be made for this call's sequences, batch and heads."""
    seq = (shapes.seq_q * shapes.shards, shapes.seq_kv * shapes.shards)
    if (block_mask.q_len, block_mask.kv_len) != seq:
        raise ValueError(
            "`mask_mod` is a BlockMask for (q_len, kv_len) = "
            f"{(block_mask.q_len, block_mask.kv_len)}; the call's sequences are {seq}."
        )
    batch, heads = block_mask.classes.shape[:2]
    # On a ring with the batch or heads split over devices: the whole batch's, all heads'.
    whole = (math.prod(shapes.batch) * shapes.batch_shards, shapes.heads * shapes.head_shards)
    if batch not in (1, whole[0]) or heads not in (1, whole[1]):
        raise ValueError(
            f"`mask_mod` is a BlockMask for batch {batch} and {heads} heads; the call has "
            f"batch {whole[0]} and {whole[1]} heads (or use 1 for either)."
        )
    if heads == 1 < whole[1] and block_mask.rule.per_head:
        raise ValueError(
            "`mask_mod` is a BlockMask classified for one head, but its mask reads `head`: "
            f"build it with heads={whole[1]}."
        )


def _score_mod(shapes: Shapes, query_dtype, score_mod=None, **_) -> tuple:
    """``(converted score_mod, the arrays it closed over)``, or ``(None, ())``."""
    if score_mod is None:
        return None, ()
    signature = "score_mod(score, batch, head, q_idx, kv_idx) -> score"
    score = jax.ShapeDtypeStruct((), accumulation_dtype(query_dtype))
    example = (score, *(INDEX_ARGUMENT,) * 4)
    fn, consts = convert("score_mod", score_mod, signature, example, "float")
    return fn, tuple(shared(x, shapes.batch) for x in consts)


def _sinks(shapes: Shapes, sinks=None, **_) -> jax.Array | None:
    """One logit per query head, shared by the batch."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    _checks.check_shape("sinks", sinks, (shapes.heads,), "(heads,)")
    _checks.check_float("sinks", sinks)
    return shared(sinks, shapes.batch)


def _sigmoid_bias(
    shapes: Shapes,
    formula: Formula,
    scores_dtype,
    sigmoid_bias=None,
    sinks=None,
    key_value_seq_lengths=None,
    **_,
) -> jax.Array | None:
    """The sigmoid's bias of each sequence and query head: given, or ``−log S`` by default.

    ``S`` is the sequence's number of keys: its ``key_value_seq_lengths`` entry if given, else
    all the keys (on a ring, of the whole sequence); masks do not change it. A constant of the
    call (no gradient reaches it), in the scores' dtype.
    """
    if formula.normalizer is not SIGMOID:
        if sigmoid_bias is not None:
            raise ValueError("`sigmoid_bias` needs `normalizer='sigmoid'`; got 'softmax'.")
        return None
    if sinks is not None:
        raise ValueError(
            "`sinks` have no meaning with `normalizer='sigmoid'` (a sink only takes weight from a "
            "row's softmax); got sinks."
        )
    if sigmoid_bias is not None:
        bias = jnp.asarray(sigmoid_bias)
        _checks.check_float("sigmoid_bias", bias)
        if bias.shape not in ((), (shapes.heads,)):
            raise ValueError(
                f"`sigmoid_bias` must be a scalar or have shape (heads,) = ({shapes.heads},); "
                f"got {tuple(bias.shape)}."
            )
        bias = jnp.broadcast_to(bias.astype(accumulation_dtype(bias.dtype)), (shapes.heads,))
        return lax.stop_gradient(shared(bias, shapes.batch))
    if key_value_seq_lengths is None:
        count = jnp.full((1,) * len(shapes.batch), shapes.seq_kv * shapes.shards, scores_dtype)
    else:
        lengths = _per_batch("key_value_seq_lengths", key_value_seq_lengths, shapes)
        count = jnp.maximum(lengths, 1).astype(scores_dtype)
    return jnp.broadcast_to(-jnp.log(count)[..., None], (*count.shape, shapes.heads))


def _window(local_window_size) -> tuple[int, int]:
    """``(left, right)`` from ``jax.nn``'s ``local_window_size``, an int or a pair."""
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
    return window


def _dropout_rng(
    shapes: Shapes,
    rate: float,
    dropout_rng=None,
    broadcast_dropout=True,
    deterministic=False,
    **_,
) -> jax.Array | None:
    """One dropout key per batch element and head, or one for all (``None``: no dropout)."""
    if rate == 0 or deterministic:
        return None
    if dropout_rng is None:
        raise ValueError(
            "`dropout_rng` must be a PRNG key when `dropout_rate` > 0 and `deterministic` is "
            f"False; got None (dropout_rate={rate})."
        )
    if broadcast_dropout:  # one mask for every batch element and head, as flax
        return jnp.reshape(dropout_rng, (1,) * (len(shapes.batch) + 1) + jnp.shape(dropout_rng))
    split = jax.random.split(dropout_rng, math.prod(shapes.batch) * shapes.heads)
    return split.reshape(*shapes.batch, shapes.heads, *split.shape[1:])
