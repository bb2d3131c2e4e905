"""Sweeps over blocks: the loops of a tile engine over the blocks a mask rule may allow.

A sweep goes over the blocks of one axis (:class:`Blocks`) for one block of the other: blocks a
rule excludes entirely are in no loop, blocks it allows entirely run without it (:func:`runs`,
:func:`sweep`); an opaque rule's tiles are classified as they are met (:func:`guarded`).
"""

import functools
from typing import Literal, NamedTuple

import jax.numpy as jnp
from jax import lax

from jax_sdpa._formula import CallArrays
from jax_sdpa._indices import INDEX, Index, positions
from jax_sdpa._masks import MaskRule


def loop(lower, upper, body, carry):
    """``lax.fori_loop`` whose index is an :data:`~jax_sdpa._indices.INDEX`, whatever x64 says.

    Python-int bounds stay Python ints: the loop then has a known trip count, a ``scan`` that
    reverse mode can differentiate (a gradient of a gradient goes through the backward pass's
    loops); traced bounds (a mask rule's ranges) are cast alike.
    """
    if not all(isinstance(bound, int) for bound in (lower, upper)):
        lower, upper = jnp.asarray(lower, INDEX), jnp.asarray(upper, INDEX)
    return lax.fori_loop(lower, upper, lambda n, c: body(n.astype(INDEX), c), carry)


class Blocks(NamedTuple):
    """What a sweep goes over: ``count`` blocks of ``size`` positions along ``axis``.

    ``axis`` is ``"kv"`` (the keys) or ``"q"``; the first block starts at global ``offset``.
    """

    axis: Literal["kv", "q"]
    offset: Index
    size: int
    count: int

    def tile(self, n) -> tuple:
        """Block ``n`` as ``(global start, size)``."""
        return self.offset + n * self.size, self.size


def sweep(step, rule: MaskRule | None, blocks: Blocks, span: tuple, carry, lists=None):
    """``carry = step(n, carry, tile_rule)`` over the blocks ``n`` that ``rule`` may allow.

    ``lists`` ``(count, order)``, a block mask's list of the blocks
    (:func:`~jax_sdpa._tiles.listed_blocks`), if there is one: the loop then runs over the
    blocks it lists, no others, each with the rule. Otherwise the loops are :func:`runs`.
    """
    if rule is not None and lists is not None:
        count, order = lists
        return loop(0, count, lambda m, c: step(order[m], c, rule), carry)
    for start, stop, tile_rule in runs(rule, blocks, span):
        carry = loop(start, stop, functools.partial(step, rule=tile_rule), carry)
    return carry


def runs(rule: MaskRule | None, blocks: Blocks, span: tuple) -> tuple:
    """The runs ``(start, stop, tile_rule)`` of the blocks of ``blocks`` that ``rule`` may allow.

    ``span`` is the global ``(lo, hi)`` of the other axis's block: the rule's
    ``kv_range(*span)`` (or ``q_range``) is where it may allow anything, its ``kv_full_range``
    where it allows everything. Blocks outside the first range are in no run; blocks wholly
    inside the second run with ``tile_rule=None``, no mask to evaluate; the blocks in between
    run with the rule. The runs are in order, each ``start ≤ stop``.
    """
    if rule is None:
        return ((0, blocks.count, None),)
    reach, full_reach = {
        "kv": (rule.kv_range, rule.kv_full_range),
        "q": (rule.q_range, rule.q_full_range),
    }[blocks.axis]
    offset, size, count = blocks.offset, blocks.size, blocks.count
    lo, hi = (x - offset for x in reach(*span))
    lo = jnp.clip(lo // size, 0, count)
    hi = jnp.clip(-(-hi // size), lo, count)  # (an empty range stays in order: lo ≤ hi)
    full_lo, full_hi = (x - offset for x in full_reach(*span))
    full_lo = jnp.clip(-(-full_lo // size), lo, hi)
    full_hi = jnp.clip(full_hi // size, full_lo, hi)
    return ((lo, full_lo, rule), (full_lo, full_hi, None), (full_hi, hi, rule))


def guarded(tile, skip, arrays: CallArrays, blocks: Blocks, other: tuple):
    """``tile(n, x, rule)`` that first reads the class of an opaque rule's tile.

    The tile is block ``n`` of ``blocks`` against the block ``other``, ``(global start, size)``,
    of the other axis. A tile the rule excludes entirely gives ``skip(n, x)``; one it allows
    entirely runs without the rule. Rules with exact ranges (the built-in ones) are left to
    :func:`sweep`. ``x`` is what the branches take and give: keep it small (a whole-sequence
    array there is copied).
    """

    def classify(n, rule):
        pair = (other, blocks.tile(n)) if blocks.axis == "kv" else (blocks.tile(n), other)
        return tile_class(rule, arrays, *pair)

    def guard(n, x, rule):
        if rule is None or not rule.opaque:
            return tile(n, x, rule)
        empty, full = classify(n, rule)

        def run(x):
            with_rule = functools.partial(tile, n, rule=rule)
            return lax.cond(full, functools.partial(tile, n, rule=None), with_rule, x)

        return lax.cond(empty, functools.partial(skip, n), run, x)

    return guard


def tile_class(rule: MaskRule, arrays: CallArrays, q_block: tuple, kv_block: tuple):
    """``rule.tile_class`` of the tile ``q_block × kv_block``, each ``(global start, count)``."""
    q_idx, kv_idx = (positions(start, count) for start, count in (q_block, kv_block))
    batch, heads = arrays.indices()
    return rule.tile_class(q_idx, kv_idx, batch, jnp.atleast_1d(heads))
