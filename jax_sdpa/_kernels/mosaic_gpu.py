r"""The Mosaic GPU backend, on Hopper GPUs (sm_90): the forward and backward kernels.

Each is a warp-specialized kernel (:mod:`jax_sdpa._kernels.warp_specialized`: a TMA producer,
two ``wgmma`` consumers running the engine's tiles), reading and writing arrays in the caller's
``(T, heads, d)`` layout, in place (strided TMA). The forward kernel's consumers hold ``block_q``
rows each and sweep the keys and values.

The backward pass is two kernels of the same shape, as FlashAttention-2's: one per block of
queries, whose consumers sweep the keys for the queries' gradient, :math:`dQ = \sum_j dS_j K_j`;
one per block of keys, whose consumers hold their keys and values and sweep the queries (and
the rows' terms) for :math:`dK`, :math:`dV`. Each tile is the engine's
(:meth:`~jax_sdpa._tiles.Tiles.tile_gradient`); the products whose left operand is a tile
transposed (:math:`P^\top dO`, :math:`dS^\top Q`) take it through shared memory.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._kernels.atomics import with_sums
from jax_sdpa._kernels.programs import Plan, Shared
from jax_sdpa._kernels.warp_specialized import (
    CONSUMERS,
    MOSAIC_GPU,
    ROWS,
    STAGES,
    InSmem,
    Program,
    Swept,
    head_blocks,
    in_memory_backend,
    laid_out,
    load,
    read_along,
    simulated,
    staging_memory,
    store,
    warp_specialized,
)
from jax_sdpa._latent import LatentValues
from jax_sdpa._quantized import Quantized
from jax_sdpa._tiles import BackwardRows

MIN_WIDTH = 64  # a head's width: 128 bytes of 16-bit numbers, the rows its TMA swizzles
MAX_WIDTH = 256  # the widest heads the kernels take (a shared latent's aside, reads_in_place)
LATENT_WIDTH = 576  # the widest shared latent the forward kernel reads (DeepSeek-V3's)
BACKWARD_SIDE = ROWS  # the backward kernels' tiles, ``(64, 64)``: their registers hold more
# A program's positions: what the kernels' sequences are padded to whole numbers of.
PROGRAM_ROWS = CONSUMERS * BACKWARD_SIDE


def sides(width: int, quantized: bool = False, latent: bool = False) -> tuple[int, int]:
    """``(block_q, block_kv)`` of the forward kernel for heads of ``width``.

    A consumer's rows are one ``wgmma``'s 64; 128 keys a step, but 64 for ``width`` 256,
    whose ring of 128 would not fit shared memory, and 64 where it reads ``quantized`` caches
    (:func:`reads_in_place`), whose consumers each widen their blocks of keys and values into
    shared memory of their own, and 64 for a shared ``latent`` (576 wide: its queries and a
    ring of two blocks fill shared memory).
    """
    return ROWS, 64 if width > 128 or quantized or latent else 128


def reads_in_place(key, value) -> bool:
    """Whether the forward kernel reads these caches as they are (where it reads them at all).

    Quantized ones (:class:`~jax_sdpa.Quantized`: 8 bits and scales) up to 128 wide: wider
    heads' blocks, widened, would not fit shared memory beside the rest. A shared latent
    (``value`` a :class:`~jax_sdpa.LatentValues`) of float keys up to :data:`LATENT_WIDTH`
    wide, whole multiples of 64, whose values split into two halves of whole 64s up to
    :data:`MAX_WIDTH`, a consumer's (:func:`forward`).
    """
    if isinstance(value, LatentValues):
        width, half = key.shape[-1], value.features // CONSUMERS
        return (
            not isinstance(key, Quantized)
            and width <= LATENT_WIDTH
            and width % MIN_WIDTH == 0
            and half * CONSUMERS == value.features
            and half % MIN_WIDTH == 0
            and half <= MAX_WIDTH
        )
    return all(x.shape[-1] <= 128 for x in (key, value) if isinstance(x, Quantized))


def _backward_stages(width: int) -> int:
    """The backward ring's slots: one for heads of 256, whose two would not fit shared memory."""
    return STAGES if width <= 128 else 1


def forward(plan: Plan, query, key, value, shared: Shared, out_dtype, masked, table=None) -> tuple:
    """``(out, lse, top)`` of ``(T, N, H)`` queries against ``(S, K, H)`` keys and values.

    The arrays as :func:`jax_sdpa._kernels.fitting.padded` gives them; ``out`` ``(T, N, V)`` in
    ``out_dtype``, the rows' ``lse`` and largest scores ``(T, N)``. A program per head and
    ``CONSUMERS · block_q`` rows: each consumer sweeps its ``block_q`` rows over the keys its
    rows may see, the producer copying the union: the rule's ranges, or the blocks a block
    mask lists where ``masked`` (the call's arrays) has one (:class:`Swept`). With a ``table``
    ``(pages,)``, the keys and values are pools of pages ``(P, page, K, ·)``, the sequence's
    its pages in the table's order: each block copied from its pages (:func:`_blocks`). Keys
    or values :class:`~jax_sdpa.Quantized` (their scales heads first, ``(K, S)`` or ``(K, P,
    page)``) are copied as they are, 8 bits and scales; each block is widened in shared memory
    for its product, and the scales meet the scores and the weights in registers
    (:func:`~jax_sdpa._quantized.keys_product`).

    ``value`` a :class:`~jax_sdpa.LatentValues` (MLA's shared latent, FlashMLA's split): only
    the keys are copied, the values being each block's first features. A program is then
    ``block_q`` rows that both consumers hold, each computing its half of the output's
    features, from its half of the values (a ``(block_q, V)`` accumulator would not fit one
    warpgroup's registers); the first computes the block's scores and weights, once, and shares
    them with the second through shared memory, with their rows' max, and its denominators at
    the end (:func:`_lead`, :func:`_follow`: FlashMLA's split, the scores' product not made
    twice).
    """
    tiles = plan.tiles
    block_q, block_kv = tiles.block_q, tiles.block_kv
    (seq_q, heads, width) = query.shape
    latent = isinstance(value, LatentValues)
    value_width = value.features if latent else value.shape[-1]
    part = value_width // CONSUMERS if latent else value_width  # (a consumer's features)
    caches, tree = jax.tree.flatten((key, value))  # (a shared latent's: the keys alone)

    def consumer(ins, outs, own, program: Program):
        q_ref = ins[0]
        out_ref, lse_ref, top_ref = outs
        q_smem, o_smem, stats, handoff, loaded, staged, widened = own
        n, c, start = program.n, program.c, program.start
        rows = pl.ds(start, block_q)
        if latent:  # (one copy of the rows both hold, made by the first)
            # (the output and its rows' statistics in the queries' place, after them)
            (q_smem,), (o_smem, stats) = q_smem
            q, features = q_smem, pl.ds(c * part, part)
            pl.when(c == 0)(lambda: plgpu.copy_gmem_to_smem(q_ref.at[rows, n], q, loaded[0]))
            plgpu.barrier_wait(loaded[0])
        else:
            q, features = q_smem.at[c], slice(None)
            load([(q_ref.at[rows, n], q)], [loaded], c)
        tiled = program.tiles(staged, widened)

        def init(arrays, sink, offsets):
            like = jnp.zeros((), query.dtype)  # (a kernel's state need not vary)
            return online_softmax.init(like, (block_q,), (block_q, part), sink)

        def tile(slots, state, arrays, at):
            blocks = jax.tree.unflatten(tree, slots)  # (a quantized block's scales loaded)
            k_j, v_j = (
                Quantized(x.values, read_along(x.scale)) if isinstance(x, Quantized) else x
                for x in blocks
            )
            if not latent:
                return tiled.forward_tile(state, q, k_j, v_j, arrays, *at)
            if c == 0:  # (the scores and weights, computed once: FlashMLA's split)
                return _lead(tiled, handoff, state, q, k_j, k_j.at[:, features], arrays, at)
            return _follow(tiled, handoff, state, k_j.at[:, features], arrays, at)

        if latent and c == 1:
            plgpu.barrier_arrive(handoff[-1])  # (no weights to be done with yet)
        state = program.sweep(program.run(init), tile)
        if latent:  # (the first's denominators; the queries' place free once both are done)
            state = _shared_denominators(state, handoff, loaded[1], c)
        out, lse = tiles.formula.normalizer.finish(state, out_dtype)
        # (the output may take the queries' place: they are read by now)
        o = (q_smem if o_smem is None else o_smem).at[c]
        rows_stats = [
            (lse, stats.at[0, c], lse_ref.at[n, rows]),
            (online_softmax.top_scores(state), stats.at[1, c], top_ref.at[n, rows]),
        ]
        written = [(out, o, out_ref.at[rows, n, features])]
        store(written if latent else written + rows_stats)
        if latent:  # (the same rows' in both consumers)
            pl.when(c == 0)(lambda: store(rows_stats))

    stats = jax.ShapeDtypeStruct((heads, seq_q), jnp.float32)
    rows_stats = plgpu.SMEM((2, CONSUMERS, block_q), jnp.float32)  # (the rows' lse and top)
    own = (
        plgpu.RefUnion(
            (plgpu.SMEM((block_q, width), query.dtype),),
            (plgpu.SMEM((CONSUMERS, block_q, part), out_dtype), rows_stats),
        )
        if latent
        else plgpu.SMEM((CONSUMERS, block_q, width), query.dtype),
        None
        if latent or (value_width, out_dtype) == (width, query.dtype)
        else plgpu.SMEM((CONSUMERS, block_q, value_width), out_dtype),
        None if latent else rows_stats,
        # (a latent's: a block's weights and rows' max, shared; ready, and done with; beside
        # the queries, the small buffers after them: each swizzled one aligned to 1 KiB)
        (
            plgpu.SMEM((block_q, block_kv), query.dtype),
            plgpu.SMEM((block_q,), jnp.float32),
            plgpu.Barrier(),
            plgpu.Barrier(),
        )
        if latent
        else None,
        # (a latent's: its queries copied, then both consumers done with them)
        (plgpu.Barrier(), plgpu.Barrier(num_arrivals=CONSUMERS))
        if latent
        else plgpu.Barrier(num_barriers=CONSUMERS),
        staging_memory(plan, query.dtype, always=False),
        {  # (a block of 8-bit keys or values, widened for its product)
            spec: plgpu.SMEM((CONSUMERS, block_kv, x.shape[-1]), query.dtype)
            for spec, x in zip(("td,sd->ts", "ts,sd->td"), (key, value), strict=True)
            if isinstance(x, Quantized)
        },
    )
    # Each leaf of the caches: its block (of keys or values, or of their scales: heads first)
    is_scale = [
        scale
        for x in (key, value)
        if not isinstance(x, LatentValues)
        for scale in ((False, True) if isinstance(x, Quantized) else (False,))  # (its leaves)
    ]
    slots = [
        jax.ShapeDtypeStruct((block_kv,) if scale else (block_kv, x.shape[-1]), x.dtype)
        for x, scale in zip(caches, is_scale, strict=True)
    ]

    def sources(ins, n):
        refs, table_ref = ins[1 : 1 + len(caches)], None if table is None else ins[-1]
        return [
            _blocks(ref, block_kv, n // plan.group, table_ref, scale)
            for ref, scale in zip(refs, is_scale, strict=True)
        ]

    out_type = (jax.ShapeDtypeStruct((seq_q, heads, value_width), out_dtype), stats, stats)
    inputs = (query, *caches) if table is None else (query, *caches, table)
    pieces = 1 if table is None else max(1, block_kv // key.shape[1])
    swept = Swept(slots, sources, STAGES, masked, pieces)
    # (A latent's kernel: 1 KiB of the 2 KiB Mosaic GPU reserves for reductions across warps,
    # to fit the shared weights' rows' max: a tile's rows reduce within warps, and a whole
    # tile to a scalar takes at most 1 KiB. Other consumers take turns at the tensor cores;
    # a latent's hand the weights over instead.)
    split = dict(split=True, reduction_scratch=1024) if latent else dict(alternate=True)
    out, lse, top = warp_specialized(
        plan, "kv", block_q, inputs, shared, out_type, own, swept, consumer, **split
    )
    return out, lse.T, top.T


def _lead(tiled, handoff, state, q, k_j, v_j, arrays, at):
    """A shared latent's tile in the first consumer: the block's weights, shared; its part."""
    weights, row_max, ready, done = handoff
    block = tiled.forward_block(state, q, k_j, arrays, *at)
    plgpu.barrier_wait(done)  # (the other consumer is done with the last block's)
    weights[...] = block.weights.astype(weights.dtype)
    row_max[...] = block.row_max
    plgpu.commit_smem()
    plgpu.barrier_arrive(ready)
    return tiled.add_block(state, block, v_j, arrays, *at)  # (its own from registers)


def _follow(tiled, handoff, state, v_j, arrays, at):
    """A shared latent's tile in the second consumer: the first's weights, for its part.

    Its denominators are not its own (the weights' sums, which the first consumer has:
    :func:`_shared_denominators`), nor its largest scores (which it does not store).
    """
    weights, row_max, ready, done = handoff
    plgpu.barrier_wait(ready)
    block = online_softmax.Block(
        read_along(row_max, 0), InSmem(weights), jnp.zeros_like(state.denom), state.top
    )
    state = tiled.add_block(state, block, v_j, arrays, *at)
    plgpu.barrier_arrive(done)
    return state


def _shared_denominators(state, handoff, both, c: int):
    """A shared latent's consumers' states with the first's denominators; both then done."""
    _, row_max, _, done = handoff
    if c == 0:
        plgpu.barrier_wait(done)  # (the other's last block)
        row_max[...] = state.denom
    plgpu.barrier_arrive(both)
    plgpu.barrier_wait(both)
    return state if c == 0 else state._replace(denom=read_along(row_max, 0))


def _blocks(ref, size: int, head, table, scale: bool):
    """Block ``m`` of ``size`` keys of head ``head`` of a cache ref: ``m -> ref(s)``.

    ``ref`` ``(S, K, ·)``, or ``(K, S)`` for a quantized cache's ``scale`` (heads first); with a
    ``table`` ``(pages,)`` (a ref), a pool of pages ``(P, page, K, ·)`` or ``(K, P, page)``. A
    block within one page (the page at least the block) is one ref; a block of several pages,
    the tuple of them. A page number outside the pool reads its nearest page: a sequence's keys
    past its length, masked.
    """

    def at(*index):
        return ref.at[(head, *index) if scale else (*index, head)]

    if table is None:
        return lambda m: at(pl.ds(m * size, size))
    count, page = ref.shape[1:3] if scale else ref.shape[:2]

    def page_of(n):
        return jnp.clip(table[n], 0, count - 1)

    def block(m):
        first = m * size
        if page >= size:
            return at(page_of(first // page), pl.ds(first % page, size))
        return tuple(at(page_of(first // page + n), pl.ds(0, page)) for n in range(size // page))

    return block


def _backward_plan(plan: Plan) -> Plan:
    """The backward kernels' plan: tiles of ``(BACKWARD_SIDE, BACKWARD_SIDE)``."""
    side = BACKWARD_SIDE
    tiles = dataclasses.replace(plan.tiles, block_q=side, block_kv=side)
    return dataclasses.replace(plan, tiles=tiles)


def _terms(d_out, delta, shift) -> BackwardRows:
    """A block's backward terms: ``d_out`` a ref, the vectors read from theirs."""
    return BackwardRows(d_out, *laid_out((delta[...], shift[...])))


def query_gradients(plan: Plan, query, key, value, rows: BackwardRows, shared: Shared, masked):
    """The queries' gradient ``(T, N, H)`` of :func:`forward`'s call, in their dtype.

    ``rows``: the queries' terms, ``d_out`` ``(T, N, V)`` in the values' dtype, ``delta`` and
    ``shift`` ``(N, T)``; ``masked`` as :func:`forward` takes it. A program per head and
    ``CONSUMERS · BACKWARD_SIDE`` rows, each consumer sweeping the keys its rows saw.
    """
    plan, side = _backward_plan(plan), BACKWARD_SIDE
    width, value_width = query.shape[-1], value.shape[-1]

    def consumer(ins, outs, own, program: Program):
        q_ref, _, _, do_ref, delta_ref, shift_ref = ins
        (dq_ref,) = outs
        q_smem, do_smem, row_smem, loaded, staged = own
        n, c, start = program.n, program.c, program.start
        q, d_out, delta, shift = q_smem.at[c], do_smem.at[c], row_smem.at[0, c], row_smem.at[1, c]
        rows = pl.ds(start, side)
        sources = (
            q_ref.at[rows, n],
            do_ref.at[rows, n],
            delta_ref.at[n, rows],
            shift_ref.at[n, rows],
        )
        load(list(zip(sources, (q, d_out, delta, shift), strict=True)), loaded, c)
        tiled = program.tiles(staged)
        row_terms = _terms(d_out, delta, shift)

        def tile(slots, d_q, arrays, at):
            grad = tiled.tile_gradient(q, *slots, arrays, row_terms, *at)
            return d_q + tiled.query_gradient(grad, slots[0], query.dtype)

        d_q = program.sweep(jnp.zeros((side, width), jnp.float32), tile)
        store([(d_q, q, dq_ref.at[rows, n])])  # (in the queries' place: read by now)

    own = (
        plgpu.SMEM((CONSUMERS, side, width), query.dtype),
        plgpu.SMEM((CONSUMERS, side, value_width), value.dtype),
        plgpu.SMEM((2, CONSUMERS, side), jnp.float32),
        (plgpu.Barrier(num_barriers=CONSUMERS),) * 4,
        staging_memory(plan, query.dtype, always=False),
    )
    slots = [jax.ShapeDtypeStruct((side, x.shape[-1]), x.dtype) for x in (key, value)]

    def sources(ins, n):
        return [head_blocks(ref, side, n // plan.group) for ref in ins[1:3]]

    inputs = (query, key, value, *rows)
    out_type = (jax.ShapeDtypeStruct(query.shape, query.dtype),)
    swept = Swept(slots, sources, _backward_stages(width), masked)
    (d_query,) = warp_specialized(plan, "kv", side, inputs, shared, out_type, own, swept, consumer)
    return d_query


def key_gradients(
    plan: Plan,
    query,
    key,
    value,
    rows: BackwardRows,
    shared: Shared,
    masked,
    consts=(),
    in_memory=False,
) -> tuple:
    """Each query head's key and value gradients ``(S, N, ·)`` of :func:`forward`'s call.

    In the keys' and values' dtypes (written through their shared memory, which holds no float32
    block of 256-wide heads): under GQA each query head's part is rounded before a group's are
    summed, where the Triton programs sum float32 parts. ``rows`` and ``masked`` as
    :func:`query_gradients` takes them. A program per head and ``CONSUMERS · BACKWARD_SIDE``
    keys, each consumer holding its keys and values and sweeping the queries that saw them.

    ``consts``: the shapes of the ``score_mod``'s arrays with gradients; after the keys' and
    values', each one's gradient as ``(parts…, entries)`` float32 parts for the caller to sum,
    its entries flat. Summed in registers, for arrays each read at one index (``slopes[h]``):
    a part from each program's consumers, ``(N, programs, CONSUMERS, ·)``, its entries padded
    to a multiple of 128 (a vector strided over a warpgroup's threads). Or, ``in_memory``, for
    arrays read at any points (a table at ``q_idx − kv_idx``): added at them into memory
    (:mod:`~jax_sdpa._kernels.atomics`), one part on a GPU, one a consumer on the simulator.
    """
    plan, side = _backward_plan(plan), BACKWARD_SIDE
    (_, heads, width), value_width = query.shape, value.shape[-1]
    programs = plan.seq_kv // PROGRAM_ROWS
    registers = [] if in_memory else [-(-math.prod(shape) // 128) * 128 for shape in consts]
    # (on the simulator, which runs no atomic add, each consumer adds into its own part)
    parts = heads * programs * CONSUMERS if simulated(plan) else 1
    swept_inputs = 3 + len(rows)  # (the queries, keys, values and rows' terms; then the sums)

    def consumer(ins, outs, own, program: Program):
        _, k_ref, v_ref, *_ = ins
        dk_ref, dv_ref, *const_refs = outs
        k_smem, v_smem, loaded, staged = own
        n, c, start = program.n, program.c, program.start
        k, v = k_smem.at[c], v_smem.at[c]
        rows = pl.ds(start, side)
        kv_head = n // plan.group
        m = lax.axis_index("blocks")
        part = (n * programs + m) * CONSUMERS + c if parts > 1 else 0
        load([(k_ref.at[rows, kv_head], k), (v_ref.at[rows, kv_head], v)], loaded, c)
        tiled = program.tiles(staged)

        def tile(slots, grads, arrays, at):
            q_i, d_out, delta, shift = slots
            grad = tiled.tile_gradient(q_i, k, v, arrays, _terms(d_out, delta, shift), *at)
            keys = tiled.key_gradients(grad, d_out, (key.dtype, value.dtype))
            d_consts = [d.astype(jnp.float32).ravel() for d in grad.d_consts if d is not None]
            if in_memory:
                for ref, d in zip(ins[swept_inputs:], d_consts, strict=True):
                    plgpu.atomic_add(ref.at[part], d)
                d_consts = []
            flat = tuple(  # (each at the start of its vector)
                lax.dynamic_update_slice(jnp.zeros(size, jnp.float32), d, (0,))
                for d, size in zip(d_consts, registers, strict=True)
            )
            return jax.tree.map(jnp.add, grads, (*keys, flat))

        zeros = tuple(jnp.zeros((side, w), jnp.float32) for w in (width, value_width))
        d_k, d_v, d_consts = program.sweep(
            (*zeros, tuple(jnp.zeros(size, jnp.float32) for size in registers)), tile
        )
        store([(d_k, k, dk_ref.at[rows, n]), (d_v, v, dv_ref.at[rows, n])])
        for ref, d in zip(const_refs, d_consts, strict=True):
            ref[n, m, c] = d

    own = (
        plgpu.SMEM((CONSUMERS, side, width), key.dtype),
        plgpu.SMEM((CONSUMERS, side, value_width), value.dtype),
        (plgpu.Barrier(num_barriers=CONSUMERS),) * 2,
        staging_memory(plan, query.dtype, always=True),
    )
    slots = [
        jax.ShapeDtypeStruct((side, width), query.dtype),
        jax.ShapeDtypeStruct((side, value_width), value.dtype),
        *[jax.ShapeDtypeStruct((side,), jnp.float32)] * 2,
    ]

    def sources(ins, n):
        q_ref, _, _, do_ref, delta_ref, shift_ref = ins[:swept_inputs]
        vectors = [lambda m, r=r: r.at[n, pl.ds(m * side, side)] for r in (delta_ref, shift_ref)]
        return [head_blocks(q_ref, side, n), head_blocks(do_ref, side, n), *vectors]

    out_type = (
        *(jax.ShapeDtypeStruct((plan.seq_kv, heads, x.shape[-1]), x.dtype) for x in (key, value)),
        *(
            jax.ShapeDtypeStruct((heads, programs, CONSUMERS, size), jnp.float32)
            for size in registers
        ),
    )
    backend = in_memory_backend(plan) if in_memory else MOSAIC_GPU

    def kernel(arrays, sums):
        inputs, shared, masked = arrays
        swept = Swept(slots, sources, _backward_stages(width), masked)
        inputs = (*inputs, *sums)
        return warp_specialized(
            plan, "q", side, inputs, shared, out_type, own, swept, consumer, backend=backend
        )

    arrays = ((query, key, value, *rows), shared, masked)
    return with_sums(kernel, consts if in_memory else [], parts, arrays)
