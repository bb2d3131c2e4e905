"""The warp-specialized kernels' pipeline: a producer's ring of slots, consumers' turns.

A producer warpgroup copies the blocks a program sweeps over into a ring of shared-memory slots
by TMA, each slot with a barrier that says its copies landed and one that says every consumer is
done with it (:class:`Ring`); two consumers take turns at the tensor cores (:class:`Turns`).
:mod:`jax_sdpa._kernels.warp_specialized` runs the engine's tiles on them.
"""

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_sdpa._kernels.schedule import KINDS, SKIP


@dataclasses.dataclass(frozen=True)
class Turns:
    """Two consumers taking turns at the tensor cores: FlashAttention-3's ping-pong.

    A barrier both consumers arrive at and wait for, twice a step: after issuing a block's
    scores' product and before issuing its weighted sum's (:func:`product`). The second
    consumer turns once before its loop (the first once after its own), so that each computes
    its softmax while the other's products run, as ``attention_mgpu``'s schedule barrier.
    (With a ring of one slot they would wait for each other: a consumer's next block is copied
    once the other is done with the last, which it is after the turn that waits for the
    first's next scores. The forward kernel's ring has two.)
    """

    barrier: object

    def __call__(self) -> None:
        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)

    def around(self, c, loop):
        """``loop()`` in consumer ``c``: a turn before it in the second, after it in the first."""
        pl.when(c == 1)(lambda: self())  # (a lambda: jax.lax.cond hashes what it calls)
        out = loop()
        pl.when(c == 0)(lambda: self())
        return out

    def skip(self) -> None:
        """A step a consumer skips: its two turns."""
        self()
        self()


@dataclasses.dataclass(frozen=True)
class Ring:
    """The producer's ring: slots of each swept array, and their barriers."""

    slots: tuple  # a (stages, *block) shared-memory ref per swept array
    full: tuple  # a barrier per slot, per array: its copy landed
    free: object  # a barrier per slot: both consumers are done with it (all its arrays)

    @property
    def stages(self) -> int:
        return self.slots[0].shape[0]

    def slot(self, step, lo):
        """The slot of step ``step`` of a loop from ``lo`` (in the steps' dtype, x64 or not)."""
        offset = step - lo
        return lax.rem(offset, jnp.asarray(self.stages, offset.dtype))

    def fill(self, sources, step, slot) -> None:
        """The producer: the block ``step`` of each source into ``slot``.

        A source's block is a ref, or a tuple of refs (pages) that fill the slot's rows in
        turn, each copy arriving at the slot's barrier (:attr:`Swept.pieces`).
        """
        for source, ring, full in zip(sources, self.slots, self.full, strict=True):
            block = source(step)
            pieces = block if isinstance(block, tuple) else (block,)
            rows = ring.shape[1] // len(pieces)
            for n, piece in enumerate(pieces):
                at = ring.at[slot] if len(pieces) == 1 else ring.at[slot, pl.ds(n * rows, rows)]
                plgpu.copy_gmem_to_smem(piece, at, full.at[slot])

    def produce(self, sources, lo, hi, block) -> None:
        """The producer's loop: steps ``lo … hi − 1``, each's ``block(step)`` into a freed slot.

        It ends when the consumers are done with the last.
        """
        for first in range(self.stages):
            pl.when(lo + first < hi)(
                lambda first=first: self.fill(sources, block(lo + first), first)
            )

        @pl.loop(lo + self.stages, jnp.maximum(hi, lo + self.stages))
        def _(step):
            slot = self.slot(step, lo)
            plgpu.barrier_wait(self.free.at[slot])
            self.fill(sources, block(step), slot)

        # Each slot's last block: waited for too, so no barrier ends a phase ahead of its
        # waiter (JAX 0.11's simulator checks that).
        for slot in range(self.stages):
            pl.when(lo + slot < hi)(functools.partial(plgpu.barrier_wait, self.free.at[slot]))

    def consume(self, runs, lo, carry, tile, block, skip=None):
        """A consumer's loop over its ``runs`` ``(start, stop, kind)`` of the producer's steps.

        All within the producer's range from ``lo``: ``carry = tile(block(step), slots, carry,
        kind)`` on each step's block, in its slot; a :data:`SKIP` step only waits for its block
        (and runs ``skip()`` where given) and frees it. A run's ``kind`` is one of
        :data:`KINDS`, or ``kind(step)`` an index of one.
        """

        def step(kind, n, carry):
            slot = self.slot(n, lo)
            for full in self.full:
                plgpu.barrier_wait(full.at[slot])
            slots = [ring.at[slot] for ring in self.slots]

            def run(kind, carry):
                if kind != SKIP:
                    return tile(block(n), slots, carry, kind)
                if skip is not None:
                    skip()
                return carry

            if callable(kind):
                branches = [functools.partial(run, k) for k in KINDS]
                carry = lax.switch(kind(n), branches, carry)
            else:
                carry = run(kind, carry)
            plgpu.barrier_arrive(self.free.at[slot])
            return carry

        for start, stop, kind in runs:
            carry = lax.fori_loop(start, stop, functools.partial(step, kind), carry)
        return carry
