"""One registry of implementations for the behaviour tests (tokamax's ``AttentionTestBase`` idea).

Each row is an implementation, called as ``dot_product_attention`` is (``row(q, k, v, ...)``),
with what it lacks. A test says what it needs, ``@each_implementation("dropout")``, and runs on
every row; a row that lacks a need is skipped with the library's own message for it (the
refusal it raises when asked). A new implementation (the Pallas kernel) is one more row.

- ``xla``: the dense reference;
- ``chunked``: tiles of 3 × 4, which divide neither T nor S in any test: every call crosses
  blocks, pads, and (with masks) skips blocks;
- ``decode``: chunks of 4 keys, merged;
- ``paged``: :func:`~jax_sdpa.paged_attention` over the keys and values cut into pages of 4
  (a pool of every sequence's pages, in order), in chunks of 8 keys. Its queries are each
  sequence's last positions, so a mask rule that places them (causal, a window) means the same
  as ``dot_product_attention``'s only where the two agree on where the queries are: the call
  is skipped otherwise;
- ``pallas``: the fused kernel in the Pallas interpreter, tiles of 16 × 16 (Triton's least),
  which the tests' sequences do not fill: every call pads, rows and heads.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jax_sdpa as js

_PAGE = 4
_PALLAS = js.Pallas(block_q=16, block_kv=16, interpret=True)


def _refusal(call) -> str:
    """The message of the error the library raises for ``call``: what it says it lacks."""
    try:
        call()
    except (TypeError, ValueError) as error:
        return str(error)
    raise AssertionError(f"{call} was expected to be refused")


def _paged(query, key, value, bias=None, mask=None, *, implementation, **keywords):
    """``dot_product_attention(query, key, value, **keywords)`` through a paged cache."""
    batch, seq_kv = key.shape[:2]
    is_causal = keywords.pop("is_causal", False)
    placed = is_causal or keywords.get("local_window_size") is not None  # rules on positions
    alignment = keywords.pop("causal_alignment", "top_left")
    lengths = keywords.pop("key_value_seq_lengths", None)
    seq_q = query.shape[1]
    # Paged queries sit at lengths − T + i: as top-left ones where lengths = T, as bottom-right
    # ones where lengths = S.
    if placed and (lengths is not None or alignment == "top_left" and seq_q != seq_kv):
        pytest.skip("paged_attention's queries are each sequence's last positions")
    lengths = jnp.full((batch,), seq_kv, jnp.int32) if lengths is None else jnp.asarray(lengths)
    pages = -(-seq_kv // _PAGE)
    pools = (
        jnp.pad(x, ((0, 0), (0, pages * _PAGE - seq_kv), (0, 0), (0, 0))).reshape(
            batch * pages, _PAGE, *x.shape[2:]
        )
        for x in (key, value)
    )
    table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    arrays = {"bias": bias, "mask": mask}
    given = {name: x for name, x in arrays.items() if x is not None}
    options = dict(is_causal=is_causal, implementation=implementation, **given, **keywords)
    return js.paged_attention(query, *pools, table, lengths, **options)


@dataclasses.dataclass(frozen=True)
class Row:
    """An implementation: its name, what ``implementation=`` gets, the needs it lacks (and why)."""

    name: str
    implementation: Any
    lacks: dict = dataclasses.field(default_factory=dict)
    paged: bool = False

    def __call__(self, query, key, value, bias=None, mask=None, **keywords):
        call = _paged if self.paged else js.dot_product_attention
        return call(query, key, value, bias, mask, implementation=self.implementation, **keywords)


def _tiny():
    x = jnp.ones((1, 2, 1, 4))
    return x, x, x


def _dropped(implementation):
    key = jax.random.key(0)
    options = dict(dropout_rate=0.5, dropout_rng=key, implementation=implementation)
    return functools.partial(js.dot_product_attention, *_tiny(), **options)


def _paged_with(query=None, **keywords):
    pages, table, lengths = jnp.ones((1, 2, 1, 4)), jnp.zeros((1, 1), jnp.int32), jnp.array([2])
    query = _tiny()[0] if query is None else query
    return functools.partial(js.paged_attention, query, pages, pages, table, lengths, **keywords)


# Not a refusal: what the split-key products are (decode.py), which XLA fuses into one pass.
_BLEND = "the split-key blend is a product (S, K, G, T, V) that XLA fuses into its sum"

# Not a refusal either: the kernel's padding of heads to 16 and its key gradients per query head.
_PER_QUERY_HEAD = (
    "the kernel pads heads to 16 features and writes the key/value gradients of each query "
    "head, summed over the heads that share them after it"
)

ROWS = (
    Row("xla", "xla"),
    Row("chunked", js.Chunked(block_q=3, block_kv=4)),
    Row(
        "decode",
        js.Decode(block_kv=4),
        {"dropout": _refusal(_dropped("decode")), "small intermediates": _BLEND},
    ),
    Row(
        "paged",
        js.Paged(block_kv=8),
        {
            "dropout": _refusal(_paged_with(dropout_rate=0.5)),
            "bias": _refusal(_paged_with(bias=jnp.zeros((1, 1, 2, 2)))),
            "mask": _refusal(_paged_with(mask=jnp.ones((1, 1, 2, 2), bool))),
            "segment ids": _refusal(_paged_with(query_segment_ids=jnp.zeros((1, 2), jnp.int32))),
            "query lengths": _refusal(_paged_with(query_seq_lengths=jnp.array([1]))),
            "batch axes": _refusal(_paged_with(jnp.ones((2, 1, 4)))),
            "small intermediates": _BLEND,
        },
        paged=True,
    ),
    Row(
        "pallas",
        _PALLAS,
        {
            "dropout": _refusal(_dropped(_PALLAS)),
            "small intermediates": _PER_QUERY_HEAD,
        },
    ),
)


# The rows the inner loop (-m "not slow", with x64 off and on) runs every behaviour test on: the
# reference and the tiled path. The others (decode, paged, the kernel) have test files of their
# own in both, and columns in the random sweep; CI runs every behaviour test on them with x64 off.
INNER_LOOP = ("xla", "chunked")


def each_implementation(*needs: str):
    """Parametrizes a test's ``impl`` over every row; a row lacking one of ``needs`` is skipped."""
    unknown = set(needs) - {need for row in ROWS for need in row.lacks}
    if unknown:
        raise ValueError(f"no row says whether it has {sorted(unknown)}")

    def param(row: Row):
        missing = [row.lacks[need] for need in needs if need in row.lacks]
        marks = [pytest.mark.skip(reason=missing[0])] if missing else []
        if row.name not in INNER_LOOP:
            marks.append(pytest.mark.slow)
        return pytest.param(row, id=row.name, marks=marks)

    return pytest.mark.parametrize("impl", [param(row) for row in ROWS])
