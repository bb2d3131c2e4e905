r"""The engine's tiles as Pallas kernels: Triton on GPUs, Mosaic on TPUs.

The kernels are the engine's sweeps (:mod:`jax_sdpa._tiles`), with the loop over query blocks
(and, in the backward pass, over key blocks) turned into a grid of programs, one per head and
block, for queries and keys that start at any global position (a ring's shards)::

    forward   program (n, i):  for j in the key blocks the rule may allow (sweep):
                                   state = forward_tile(state, q_i, k_j, v_j)
                               o_i, lse_i = finish(state)
    backward  program (n, i):  dq_i  = Σ_j backward_tile(...)[dq]      (sweep over keys)
              program (n, j):  dk_j, dv_j, dconsts_j = Σ_i backward_tile(...)   (over queries)

Every tile is the engine's own (:meth:`jax_sdpa._tiles.Tiles.forward_tile`,
:meth:`~jax_sdpa._tiles.Tiles.backward_tile`): the formula, the mods, their ``jax.vjp`` and the
mask rules are the XLA paths', traced into the kernel body. Query head ``n`` reads key/value
head ``n // G`` (GQA without copying); the key gradients of the ``G`` heads that share a key
head are summed after the kernel. The arrays a call brings besides ``q``, ``k``, ``v`` (the
rule's, the mods' captured arrays, the sinks) enter whole.

Which kernel runs is chosen by the platform the program is lowered for
(:func:`jax.lax.platform_dependent`): Triton on ``cuda``/``rocm``, Mosaic on ``tpu``, the
Pallas interpreter on any other (a CPU), where it is exact but slow: a test oracle, not a
fast path. ``Pallas(interpret=True)`` runs the interpreter everywhere;
``Pallas(interpret=pltpu.InterpretParams())`` the TPU simulator, which raises on out-of-bounds
reads that the interpreter clamps.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._block_mask import EMPTY, BlockMask
from jax_sdpa._formula import CallArrays
from jax_sdpa._indices import INDEX
from jax_sdpa._kernel_reads import evaluate
from jax_sdpa._online_softmax import SIGMOID
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._tiles import BackwardRows, Tiles, classified, loop, sweep, tile_class
from jax_sdpa._tunables import Pallas


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What the kernels of one call share (static): tiles, tunables, the arrays' layout.

    Besides queries, keys and values, every program reads whole: the query heads' indices, the
    sinks and the sigmoid's biases (if any) and the ``shared`` arrays (the rule's, the batch
    index, the ``score_mod``'s arrays, the global positions of the first query and key, a block
    mask's lists), each with two leading axes of 1.
    """

    tiles: Tiles
    tunables: Pallas
    seq_q: int  # padded to whole tiles
    seq_kv: int
    shared: Any  # the treedef of (rule, batch, score_consts, offsets, lists)
    shapes: tuple  # the shapes of its leaves
    sinks: bool
    # For each of the ``score_mod``'s arrays with a gradient (floating point): whether it is
    # summed in memory (an array too large to hold as one-hot sums: a table per position).
    in_memory: tuple[bool, ...]
    atomics: bool = False  # in memory, summed by atomic adds (Triton's programs run at once)

    @property
    def gradients(self) -> int:
        """How many of the ``score_mod``'s arrays have a gradient."""
        return len(self.in_memory)

    @property
    def group(self) -> int:
        """``G``, the query heads per key/value head."""
        return self.tiles.groups[1]

    def inputs(self, arrays: CallArrays, offsets, lists) -> list:
        """The arrays every program reads, in the order :meth:`run` takes their refs."""
        leaves = jax.tree.leaves(shared_arrays(arrays, offsets, lists))
        shapes = zip(leaves, self.shapes, strict=True)
        # Two axes of 1 first: under vmap a batch axis joins them, and TPU blocks end in two
        # whole axes.
        shared = [jnp.reshape(x, (1, 1, *shape)) for x, shape in shapes]
        heads = [arrays.head, arrays.sinks, arrays.sigmoid_bias]
        return [x for x in heads if x is not None] + shared

    def run(self, body, refs: list, n):
        """``body(arrays, sink, (q_offset, kv_offset), sweep)`` in a program of query head ``n``.

        ``arrays`` are head ``n``'s, read from the refs of :meth:`inputs`; ``sweep(step, axis,
        block, carry)`` is :meth:`sweep` with this program's arrays, offsets and block lists.

        The shared arrays stay in memory, read where ``body`` reads them
        (:func:`jax_sdpa._kernel_reads.evaluate`).
        """
        head, *refs = refs
        sink = refs.pop(0)[n] if self.sinks else None
        bias = refs.pop(0)[n] if self.tiles.formula.normalizer is SIGMOID else None
        head = head[n]

        def with_values(*shared):
            shared = [x.reshape(shape) for x, shape in zip(shared, self.shapes, strict=True)]
            rule, batch, consts, offsets, lists = jax.tree.unflatten(self.shared, shared)
            arrays = CallArrays(
                rule=rule, batch=batch, head=head, score_consts=consts, sigmoid_bias=bias
            )
            offsets = (offsets[0], offsets[1])
            sweep = functools.partial(self.sweep, arrays, offsets=offsets, head_lists=(n, lists))
            return body(arrays, sink, offsets, sweep)

        return evaluate(with_values, refs)

    def call(self, kernel, grid, in_specs, out_specs, out_shape, name: str, aliases=None):
        """``kernel`` as a ``pallas_call``, compiled for the platform the program is lowered for.

        ``aliases``: ``pallas_call``'s ``input_output_aliases`` (outputs that start as inputs).
        """

        def on(interpret, params, atomics=False):
            return pl.pallas_call(
                functools.partial(kernel, dataclasses.replace(self, atomics=atomics)),
                grid=grid,
                in_specs=in_specs,
                out_specs=out_specs,
                out_shape=out_shape,
                interpret=interpret,
                compiler_params=params,
                name=name,
                input_output_aliases=aliases or {},
            )

        interpret = self.tunables.interpret
        if isinstance(interpret, pltpu.InterpretParams):
            return on(interpret, pltpu.CompilerParams())
        if interpret:
            return on(True, None)
        tunables = self.tunables
        triton = on(
            False,
            pltriton.CompilerParams(num_warps=tunables.num_warps, num_stages=tunables.num_stages),
            atomics=True,
        )
        mosaic = on(False, pltpu.CompilerParams())
        interpreter = on(True, None)

        def lowered(*args):
            return lax.platform_dependent(
                *args, cuda=triton, rocm=triton, tpu=mosaic, default=interpreter
            )

        return lowered

    def sweep(self, arrays: CallArrays, step, axis: str, block, carry, *, offsets, head_lists):
        """``carry = step(m, carry, rule)`` over the ``axis`` blocks ``m`` the rule may allow.

        ``block`` is the program's block of the other axis; ``offsets`` the global position of
        each axis's first (``(q_offset, kv_offset)``). The blocks the rule excludes are never
        visited: the loop runs between the rule's ranges or, given a block mask's
        :class:`BlockLists` (``head_lists = (n, lists)``, query head ``n``), over its list of the
        blocks it does not exclude; inside either, an opaque rule's class of each tile says
        whether it is skipped, run with the rule, or run without it (full).
        """
        tiles = self.tiles
        forward = axis == "kv"
        this, other = (
            (tiles.block_q, tiles.block_kv) if forward else (tiles.block_kv, tiles.block_q)
        )
        start = offsets[1 - forward] + block * this
        first = offsets[1] if forward else offsets[0]
        count = (self.seq_kv if forward else self.seq_q) // other

        def classify(m, rule):
            blocks = ((start, this), (first + m * other, other))
            return tile_class(rule, arrays, *(blocks if forward else blocks[::-1]))

        guarded = classified(step, classify, skip=lambda m, carry: carry)
        n, lists = head_lists
        if lists is None:
            span = (start, start + this)
            return sweep(guarded, arrays.rule, axis, span, first, other, count, carry)
        counts, blocks = lists.along(axis)
        head = 0 if counts.shape[0] == 1 else n
        listed = lambda m, carry: guarded(blocks[head, block, m], carry, arrays.rule)  # noqa: E731
        return loop(0, counts[head, block], listed, carry)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockLists:
    """A block mask's tiles as lists: FlexAttention's ``kv_num_blocks`` and ``kv_indices``.

    For each head (or one for all) and query block, how many key blocks the mask does not
    exclude and which, those first (``kv_count``, ``kv_blocks``); the same for each key block's
    query blocks (``q_count``, ``q_blocks``), for the backward pass.
    """

    kv_count: jax.Array  # (heads or 1, q_blocks)
    kv_blocks: jax.Array  # (heads or 1, q_blocks, kv_blocks)
    q_count: jax.Array  # (heads or 1, kv_blocks)
    q_blocks: jax.Array  # (heads or 1, kv_blocks, q_blocks)

    @classmethod
    def of(cls, mask: BlockMask) -> "BlockLists":
        """The lists of one sequence's :class:`~jax_sdpa.BlockMask` (a batch axis of 1)."""
        visited = mask.classes[0] != EMPTY

        def lists(x):
            order = jnp.argsort(~x, axis=-1, stable=True)
            return x.sum(axis=-1).astype(INDEX), order.astype(INDEX)

        return cls(*lists(visited), *lists(jnp.swapaxes(visited, -1, -2)))

    def along(self, axis: str) -> tuple:
        return (self.kv_count, self.kv_blocks) if axis == "kv" else (self.q_count, self.q_blocks)


def forward_kernel(kernel: Kernel, q_ref, k_ref, v_ref, *refs):
    *inputs, o_ref, lse_ref, top_ref = refs
    tiles = kernel.tiles
    n, i = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]

    def body(arrays: CallArrays, sink, offsets, sweep):
        q_offset, kv_offset = offsets
        tile_q = q_offset + i * tiles.block_q
        like = jnp.zeros((), q.dtype)  # in a kernel the state's zeros need not vary (shard_map)
        shape = (tiles.block_q,)
        state = online_softmax.init(like, shape, (tiles.block_q, v_ref.shape[-1]), sink)

        def step(j, state, rule):
            keys = pl.ds(j * tiles.block_kv, tiles.block_kv)
            tile = dataclasses.replace(arrays, rule=rule)
            k_j, v_j = k_ref[keys, :], v_ref[keys, :]
            tile_kv = kv_offset + j * tiles.block_kv
            return tiles.forward_tile(state, q, k_j, v_j, tile, tile_q, tile_kv)

        state = sweep(step, "kv", i, state)
        out, lse = tiles.formula.normalizer.finish(state, o_ref.dtype)
        return out, lse, online_softmax.max_scores(state)

    out, lse, top = kernel.run(body, inputs, n)
    o_ref[...] = out
    lse_ref[...] = lse[:, None]
    top_ref[...] = top[:, None]


def _zeros(x):
    """An accumulator for the gradient of the tile ``x``: zeros in at least float32."""
    return jnp.zeros(x.shape, accumulation_dtype(x.dtype))


def dq_kernel(kernel: Kernel, q_ref, k_ref, v_ref, d_out_ref, delta_ref, shift_ref, *refs):
    *inputs, dq_ref = refs
    tiles = kernel.tiles
    n, i = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]
    terms = BackwardRows(d_out_ref[...], delta_ref[:, 0], shift_ref[:, 0])

    def body(arrays: CallArrays, _, offsets, sweep):
        q_offset, kv_offset = offsets
        tile_q = q_offset + i * tiles.block_q

        def step(j, dq, rule):
            keys = pl.ds(j * tiles.block_kv, tiles.block_kv)
            tile = dataclasses.replace(arrays, rule=rule)
            k_j, v_j = k_ref[keys, :], v_ref[keys, :]
            tile_kv = kv_offset + j * tiles.block_kv
            return dq + tiles.backward_tile(q, k_j, v_j, tile, terms, tile_q, tile_kv)[0]

        return sweep(step, "kv", i, _zeros(q))

    dq_ref[...] = kernel.run(body, inputs, n).astype(dq_ref.dtype)


def dkv_kernel(kernel: Kernel, q_ref, k_ref, v_ref, d_out_ref, delta_ref, shift_ref, *refs):
    """Program ``(n, j)``: key block ``j``'s gradients, and its part of the mods' arrays'.

    An array's gradient is carried through the loop; one summed in memory
    (``kernel.in_memory``) is an output all programs add to at each step. On a GPU its programs
    run at once: it starts as zeros (an input it is aliased to) and takes atomic adds, which
    also add a scatter's repeated points (a table read at ``q_idx − kv_idx``). Elsewhere they
    run one after another, and the first zeroes it (a TPU keeps the block in VMEM throughout,
    never loading the aliased zeros).
    """
    first_output = len(refs) - 2 - kernel.gradients  # after the inputs and the aliased zeros
    inputs = refs[: first_output - sum(kernel.in_memory)]
    dk_ref, dv_ref, *d_const_refs = refs[first_output:]
    tiles = kernel.tiles
    n, j = pl.program_id(0), pl.program_id(1)
    k, v = k_ref[...], v_ref[...]

    def split(xs: list, in_memory: bool) -> list:
        return [x for x, m in zip(xs, kernel.in_memory, strict=True) if m == in_memory]

    if not kernel.atomics:

        @pl.when((n == 0) & (j == 0))
        def _():
            for ref in split(d_const_refs, True):
                ref[...] = jnp.zeros(ref.shape, ref.dtype)

    def body(arrays: CallArrays, _, offsets, sweep):
        q_offset, kv_offset = offsets
        tile_kv = kv_offset + j * tiles.block_kv

        def step(i, grads, rule):
            rows = pl.ds(i * tiles.block_q, tiles.block_q)
            terms = BackwardRows(d_out_ref[rows, :], delta_ref[rows, 0], shift_ref[rows, 0])
            tile = dataclasses.replace(arrays, rule=rule)
            tile_q = q_offset + i * tiles.block_q
            _, dk, dv, _, d_consts = tiles.backward_tile(
                q_ref[rows, :], k, v, tile, terms, tile_q, tile_kv
            )
            d_consts = [d for d in d_consts if d is not None]
            for ref, d in zip(split(d_const_refs, True), split(d_consts, True), strict=True):
                if kernel.atomics:
                    pltriton.atomic_add(ref, (0, 0), d.astype(ref.dtype))
                else:
                    ref[0, 0] += d.astype(ref.dtype)
            return jax.tree.map(jnp.add, grads, (dk, dv, split(d_consts, False)))

        consts = [jnp.zeros(r.shape[2:], r.dtype) for r in split(d_const_refs, False)]
        zeros = (_zeros(k), _zeros(v), consts)
        return sweep(step, "q", j, zeros)

    dk, dv, d_consts = kernel.run(body, inputs, n)
    dk_ref[...] = dk
    dv_ref[...] = dv
    for ref, d in zip(split(d_const_refs, False), d_consts, strict=True):
        ref[0, 0] = d


def shared_arrays(arrays: CallArrays, offsets, lists) -> tuple:
    """The arrays every program reads whole: rule, batch index, mods, offsets, block lists."""
    return arrays.rule, arrays.batch, arrays.score_consts, jnp.asarray(offsets, INDEX), lists
