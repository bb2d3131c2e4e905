r"""Attention over selected keys: each query reads only the keys it lists, gathered.

DeepSeek Sparse Attention (DeepSeek-AI, DeepSeek-V3.2, 2025) picks, for each query, the top-k
keys of a cheap indexer and attends to those alone: with ``k = 2048`` of ``S = 32768`` keys a
query reads 1/16 of the cache. A mask that allowed the same keys would still read and score all
of them; here each query's keys (and values) are gathered and attended as one chunk of the
decode path (:func:`jax_sdpa._decode.split_keys`), at the positions they came from, so that the
call's mask rules, ``score_mod``, sinks and normaliser apply to them as to any key.

Indices are shared by every head of a query. Out-of-range indices (refused when concrete) and
repeats of an index count as masked: the result equals the call with the dense mask "key ``j``
is listed for query ``i``". Gradients (to the queries, the keys, the values, the mods'
arrays) are JAX's, through the gather; queries are attended a block at a time, each block
recomputed in the backward pass (``jax.checkpoint``), so no ``(T, k)`` copy of the keys exists.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa._decode import split_keys
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result
from jax_sdpa._quantized import Quantized
from jax_sdpa._tiles import check_sizes


@dataclasses.dataclass(frozen=True)
class Selected:
    """The selected-keys path's tunable: ``implementation=Selected(block_q=…)``.

    Attributes:
        block_q: Queries attended together (their gathered keys held at once).
    """

    block_q: int = 16

    def __post_init__(self):
        check_sizes(self)


def listed(indices: jax.Array, seq_kv: int) -> tuple[jax.Array, jax.Array]:
    """``(indices, valid)`` of one query's ``(k,)`` indices: sorted, repeats and strays invalid.

    The order of a query's keys does not change its attention; sorted, a repeat sits right
    after its first occurrence.
    """
    indices = jnp.sort(indices)
    repeat = jnp.concatenate([jnp.zeros((1,), bool), indices[1:] == indices[:-1]])
    valid = (indices >= 0) & (indices < seq_kv) & ~repeat
    return jnp.clip(indices, 0, seq_kv - 1), valid


def selected_sequence(
    formula: Formula, options: Selected, query, key, value, arrays: CallArrays, indices
) -> Result:
    """One sequence's queries ``(T, N, H)``, each attending to its ``indices[t]`` ``(k,)``."""
    seq_kv = key.shape[0]
    key, value = (x.per_token() if isinstance(x, Quantized) else x for x in (key, value))

    def one_query(t, query, indices):
        indices, valid = listed(indices, seq_kv)
        keys, values = (
            jax.tree.map(lambda x: jnp.take(x, indices, axis=0)[None], x) for x in (key, value)
        )
        # The listed keys' mask, in the place of the call's per-logit mask (refused with these).
        tile = dataclasses.replace(arrays, mask=valid[None, None, :])
        return split_keys(
            formula, query[None], keys, values, tile, q_offset=t, key_positions=indices[None]
        )

    seq_q = query.shape[0]
    args = (jnp.arange(seq_q, dtype=indices.dtype), query, indices)
    one = jax.checkpoint(lambda args: one_query(*args))
    result = lax.map(one, args, batch_size=min(options.block_q, seq_q))
    return jax.tree.map(lambda x: x[:, 0], result)
