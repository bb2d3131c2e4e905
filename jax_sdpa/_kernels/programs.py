r"""The kernels' programs, written once for every backend over named refs.

The programs are the engine's sweeps (:mod:`jax_sdpa._tiles`), with the loop over query blocks
(and, in the backward pass, over key blocks) turned into a grid of programs, one per head and
block, for queries and keys that start at any global position (a ring's shards)::

    forward   program (n, i):  for j in the key blocks the rule may allow (sweep):
                                   state = forward_tile(state, q_i, k_j, v_j)
                               o_i, lse_i = finish(state)
    backward  program (n, i):  dq_i  = Σ_j query_gradient(tile_gradient(...))   (over keys)
              program (n, j):  dk_j, dv_j, dconsts_j = Σ_i backward_tile(...)   (over queries)

Every tile is the engine's own (:meth:`jax_sdpa._tiles.Tiles.forward_tile`,
:meth:`~jax_sdpa._tiles.Tiles.tile_gradient` and the products after it): the formula, the
mods, their ``jax.vjp`` and the mask rules are the XLA paths', traced into the kernel body.
Query head ``n`` reads key/value head ``n // G`` (GQA without copying); the key gradients of
the ``G`` heads that share a key head are summed after the kernel. The arrays a call brings
besides ``q``, ``k``, ``v`` (the rule's, the mods' captured arrays, the sinks) enter whole.

Each program's refs are named (:class:`Shared`, ``ForwardIn``, …: pytrees of refs, as
``pallas_call`` hands them over), and what it reads whole besides (:class:`Shared`) is read where
its body reads it (:func:`jax_sdpa._kernels.reads.evaluate`). The backend
(:mod:`jax_sdpa._kernels.backend`) decides only how a gradient all programs add into is summed.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array

from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._block_mask import EMPTY, BlockMask
from jax_sdpa._formula import CallArrays
from jax_sdpa._indices import INDEX, listed
from jax_sdpa._kernels.backend import Backend
from jax_sdpa._kernels.interpreter import INTERPRETER
from jax_sdpa._kernels.reads import evaluate
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._sweeps import Blocks, guarded, sweep
from jax_sdpa._tiles import BackwardRows, Tiles
from jax_sdpa._tunables import Pallas


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Shared:
    """What every program reads whole (refs in a program, arrays outside).

    The query heads' indices ``(N,)``; the sinks and the sigmoid's biases ``(N,)``, None where
    the call has none (then no ref at all); and the call's other arrays, ``arrays`` (the rule's,
    the batch index, the ``score_mod``'s arrays, the global positions of the first query and
    key, a block mask's lists: :func:`shared_arrays`), each with two leading axes of 1.
    """

    head: Array
    sinks: Array | None
    sigmoid_bias: Array | None
    arrays: tuple


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardIn:
    """The forward program's inputs: its query block, its key/value head, what all share."""

    query: Array
    key: Array
    value: Array
    shared: Shared


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOut:
    """The forward program's outputs: its rows' output, log-sum-exp and largest scores."""

    out: Array
    lse: Array
    top: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BackwardIn:
    """A backward program's inputs: the forward's and the rows' backward terms.

    ``sums``: the queries' program has none; the keys' program has, for each gradient summed
    in memory, the zeros it starts as (an input its output is aliased to).
    """

    query: Array
    key: Array
    value: Array
    rows: BackwardRows  # d_out (T, V), delta (T, 1), shift (T, 1)
    shared: Shared
    sums: tuple = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeysOut:
    """The keys' program's outputs: its key block's gradients, and the mods' arrays'.

    ``consts``: one per ``score_mod`` array with a gradient, in order: this program's part, or
    (summed in memory) the one gradient all programs add into.
    """

    key: Array
    value: Array
    consts: tuple


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the programs of one call share (static): tiles, tunables, layout, backend.

    ``shared``, ``shapes``, ``dtypes``: the treedef of :func:`shared_arrays` and its leaves'
    shapes and dtypes.
    ``in_memory``: for each of the ``score_mod``'s arrays with a gradient (floating point,
    not fixed), whether it is summed in memory (an array too large to hold as one-hot sums: a
    table per position). ``fixed``: the call's ``CallArrays.fixed_consts``.
    """

    tiles: Tiles
    tunables: Pallas
    seq_q: int  # padded to whole tiles
    seq_kv: int
    shared: Any
    shapes: tuple
    dtypes: tuple
    in_memory: tuple[bool, ...]
    fixed: tuple = ()
    backend: Backend = INTERPRETER

    @property
    def group(self) -> int:
        """``G``, the query heads per key/value head."""
        return self.tiles.groups[1]

    def inputs(self, arrays: CallArrays, offsets, lists) -> Shared:
        """What every program reads whole, as arrays (:class:`Shared`)."""
        leaves = jax.tree.leaves(shared_arrays(arrays, offsets, lists))
        shapes = zip(leaves, self.shapes, strict=True)
        # Two axes of 1 first: under vmap a batch axis joins them, and TPU blocks end in two
        # whole axes.
        shared = tuple(jnp.reshape(x, (1, 1, *shape)) for x, shape in shapes)
        return Shared(arrays.head, arrays.sinks, arrays.sigmoid_bias, shared)

    def run(self, body, shared: Shared, n):
        """``body(arrays, sink, (q_offset, kv_offset), sweep)`` in a program of query head ``n``.

        ``arrays`` are head ``n``'s, read from the refs ``shared``; ``sweep(step, axis, block,
        carry)`` is :meth:`sweep` with this program's arrays, offsets and block lists. The
        shared arrays stay in memory, read where ``body`` reads them
        (:func:`jax_sdpa._kernels.reads.evaluate`).
        """
        sink = None if shared.sinks is None else shared.sinks[n]
        bias = None if shared.sigmoid_bias is None else shared.sigmoid_bias[n]
        head = shared.head[n]

        def with_values(*arrays):
            arrays = [x.reshape(shape) for x, shape in zip(arrays, self.shapes, strict=True)]
            rule, batch, consts, offsets, lists = jax.tree.unflatten(self.shared, arrays)
            arrays = CallArrays(
                rule=rule,
                batch=batch,
                head=head,
                score_consts=consts,
                sigmoid_bias=bias,
                fixed_consts=self.fixed,
            )
            offsets = (offsets[0], offsets[1])
            sweep = functools.partial(self.sweep, arrays, offsets=offsets, head_lists=(n, lists))
            return body(arrays, sink, offsets, sweep)

        return evaluate(
            with_values, list(shared.arrays), dtypes=self.dtypes, rules=self.backend.rules
        )

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
        count = (self.seq_kv if forward else self.seq_q) // other
        blocks = Blocks(axis, offsets[1] if forward else offsets[0], other, count)
        step = guarded(step, lambda m, carry: carry, arrays, blocks, (start, this))
        n, block_lists = head_lists
        lists = None
        if block_lists is not None:
            counts, order = block_lists.along(axis)
            head = 0 if counts.shape[0] == 1 else n
            lists = (counts[head, block], order[head, block])
        return sweep(step, arrays.rule, blocks, (start, start + this), carry, lists)


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
        return cls(*listed(visited), *listed(jnp.swapaxes(visited, -1, -2)))

    def along(self, axis: str) -> tuple:
        return (self.kv_count, self.kv_blocks) if axis == "kv" else (self.q_count, self.q_blocks)


def forward_program(plan: Plan, refs: ForwardIn, outs: ForwardOut):
    """Program ``(n, i)``: query block ``i`` of head ``n`` against the keys it may see."""
    tiles = plan.tiles
    n, i = pl.program_id(0), pl.program_id(1)
    q = refs.query[...]

    def body(arrays: CallArrays, sink, offsets, sweep):
        q_offset, kv_offset = offsets
        tile_q = q_offset + i * tiles.block_q
        like = jnp.zeros((), q.dtype)  # in a kernel the state's zeros need not vary (shard_map)
        shape = (tiles.block_q,)
        state = online_softmax.init(like, shape, (tiles.block_q, refs.value.shape[-1]), sink)

        def step(j, state, rule):
            keys = pl.ds(j * tiles.block_kv, tiles.block_kv)
            tile = dataclasses.replace(arrays, rule=rule)
            k_j, v_j = refs.key[keys, :], refs.value[keys, :]
            tile_kv = kv_offset + j * tiles.block_kv
            return tiles.forward_tile(state, q, k_j, v_j, tile, tile_q, tile_kv)

        state = sweep(step, "kv", i, state)
        out, lse = tiles.formula.normalizer.finish(state, outs.out.dtype)
        return out, lse, online_softmax.top_scores(state)

    out, lse, top = plan.run(body, refs.shared, n)
    outs.out[...] = out
    outs.lse[...] = lse[:, None]
    outs.top[...] = top[:, None]


def _zeros(x):
    """An accumulator for the gradient of the tile ``x``: zeros in at least float32."""
    return jnp.zeros(x.shape, accumulation_dtype(x.dtype))


def queries_program(plan: Plan, refs: BackwardIn, d_query):
    """Program ``(n, i)``: query block ``i``'s gradient, a sweep over the keys it saw."""
    tiles = plan.tiles
    n, i = pl.program_id(0), pl.program_id(1)
    q = refs.query[...]
    rows = refs.rows
    terms = BackwardRows(rows.d_out[...], rows.delta[:, 0], rows.shift[:, 0])

    def body(arrays: CallArrays, _, offsets, sweep):
        q_offset, kv_offset = offsets
        tile_q = q_offset + i * tiles.block_q

        def step(j, dq, rule):
            keys = pl.ds(j * tiles.block_kv, tiles.block_kv)
            tile = dataclasses.replace(arrays, rule=rule)
            k_j, v_j = refs.key[keys, :], refs.value[keys, :]
            tile_kv = kv_offset + j * tiles.block_kv
            grad = tiles.tile_gradient(q, k_j, v_j, tile, terms, tile_q, tile_kv)
            return dq + tiles.query_gradient(grad, k_j, q.dtype)

        return sweep(step, "kv", i, _zeros(q))

    d_query[...] = plan.run(body, refs.shared, n).astype(d_query.dtype)


def keys_program(plan: Plan, refs: BackwardIn, outs: KeysOut):
    """Program ``(n, j)``: key block ``j``'s gradients, and its part of the mods' arrays'.

    An array's gradient is carried through the loop; one summed in memory
    (``plan.in_memory``) is an output all programs add to at each step. Where the programs run
    at once (a GPU's), it starts as zeros (an input it is aliased to) and takes atomic adds,
    which also add a scatter's repeated points (a table read at ``q_idx − kv_idx``). Where they
    run one after another, the first zeroes it (a TPU keeps the block in VMEM throughout,
    never loading the aliased zeros).
    """
    tiles = plan.tiles
    n, j = pl.program_id(0), pl.program_id(1)
    k, v = refs.key[...], refs.value[...]

    def split(xs, in_memory: bool) -> list:
        return [x for x, m in zip(xs, plan.in_memory, strict=True) if m == in_memory]

    if not plan.backend.concurrent:

        @pl.when((n == 0) & (j == 0))
        def _():
            for ref in split(outs.consts, True):
                ref[...] = jnp.zeros(ref.shape, ref.dtype)

    def body(arrays: CallArrays, _, offsets, sweep):
        q_offset, kv_offset = offsets
        tile_kv = kv_offset + j * tiles.block_kv

        def step(i, grads, rule):
            rows = pl.ds(i * tiles.block_q, tiles.block_q)
            r = refs.rows
            terms = BackwardRows(r.d_out[rows, :], r.delta[rows, 0], r.shift[rows, 0])
            tile = dataclasses.replace(arrays, rule=rule)
            tile_q = q_offset + i * tiles.block_q
            _, dk, dv, _, d_consts = tiles.backward_tile(
                refs.query[rows, :], k, v, tile, terms, tile_q, tile_kv
            )
            d_consts = [d for d in d_consts if d is not None]
            for ref, d in zip(split(outs.consts, True), split(d_consts, True), strict=True):
                if plan.backend.concurrent:
                    plan.backend.atomic_add(ref, (0, 0), d.astype(ref.dtype))
                else:
                    ref[0, 0] += d.astype(ref.dtype)
            # (an array's in its accumulator's dtype: a bfloat16 array's summed in float32)
            registers = split(d_consts, False)
            d_consts = [d.astype(g.dtype) for g, d in zip(grads[2], registers, strict=True)]
            return jax.tree.map(jnp.add, grads, (dk, dv, d_consts))

        consts = [jnp.zeros(r.shape[2:], r.dtype) for r in split(outs.consts, False)]
        return sweep(step, "q", j, (_zeros(k), _zeros(v), consts))

    dk, dv, d_consts = plan.run(body, refs.shared, n)
    outs.key[...] = dk
    outs.value[...] = dv
    for ref, d in zip(split(outs.consts, False), d_consts, strict=True):
        ref[0, 0] = d


def shared_arrays(arrays: CallArrays, offsets, lists) -> tuple:
    """The arrays every program reads whole: rule, batch index, mods, offsets, block lists."""
    return arrays.rule, arrays.batch, arrays.score_consts, jnp.asarray(offsets, INDEX), lists
