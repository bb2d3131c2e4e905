"""The calls users make of the fused kernel, as a matrix: the shapes and options users have.

One list for two checks: ``tests/test_lowering.py`` lowers each call for a GPU and a TPU and
verifies every kernel module inside; ``benchmarks/bench_device.py --smoke`` runs each on a GPU
in bfloat16 against ``implementation="xla"`` in float32 (and in the interpreter, shrunk, on a
CPU). Each call is forward, or forward+backward with every gradient: the queries', keys',
values' and those of the floating-point arrays the call closes over.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jax_sdpa as js


@dataclasses.dataclass(frozen=True)
class Case:
    """A call: shapes, dtype, keywords and the arrays with gradients it closes over.

    ``keywords(case, *arrays)`` gives the call's keywords from ``arrays``, traced arguments of
    the program (shapes from ``arrays_of(case)``): their gradients are taken. Integer arrays
    (ids, lengths) are built inside ``keywords``, constants of the program.
    """

    t: int = 1000
    s: int | None = None  # T by default
    batch: int = 2
    heads: tuple = (4, 2)  # (N, K): GQA
    dims: tuple = (128, 128)  # (d_k, d_v)
    dtype: Any = jnp.bfloat16
    keywords: Callable = lambda case: {}
    arrays_of: Callable = lambda case: ()
    tpu: bool = True  # whether Mosaic lowers it (see TPU_CANNOT)

    @property
    def kv_length(self) -> int:
        return self.t if self.s is None else self.s

    def inputs(self) -> list:
        (n, k), (d_k, d_v) = self.heads, self.dims
        shapes = [(self.batch, self.t, n, d_k), (self.batch, self.kv_length, k, d_k)]
        shapes.append((self.batch, self.kv_length, k, d_v))
        qkv = [jax.ShapeDtypeStruct(shape, self.dtype) for shape in shapes]
        return qkv + [jax.ShapeDtypeStruct(s, jnp.float32) for s in self.arrays_of(self)]


def causal(case):
    return dict(is_causal=True)


def bottom_right(case):
    return dict(is_causal=True, causal_alignment="bottom_right")


def _lengths(case, which: str):
    lengths = {
        "query": dict(query_seq_lengths=jnp.array([case.t * 7 // 10, case.t], jnp.int32)),
        "key": dict(
            key_value_seq_lengths=jnp.array([case.kv_length, case.kv_length // 3], jnp.int32)
        ),
    }
    return lengths[which] if which in lengths else {**lengths["query"], **lengths["key"]}


def _segments(case):
    def ids(n):  # three packed sequences
        return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * 3 // n, (case.batch, n))

    return dict(query_segment_ids=ids(case.t), key_value_segment_ids=ids(case.kv_length))


def _alibi(case, slopes):
    def score_mod(s, b, h, i, j):
        return s - slopes[h] * jnp.abs(i - j).astype(s.dtype)

    return dict(is_causal=True, score_mod=score_mod)


def _relative_positions(case, table):  # a bias per query head and distance: 2·S entries a head
    def score_mod(s, b, h, i, j):
        return s + table[h, i - j + case.kv_length].astype(s.dtype)

    return dict(is_causal=True, score_mod=score_mod)


def _relative_positions_bf16(case, table):  # a bfloat16 row a head, read as table[h][i − j]
    def score_mod(s, b, h, i, j):
        return s + table.astype(jnp.bfloat16)[h][i - j + case.kv_length].astype(s.dtype)

    return dict(is_causal=True, score_mod=score_mod)


def _band(case):
    width = case.t * 3 // 10
    return dict(mask_mod=lambda b, h, i, j: (j <= i) & (i - j < width))


def _documents_of(length: int):
    """A document id for each of ``length`` positions: four documents."""
    return jnp.arange(length, dtype=jnp.int32) * 4 // length


def _documents(case):  # a document id per position of each sequence: a (B, T) array
    doc = _documents_of(case.batch * case.t).reshape(case.batch, case.t)  # each its own

    def mask_mod(b, h, i, j):
        return (doc[b, i] == doc[b, j]) & (j <= i)

    return dict(mask_mod=mask_mod)


def _block_mask(case, band: bool):
    doc, width = _documents_of(case.t), case.t * 3 // 10
    rule = (
        (lambda b, h, i, j: (j <= i) & (i - j < width))
        if band
        else (lambda b, h, i, j: doc[i] == doc[j])
    )
    blocks = js.create_block_mask(rule, None, None, case.t, case.t, block_q=64, block_kv=64)
    return dict(mask_mod=blocks)


def _alibi_documents_sinks(case, slopes, sinks):  # a mask_mod and is_causal: two rules
    doc = _documents_of(case.t)
    keywords = dict(_alibi(case, slopes), sinks=sinks)
    return dict(keywords, mask_mod=lambda b, h, i, j: doc[i] == doc[j])


def _made_of_literals(case):  # arrays the function makes (ALiBi's slopes, a bias per key)
    heads, length = case.heads[0], case.kv_length

    def score_mod(s, b, h, i, j):
        slopes = 2.0 ** -jnp.arange(1, heads + 1, dtype=jnp.float32)
        bias = jnp.linspace(-1.0, 1.0, length, dtype=jnp.float32)
        return s + (bias[j] - slopes[h] * (i - j).astype(jnp.float32)).astype(s.dtype)

    return dict(is_causal=True, score_mod=score_mod)


def _clipped(s, b, h, i, j):  # constants, not arrays: nothing to compute ahead
    return jnp.where(j <= i, jnp.clip(s, -30.0, 30.0), -jnp.inf)


def _sinks(case, sinks):
    return dict(is_causal=True, sinks=sinks)


def _bias_and_mask(case, bias):  # jax.nn's arrays: a bias per sequence and head, a mask
    i, j = jnp.arange(case.t)[:, None], jnp.arange(case.kv_length)[None, :]
    return dict(bias=bias, mask=((i + j) % 5 != 4)[None, None])


HEADS = lambda case: ((case.heads[0],),)  # noqa: E731

CASES = {
    # Lengths: none a multiple of the 64 × 64 tile but 1024; T ≠ S.
    "T = S = 1": Case(t=1),
    "T = S = 63": Case(t=63),
    "T = S = 65, causal": Case(t=65, keywords=causal),
    "T = S = 1000": Case(),
    "T = S = 1000, causal": Case(keywords=causal),
    "T = S = 1024, causal": Case(t=1024, keywords=causal),
    "T = S = 4095, causal": Case(t=4095, batch=1, keywords=causal),
    "T = 65, S = 63": Case(t=65, s=63),
    "T = 1000, S = 63": Case(s=63),
    "T = 1, S = 4095, bottom-right causal": Case(t=1, s=4095, keywords=bottom_right),
    "T = 63, S = 1000, bottom-right causal": Case(t=63, keywords=bottom_right),
    # Lengths, packed sequences and windows.
    "query lengths": Case(keywords=lambda c: _lengths(c, "query")),
    "key lengths": Case(keywords=lambda c: _lengths(c, "key")),
    "both lengths, causal": Case(keywords=lambda c: {**_lengths(c, "both"), **causal(c)}),
    "segment ids": Case(keywords=_segments),
    "window": Case(keywords=lambda c: dict(local_window_size=(128, 64))),
    "window, bottom-right causal, T ≠ S": Case(
        t=63, keywords=lambda c: {**bottom_right(c), "local_window_size": (200, 0)}
    ),
    # Heads.
    "MHA": Case(heads=(4, 4), keywords=causal),
    "MQA": Case(heads=(4, 1), keywords=causal),
    "d = 64": Case(dims=(64, 64), keywords=causal),
    "d = 80": Case(dims=(80, 80), keywords=causal),
    "d = 96": Case(dims=(96, 96), keywords=causal),
    "d = 256": Case(dims=(256, 256), keywords=causal),
    "d_k = 128, d_v = 64": Case(dims=(128, 64), keywords=causal),
    "d_k = 96, d_v = 256": Case(dims=(96, 256)),
    # Dtypes.
    "float16": Case(dtype=jnp.float16, keywords=causal),
    "float32": Case(dtype=jnp.float32, keywords=causal),
    # Normalizers, statistics, sinks, soft cap.
    "sigmoid": Case(keywords=lambda c: dict(is_causal=True, normalizer="sigmoid")),
    "sigmoid, max scores": Case(
        keywords=lambda c: dict(is_causal=True, normalizer="sigmoid", return_max_scores=True)
    ),
    "softmax, max scores": Case(keywords=lambda c: dict(return_max_scores=True)),
    "sinks": Case(keywords=_sinks, arrays_of=HEADS),
    "soft cap": Case(keywords=lambda c: dict(is_causal=True, logits_soft_cap=30.0)),
    "a mod of literals (jnp.clip, jnp.where to −∞)": Case(
        keywords=lambda c: dict(score_mod=_clipped)
    ),
    "arrays a mod makes of literals (computed ahead)": Case(keywords=_made_of_literals),
    # Mods over captured arrays (their gradients too) and block masks.
    "ALiBi, a small captured array": Case(keywords=_alibi, arrays_of=HEADS),
    "relative positions, a large captured table": Case(
        keywords=_relative_positions,
        arrays_of=lambda c: ((c.heads[0], 2 * c.kv_length),),
        tpu=False,
    ),
    "relative positions, a bfloat16 row a head": Case(
        keywords=_relative_positions_bf16,
        arrays_of=lambda c: ((c.heads[0], 2 * c.kv_length),),
        tpu=False,
    ),
    "documents over a (B, T) array": Case(keywords=_documents),
    "ALiBi, documents and sinks": Case(
        keywords=_alibi_documents_sinks, arrays_of=lambda c: ((c.heads[0],),) * 2
    ),
    "a bias (B, N, T, S) and a mask (1, 1, T, S) array": Case(
        keywords=_bias_and_mask,
        arrays_of=lambda c: ((c.batch, c.heads[0], c.t, c.kv_length),),
        tpu=False,
    ),
    "a band": Case(keywords=_band),
    "block mask of documents": Case(t=1000, keywords=lambda c: _block_mask(c, band=False)),
    "block mask of a band": Case(t=1000, keywords=lambda c: _block_mask(c, band=True)),
}
# Mosaic has no load at a vector of indices, which a table read at ``q_idx − kv_idx`` is, nor
# lowers a matrix read at a tile's rows and columns: the GPU's kernels take them.
TPU_CANNOT = {name for name, case in CASES.items() if not case.tpu}


def call(case: Case, implementation):
    """The case's call, a function of ``case.inputs()``: queries, keys, values, arrays."""

    def attend(q, k, v, *arrays):
        keywords = case.keywords(case, *arrays)
        return js.dot_product_attention(q, k, v, implementation=implementation, **keywords)

    return attend


def gradients(case: Case, implementation):
    """The gradients of a loss of the call's outputs wrt every input, and the outputs."""

    def loss(*args):
        outputs = call(case, implementation)(*args)
        weighted = [_weighted(x.astype(jnp.float32)) for x in jax.tree.leaves(outputs)]
        return sum(weighted), outputs

    return jax.grad(loss, argnums=tuple(range(len(case.inputs()))), has_aux=True)


def _weighted(x):
    """A sum of ``x`` with weights that differ entry by entry (a cotangent that is not flat)."""
    return (x * jnp.cos(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape))).sum()


def shrunk(case: Case, length: int) -> Case:
    """The case with no sequence longer than ``length``: for the interpreter on a CPU."""
    s = None if case.s is None else min(case.s, length)
    return dataclasses.replace(case, t=min(case.t, length), s=s)
