"""The public keywords: pinned by name, and the same in the functions, overloads and TypedDicts.

The functions spell their keywords out, because flax linen hands an ``attention_fn`` only the
keywords its ``inspect.signature`` names; their ``@overload``s take the same vocabulary as
``**keywords`` from the TypedDicts of ``jax_sdpa._dot_product``. A keyword that vanishes from a
signature, or that a TypedDict and a signature disagree on, fails here.
"""

import inspect
import re
import sys
import typing

import jax
import jax.numpy as jnp
import pytest
from flax import linen

import jax_sdpa as js
from jax_sdpa import _keywords
from jax_sdpa._keywords import Keywords, PagedKeywords, RingKeywords, WeightsKeywords

# Every parameter of each public function, written out: a keyword must not vanish silently.
PARAMETERS = {
    "dot_product_attention": set(
        "attn_weights_value_einsum bias broadcast_dropout causal_alignment deterministic "
        "dropout_rate dropout_rng dtype force_fp32_for_softmax implementation is_causal key "
        "key_value_segment_ids key_value_seq_lengths local_window_size logits_soft_cap mask "
        "mask_mod module precision qk_attn_weights_einsum query query_segment_ids "
        "query_seq_lengths return_residual scale score_mod sinks value normalizer sigmoid_bias "
        "return_max_scores key_indices".split()
    ),
    "dot_product_attention_weights": set(
        "bias broadcast_dropout causal_alignment deterministic dropout_rate dropout_rng dtype "
        "is_causal key key_value_segment_ids key_value_seq_lengths local_window_size "
        "logits_soft_cap mask mask_mod module precision query query_segment_ids query_seq_lengths "
        "scale score_mod sinks normalizer sigmoid_bias force_fp32_for_softmax".split()
    ),
    "ring_attention": set(
        "axis_name batch_axis bias causal_alignment head_axis implementation is_causal key "
        "key_value_seq_lengths layout local_window_size logits_soft_cap mask mask_mod precision "
        "query query_seq_lengths return_residual scale score_mod sinks value normalizer "
        "sigmoid_bias return_max_scores".split()
    ),
    "ring_dot_product_attention": set(
        "batch_axis bias head_axis key key_value_seq_lengths keywords layout mask mesh query "
        "query_seq_lengths return_residual return_max_scores seq_axis value".split()
    ),
}
POSITIONAL = {
    "dot_product_attention": ["query", "key", "value", "bias", "mask"],
    "dot_product_attention_weights": ["query", "key", "bias", "mask"],
    "ring_attention": ["query", "key", "value", "bias", "mask"],
    "ring_dot_product_attention": ["query", "key", "value", "bias", "mask"],
}
# Each TypedDict and the function whose keywords it holds, but for those the function names itself
# in its overloads.
GROUPS = [
    (
        js.dot_product_attention,
        Keywords,
        {"return_residual", "return_max_scores", "implementation"},
    ),
    (js.dot_product_attention_weights, WeightsKeywords, set()),
    (
        js.ring_attention,
        RingKeywords,
        {
            "return_residual",
            "return_max_scores",
            "axis_name",
            "layout",
            "batch_axis",
            "head_axis",
            "query_seq_lengths",
            "key_value_seq_lengths",
        },
    ),
    # what ragged_paged_attention passes on: all but the mods it wraps
    (js.paged_attention, PagedKeywords, {"score_mod", "mask_mod"}),
]
GROUP_IDS = [fn.__name__ for fn, _, _ in GROUPS]
OVERLOADED = [js.dot_product_attention, js.ring_attention, js.ring_dot_product_attention]


def _keyword_only(fn) -> set[str]:
    parameters = inspect.signature(fn).parameters.values()
    return {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}


def _positional(fn) -> list[str]:
    parameters = inspect.signature(fn).parameters.values()
    return [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]


def _accepted(fn) -> set[str]:
    """The keywords ``fn`` accepts: its keyword-only ones and those of its ``**keywords``."""
    names = _keyword_only(fn)
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            (typed_dict,) = re.fullmatch(r"Unpack\[(\w+)\]", p.annotation).groups()
            keys = getattr(_keywords, typed_dict).__optional_keys__
            assert not names & keys, f"`{p.name}` repeats named keywords"  # PEP 692
            names |= keys
    return names


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_the_public_parameters_are_the_pinned_ones(name):
    fn = getattr(js, name)
    assert set(inspect.signature(fn).parameters) == PARAMETERS[name]
    assert _positional(fn) == POSITIONAL[name]


@pytest.mark.parametrize(("fn", "typed_dict", "named"), GROUPS, ids=GROUP_IDS)
def test_a_typed_dict_holds_the_keywords_its_function_does_not_name(fn, typed_dict, named):
    assert typed_dict.__required_keys__ == frozenset()
    assert typed_dict.__optional_keys__ == _keyword_only(fn) - named


@pytest.mark.parametrize(("fn", "typed_dict", "named"), GROUPS, ids=GROUP_IDS)
def test_a_typed_dict_gives_each_keyword_its_functions_type(fn, typed_dict, named):
    expected = typing.get_type_hints(fn, include_extras=True)
    for name, hint in typing.get_type_hints(typed_dict, include_extras=True).items():
        assert hint == _without_implicit_optional(expected[name]), name


def _without_implicit_optional(hint):
    """``Any`` for ``Optional[Any]``, which Python 3.10's get_type_hints makes of ``x: Any = None``."""
    return typing.Any if hint == typing.Union[typing.Any, None] else hint  # noqa: UP007


@pytest.mark.skipif(sys.version_info < (3, 11), reason="typing.get_overloads is new in 3.11")
@pytest.mark.parametrize("fn", OVERLOADED, ids=lambda fn: fn.__name__)
def test_the_overloads_take_what_the_function_takes(fn):
    overloads = typing.get_overloads(fn)
    # return_residual: Literal[False], Literal[True]; return_max_scores: Literal[True]
    assert len(overloads) == 3
    for overload in overloads:
        assert _positional(overload) == _positional(fn)
        assert _accepted(overload) == _accepted(fn)


def test_the_ragged_call_reaches_every_paged_attention_keyword():
    assert _accepted(js.ragged_paged_attention) - {"max_queries"} == _accepted(js.paged_attention)


def test_the_sharded_ring_call_reaches_every_ring_attention_keyword():
    sharded = _accepted(js.ring_dot_product_attention) - {"mesh", "seq_axis"}
    assert sharded == _accepted(js.ring_attention) - {"axis_name"}  # seq_axis is the axis_name


class _Everything(inspect.Signature):
    """A signature that has every parameter name, so that flax linen filters no keyword out."""

    @property
    def parameters(self):
        return _EveryName()


class _EveryName:
    def __contains__(self, name):
        return True


def test_linen_hands_its_attention_fn_only_keywords_dot_product_attention_has():
    passed = set()

    def attention_fn(query, key, value, **keywords):
        passed.update(keywords)
        return js.dot_product_attention(query, key, value, **keywords)

    attention_fn.__signature__ = _Everything()
    layer = linen.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, dropout_rate=0.5, attention_fn=attention_fn
    )
    x = jnp.ones((1, 3, 8), jnp.float32)
    params = layer.init(jax.random.key(0), x, deterministic=True)
    rngs = {"dropout": jax.random.key(1)}
    layer.apply(params, x, deterministic=False, sow_weights=True, rngs=rngs, mutable=True)
    assert {"mask", "dropout_rng", "dropout_rate", "module"} <= passed  # what linen passed
    assert passed <= set(inspect.signature(js.dot_product_attention).parameters)


def test_the_implementation_names_are_the_table_s_entries():
    from jax_sdpa._implementations import IMPLEMENTATIONS, Implementation

    # The ring and the paged cache have functions of their own (and tunables objects).
    assert set(typing.get_args(Implementation)) == IMPLEMENTATIONS.keys() - {"ring", "paged"}
