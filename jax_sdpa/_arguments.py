"""Binding a public call: every argument checked and put in canonical form, once.

:func:`bind` takes the keyword arguments of a public function as they were given and hands each
to the small checker that owns it (query/key/value, per-logit bias and mask, the mask rule, the
dropout keys, the formula, the tiling, the ring); each keyword and its default is written in one
checker, which ignores the others (``**_``); the dropout keys take the rate from the formula.
The result is one :class:`~jax_sdpa._implementations.Inputs` pytree and one static
:class:`~jax_sdpa._implementations.Config`, with the implementation chosen from the table.
"""

import dataclasses
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from jax_sdpa import _checks
from jax_sdpa._chunked import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q, Tiling
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._implementations import Config, Inputs, Output, choose
from jax_sdpa._masks import (
    AndMask,
    BlockMask,
    CausalMask,
    FunctionMask,
    LengthMask,
    LocalWindowMask,
    MaskRule,
    SegmentMask,
)
from jax_sdpa._ring import Ring
from jax_sdpa._steps import accumulation_dtype, default_scale


class _Shapes(NamedTuple):
    """The sizes of a call, once its query, key and value are checked."""

    batch: tuple[int, ...]
    seq_q: int
    heads: int
    seq_kv: int  # this device's keys, on a ring
    kv_heads: int
    shards: int  # the ring's size (1 off a ring)

    def per_logit(self) -> tuple[tuple[int, ...], str]:
        """The shape of the scores, and its letters: keys span the whole ring."""
        letters = f"({'batch, ' * len(self.batch)}heads, q_seq, kv_seq)"
        return (*self.batch, self.heads, self.seq_q, self.seq_kv * self.shards), letters


def bind(
    query, key, value, bias=None, mask=None, *, output: Output, implementation=None, **keywords
) -> tuple[Inputs, Config]:
    """Checks every argument of a public call (raising on the first problem) and bundles them.

    ``keywords`` are the public function's other arguments, by name.
    """
    _flax_only(**keywords)
    ring = _ring_spec(query, key, **keywords)
    query, key, value, shapes = _query_key_value(
        query, key, value, 1 if ring is None else ring.shards, **keywords
    )
    score_mod, score_consts = _score_mod(shapes, query.dtype, **keywords)
    formula = dataclasses.replace(_formula(query.shape[-1], **keywords), score_mod=score_mod)
    arrays = CallArrays(
        bias=_per_logit("bias", bias, shapes),
        mask=_per_logit("mask", mask, shapes),
        rule=_mask_rule(shapes, **keywords),
        dropout_rng=_dropout_rng(shapes, formula.dropout_rate, **keywords),
        batch=_index(shapes.batch),
        head=_index((1,) * len(shapes.batch) + (shapes.heads,)),
        score_consts=score_consts,
        sinks=_sinks(shapes, **keywords),
    )
    inputs = Inputs(query, key, value, arrays)
    config = Config(formula, output, tiling=_tiling(**keywords), ring=ring)
    return inputs, dataclasses.replace(
        config, implementation=choose(inputs, config, implementation)
    )


def _index(shape: tuple[int, ...]) -> jax.Array:
    """``0, 1, …`` over the last axis of ``shape`` (the rest 1) or over all of it (the batch)."""
    return jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)


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


def _ring_spec(query, key, axis_name=None, layout="contiguous", **_) -> Ring | None:
    """The ring of a ``ring_attention`` call (``None`` off a ring)."""
    if axis_name is None:
        return None
    _checks.check_choice("layout", layout, ("contiguous", "striped"))
    if layout == "striped":
        for name, x in (("query", query), ("key", key)):
            check_equal_parts(name, jnp.shape(x)[-3], 2, "local sequence", STRIPED)
    try:
        shards = lax.axis_size(axis_name)
    except NameError:
        axes = jax.sharding.get_abstract_mesh().axis_names
        if not axes:
            raise ValueError(
                f"`axis_name` must name an axis of an enclosing `jax.shard_map`: ring_attention "
                f"runs only inside one; got {axis_name!r} outside any."
            ) from None
        raise ValueError(
            f"`axis_name` must name an axis of the enclosing `jax.shard_map` {axes}; "
            f"got {axis_name!r}."
        ) from None
    return Ring(axis_name, shards, layout)


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


def _query_key_value(query, key, value, shards: int, dtype=None, **_):
    """The three arrays (cast to ``dtype`` if given), checked against each other, and the sizes."""
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
    return query, key, value, _Shapes(batch_shape, seq_q, heads, seq_kv, kv_heads, shards)


def _squeeze_leading_ones(x: jax.Array, ndim: int) -> jax.Array:
    """Drops extra leading size-1 axes (e.g. a 4-D mask for unbatched TNH inputs)."""
    extra = x.ndim - ndim
    if extra > 0 and all(s == 1 for s in x.shape[:extra]):
        return x.reshape(x.shape[extra:])
    return x


def _per_logit(name: str, x, shapes: _Shapes) -> jax.Array | None:
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


def _per_batch(name: str, x, shapes: _Shapes, seq: int | None = None) -> jax.Array:
    """Lengths ``(batch)`` or segment ids ``(batch, seq)``: integers, exactly that shape."""
    extra = () if seq is None else (seq,)
    x = _squeeze_leading_ones(jnp.asarray(x), len(shapes.batch) + len(extra))
    dims = ["batch"] * bool(shapes.batch) + ["seq"] * bool(extra)
    _checks.check_shape(name, x, (*shapes.batch, *extra), f"({', '.join(dims)})")
    _checks.check_integer(name, x)
    return x


def _mask_rule(
    shapes: _Shapes,
    is_causal=False,
    local_window_size=None,
    causal_alignment="top_left",
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    mask_mod=None,
    **_,
) -> MaskRule | None:
    """The mask rules a call asks for, as one :class:`~jax_sdpa.AndMask` (``None``: none)."""
    _checks.check_choice("causal_alignment", causal_alignment, ("top_left", "bottom_right"))
    offset = 0 if causal_alignment == "top_left" else (shapes.seq_kv - shapes.seq_q) * shapes.shards
    rules: list[MaskRule] = [CausalMask(offset)] if is_causal else []
    if local_window_size is not None:
        rules.append(LocalWindowMask(*_window(local_window_size), offset=offset))
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        lengths = {
            "query_seq_lengths": query_seq_lengths,
            "key_value_seq_lengths": key_value_seq_lengths,
        }
        rules.append(
            LengthMask(
                *(None if x is None else _per_batch(n, x, shapes) for n, x in lengths.items())
            )
        )
    if query_segment_ids is not None or key_value_segment_ids is not None:
        if key_value_segment_ids is None and shapes.seq_q == shapes.seq_kv:
            key_value_segment_ids = query_segment_ids
        if query_segment_ids is None or key_value_segment_ids is None:
            raise ValueError(
                "`query_segment_ids` and `key_value_segment_ids` must both be given when "
                f"q_seq != kv_seq; got q_seq {shapes.seq_q} and kv_seq {shapes.seq_kv}."
            )
        rules.append(
            SegmentMask(
                _per_batch("query_segment_ids", query_segment_ids, shapes, shapes.seq_q),
                _per_batch("key_value_segment_ids", key_value_segment_ids, shapes, shapes.seq_kv),
            )
        )
    if mask_mod is not None:
        rules.append(_mask_mod(shapes, mask_mod))
    return AndMask(tuple(rules)) if rules else None


def _shared(x: jax.Array, shapes: _Shapes) -> jax.Array:
    """An array the whole batch shares, as a leaf of the call: with leading batch axes of 1."""
    return jnp.reshape(x, (1,) * len(shapes.batch) + jnp.shape(x))


_INDEX = jax.ShapeDtypeStruct((), jnp.int32)


_EVALUATORS: dict = {}  # jaxpr text and shapes → its evaluator; cleared when it grows large


def _hoisted(fn, args: list) -> tuple:
    """``(g, arrays)``: ``fn(*args) == g(*args, *arrays)`` for every array ``fn`` closes over.

    As ``jax.closure_convert``, but every closed-over array is hoisted, traced or not: a table
    the function closes over is an input of the compiled program, not a constant baked into it.
    ``fn`` is traced afresh on every call (it may read values that changed since), and ``g`` is
    shared by every function that traces to the same program with the same shapes, so that a
    call with new values, or with a new but equal lambda, reuses the compiled program.
    """
    closed = jax.make_jaxpr(lambda *a: fn(*a))(*args)
    key = (str(closed.jaxpr), tuple(jax.typeof(x) for x in (*args, *closed.consts)))
    if key not in _EVALUATORS:
        if len(_EVALUATORS) > 256:
            _EVALUATORS.clear()
        jaxpr, count = closed.jaxpr, len(args)

        def evaluate(*args_and_arrays):
            arrays = list(args_and_arrays[count:])
            return jaxpr_as_fun(ClosedJaxpr(jaxpr, arrays))(*args_and_arrays[:count])[0]

        evaluate.jaxpr = jaxpr  # what the function computes, to inspect without tracing again
        _EVALUATORS[key] = evaluate
    return _EVALUATORS[key], tuple(closed.consts)


def _convert(name: str, fn, signature: str, example: tuple, kind: str) -> tuple:
    """``fn`` with the arrays it closes over as arguments (:func:`_hoisted`), checked."""
    if not callable(fn):
        raise TypeError(f"`{name}` must be a function {signature}; got {type(fn).__name__}.")
    args = [jnp.zeros(x.shape, x.dtype) for x in example]
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as error:
        raise TypeError(
            f"`{name}` must accept {len(example)} scalars {signature}; {error}."
        ) from None
    except ValueError:  # no signature to inspect (some built-ins): calling it will tell
        pass
    out = jax.eval_shape(fn, *args)
    is_array = isinstance(out, jax.ShapeDtypeStruct)
    want = jnp.floating if kind == "float" else jnp.bool_
    if not is_array or out.shape != () or not jnp.issubdtype(out.dtype, want):
        got = f"{out.dtype}{list(out.shape)}" if is_array else type(out).__name__
        raise TypeError(f"`{name}` must return one {kind} scalar; got {got}.")
    return _hoisted(fn, args)


def _mask_mod(shapes: _Shapes, mask_mod) -> MaskRule:
    """A function of ``(batch, head, q_idx, kv_idx)`` as a rule; a rule or block mask checked.

    Arrays a function closed over are shared by the batch (it indexes them with ``batch``
    itself); a rule's array fields are mapped over the batch where they lead with it.
    """
    if isinstance(mask_mod, BlockMask):
        return _block_mask(shapes, mask_mod)
    if isinstance(mask_mod, FunctionMask):
        consts = tuple(_shared(x, shapes) for x in mask_mod.consts)
        return dataclasses.replace(mask_mod, consts=consts)
    if isinstance(mask_mod, MaskRule):

        def batched(x):
            x = jnp.asarray(x)
            return x if x.shape[: len(shapes.batch)] == shapes.batch else _shared(x, shapes)

        return jax.tree.map(batched, mask_mod)
    return _mask_mod(shapes, function_mask(mask_mod))


def function_mask(mask_mod) -> FunctionMask:
    """A user's ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` as a rule, checked."""
    signature = "mask_mod(batch, head, q_idx, kv_idx) -> bool"
    fn, consts = _convert("mask_mod", mask_mod, signature, (_INDEX,) * 4, "bool")
    jaxpr = fn.jaxpr
    read = {id(x) for eqn in jaxpr.eqns for x in eqn.invars} | {id(x) for x in jaxpr.outvars}
    batch, head = (id(x) in read for x in jaxpr.invars[:2])
    return FunctionMask(fn, consts, uses_head=head, uses_batch=batch)


def _block_mask(shapes: _Shapes, block_mask: BlockMask) -> BlockMask:
    """A :class:`~jax_sdpa.BlockMask` made for this call's sequences, batch and heads."""
    seq = (shapes.seq_q * shapes.shards, shapes.seq_kv * shapes.shards)
    if (block_mask.q_len, block_mask.kv_len) != seq:
        raise ValueError(
            "`mask_mod` is a BlockMask for (q_len, kv_len) = "
            f"{(block_mask.q_len, block_mask.kv_len)}; the call's sequences are {seq}."
        )
    batch, heads = block_mask.classes.shape[:2]
    if batch not in (1, math.prod(shapes.batch)) or heads not in (1, shapes.heads):
        raise ValueError(
            f"`mask_mod` is a BlockMask for batch {batch} and {heads} heads; the call has "
            f"batch {math.prod(shapes.batch)} and {shapes.heads} heads (or use 1 for either)."
        )
    if heads == 1 < shapes.heads and block_mask.rule.per_head:
        raise ValueError(
            "`mask_mod` is a BlockMask classified for one head, but its mask reads `head`: "
            f"build it with heads={shapes.heads}."
        )
    leading = shapes.batch if batch > 1 else (1,) * len(shapes.batch)
    return dataclasses.replace(
        block_mask,
        rule=_mask_mod(shapes, block_mask.rule),
        classes=block_mask.classes.reshape(leading + block_mask.classes.shape[1:]),
    )


def _score_mod(shapes: _Shapes, query_dtype, score_mod=None, **_) -> tuple:
    """``(converted score_mod, the arrays it closed over)``, or ``(None, ())``."""
    if score_mod is None:
        return None, ()
    signature = "score_mod(score, batch, head, q_idx, kv_idx) -> score"
    score = jax.ShapeDtypeStruct((), accumulation_dtype(query_dtype))
    fn, consts = _convert("score_mod", score_mod, signature, (score, *(_INDEX,) * 4), "float")
    return fn, tuple(_shared(x, shapes) for x in consts)


def _sinks(shapes: _Shapes, sinks=None, **_) -> jax.Array | None:
    """One logit per query head, shared by the batch."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    _checks.check_shape("sinks", sinks, (shapes.heads,), "(heads,)")
    _checks.check_float("sinks", sinks)
    return _shared(sinks, shapes)


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
    shapes: _Shapes,
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


def _formula(d_k: int, scale=None, logits_soft_cap=None, dropout_rate=0.0, precision=None, **_):
    """The static formula: the scale (``1/√d_k`` by default), soft cap, dropout rate, precision."""
    _checks.check_range("dropout_rate", dropout_rate, 0.0, 1.0)
    if logits_soft_cap is not None:
        logits_soft_cap = _static_float("logits_soft_cap", logits_soft_cap)
        if not logits_soft_cap > 0:
            raise ValueError(f"`logits_soft_cap` must be positive; got {logits_soft_cap}.")
    return Formula(
        scale=default_scale(d_k) if scale is None else _static_float("scale", scale),
        soft_cap=logits_soft_cap,
        dropout_rate=float(dropout_rate),
        precision=precision,
    )


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


def _tiling(block_q=DEFAULT_BLOCK_Q, block_kv=DEFAULT_BLOCK_KV, **_) -> Tiling:
    """The chunked and ring paths' tile, checked."""
    for name, block in (("block_q", block_q), ("block_kv", block_kv)):
        _checks.check_positive_int(name, block)
    return Tiling(block_q, block_kv)
