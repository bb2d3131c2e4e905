r"""Warp-specialized Mosaic GPU kernels: a producer's ring and consumers running the engine's tiles.

:func:`warp_specialized` is a ``plgpu.kernel`` of three warpgroups, as FlashAttention-3 and JAX's
own ``attention_mgpu`` are built: a producer copies the blocks a program sweeps over into a ring
of shared-memory slots by TMA, and two consumers, taking turns at the tensor cores, use them
(:mod:`jax_sdpa._kernels.pipeline`); each consumer holds its own positions (:class:`Program`)
and runs the engine's own tile on every block: its products are ``wgmma`` on the slots
(:func:`product`), everything between them (the formula, the mods, the mask rules,
the online softmax, their ``jax.vjp``) is :class:`~jax_sdpa._tiles.Tiles`' code, the XLA
paths' and the Triton kernel's, traced into the kernel. The blocks a rule excludes are not
copied; those it allows wholly run with no mask (which blocks, and how:
:mod:`jax_sdpa._kernels.schedule`). The kernels themselves are
:mod:`jax_sdpa._kernels.mosaic_gpu`'s.

Written for the Warpgroup lowering semantics (Mosaic GPU infers the register layouts): JAX 0.11
and later. ``plgpu.InterpretGPUParams`` runs the same kernels on a CPU (shared memory, threads
and barriers simulated), where the tiles that meet a product go through shared memory: the
simulator has no ``wgmma`` from registers.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_sdpa._formula import CallArrays
from jax_sdpa._indices import INDEX
from jax_sdpa._jax_compat import SIMULATES_WGMMA_INTO
from jax_sdpa._jaxpr import table
from jax_sdpa._kernels import atomics
from jax_sdpa._kernels.atomics import GradientAtPoints
from jax_sdpa._kernels.backend import Backend
from jax_sdpa._kernels.pipeline import Ring, Turns
from jax_sdpa._kernels.positions import tile_positions
from jax_sdpa._kernels.programs import Plan, Shared
from jax_sdpa._kernels.reads import looped_gathers, refuse_eight_bits
from jax_sdpa._kernels.schedule import (
    CONSUMERS,
    RULE,
    Lists,
    Steps,
    held_start,
    ranged,
)
from jax_sdpa._kernels.values import Lazy, for_mosaic_gpu
from jax_sdpa._kernels.windows import Vectors
from jax_sdpa._user_functions import float64_as_float32

ROWS = 64  # a consumer's positions: one ``wgmma``'s rows
STAGES = 2  # shared-memory slots of the producer's ring


def _tile(x):
    """A tile in ``wgmma``'s register layout.

    Every kernel's tiles have sides that are multiples of 64 (``fitting``'s least block); any
    other array, a mod's, is refused (:func:`_not_a_tile`).
    """
    shape = jnp.shape(x)
    if len(shape) != 2 or shape[0] % 64 or shape[1] % 64:
        raise _not_a_tile(shape)
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _not_a_tile(shape) -> NotImplementedError:
    """The error of a mod that makes an array that is not a tile, nor a vector along one.

    (``jnp.any(kv_idx == tokens)``: a tile's positions compared with each entry of an array.)
    """
    return NotImplementedError(
        "The Mosaic GPU kernel holds tiles (and vectors along their axes) in registers, and "
        f"this call's score_mod or mask_mod makes a {tuple(shape)} array (positions or a tile "
        "against each entry of an array, as `jnp.any(kv_idx == tokens)`): write it entry by "
        "entry (`(kv_idx == tokens[0]) | (kv_idx == tokens[1]) | …`), or use "
        '`Pallas(backend="triton")` (an array whose length is a power of two) or '
        "`implementation='xla'`."
    )


def _along(axis: int) -> Vectors:
    """Vectors along a tile's ``axis`` (0: its rows, 1: its columns) in ``wgmma``'s layout.

    (A jaxpr's axes may be NumPy integers, which Mosaic GPU's layouts take for sequences.)
    """
    axis = int(axis)
    layout = plgpu.Layout.WGMMA.reduce(1 - axis)

    def load(part):
        return part.loaded(read_along(part.ref.at[part.index], axis))

    return Vectors(
        load=load,
        iota=lambda count: plgpu.broadcasted_iota(INDEX, (count,), 0, layout=layout),
        refuse=refuse_eight_bits,
    )


def read_along(ref, axis: int = 1):
    """A vector ref in registers, along a tile's ``axis`` (by default its columns: its keys)."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1 - axis), optimized=False)


def _read_tile(ref):
    """A 2-D ref in registers, a tile in ``wgmma``'s layout (a matrix a mod reads)."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False)


def _one_point(eqn, operands):
    """A scatter-add (a read's gradient) at more than one point: an error (None at one).

    The kernels sum the gradient of an array read at one index (``slopes[h]``) in registers;
    a call that reads one at more adds the gradients into memory (:func:`in_memory_backend`).
    """
    if eqn.invars[2].aval.size <= 1:
        return None
    raise GradientAtPoints(f"a {eqn.invars[0].aval} array's gradient at more than one point")


def _by_rows(eqn, operands):
    """A tile's sum (max, min) to a scalar: its rows' first (a whole tile's fails to lower)."""
    x = operands[0]
    if isinstance(x, Lazy) or jnp.ndim(x) != 2 or tuple(eqn.params["axes"]) != (0, 1):
        return None
    reduce = getattr(lax, eqn.primitive.name)  # (lax's: the equation's dtype kept)
    return reduce(reduce(x, (1,)), (0,))


def _reduced_beyond_a_tile(eqn, operands):
    """A reduction of an array of more axes than a tile's two: refused by name."""
    if eqn.invars[0].aval.ndim > 2:
        raise _not_a_tile(eqn.invars[0].aval.shape)
    return None


# Its programs' own rules: a tile's positions, and values read at them, in the products'
# (``wgmma``'s) register layouts; gathers at tiles or vectors of points looped, others refused;
# a tile reduced to a scalar by rows, an array of more axes refused.
_RULES = (
    tile_positions(_tile, _along),
    looped_gathers(_tile, _along, _read_tile),
    dict.fromkeys(("reduce_sum", "reduce_max", "reduce_min"), (_reduced_beyond_a_tile, _by_rows)),
    dict.fromkeys(("reduce_and", "reduce_or"), (_reduced_beyond_a_tile,)),
)
# Gradients summed in registers: of arrays read at one point.
MOSAIC_GPU = Backend(lambda tunables: None, rules=table({"scatter-add": (_one_point,)}, *_RULES))


def in_memory_backend(plan: Plan) -> Backend:
    """Its rules where gradients are added into memory at their points (:mod:`.atomics`)."""
    rules = atomics.rules(simulated(plan), _along)
    return Backend(lambda tunables: None, rules=table(rules, *_RULES))


@dataclasses.dataclass(frozen=True)
class InSmem:
    """A tile already in shared memory (``ref``, in the product's dtype), read there by ``wgmma``.

    (Weights a consumer shares with the other: :func:`~jax_sdpa._kernels.mosaic_gpu.forward`.)
    """

    ref: object


def product(staging, simulated: bool, widened=None, turn=None):
    """The tiles' :func:`~jax_sdpa._steps.cast_product` as ``wgmma``.

    ``td,sd->ts`` (the raw scores ``q · kᵀ``, the weights' gradient ``dO · vᵀ``) of two refs in
    shared memory; ``ts,sd->td`` (``p · v``, ``dS · k``) of a tile (an array) and a ref, the
    tile from registers, or through ``staging`` (shared memory) under the simulator
    (``simulated``), which has no ``wgmma`` from registers, or where it is (:class:`InSmem`);
    ``ts,td->sd`` (``Pᵀ · dO``,
    ``dSᵀ · q``) of a tile and a ref, the tile through ``staging``, read transposed. A ref of
    8-bit numbers (a quantized cache's block) is first widened to ``dtype``, into shared memory:
    ``widened[spec]``, the product's own. ``onto``: an accumulator the product adds into
    (``ts,sd->td``). ``turn``: the consumers' turns at the tensor cores
    (:class:`Turns`), taken after a ``td,sd->ts`` product is issued and before a ``ts,sd->td``.
    """

    def stage(a, dtype, into=staging):
        into[...] = a.astype(dtype)
        plgpu.commit_smem()
        return into

    def wide(spec, b, dtype):
        if b.dtype == dtype:
            return b
        into = widened[spec]
        eight_bits = plgpu.load(b, layout=plgpu.Layout.WGMMA_8BIT)
        # (float8 widens through float32: Hopper converts it to float16 alone)
        return stage(eight_bits.astype(jnp.float32), dtype, into)

    def product(spec: str, a, b, dtype, *, precision=None, onto=None):
        # (``dtype``: every operand has it, the kernels' inputs' one dtype, fitting.for_inputs)
        b = wide(spec, b, dtype)
        if spec == "td,sd->ts":
            shape, b = (a.shape[0], b.shape[0]), b.transpose((1, 0))
        elif spec == "ts,sd->td":
            if isinstance(a, InSmem):
                a = a.ref
            else:
                a = stage(a, b.dtype) if simulated else a.astype(b.dtype)
            shape = (a.shape[0], b.shape[1])
        else:  # "ts,td->sd"
            shape, a = (a.shape[1], b.shape[1]), stage(a, b.dtype).transpose((1, 0))

        if turn is not None and spec == "ts,sd->td":
            turn()

        def run(acc):
            plgpu.wgmma(acc, a, b)
            if turn is not None and spec == "td,sd->ts":
                turn()
            return acc[...]

        if onto is not None and (SIMULATES_WGMMA_INTO or not simulated):
            # (adding into it: no second accumulator, no add after)
            return pl.run_state(functools.partial(plgpu.wgmma, a=a, b=b))(plgpu.ACC.init(onto))
        fresh = pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))
        return fresh if onto is None else onto + fresh

    return product


def laid_out(tree):
    """A consumer's carry in register layouts: ``wgmma``'s, or strided over its threads.

    Tiles as the products', vectors of a tile's rows as their rows; longer vectors (an array's
    gradient, a multiple of the warpgroup's 128 threads) an entry to a thread in turn. (Layout
    inference, left to find them across the loops, runs out of attempts.)
    """
    rows, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA

    def layout(x):
        if x.ndim == 2:
            return tile
        return rows if x.shape == (ROWS,) else plgpu.Layout.WG_STRIDED(x.shape, vec_size=1)

    return jax.tree.map(lambda x: plgpu.layout_cast(x, layout(x)), tree)


@dataclasses.dataclass(frozen=True)
class Swept:
    """What a kernel's producer copies into its ring of ``stages`` slots.

    ``blocks``: each swept array's block (a ``jax.ShapeDtypeStruct``); ``sources(inputs, n)``:
    for each, the ref of block ``m`` (``m -> ref``, or a tuple of ``pieces`` refs, each a part
    of its rows) in a program of query head ``n``. The blocks are those the rule's ranges hold
    or, where ``masked`` (the call's arrays, whose rule is a block mask's classes), those the
    mask lists (:class:`Lists`).
    """

    blocks: list
    sources: Callable
    stages: int
    masked: CallArrays | None = None
    pieces: int = 1  # copies a block takes (pages of a paged cache)


@dataclasses.dataclass(frozen=True)
class Program:
    """What a consumer of program ``(n, ·)`` knows.

    It holds positions of one axis from ``start``; the producer sweeps blocks of the other,
    ``axis`` (``"kv"``: keys, for query rows; ``"q"``: queries, for keys).
    """

    plan: Plan
    axis: str
    n: jax.Array  # the query head
    c: jax.Array | int  # the consumer (an int in a split program: :func:`warp_specialized`)
    start: jax.Array
    shared: Shared  # refs
    steps: Steps
    ring: Ring
    turns: Turns | None = None  # where its consumers take turns at the tensor cores

    @property
    def size(self) -> int:
        """The swept blocks' size."""
        tiles = self.plan.tiles
        return tiles.block_kv if self.axis == "kv" else tiles.block_q

    def tiles(self, staging, widened=None):
        """The plan's tiles, their products ``wgmma`` (:func:`product`).

        Through this consumer's part of ``staging`` (a ref, or None) and of each of ``widened``
        (a dict of refs, by product).
        """
        staged = None if staging is None else staging.at[self.c]
        own = {spec: ref.at[self.c] for spec, ref in (widened or {}).items()}
        tiles = self.plan.tiles
        wgmma = product(staged, simulated(self.plan), own, self.turns)
        return dataclasses.replace(tiles, product=wgmma)

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

            return laid_out(self.run(body))

        steps, turns = self.steps, self.turns
        loop = functools.partial(
            self.ring.consume, steps.runs, steps.lo, laid_out(carry), step, steps.block
        )
        if turns is None:
            return loop()
        return turns.around(self.c, functools.partial(loop, skip=turns.skip))


def warp_specialized(
    plan: Plan,
    axis: str,
    held: int,
    inputs,
    shared,
    out_type,
    own,
    swept,
    consumer,
    split=False,
    alternate=False,
    backend=MOSAIC_GPU,
    reduction_scratch=plgpu.CompilerParams.reduction_scratch_bytes,
):
    """A warp-specialized kernel: program ``(n, m)`` a producer and :data:`CONSUMERS` consumers.

    Each consumer holds ``held`` positions of the axis that is not ``axis``, the program
    ``CONSUMERS · held`` of them (or, ``split``, the same ``held`` for all: each computes a
    part of their output, and ``program.c`` is a Python int), and sweeps the ``axis`` blocks
    its positions may meet; the producer copies the blocks any of them may meet into its ring
    (:class:`Swept`). ``alternate``: the consumers take turns at the tensor cores
    (:class:`Turns`). ``own``: the consumers' scratch (shared-memory types).
    ``consumer(inputs, outputs, own, program)`` runs in each consumer (refs; :class:`Program`).
    ``inputs``: arrays, the queries first, ``(T, N, ·)``. ``backend``: the rules its programs'
    bodies are read with. ``reduction_scratch``: the shared memory's bytes Mosaic GPU reserves
    for reductions across warps (by default its own).
    """
    plan = dataclasses.replace(plan, backend=backend)
    interpret = plan.tunables.interpret or None
    rows = held if split else CONSUMERS * held
    heads = inputs[0].shape[1]
    count = (plan.seq_q if axis == "kv" else plan.seq_kv) // rows
    size = swept.blocks[0].shape[0]
    swept_count = (plan.seq_kv if axis == "kv" else plan.seq_q) // size
    masked = swept.masked
    counts = (count, swept_count)
    lists = None if masked is None else Lists.of(masked, axis, held, size, counts, split)
    shared = dataclasses.replace(shared, arrays=tuple(map(for_mosaic_gpu, shared.arrays)))
    leaves, tree = jax.tree.flatten((shared, lists))
    arity = len(inputs) + len(leaves)

    @float64_as_float32()  # (as the arrays are held: for_mosaic_gpu)
    def kernel(*refs):
        ins, (*outs, scratch) = refs[: len(inputs)], refs[arity:]
        shared_refs, lists_refs = jax.tree.unflatten(tree, refs[len(inputs) : arity])
        own_refs, ring_refs, full, free, schedule = scratch
        n, c, m = lax.axis_index("heads"), lax.axis_index("wg"), lax.axis_index("blocks")
        first = m * rows
        start = held_start(m, jnp.minimum(c, CONSUMERS - 1), held, split)
        span, whole = (start, start + held), (first, first + rows)
        if lists_refs is None:
            steps = ranged(plan, shared_refs, n, axis, span, whole)
        else:
            steps = lists_refs.steps(n, m, c)
        ring = Ring(ring_refs, full, free)

        @pl.when(c == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            ring.produce(swept.sources(ins, n), steps.lo, steps.hi, steps.block)

        def run_consumer(c):
            plgpu.set_max_registers(232, action="increase")
            turns = None if schedule is None else Turns(schedule)
            program = Program(plan, axis, n, c, start, shared_refs, steps, ring, turns)
            consumer(ins, outs, own_refs, program)

        if split:  # (each consumer its own code: which one it is, a Python int)
            for each in range(CONSUMERS):
                pl.when(c == each)(functools.partial(run_consumer, each))
        else:
            pl.when(c < CONSUMERS)(functools.partial(run_consumer, c))

    scratch = (
        own,
        tuple(plgpu.SMEM((swept.stages, *block.shape), block.dtype) for block in swept.blocks),
        tuple(
            plgpu.Barrier(num_arrivals=swept.pieces, num_barriers=swept.stages)
            for _ in swept.blocks
        ),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=swept.stages),
        plgpu.Barrier(num_arrivals=CONSUMERS) if alternate else None,
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
            approx_math=True,
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            reduction_scratch_bytes=reduction_scratch,
        ),
        interpret=interpret,
    )(*inputs, *leaves)


def head_blocks(ref, size: int, head):
    """Block ``m`` of ``size`` rows of head ``head`` of a ``(T, heads, d)`` ref: ``m -> ref``."""
    return lambda m: ref.at[pl.ds(m * size, size), head]


def load(pairs, barriers, c) -> None:
    """Copies each ``(source, destination)`` into shared memory, each with its barrier; waits."""
    for (source, destination), barrier in zip(pairs, barriers, strict=True):
        plgpu.copy_gmem_to_smem(source, destination, barrier.at[c])
    for barrier in barriers:
        plgpu.barrier_wait(barrier.at[c])


def store(pairs) -> None:
    """Writes each ``(value, shared-memory ref, destination)`` out through shared memory."""
    for value, smem, _ in pairs:
        smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    for _, smem, destination in pairs:
        plgpu.copy_smem_to_gmem(smem, destination)
    plgpu.wait_smem_to_gmem(0)


def simulated(plan: Plan) -> bool:
    """Whether the plan's kernels run on the GPU simulator."""
    return bool(plan.tunables.interpret)


def staging_memory(plan: Plan, dtype, always: bool):
    """The consumers' shared memory (a type) through which tiles meet a product, or None.

    (:func:`product`.) A kernel needs it ``always`` (its tiles meet products transposed) or on
    the simulator.
    """
    if not (always or simulated(plan)):
        return None
    return plgpu.SMEM((CONSUMERS, plan.tiles.block_q, plan.tiles.block_kv), dtype)
