r"""The Mosaic GPU backend, on Hopper GPUs (sm_90): warp-specialized kernels, forward and backward.

Each a ``plgpu.kernel`` of three warpgroups (:func:`_kernel`), as FlashAttention-3 and JAX's own
``attention_mgpu`` are built: a producer copies the blocks a program sweeps over (in the forward
pass, the keys and values) into a ring of shared-memory slots by TMA, each slot with a barrier
that says it is full and one that says both consumers are done with it; two consumers each hold
their own positions (in the forward pass, ``block_q`` rows) and run the engine's own tile on
every block: its products are ``wgmma`` on the slots (:func:`_product`),
everything between them (the formula, the mods, the mask rules, the online softmax) is
:class:`~jax_sdpa._tiles.Tiles`' code, the XLA paths' and the Triton kernel's, traced into the
kernel. The blocks a rule excludes are not copied; those it allows wholly run with no mask
(:func:`~jax_sdpa._tiles.runs`). Arrays are read and written in the caller's ``(T, heads, d)``
layout, in place (strided TMA).

The backward pass is two kernels of the same shape, as FlashAttention-2's: one per block of
queries, whose consumers sweep the keys for the queries' gradient, :math:`dQ = \sum_j dS_j K_j`;
one per block of keys, whose consumers hold their keys and values and sweep the queries (and
the rows' terms) for :math:`dK`, :math:`dV`. Each tile is the engine's
(:meth:`~jax_sdpa._tiles.Tiles.tile_gradient`); the products whose left operand is a tile
transposed (:math:`P^\top dO`, :math:`dS^\top Q`) take it through shared memory.

Written for the Warpgroup lowering semantics (Mosaic GPU infers the register layouts): JAX 0.11
and later. ``plgpu.InterpretGPUParams`` runs the same kernel on a CPU (shared memory, threads
and barriers simulated), where the weights that meet a product go through shared memory: the
simulator has no ``wgmma`` from registers.
"""

import dataclasses
import functools
from collections.abc import Callable

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
from jax_sdpa._tiles import BackwardRows, Blocks, runs

CONSUMERS = 2  # warpgroups that compute, each its own rows; a third copies
STAGES = 2  # shared-memory slots of the producer's ring
MIN_WIDTH = 64  # a head's width: 128 bytes of 16-bit numbers, the rows its TMA swizzles
BACKWARD_SIDE = 64  # the backward kernels' tiles, ``(64, 64)``: their registers hold more
# A program's positions: what the kernels' sequences are padded to whole numbers of.
PROGRAM_ROWS = CONSUMERS * BACKWARD_SIDE


def sides(width: int) -> tuple[int, int]:
    """``(block_q, block_kv)`` of the forward kernel for heads of ``width``.

    A consumer's rows are one ``wgmma``'s 64; 128 keys a step, but 64 for ``width`` 256,
    whose ring of 128 would not fit shared memory.
    """
    return 64, 128 if width <= 128 else 64


def _backward_stages(width: int) -> int:
    """The backward ring's slots: one for heads of 256, whose two would not fit shared memory."""
    return STAGES if width <= 128 else 1


# A run's kind: its tiles run with the mask rule, or without (the rule allows them wholly), or
# not at all (the blocks of the producer's range that a consumer's positions never meet: it
# waits for each and frees it).
RULE, FULL, SKIP = "rule", "full", "skip"
# Its programs' own rules: a tile's positions as the products' (``wgmma``'s) register layout.
MOSAIC_GPU = Backend(
    lambda tunables: None,
    rules=tile_positions(lambda iota: plgpu.layout_cast(iota, plgpu.Layout.WGMMA)),
)


def _product(staging, simulated: bool):
    """The tiles' :func:`~jax_sdpa._steps.cast_product` as ``wgmma``.

    ``td,sd->ts`` (the raw scores ``q · kᵀ``, the weights' gradient ``dO · vᵀ``) of two refs in
    shared memory; ``ts,sd->td`` (``p · v``, ``dS · k``) of a tile (an array) and a ref, the
    tile from registers, or through ``staging`` (shared memory) under the simulator
    (``simulated``), which has no ``wgmma`` from registers; ``ts,td->sd`` (``Pᵀ · dO``,
    ``dSᵀ · q``) of a tile and a ref, the tile through ``staging``, read transposed.
    """

    def stage(a, dtype):
        staging[...] = a.astype(dtype)
        plgpu.commit_smem()
        return staging

    def product(spec: str, a, b, dtype, *, precision=None):
        # (``dtype``: every operand has it, the kernels' inputs' one dtype, calls.for_inputs)
        if spec == "td,sd->ts":
            shape, b = (a.shape[0], b.shape[0]), b.transpose((1, 0))
        elif spec == "ts,sd->td":
            shape = (a.shape[0], b.shape[1])
            a = stage(a, b.dtype) if simulated else a.astype(b.dtype)
        else:  # "ts,td->sd"
            shape, a = (a.shape[1], b.shape[1]), stage(a, b.dtype).transpose((1, 0))

        def run(acc):
            plgpu.wgmma(acc, a, b)
            return acc[...]

        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

    return product


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The producer's ring: slots of each swept array, and their barriers."""

    slots: tuple  # a (stages, *block) shared-memory ref per swept array
    full: tuple  # a barrier per slot, per array: its copy landed
    free: object  # a barrier per slot: both consumers are done with it (all its arrays)

    @property
    def stages(self) -> int:
        return self.slots[0].shape[0]

    def fill(self, sources, step, slot) -> None:
        """The producer: the block ``step`` of each source into ``slot``."""
        for source, ring, full in zip(sources, self.slots, self.full, strict=True):
            plgpu.copy_gmem_to_smem(source(step), ring.at[slot], full.at[slot])

    def produce(self, sources, lo, hi) -> None:
        """The producer's loop: blocks ``lo … hi − 1``, each into the slot freed for it.

        It ends when the consumers are done with the last.
        """
        for first in range(self.stages):
            pl.when(lo + first < hi)(functools.partial(self.fill, sources, lo + first, first))

        @pl.loop(lo + self.stages, jnp.maximum(hi, lo + self.stages))
        def _(step):
            slot = lax.rem(step - lo, self.stages)
            plgpu.barrier_wait(self.free.at[slot])
            self.fill(sources, step, slot)

        # Each slot's last block: waited for too, so no barrier ends a phase ahead of its
        # waiter (JAX 0.11's simulator checks that).
        for slot in range(self.stages):
            pl.when(lo + slot < hi)(functools.partial(plgpu.barrier_wait, self.free.at[slot]))

    def consume(self, runs, lo, carry, tile):
        """A consumer's loop over its ``runs`` ``(start, stop, kind)``.

        All within the producer's range from ``lo``: ``carry = tile(step, slots, carry, kind)``
        on each block, in its slot; a :data:`SKIP` run only waits for its blocks and frees them.
        """

        def step(kind, n, carry):
            slot = lax.rem(n - lo, self.stages)
            for full in self.full:
                plgpu.barrier_wait(full.at[slot])
            if kind != SKIP:
                carry = tile(n, [ring.at[slot] for ring in self.slots], carry, kind)
            plgpu.barrier_arrive(self.free.at[slot])
            return carry

        for start, stop, kind in runs:
            carry = lax.fori_loop(start, stop, functools.partial(step, kind), carry)
        return carry


def _laid_out(tree):
    """A consumer's carry in ``wgmma``'s register layouts.

    Tiles as the products', vectors as their rows. (Layout inference, left to find them across
    the loops, runs out of attempts.)
    """
    rows, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA
    return jax.tree.map(lambda x: plgpu.layout_cast(x, tile if x.ndim == 2 else rows), tree)


def _static(x):
    """A bound the interpreter found constant (a NumPy scalar) as a Python int.

    Mosaic GPU's indexing takes those; a traced bound stays as it is.
    """
    return int(x) if isinstance(x, np.generic | np.ndarray) else x


@dataclasses.dataclass(frozen=True)
class _Swept:
    """What a kernel's producer copies into its ring of ``stages`` slots.

    ``blocks``: each swept array's block (a ``jax.ShapeDtypeStruct``); ``sources(inputs, n)``:
    for each, the ref of block ``m`` (``m -> ref``) in a program of query head ``n``.
    """

    blocks: list
    sources: Callable
    stages: int


@dataclasses.dataclass(frozen=True)
class _Program:
    """What a consumer of program ``(n, ·)`` knows.

    It holds positions of one axis from ``start``; the producer sweeps blocks of the other,
    ``axis`` (``"kv"``: keys, for query rows; ``"q"``: queries, for keys).
    """

    plan: Plan
    axis: str
    n: jax.Array  # the query head
    c: jax.Array  # the consumer
    start: jax.Array
    shared: Shared  # refs
    runs: tuple  # the consumer's runs, and the producer's first block
    ring: _Ring

    @property
    def size(self) -> int:
        """The swept blocks' size."""
        tiles = self.plan.tiles
        return tiles.block_kv if self.axis == "kv" else tiles.block_q

    def run(self, body):
        """``body(arrays, sink, offsets)`` with head ``n``'s arrays (:meth:`Plan.run`)."""
        return self.plan.run(lambda *args: body(*args[:3]), self.shared, self.n)

    def sweep(self, carry, tile):
        """``carry = tile(slots, carry, arrays, (q_offset, kv_offset))`` on each swept block.

        In the producer's slots; ``arrays`` are the tile's (with the rule where it needs it),
        the offsets the global positions of its first query and key.
        """

        def step(m, slots, carry, kind):
            def body(arrays, _, offsets):
                arrays = dataclasses.replace(arrays, rule=arrays.rule if kind == RULE else None)
                held, swept = self.start, m * self.size
                q, kv = (held, swept) if self.axis == "kv" else (swept, held)
                return tile(slots, carry, arrays, (offsets[0] + q, offsets[1] + kv))

            return _laid_out(self.run(body))

        runs, lo = self.runs
        return self.ring.consume(runs, lo, _laid_out(carry), step)


def _runs(plan: Plan, shared: Shared, n, axis: str, span: tuple, whole: tuple) -> tuple:
    """A consumer's runs over the ``axis`` blocks, and the producer's range ``(lo, hi)``.

    ``span`` is the consumer's positions of the other axis, ``whole`` the program's (all its
    consumers'), each ``(lo, hi)`` from that axis's first. A run is ``(start, stop, kind)``:
    :data:`RULE` (its tiles run with the rule), :data:`FULL` (without: the rule allows them
    wholly) or :data:`SKIP` (blocks of the producer's range that the consumer's positions never
    meet). The producer's range is the rule's for the whole program, which holds each
    consumer's (the rules' ranges are intervals).
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
    return [(lo, own[0][0], SKIP), *own, (own[-1][1], hi, SKIP)], lo, hi


def _kernel(plan: Plan, axis: str, held: int, inputs, shared, out_type, own, swept, consumer):
    """A warp-specialized kernel: program ``(n, m)`` a producer and :data:`CONSUMERS` consumers.

    Each consumer holds ``held`` positions of the axis that is not ``axis``, the program
    ``CONSUMERS · held`` of them, and sweeps the ``axis`` blocks its positions may meet; the
    producer copies the blocks any of them may meet into its ring (:class:`_Swept`). ``own``: the
    consumers' scratch (shared-memory types). ``consumer(inputs, outputs, own, program)`` runs
    in each consumer (refs; :class:`_Program`). ``inputs``: arrays, the queries first,
    ``(T, N, ·)``.
    """
    interpret = plan.tunables.interpret or None
    rows = CONSUMERS * held
    heads = inputs[0].shape[1]
    count = (plan.seq_q if axis == "kv" else plan.seq_kv) // rows
    leaves, tree = jax.tree.flatten(shared)
    arity = len(inputs) + len(leaves)

    def kernel(*refs):
        ins, (*outs, scratch) = refs[: len(inputs)], refs[arity:]
        shared_refs = jax.tree.unflatten(tree, refs[len(inputs) : arity])
        own_refs, ring_refs, full, free = scratch
        n, c = lax.axis_index("heads"), lax.axis_index("wg")
        first = lax.axis_index("blocks") * rows
        start = first + jnp.minimum(c, CONSUMERS - 1) * held
        span, whole = (start, start + held), (first, first + rows)
        own_runs, lo, hi = _runs(plan, shared_refs, n, axis, span, whole)
        ring = _Ring(ring_refs, full, free)

        @pl.when(c == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            ring.produce(swept.sources(ins, n), lo, hi)

        @pl.when(c < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            program = _Program(plan, axis, n, c, start, shared_refs, (own_runs, lo), ring)
            consumer(ins, outs, own_refs, program)

    scratch = (
        own,
        tuple(plgpu.SMEM((swept.stages, *block.shape), block.dtype) for block in swept.blocks),
        tuple(plgpu.Barrier(num_barriers=swept.stages) for _ in swept.blocks),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=swept.stages),
    )
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=(scratch,),
        grid=(heads, count),
        grid_names=("heads", "blocks"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=interpret,
    )(*inputs, *leaves)


def _blocks(ref, size: int, head):
    """Block ``m`` of ``size`` rows of head ``head`` of a ``(T, heads, d)`` ref: ``m -> ref``."""
    return lambda m: ref.at[pl.ds(m * size, size), head]


def _load(pairs, barriers, c) -> None:
    """Copies each ``(source, destination)`` into shared memory, each with its barrier; waits."""
    for (source, destination), barrier in zip(pairs, barriers, strict=True):
        plgpu.copy_gmem_to_smem(source, destination, barrier.at[c])
    for barrier in barriers:
        plgpu.barrier_wait(barrier.at[c])


def _store(pairs) -> None:
    """Writes each ``(value, shared-memory ref, destination)`` out through shared memory."""
    for value, smem, _ in pairs:
        smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    for _, smem, destination in pairs:
        plgpu.copy_smem_to_gmem(smem, destination)
    plgpu.wait_smem_to_gmem(0)


def _staging(plan: Plan, dtype, always: bool) -> tuple:
    """``(staging, simulated)``: the consumers' staging memory, and whether it is simulated.

    ``staging`` is the shared memory (a type) through which tiles meet a product
    (:func:`_product`), or None: a kernel needs it ``always`` (its tiles meet products
    transposed) or on the simulator.
    """
    simulated = bool(plan.tunables.interpret)
    if not (always or simulated):
        return None, simulated
    return plgpu.SMEM((CONSUMERS, plan.tiles.block_q, plan.tiles.block_kv), dtype), simulated


def _tiled(plan: Plan, staging, simulated: bool, c):
    """The plan's tiles, their products ``wgmma`` (:func:`_product`), consumer ``c``'s staging."""
    staged = None if staging is None else staging.at[c]
    return dataclasses.replace(plan.tiles, product=_product(staged, simulated))


def forward(plan: Plan, query, key, value, shared: Shared, out_dtype) -> tuple:
    """``(out, lse, top)`` of ``(T, N, H)`` queries against ``(S, K, H)`` keys and values.

    The arrays as :func:`jax_sdpa._kernels.calls.padded` gives them; ``out`` ``(T, N, V)`` in
    ``out_dtype``, the rows' ``lse`` and largest scores ``(T, N)``. A program per head and
    ``CONSUMERS · block_q`` rows: each consumer sweeps its ``block_q`` rows over the keys its
    rows may see, the producer copying the union.
    """
    plan = dataclasses.replace(plan, backend=MOSAIC_GPU)
    tiles = plan.tiles
    block_q, block_kv = tiles.block_q, tiles.block_kv
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    staging_type, simulated = _staging(plan, query.dtype, always=False)

    def consumer(ins, outs, own, program: _Program):
        q_ref, _, _ = ins
        out_ref, lse_ref, top_ref = outs
        q_smem, o_smem, stats, loaded, staging = own
        n, c, start = program.n, program.c, program.start
        q = q_smem.at[c]
        _load([(q_ref.at[pl.ds(start, block_q), n], q)], [loaded], c)
        tiled = _tiled(plan, staging, simulated, c)

        def init(arrays, sink, offsets):
            like = jnp.zeros((), query.dtype)  # (a kernel's state need not vary)
            return online_softmax.init(like, (block_q,), (block_q, value_width), sink)

        def tile(slots, state, arrays, at):
            return tiled.forward_tile(state, q, *slots, arrays, *at)

        state = program.sweep(program.run(init), tile)
        out, lse = tiles.formula.normalizer.finish(state, out_dtype)
        rows = pl.ds(start, block_q)
        _store(
            [
                (out, (q_smem if o_smem is None else o_smem).at[c], out_ref.at[rows, n]),
                (lse, stats.at[0, c], lse_ref.at[n, rows]),
                (online_softmax.top_scores(state), stats.at[1, c], top_ref.at[n, rows]),
            ]
        )  # (the output may take the queries' place: they are read by now)

    stats = jax.ShapeDtypeStruct((heads, seq_q), jnp.float32)
    own = (
        plgpu.SMEM((CONSUMERS, block_q, width), query.dtype),
        None
        if (value_width, out_dtype) == (width, query.dtype)
        else plgpu.SMEM((CONSUMERS, block_q, value_width), out_dtype),
        plgpu.SMEM((2, CONSUMERS, block_q), jnp.float32),
        plgpu.Barrier(num_barriers=CONSUMERS),
        staging_type,
    )
    slots = [jax.ShapeDtypeStruct((block_kv, x.shape[-1]), x.dtype) for x in (key, value)]

    def sources(ins, n):
        return [_blocks(ref, block_kv, n // plan.group) for ref in ins[1:]]

    out_type = (jax.ShapeDtypeStruct((seq_q, heads, value_width), out_dtype), stats, stats)
    inputs = (query, key, value)
    out, lse, top = _kernel(
        plan, "kv", block_q, inputs, shared, out_type, own, _Swept(slots, sources, STAGES), consumer
    )
    return out, lse.T, top.T


def _backward_plan(plan: Plan) -> Plan:
    """The backward kernels' plan: tiles of ``(BACKWARD_SIDE, BACKWARD_SIDE)``."""
    side = BACKWARD_SIDE
    tiles = dataclasses.replace(plan.tiles, block_q=side, block_kv=side)
    return dataclasses.replace(plan, tiles=tiles, backend=MOSAIC_GPU)


def _terms(d_out, delta, shift) -> BackwardRows:
    """A block's backward terms: ``d_out`` a ref, the vectors read from theirs."""
    return BackwardRows(d_out, *_laid_out((delta[...], shift[...])))


def query_gradients(plan: Plan, query, key, value, rows: BackwardRows, shared: Shared):
    """The queries' gradient ``(T, N, H)`` of :func:`forward`'s call, in their dtype.

    ``rows``: the queries' terms, ``d_out`` ``(T, N, V)`` in the values' dtype, ``delta`` and
    ``shift`` ``(N, T)``. A program per head and ``CONSUMERS · BACKWARD_SIDE`` rows, each
    consumer sweeping the keys its rows saw.
    """
    plan, side = _backward_plan(plan), BACKWARD_SIDE
    width, value_width = query.shape[-1], value.shape[-1]
    staging_type, simulated = _staging(plan, query.dtype, always=False)

    def consumer(ins, outs, own, program: _Program):
        q_ref, _, _, do_ref, delta_ref, shift_ref = ins
        (dq_ref,) = outs
        q_smem, do_smem, row_smem, loaded, staging = own
        n, c, start = program.n, program.c, program.start
        q, d_out, delta, shift = q_smem.at[c], do_smem.at[c], row_smem.at[0, c], row_smem.at[1, c]
        rows = pl.ds(start, side)
        sources = (
            q_ref.at[rows, n],
            do_ref.at[rows, n],
            delta_ref.at[n, rows],
            shift_ref.at[n, rows],
        )
        _load(list(zip(sources, (q, d_out, delta, shift), strict=True)), loaded, c)
        tiled = _tiled(plan, staging, simulated, c)
        row_terms = _terms(d_out, delta, shift)

        def tile(slots, d_q, arrays, at):
            grad = tiled.tile_gradient(q, *slots, arrays, row_terms, *at)
            return d_q + tiled.query_gradient(grad, slots[0], query.dtype)

        d_q = program.sweep(jnp.zeros((side, width), jnp.float32), tile)
        _store([(d_q, q, dq_ref.at[rows, n])])  # (in the queries' place: read by now)

    own = (
        plgpu.SMEM((CONSUMERS, side, width), query.dtype),
        plgpu.SMEM((CONSUMERS, side, value_width), value.dtype),
        plgpu.SMEM((2, CONSUMERS, side), jnp.float32),
        (plgpu.Barrier(num_barriers=CONSUMERS),) * 4,
        staging_type,
    )
    slots = [jax.ShapeDtypeStruct((side, x.shape[-1]), x.dtype) for x in (key, value)]

    def sources(ins, n):
        return [_blocks(ref, side, n // plan.group) for ref in ins[1:3]]

    inputs = (query, key, value, *rows)
    out_type = (jax.ShapeDtypeStruct(query.shape, query.dtype),)
    swept = _Swept(slots, sources, _backward_stages(width))
    (d_query,) = _kernel(plan, "kv", side, inputs, shared, out_type, own, swept, consumer)
    return d_query


def key_gradients(plan: Plan, query, key, value, rows: BackwardRows, shared: Shared) -> tuple:
    """Each query head's key and value gradients ``(S, N, ·)`` of :func:`forward`'s call.

    In the keys' and values' dtypes (written through their shared memory, which holds no float32
    block of 256-wide heads): under GQA each query head's part is rounded before a group's are
    summed, where the Triton programs sum float32 parts. ``rows`` as :func:`query_gradients`
    takes them. A program per head and ``CONSUMERS · BACKWARD_SIDE`` keys, each consumer
    holding its keys and values and sweeping the queries that saw them.
    """
    plan, side = _backward_plan(plan), BACKWARD_SIDE
    (_, heads, width), value_width = query.shape, value.shape[-1]
    staging_type, simulated = _staging(plan, query.dtype, always=True)

    def consumer(ins, outs, own, program: _Program):
        _, k_ref, v_ref, _, _, _ = ins
        dk_ref, dv_ref = outs
        k_smem, v_smem, loaded, staging = own
        n, c, start = program.n, program.c, program.start
        k, v = k_smem.at[c], v_smem.at[c]
        rows = pl.ds(start, side)
        kv_head = n // plan.group
        _load([(k_ref.at[rows, kv_head], k), (v_ref.at[rows, kv_head], v)], loaded, c)
        tiled = _tiled(plan, staging, simulated, c)

        def tile(slots, grads, arrays, at):
            q_i, d_out, delta, shift = slots
            grad = tiled.tile_gradient(q_i, k, v, arrays, _terms(d_out, delta, shift), *at)
            parts = tiled.key_gradients(grad, d_out, (key.dtype, value.dtype))
            return jax.tree.map(jnp.add, grads, parts)

        zeros = tuple(jnp.zeros((side, w), jnp.float32) for w in (width, value_width))
        d_k, d_v = program.sweep(zeros, tile)
        _store([(d_k, k, dk_ref.at[rows, n]), (d_v, v, dv_ref.at[rows, n])])

    own = (
        plgpu.SMEM((CONSUMERS, side, width), key.dtype),
        plgpu.SMEM((CONSUMERS, side, value_width), value.dtype),
        (plgpu.Barrier(num_barriers=CONSUMERS),) * 2,
        staging_type,
    )
    slots = [
        jax.ShapeDtypeStruct((side, width), query.dtype),
        jax.ShapeDtypeStruct((side, value_width), value.dtype),
        *[jax.ShapeDtypeStruct((side,), jnp.float32)] * 2,
    ]

    def sources(ins, n):
        q_ref, _, _, do_ref, delta_ref, shift_ref = ins
        vectors = [lambda m, r=r: r.at[n, pl.ds(m * side, side)] for r in (delta_ref, shift_ref)]
        return [_blocks(q_ref, side, n), _blocks(do_ref, side, n), *vectors]

    inputs = (query, key, value, *rows)
    out_type = tuple(
        jax.ShapeDtypeStruct((plan.seq_kv, heads, x.shape[-1]), x.dtype) for x in (key, value)
    )
    swept = _Swept(slots, sources, _backward_stages(width))
    return _kernel(plan, "q", side, inputs, shared, out_type, own, swept, consumer)
