"""The caches the kernels read as they are: pages of a pool, 8-bit keys and values, a latent.

:func:`cache_forward` is :func:`~jax_sdpa._kernels.calls.forward` of keys and values kept as a
server keeps them: in :class:`Pages` of a pool (``paged_attention``'s), or quantized
(:class:`~jax_sdpa.Quantized`), or both; or a shared latent, the values the keys' first
features (:class:`~jax_sdpa.LatentValues`). The Mosaic GPU kernel reads them in place: each
block of keys copied page by page, 8 bits and scales, a latent's once for both products. Around
it, the scales are made heads first (a
copy of :math:`4/H` of the 8-bit cache's bytes, float8's one scale a head broadcast to one a
token), and, as for any cache, keys that are not whole programs or heads that are not 64, 128
or 256 wide are padded (a copy). The other backends read plain arrays (:func:`plain`): the
pages gathered, the 8 bits widened and a latent's values sliced first, a copy of the
sequence's keys and values.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa._formula import CallArrays
from jax_sdpa._jax_compat import GPU_SIMULATOR
from jax_sdpa._kernels import mosaic_gpu
from jax_sdpa._kernels.calls import block_mask_arrays, forward, plan_for, varying_as_inputs
from jax_sdpa._kernels.fitting import on_mosaic_gpu
from jax_sdpa._latent import LatentValues
from jax_sdpa._quantized import Quantized
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._tiles import Tiles
from jax_sdpa._tunables import Pallas


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
    """A sequence's keys and values in pages: ``table`` ``(pages,)`` of ``(P, page, K, ·)``.

    The pools are arrays, or :class:`~jax_sdpa.Quantized` with a scale per token; the values
    may be a shared latent's, the keys' first features (:class:`~jax_sdpa.LatentValues`).
    """

    key: jax.Array | Quantized
    value: jax.Array | Quantized | LatentValues
    table: jax.Array

    @property
    def length(self) -> int:
        return self.table.shape[0] * self.key.shape[1]

    def gathered(self) -> tuple:
        """The sequence's keys and values, ``(S, K, ·)``: a copy of its pages."""

        def gather(x):
            return x[self.table].reshape(-1, *x.shape[2:])

        return tuple(jax.tree.map(gather, x) for x in (self.key, self.value))

    def padded(self, length: int) -> "Pages":
        """The pages of ``length`` keys (whole pages): the last page repeated after them."""
        extra = length // self.key.shape[1] - self.table.shape[0]
        return dataclasses.replace(self, table=jnp.pad(self.table, (0, extra), mode="edge"))


def key_value(keys) -> tuple:
    """``(key, value)`` of ``keys``: the pools of :class:`Pages`, or the pair itself."""
    return (keys.key, keys.value) if isinstance(keys, Pages) else keys


def plain(keys, accumulated: bool = False) -> tuple:
    """``(key, value)`` of ``keys`` as float arrays: pages gathered, 8 bits widened (copies).

    A shared latent's values (:class:`~jax_sdpa.LatentValues`) sliced from its keys (a copy).

    In their dtypes, or (``accumulated``) in those their sums accumulate in.
    """
    key, value = keys.gathered() if isinstance(keys, Pages) else keys

    def widened(x):
        dtype = accumulation_dtype(x.dtype) if accumulated else x.dtype
        return x.dequantize(dtype) if isinstance(x, Quantized) else x.astype(dtype)

    key = widened(key)
    return key, value.of(key) if isinstance(value, LatentValues) else widened(value)


def _scales_heads_first(cache):
    """A quantized cache's scale ``(…, K, 1)`` as ``(K, …)``: a head's are then a run."""
    if not isinstance(cache, Quantized):
        return cache
    return Quantized(cache.values, jnp.moveaxis(cache.scale[..., 0], -1, 0))


def cache_forward(
    tiles: Tiles, tunables: Pallas, query, keys, arrays: CallArrays, offsets=(0, 0), lists=None
):
    """:func:`~jax_sdpa._kernels.calls.forward` of ``keys``: ``(out, lse, max_scores)``.

    ``keys``: ``(key, value)`` (either may be quantized, or ``value`` a shared latent's
    :class:`~jax_sdpa.LatentValues`), or :class:`Pages` whose table's pages are all inside the
    pool, whole multiples of the kernels' programs of keys. The Mosaic GPU kernel reads them as
    they are (on its simulator, or on ``cuda``; quantized heads up to 128 wide, a latent up to
    576, :func:`~jax_sdpa._kernels.mosaic_gpu.reads_in_place`); elsewhere they are made plain
    arrays first (:func:`plain`). ``lists``: a block mask's, of keys that are not pages.
    """
    paged = isinstance(keys, Pages)
    key, value = key_value(keys)
    latent = isinstance(value, LatentValues)
    arrays_as_they_are = not (latent or any(isinstance(x, Quantized) for x in (key, value)))
    if not paged and arrays_as_they_are:
        return forward(tiles, tunables, query, key, value, arrays, offsets, lists=lists)

    def elsewhere(inputs):
        query, keys = inputs
        return forward(tiles, tunables, query, *plain(keys), arrays, offsets, lists=lists)

    if not (on_mosaic_gpu(tunables) and mosaic_gpu.reads_in_place(key, value)):
        return elsewhere((query, keys))
    plan = plan_for(tiles, tunables, query, keys.length if paged else key.shape[0], arrays, lists)

    def kernel(inputs):
        query, keys = inputs
        key, value = key_value(keys)
        return mosaic_gpu.forward(
            plan,
            query,
            _scales_heads_first(key),
            _scales_heads_first(value),
            plan.inputs(arrays, offsets, lists),
            (key if latent else value).dtype,
            None if paged else block_mask_arrays(arrays, offsets),
            keys.table if paged else None,
        )

    if isinstance(tunables.interpret, GPU_SIMULATOR):
        return kernel((query, keys))
    return lax.platform_dependent((query, keys), cuda=varying_as_inputs(kernel), default=elsewhere)
