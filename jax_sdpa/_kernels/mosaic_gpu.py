r"""The Mosaic GPU backend, on Hopper GPUs (sm_90): the forward pass as a warp-specialized kernel.

A ``plgpu.kernel`` of three warpgroups, as FlashAttention-3 and JAX's own ``attention_mgpu`` are
built: a producer copies the key and value blocks a program sweeps over into a ring of
``STAGES`` shared-memory slots by TMA, each slot with a barrier that says it is full and one that
says both consumers are done with it; two consumers each hold ``block_q`` rows and run the
engine's own tile on every block: its products are ``wgmma`` on the slots (:func:`_product`),
everything between them (the formula, the mods, the mask rules, the online softmax) is
:class:`~jax_sdpa._tiles.Tiles`' code, the XLA paths' and the Triton kernel's, traced into the
kernel. The blocks a rule excludes are not copied; those it allows wholly run with no mask
(:func:`~jax_sdpa._tiles.runs`). Arrays are read and written in the caller's ``(T, heads, d)``
layout, in place (strided TMA). The backward pass is the Triton programs' (not written here yet).

Written for the Warpgroup lowering semantics (Mosaic GPU infers the register layouts): JAX 0.11
and later. ``plgpu.InterpretGPUParams`` runs the same kernel on a CPU (shared memory, threads
and barriers simulated), where the weights that meet a product go through shared memory: the
simulator has no ``wgmma`` from registers.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._indices import INDEX
from jax_sdpa._kernels.backend import Backend
from jax_sdpa._kernels.positions import tile_positions
from jax_sdpa._kernels.programs import Plan, Shared
from jax_sdpa._tiles import Blocks, runs

CONSUMERS = 2  # warpgroups that compute, each its own rows; a third copies
STAGES = 2  # shared-memory slots of the producer's ring
MIN_WIDTH = 64  # a head's width: 128 bytes of 16-bit numbers, the rows its TMA swizzles


def sides(width: int) -> tuple[int, int]:
    """``(block_q, block_kv)`` for heads of ``width``.

    A consumer's rows are one ``wgmma``'s 64; 128 keys a step, but 64 for ``width`` 256,
    whose ring of 128 would not fit shared memory.
    """
    return 64, 128 if width <= 128 else 64


# A run's kind: its tiles run with the mask rule, or without (the rule allows them wholly), or
# not at all (the blocks of the producer's range that a consumer's rows never meet: it waits
# for each and frees it).
RULE, FULL, SKIP = "rule", "full", "skip"
# Its programs' own rules: a tile's positions as the products' (``wgmma``'s) register layout.
MOSAIC_GPU = Backend(
    lambda tunables: None,
    rules=tile_positions(lambda iota: plgpu.layout_cast(iota, plgpu.Layout.WGMMA)),
)


def _product(staging):
    """The forward tile's :func:`~jax_sdpa._steps.cast_product` as ``wgmma``.

    The raw scores ``q · kᵀ`` (``td,sd->ts``) of two refs in shared memory; the weighted sum
    ``p · v`` (``ts,sd->td``) of the weights (an array) and a ref, the weights from registers,
    or through ``staging`` (shared memory) under the simulator, which has no ``wgmma`` from
    registers (``staging`` None on a GPU).
    """

    def product(spec: str, a, b, dtype, *, precision=None):
        if spec == "td,sd->ts":
            shape, b = (a.shape[0], b.shape[0]), b.transpose((1, 0))
        else:
            shape, a = (a.shape[0], b.shape[1]), a.astype(b.dtype)
            if staging is not None:
                staging[...] = a
                plgpu.commit_smem()
                a = staging

        def run(acc):
            plgpu.wgmma(acc, a, b)
            return acc[...]

        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

    return product


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The producer's ring: ``STAGES`` slots of each swept array, and their barriers."""

    slots: tuple  # a (STAGES, block, d) shared-memory ref per swept array
    full: tuple  # a barrier per slot, per array: its copy landed
    free: object  # a barrier per slot: both consumers are done with it (all its arrays)

    def fill(self, sources, step, slot) -> None:
        """The producer: the block ``step`` of each source into ``slot``."""
        for source, ring, full in zip(sources, self.slots, self.full, strict=True):
            plgpu.copy_gmem_to_smem(source(step), ring.at[slot], full.at[slot])

    def produce(self, sources, lo, hi) -> None:
        """The producer's loop: blocks ``lo … hi − 1``, each into the slot freed for it."""
        for first in range(STAGES):
            pl.when(lo + first < hi)(functools.partial(self.fill, sources, lo + first, first))

        @pl.loop(lo + STAGES, jnp.maximum(hi, lo + STAGES))
        def _(step):
            slot = lax.rem(step - lo, STAGES)
            plgpu.barrier_wait(self.free.at[slot])
            self.fill(sources, step, slot)

    def consume(self, runs, lo, carry, tile):
        """A consumer's loop over its ``runs`` ``(start, stop, kind)``.

        All within the producer's range from ``lo``: ``carry = tile(step, slots, carry, kind)``
        on each block, in its slot; a :data:`SKIP` run only waits for its blocks and frees them.
        """

        def step(kind, n, carry):
            slot = lax.rem(n - lo, STAGES)
            for full in self.full:
                plgpu.barrier_wait(full.at[slot])
            if kind != SKIP:
                carry = tile(n, [ring.at[slot] for ring in self.slots], carry, kind)
            plgpu.barrier_arrive(self.free.at[slot])
            return carry

        for start, stop, kind in runs:
            carry = lax.fori_loop(start, stop, functools.partial(step, kind), carry)
        return carry


def _laid_out(state: online_softmax.State) -> online_softmax.State:
    """A consumer's state in ``wgmma``'s register layouts.

    Its rows' vectors as the products' rows (layout inference, left to find them across the
    loops, runs out of attempts).
    """
    rows, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA
    return jax.tree.map(lambda x: plgpu.layout_cast(x, tile if x.ndim == 2 else rows), state)


def _static(x):
    """A bound the interpreter found constant (a NumPy scalar) as a Python int.

    Mosaic GPU's indexing takes those; a traced bound stays as it is.
    """
    return int(x) if isinstance(x, np.generic | np.ndarray) else x


def _key_runs(plan: Plan, shared: Shared, n, span: tuple, whole: tuple) -> tuple:
    """A consumer's runs over the key blocks and the producer's range ``(lo, hi)``.

    ``span`` is the consumer's rows, ``whole`` the program's (all its consumers'), each
    ``(lo, hi)`` from the first query. A run is ``(start, stop,
    kind)``: :data:`RULE` (its tiles run with the rule), :data:`FULL` (without: the rule allows
    them wholly) or :data:`SKIP` (blocks of the producer's range that the consumer's rows never
    meet). The producer's range is the rule's for the whole block, which holds each
    consumer's (the rules' ranges are intervals).
    """
    size = plan.tiles.block_kv
    kinds = []  # static: whether the call has a rule decides them

    def bounds(arrays, _, offsets, __):
        blocks = Blocks("kv", offsets[1], size, plan.seq_kv // size)
        start = offsets[0]
        own, union = (runs(arrays.rule, blocks, (start + a, start + b)) for a, b in (span, whole))
        kinds.extend(FULL if rule is None else RULE for *_, rule in own)
        ends = [(a, b) for a, b, _ in own] + [(union[0][0], union[-1][1])]
        return [tuple(jnp.asarray(x, INDEX) for x in pair) for pair in ends]

    *own, (lo, hi) = jax.tree.map(_static, plan.run(bounds, shared, n))
    own = [(a, b, kind) for (a, b), kind in zip(own, kinds, strict=True)]
    return [(lo, own[0][0], SKIP), *own, (own[-1][1], hi, SKIP)], lo, hi


def forward(plan: Plan, query, key, value, shared: Shared, out_dtype, interpret=None) -> tuple:
    """``(out, lse, top)`` of ``(T, N, H)`` queries against ``(S, K, H)`` keys and values.

    The arrays as :func:`jax_sdpa._kernels.calls.padded` gives them, ``T`` a multiple of
    ``CONSUMERS · block_q``; ``out`` ``(T, N, V)`` in ``out_dtype``, the rows' ``lse`` and largest
    scores ``(T, N)``. A program per head and ``CONSUMERS · block_q`` rows: each consumer sweeps
    its ``block_q`` rows over the keys its rows may see, the producer copying the union.
    ``interpret``: a ``plgpu.InterpretGPUParams`` to run it on the simulator.
    """
    plan = dataclasses.replace(plan, backend=MOSAIC_GPU)
    tiles = plan.tiles
    block_q, block_kv = tiles.block_q, tiles.block_kv
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    leaves, tree = jax.tree.flatten(shared)
    rows = CONSUMERS * block_q

    def kernel(q_ref, k_ref, v_ref, *refs):
        *shared_leaves, out_ref, lse_ref, top_ref, scratch = refs
        shared_refs = jax.tree.unflatten(tree, shared_leaves)
        q_smem, o_smem, stats, k_ring, v_ring, q_full, kv_full, kv_free, staging = scratch
        n, c = lax.axis_index("heads"), lax.axis_index("wg")
        first = lax.axis_index("blocks") * rows
        start = first + jnp.minimum(c, CONSUMERS - 1) * block_q
        span, whole = (start, start + block_q), (first, first + rows)
        own, lo, hi = _key_runs(plan, shared_refs, n, span, whole)
        ring = _Ring((k_ring, v_ring), kv_full, kv_free)

        @pl.when(c == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = n // plan.group
            keys = lambda ref: lambda j: ref.at[pl.ds(j * block_kv, block_kv), kv_head]  # noqa: E731
            ring.produce((keys(k_ref), keys(v_ref)), lo, hi)

        @pl.when(c < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q = q_smem.at[c]
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(start, block_q), n], q, q_full.at[c])
            plgpu.barrier_wait(q_full.at[c])
            staged = None if staging is None else staging.at[c]
            tiled = dataclasses.replace(tiles, product=_product(staged))

            def init(arrays, sink, offsets, _):
                like = jnp.zeros((), query.dtype)  # (a kernel's state need not vary)
                return online_softmax.init(like, (block_q,), (block_q, value_width), sink)

            def tile(j, slots, state, kind):
                def body(arrays, sink, offsets, _):
                    tile = dataclasses.replace(arrays, rule=arrays.rule if kind == RULE else None)
                    at = (offsets[0] + start, offsets[1] + j * block_kv)
                    return tiled.forward_tile(state, q, *slots, tile, *at)

                return _laid_out(plan.run(body, shared_refs, n))

            state = ring.consume(own, lo, _laid_out(plan.run(init, shared_refs, n)), tile)
            out, lse = tiles.formula.normalizer.finish(state, out_dtype)
            o = (q_smem if o_smem is None else o_smem).at[c]  # (the queries are read by now)
            o[...] = out
            stats.at[0, c][...] = lse
            stats.at[1, c][...] = online_softmax.top_scores(state)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o, out_ref.at[pl.ds(start, block_q), n])
            for k, ref in enumerate((lse_ref, top_ref)):
                plgpu.copy_smem_to_gmem(stats.at[k, c], ref.at[n, pl.ds(start, block_q)])
            plgpu.wait_smem_to_gmem(0)

    stats = jax.ShapeDtypeStruct((heads, seq_q), jnp.float32)
    scratch = (
        plgpu.SMEM((CONSUMERS, block_q, width), query.dtype),
        None
        if (value_width, out_dtype) == (width, query.dtype)
        else plgpu.SMEM((CONSUMERS, block_q, value_width), out_dtype),
        plgpu.SMEM((2, CONSUMERS, block_q), jnp.float32),
        plgpu.SMEM((STAGES, block_kv, width), key.dtype),
        plgpu.SMEM((STAGES, block_kv, value_width), value.dtype),
        plgpu.Barrier(num_barriers=CONSUMERS),
        (plgpu.Barrier(num_barriers=STAGES),) * 2,
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=STAGES),
        plgpu.SMEM((CONSUMERS, block_q, block_kv), query.dtype) if interpret else None,
    )
    out, lse, top = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((seq_q, heads, value_width), out_dtype), stats, stats),
        scratch_types=(scratch,),
        grid=(heads, seq_q // rows),
        grid_names=("heads", "blocks"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=interpret,
    )(query, key, value, *leaves)
    return out, lse.T, top.T
