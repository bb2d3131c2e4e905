"""The ring a call runs on: its mesh axis, its size, its layout and how a device's shards lie.

Static (hashable), read by the front end that binds a ring call, the table that runs it and the
ring implementation that passes the shards round.
"""

import dataclasses
from typing import Literal

import jax.numpy as jnp
from jax import lax

Layout = Literal["contiguous", "striped"]


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """The ring a call runs on (static): the mesh axis, its size and the sequence layout."""

    axis_name: str
    shards: int
    layout: Layout
    batch_axis: str | None = None  # the mesh axes the batch and the heads are split over,
    head_axis: str | None = None
    batch_shards: int = 1  # and the devices along each
    head_shards: int = 1

    @property
    def axes(self) -> frozenset:
        """The mesh axes the call's positions, batch and head indices vary over."""
        return frozenset({self.axis_name, self.batch_axis, self.head_axis} - {None})

    @property
    def pieces(self) -> int:
        """The contiguous runs of positions each device holds: 1, or 2 when striped."""
        return 1 if self.layout == "contiguous" else 2

    def piece(self, shard, n, length: int):
        """Run ``n`` of a shard of ``length``: ``(local start, global start, size)``.

        Striped, device ``d`` holds chunks ``d`` and ``2P − 1 − d`` of the ``2P``.
        """
        size = length // self.pieces
        chunk = (
            shard
            if self.layout == "contiguous"
            else jnp.where(n == 0, shard, 2 * self.shards - 1 - shard)
        )
        return n * size, chunk * size, size

    def rotate(self, xs):
        """Passes ``xs`` to the next device of the ring."""
        perm = [(i, (i + 1) % self.shards) for i in range(self.shards)]
        return lax.ppermute(xs, self.axis_name, perm)

    def run(self, n, me, src, seq_q: int, seq_kv: int):
        """Pair ``n`` of (query run, key run) at one step: ``((start, size), global start)`` each.

        There are ``pieces²`` pairs, looped over (one copy of the sweep in the program, not one
        per pair). The key run's columns in a bias or mask follow the sharded key order: shard
        ``src`` starts at column ``src · seq_kv``.
        """
        q_start, q_offset, q_size = self.piece(me, n // self.pieces, seq_q)
        kv_start, kv_offset, kv_size = self.piece(src, n % self.pieces, seq_kv)
        kv_columns = (src * seq_kv + kv_start, kv_size)
        return ((q_start, q_size), q_offset), ((kv_start, kv_size), kv_offset), kv_columns
