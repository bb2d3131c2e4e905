"""One call, as every implementation receives it.

Its arrays (:class:`Inputs`, a pytree) and its static settings (:class:`Config`, hashable).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
from jaxtyping import Array

from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result, over_batch
from jax_sdpa._latent import LatentValues
from jax_sdpa._quantized import Quantized
from jax_sdpa._ring_spec import RingSpec

Output = Literal["attention", "attention_and_weights", "weights"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Inputs:
    """The checked arrays of one call, in canonical form (a pytree, so it can enter ``jax.jit``).

    ``query`` ``(*batch, T, N, H)``, ``key`` ``(*batch, S, K, H)``, ``value`` ``(*batch, S, K, V)``;
    the leaves of ``arrays`` lead with the batch axes (each full or 1). A paged call's ``key`` and
    ``value`` are the pools of pages ``(1, P, page_size, K, ·)``, shared by the batch, and
    ``page_table`` ``(B, pages)`` says which pages each sequence's keys are.
    """

    query: Array
    key: Array
    value: Array
    arrays: CallArrays
    page_table: Array | None = None
    key_indices: Array | None = None  # (*batch, T, k): the keys each query attends (selected)

    @property
    def seq_kv(self) -> int:
        """``S``, the keys of each sequence (a paged sequence's pages end to end)."""
        pages = 1 if self.page_table is None else self.page_table.shape[-1]
        return pages * self.key.shape[-3]

    def over_batch(self, sequence: Callable, *, sequential: bool = False) -> Result:
        """``sequence(query, key, value, arrays)`` for one sequence, mapped over the batch."""
        batch_shape = self.query.shape[:-3]
        args = (self.query, self.key, self.value, self.arrays)
        return over_batch(sequence, batch_shape, *args, sequential=sequential)

    @property
    def quantized(self) -> bool:
        """Whether the keys or values are a quantized cache (:class:`~jax_sdpa.Quantized`)."""
        return any(isinstance(x, Quantized) for x in (self.key, self.value))

    @property
    def values_like(self):
        """The values, or the shape and dtype that :class:`~jax_sdpa.LatentValues` stand for."""
        return self.value.like(self.key) if isinstance(self.value, LatentValues) else self.value


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one call: hashable, so it can key ``jax.jit``'s cache."""

    formula: Formula
    output: Output = "attention"
    implementation: str = "xla"
    tunables: Any = None  # the implementation's tunables (Chunked(...), ...), if it has any
    ring: RingSpec | None = None
    max_scores: bool = False  # whether the call returns them (cuDNN does not give them)
    residual: bool = False  # whether it returns the log-sum-exp (cuDNN's has no gradient)
