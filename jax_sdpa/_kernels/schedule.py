"""Which blocks a warp-specialized kernel's programs sweep: the rule's ranges, or a mask's lists.

A program's producer copies blocks of the swept axis into its ring; each of its
:data:`CONSUMERS` holds its own positions of the other axis and runs its tile on each block, of
one of :data:`KINDS`: with the mask rule, without it (the rule allows the tile wholly), or not
at all (it only waits for the block and frees it). :func:`ranged` finds the blocks from the
rule's ranges (:func:`~jax_sdpa._sweeps.runs`), in the kernel; a block mask's :class:`Lists` are
computed by XLA outside it, from the mask's classes, and read in it (:meth:`Lists.steps`). Both
give :class:`Steps`.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdpa._indices import INDEX, listed, positions
from jax_sdpa._kernels.programs import Plan, Shared
from jax_sdpa._sweeps import Blocks, runs

CONSUMERS = 2  # warpgroups that compute, each its own rows; a third copies

# A run's kind: its tiles run with the mask rule, or without (the rule allows them wholly), or
# not at all (the blocks of the producer's range that a consumer's positions never meet: it
# waits for each and frees it).
RULE, FULL, SKIP = "rule", "full", "skip"
KINDS = (SKIP, RULE, FULL)  # a listed tile's kind, held by its index


def _static(x):
    """A bound the interpreter found constant (a NumPy scalar) as a Python int.

    Mosaic GPU's indexing takes those; a traced bound stays as it is.
    """
    return int(x) if isinstance(x, np.generic | np.ndarray) else x


def held_start(program, consumer, held: int, split: bool = False):
    """The first of the ``held`` positions a consumer holds in program ``program``.

    Each consumer its own, one after the other; or (``split``) all the program's same ones.
    """
    return (program if split else program * CONSUMERS + consumer) * held


@dataclasses.dataclass(frozen=True)
class Steps:
    """The producer's steps ``lo … hi − 1``, the block of each, and a consumer's runs of them.

    A run is ``(start, stop, kind)`` (:meth:`Ring.consume`).
    """

    lo: jax.Array
    hi: jax.Array
    block: Callable  # step -> the swept block it copies
    runs: list


def ranged(plan: Plan, shared: Shared, n, axis: str, span: tuple, whole: tuple) -> Steps:
    """A consumer's runs over the ``axis`` blocks the rule's ranges hold, and the producer's.

    ``span`` is the consumer's positions of the other axis, ``whole`` the program's (all its
    consumers'), each ``(lo, hi)`` from that axis's first. The producer's steps are the blocks
    of the rule's range for the whole program, which holds each consumer's (the rules' ranges
    are intervals); a consumer's runs are :data:`RULE` (its tiles run with the rule),
    :data:`FULL` (without: the rule allows them wholly) or :data:`SKIP` (blocks of the
    producer's range that the consumer's positions never meet).
    """
    forward = axis == "kv"
    size = plan.tiles.block_kv if forward else plan.tiles.block_q
    count = (plan.seq_kv if forward else plan.seq_q) // size
    kinds = []  # static: whether the call has a rule decides them

    def bounds(arrays, _, offsets, __):
        swept, held = (offsets[1], offsets[0]) if forward else (offsets[0], offsets[1])
        blocks = Blocks(axis, swept, size, count)
        own, union = (runs(arrays.rule, blocks, (held + a, held + b)) for a, b in (span, whole))
        kinds.extend(FULL if rule is None else RULE for *_, rule in own)
        lo, hi = union[0][0], union[-1][1]
        # (within the producer's: a consumer whose range is empty may have it anywhere)
        ends = [tuple(jnp.clip(x, lo, hi) for x in run[:2]) for run in own] + [(lo, hi)]
        return [tuple(jnp.asarray(x, INDEX) for x in pair) for pair in ends]

    *own, (lo, hi) = jax.tree.map(_static, plan.run(bounds, shared, n))
    own = [(a, b, kind) for (a, b), kind in zip(own, kinds, strict=True)]
    runs_ = [(lo, own[0][0], SKIP), *own, (own[-1][1], hi, SKIP)]
    return Steps(lo, hi, lambda step: step, runs_)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Lists:
    """A block mask's blocks for each program of a warp-specialized kernel: FlexAttention's lists.

    For each query head (or one for all) and program, how many of the swept blocks its
    consumers' tiles meet and which, those first (``count``, ``blocks``); and each consumer's
    kind of its tile with each of them, an index of :data:`KINDS` (``kinds``). The producer
    copies the listed blocks; each consumer skips its tile, or runs it with the rule or
    without. Arrays outside a kernel, refs in it.
    """

    count: jax.Array  # (heads or 1, programs)
    blocks: jax.Array  # (heads or 1, programs, swept blocks)
    kinds: jax.Array  # (heads or 1, programs, swept blocks, CONSUMERS)

    @classmethod
    def of(
        cls, arrays, axis: str, held: int, size: int, shape: tuple, split: bool = False
    ) -> "Lists":
        """The lists of ``arrays.rule``, an opaque rule (a block mask's classes, read).

        For programs of :data:`CONSUMERS` · ``held`` positions (or, ``split``, of ``held`` that
        all consumers hold) sweeping the ``axis`` blocks of ``size``; ``shape``: ``(programs,
        swept blocks)``. Both axes from position 0.
        """
        rule, (batch, heads) = arrays.rule, arrays.indices()
        heads = jnp.atleast_1d(heads)
        heads = heads if rule.per_head else heads[:1]

        def kind(head, program, block, consumer):
            own = positions(held_start(program, consumer, held, split), held)
            swept = positions(block * size, size)
            q_idx, kv_idx = (own, swept) if axis == "kv" else (swept, own)
            empty, full = rule.tile_class(q_idx, kv_idx, batch, head[None])
            kind = jnp.where(full, KINDS.index(FULL), KINDS.index(RULE))
            return jnp.where(empty, KINDS.index(SKIP), kind).astype(INDEX)

        for mapped in range(3, -1, -1):  # (head, program, block, consumer): from the last
            kind = jax.vmap(kind, in_axes=tuple(0 if k == mapped else None for k in range(4)))
        kinds = kind(heads, *(jnp.arange(count, dtype=INDEX) for count in (*shape, CONSUMERS)))
        count, blocks = listed((kinds != KINDS.index(SKIP)).any(-1))
        return cls(count, blocks, jnp.take_along_axis(kinds, blocks[..., None], axis=2))

    def steps(self, n, program, consumer) -> Steps:
        """The producer's steps, and ``consumer``'s run, in program ``program`` of head ``n``."""
        head = 0 if self.count.shape[0] == 1 else n
        count = self.count[head, program]
        blocks, kinds = self.blocks.at[head, program], self.kinds.at[head, program]
        return Steps(0, count, lambda k: blocks[k], [(0, count, lambda k: kinds[k, consumer])])
