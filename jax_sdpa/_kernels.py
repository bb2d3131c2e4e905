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
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._indices import INDEX
from jax_sdpa._kernel_reads import evaluate
from jax_sdpa._masks import LengthMask
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._tiles import (
    BackwardRows,
    Tiles,
    check_sizes,
    classified,
    differentiable,
    sweep,
    tile_class,
)

# The smallest side of a tile and of a head: Triton's matrix product takes no less.
_MIN_SIDE = 16


@dataclasses.dataclass(frozen=True)
class Pallas:
    """The fused kernel and its tunables: ``implementation=Pallas(block_q=64)``.

    Attributes:
        block_q: Queries per program, a power of two ≥ 16 (a shorter sequence takes the next
            power of two at or above its length).
        block_kv: Keys per step of a program's loop, a power of two ≥ 16.
        num_warps: Triton's warps per program (GPU).
        num_stages: Triton's software-pipelining stages (GPU).
        interpret: ``True`` runs the Pallas interpreter on any backend; a
            ``jax.experimental.pallas.tpu.InterpretParams`` the TPU simulator.

    Examples:
        >>> Pallas(block_kv=32)
        Pallas(block_q=128, block_kv=32, num_warps=4, num_stages=2, interpret=False)
    """

    block_q: int = 128
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    interpret: Any = False

    def __post_init__(self):
        check_sizes(self, ("block_q", "block_kv", "num_warps", "num_stages"))
        for name, least in (("block_q", _MIN_SIDE), ("block_kv", _MIN_SIDE), ("num_warps", 1)):
            size = getattr(self, name)
            if size < least or size & (size - 1):
                raise ValueError(
                    f"`Pallas.{name}` must be a power of two ≥ {least} (Triton's tiles); "
                    f"got {size}."
                )
        if not isinstance(self.interpret, (bool, pltpu.InterpretParams)):
            raise TypeError(
                "`Pallas.interpret` must be a bool or a pltpu.InterpretParams; "
                f"got {self.interpret!r}."
            )


def _side(length: int, block: int) -> int:
    """The tile side for ``length`` positions: ``block``, or the power of two ≥ a short one."""
    return min(block, _power_of_two(length))


def _power_of_two(size: int) -> int:
    """The least power of two ≥ ``size`` and ≥ 16 (Triton's tiles and heads)."""
    return max(_MIN_SIDE, 1 << (size - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """What the kernels of one call share (static): tiles, options, the arrays' layout.

    Besides queries, keys and values, every program reads whole: the query heads' indices, the
    sinks (if any) and the ``shared`` arrays (the rule's, the batch index, the ``score_mod``'s
    arrays, the global positions of the first query and key), each with two leading axes of 1.
    """

    tiles: Tiles
    options: Pallas
    seq_q: int  # padded to whole tiles
    seq_kv: int
    shared: Any  # the treedef of (rule, batch, score_consts, offsets)
    shapes: tuple  # the shapes of its leaves
    sinks: bool
    gradients: int  # how many of the ``score_mod``'s arrays have one (floating point)

    @property
    def groups(self) -> int:
        return self.tiles.groups[1]

    def inputs(self, arrays: CallArrays, offsets) -> list:
        """The arrays every program reads, in the order :meth:`arrays` takes their refs."""
        leaves = jax.tree.leaves(_shared(arrays, offsets))
        shapes = zip(leaves, self.shapes, strict=True)
        # Two axes of 1 first: under vmap a batch axis joins them, and TPU blocks end in two
        # whole axes.
        shared = [jnp.reshape(x, (1, 1, *shape)) for x, shape in shapes]
        return [arrays.head, *([arrays.sinks] if self.sinks else []), *shared]

    def run(self, body, refs: list, n):
        """``body(arrays, sink, (q_offset, kv_offset))`` in a program of query head ``n``.

        ``arrays`` are head ``n``'s, read from the refs of :meth:`inputs`.

        The shared arrays stay in memory, read where ``body`` reads them
        (:func:`jax_sdpa._kernel_reads.evaluate`).
        """
        head, *refs = refs
        sink = refs.pop(0)[n] if self.sinks else None
        head = head[n]

        def with_values(*shared):
            shared = [x.reshape(shape) for x, shape in zip(shared, self.shapes, strict=True)]
            rule, batch, consts, offsets = jax.tree.unflatten(self.shared, shared)
            arrays = CallArrays(rule=rule, batch=batch, head=head, score_consts=consts)
            return body(arrays, sink, (offsets[0], offsets[1]))

        return evaluate(with_values, refs)

    def call(self, kernel, grid, in_specs, out_specs, out_shape, name: str):
        """``kernel`` as a ``pallas_call``, compiled for the platform the program is lowered for."""

        def on(interpret, params):
            return pl.pallas_call(
                functools.partial(kernel, self),
                grid=grid,
                in_specs=in_specs,
                out_specs=out_specs,
                out_shape=out_shape,
                interpret=interpret,
                compiler_params=params,
                name=name,
            )

        interpret = self.options.interpret
        if isinstance(interpret, pltpu.InterpretParams):
            return on(interpret, pltpu.CompilerParams())
        if interpret:
            return on(True, None)
        options = self.options
        triton = on(False, pltriton.CompilerParams(options.num_warps, options.num_stages))
        mosaic = on(False, pltpu.CompilerParams())
        interpreter = on(True, None)

        def lowered(*args):
            return lax.platform_dependent(
                *args, cuda=triton, rocm=triton, tpu=mosaic, default=interpreter
            )

        return lowered

    def sweep(self, arrays: CallArrays, step, axis: str, start, offset, carry):
        """``carry = step(m, carry, rule)`` over the ``axis`` blocks ``m`` the rule may allow.

        ``start`` is the global position of the program's block of the other axis, ``offset``
        that of the swept axis's first. The blocks the rule excludes are skipped: by its ranges
        (the loop's bounds) or, for an opaque rule, by each tile's class.
        """
        tiles = self.tiles
        forward = axis == "kv"
        this, other = (
            (tiles.block_q, tiles.block_kv) if forward else (tiles.block_kv, tiles.block_q)
        )
        count = (self.seq_kv if forward else self.seq_q) // other

        def classify(m, rule):
            blocks = ((start, this), (offset + m * other, other))
            return tile_class(rule, arrays, *(blocks if forward else blocks[::-1]))

        guarded = classified(step, classify, skip=lambda m, carry: carry)
        span = (start, start + this)
        return sweep(guarded, arrays.rule, axis, span, offset, other, count, carry)


def _whole(x):
    """A spec reading all of ``x`` in every program."""
    return pl.BlockSpec(x.shape, lambda n, m: (0,) * x.ndim)


def _block(rows: int, width: int):
    """A spec of ``(heads, rows, width)`` reading program ``(n, m)``'s block ``m`` of head ``n``."""
    return pl.BlockSpec((None, rows, width), lambda n, m: (n, m, 0))


def _head(rows: int, width: int, groups: int = 1, block: bool = False):
    """A spec of ``(heads, rows, width)``: all rows of head ``n // groups``, or block ``m``."""
    return pl.BlockSpec((None, rows, width), lambda n, m: (n // groups, m if block else 0, 0))


def _lse(rows: int, block: bool = True):
    """A spec of ``(heads, T, 1)`` row statistics: block ``m`` of head ``n``, or all of it.

    A column, not a row: TPU blocks end in (a multiple of 8, whole).
    """
    return pl.BlockSpec((None, rows, 1), lambda n, m: (n, m if block else 0, 0))


def _forward_kernel(kernel: _Kernel, q_ref, k_ref, v_ref, *refs):
    *inputs, o_ref, lse_ref = refs
    tiles = kernel.tiles
    n, i = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]

    def body(arrays: CallArrays, sink, offsets):
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

        state = kernel.sweep(arrays, step, "kv", tile_q, kv_offset, state)
        return online_softmax.finish(state, o_ref.dtype)

    out, lse = kernel.run(body, inputs, n)
    o_ref[...] = out
    lse_ref[...] = lse[:, None]


def _wide(x):
    """A tile widened for the backward products, whose other side is a float32 gradient.

    Triton multiplies only equal dtypes; the forward pass keeps 16-bit tiles 16-bit.
    """
    return x.astype(accumulation_dtype(x.dtype))


def _dq_kernel(kernel: _Kernel, q_ref, k_ref, v_ref, d_out_ref, delta_ref, shift_ref, *refs):
    *inputs, dq_ref = refs
    tiles = kernel.tiles
    n, i = pl.program_id(0), pl.program_id(1)
    q = _wide(q_ref[...])
    terms = BackwardRows(_wide(d_out_ref[...]), delta_ref[:, 0], shift_ref[:, 0])

    def body(arrays: CallArrays, _, offsets):
        q_offset, kv_offset = offsets
        tile_q = q_offset + i * tiles.block_q

        def step(j, dq, rule):
            keys = pl.ds(j * tiles.block_kv, tiles.block_kv)
            tile = dataclasses.replace(arrays, rule=rule)
            k_j, v_j = _wide(k_ref[keys, :]), _wide(v_ref[keys, :])
            tile_kv = kv_offset + j * tiles.block_kv
            return dq + tiles.backward_tile(q, k_j, v_j, tile, terms, tile_q, tile_kv)[0]

        return kernel.sweep(arrays, step, "kv", tile_q, kv_offset, jnp.zeros_like(q))

    dq_ref[...] = kernel.run(body, inputs, n).astype(dq_ref.dtype)


def _dkv_kernel(kernel: _Kernel, q_ref, k_ref, v_ref, d_out_ref, delta_ref, shift_ref, *refs):
    *inputs, dk_ref, dv_ref = refs[: len(refs) - kernel.gradients]
    d_const_refs = refs[len(refs) - kernel.gradients :]
    tiles = kernel.tiles
    n, j = pl.program_id(0), pl.program_id(1)
    k, v = _wide(k_ref[...]), _wide(v_ref[...])

    def body(arrays: CallArrays, _, offsets):
        q_offset, kv_offset = offsets
        tile_kv = kv_offset + j * tiles.block_kv

        def step(i, grads, rule):
            rows = pl.ds(i * tiles.block_q, tiles.block_q)
            terms = BackwardRows(_wide(d_out_ref[rows, :]), delta_ref[rows, 0], shift_ref[rows, 0])
            tile = dataclasses.replace(arrays, rule=rule)
            tile_q = q_offset + i * tiles.block_q
            _, dk, dv, _, d_consts = tiles.backward_tile(
                _wide(q_ref[rows, :]), k, v, tile, terms, tile_q, tile_kv
            )
            d_consts = [d for d in d_consts if d is not None]
            return jax.tree.map(jnp.add, grads, (dk, dv, d_consts))

        consts = [jnp.zeros(r.shape[2:], r.dtype) for r in d_const_refs]
        zeros = (jnp.zeros_like(k), jnp.zeros_like(v), consts)
        return kernel.sweep(arrays, step, "q", tile_kv, q_offset, zeros)

    dk, dv, d_consts = kernel.run(body, inputs, n)
    dk_ref[...] = dk
    dv_ref[...] = dv
    for ref, d in zip(d_const_refs, d_consts, strict=True):
        ref[0, 0] = d


def _heads_first(x, rows: int | None = None):
    """``(T, heads, d)`` → ``(heads, T, d)``; ``(T, heads)`` → ``(heads, T, 1)``."""
    return jnp.swapaxes(x, 0, 1) if x.ndim == 3 else x.T[:, :, None]


def forward(
    tiles: Tiles,
    options: Pallas,
    query,
    key,
    value,
    arrays: CallArrays,
    offsets=(0, 0),
    out_dtype=None,
):
    """``(out, lse)`` of ``(T, N, ·)`` queries against ``(S, K, ·)`` keys, from :func:`padded`.

    ``offsets``: the global positions of the first query and the first key. With sinks in
    ``arrays``, the rows start from them. ``out`` is in ``out_dtype`` (the values' by default).
    """
    kernel = _kernel(tiles, options, query, key, arrays)
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    groups = kernel.groups
    inputs = kernel.inputs(arrays, offsets)
    result = functools.partial(_result, like=query)
    call = kernel.call(
        _forward_kernel,
        grid=(heads, seq_q // kernel.tiles.block_q),
        in_specs=[
            _block(tiles.block_q, width),
            _head(kernel.seq_kv, width, groups),
            _head(kernel.seq_kv, value_width, groups),
            *map(_whole, inputs),
        ],
        out_specs=[_block(tiles.block_q, value_width), _lse(tiles.block_q)],
        out_shape=[
            result((heads, seq_q, value_width), out_dtype or value.dtype),
            result((heads, seq_q, 1), accumulation_dtype(query.dtype)),
        ],
        name="jax_sdpa_forward",
    )
    out, lse = call(*map(_heads_first, (query, key, value)), *inputs)
    return jnp.swapaxes(out, 0, 1), lse[:, :, 0].T


def backward(
    tiles: Tiles,
    options: Pallas,
    query,
    key,
    value,
    arrays: CallArrays,
    rows: BackwardRows,
    offsets=(0, 0),
) -> tuple:
    """``(dq, dk, dv, d_consts)`` of :func:`forward`'s call, from the rows' backward terms.

    ``rows`` are the queries' :class:`~jax_sdpa._tiles.BackwardRows` (over all the keys the
    rows meet, wherever they are); ``d_consts`` the ``score_mod``'s floating-point arrays'
    gradients (None for the others). All in the accumulation dtype; the sinks' gradient is the
    caller's.
    """
    kernel = _kernel(tiles, options, query, key, arrays)
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    groups = kernel.groups
    d_out = rows.d_out.reshape(seq_q, heads, value_width)
    operands = [*map(_heads_first, (query, key, value, d_out, rows.delta, rows.shift))]
    inputs = kernel.inputs(arrays, offsets)
    result = functools.partial(_result, like=query)
    (dq,) = kernel.call(
        _dq_kernel,
        grid=(heads, seq_q // kernel.tiles.block_q),
        in_specs=[
            _block(tiles.block_q, width),
            _head(kernel.seq_kv, width, groups),
            _head(kernel.seq_kv, value_width, groups),
            _block(tiles.block_q, value_width),
            _lse(tiles.block_q),
            _lse(tiles.block_q),
            *map(_whole, inputs),
        ],
        out_specs=[_block(tiles.block_q, width)],
        out_shape=[result((heads, seq_q, width), accumulation_dtype(query.dtype))],
        name="jax_sdpa_backward_queries",
    )(*operands, *inputs)
    kv_blocks = kernel.seq_kv // tiles.block_kv
    consts = [c for c in differentiable(arrays.score_consts) if c is not None]
    dk, dv, *d_consts = kernel.call(
        _dkv_kernel,
        grid=(heads, kv_blocks),
        in_specs=[
            _head(seq_q, width),
            _head(tiles.block_kv, width, groups, block=True),
            _head(tiles.block_kv, value_width, groups, block=True),
            _head(seq_q, value_width),
            _lse(seq_q, block=False),
            _lse(seq_q, block=False),
            *map(_whole, inputs),
        ],
        out_specs=[
            _block(tiles.block_kv, width),
            _block(tiles.block_kv, value_width),
            *(
                pl.BlockSpec(
                    (None, None, 1, 1, *c.shape), lambda n, m, c=c: (n, m) + (0,) * (2 + c.ndim)
                )
                for c in consts
            ),
        ],
        out_shape=[
            result((heads, kernel.seq_kv, width), accumulation_dtype(key.dtype)),
            result((heads, kernel.seq_kv, value_width), accumulation_dtype(value.dtype)),
            # Two axes of 1 before each array's: TPU blocks end in two whole axes.
            *(
                result((heads, kv_blocks, 1, 1, *c.shape), accumulation_dtype(c.dtype))
                for c in consts
            ),
        ],
        name="jax_sdpa_backward_keys",
    )(*operands, *inputs)

    def per_kv_head(d):  # (N, S, d) → (S, K, d), summed over the heads that share one
        return jnp.swapaxes(d.reshape(heads // groups, groups, *d.shape[1:]).sum(1), 0, 1)

    sums = iter(d.sum(axis=(0, 1, 2, 3)) for d in d_consts)
    d_consts = tuple(None if c is None else next(sums) for c in differentiable(arrays.score_consts))
    return jnp.swapaxes(dq, 0, 1), per_kv_head(dk), per_kv_head(dv), d_consts


def _result(shape: tuple, dtype, like) -> jax.ShapeDtypeStruct:
    """A kernel's output, varying over the mesh axes ``like`` varies over (``shard_map``)."""
    aval = jax.typeof(like)
    mat = getattr(aval, "mat", None)  # JAX 0.10; before, the axes were ``aval.vma``
    if mat is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    return jax.ShapeDtypeStruct(shape, dtype, vma=getattr(aval, "vma", frozenset()))


def _shared(arrays: CallArrays, offsets) -> tuple:
    """The arrays every program reads whole: the rule's, the batch index, the mods', offsets."""
    return arrays.rule, arrays.batch, arrays.score_consts, jnp.asarray(offsets, INDEX)


def _kernel(tiles: Tiles, options: Pallas, query, key, arrays: CallArrays) -> _Kernel:
    leaves, shared = jax.tree.flatten(_shared(arrays, (0, 0)))
    return _Kernel(
        tiles,
        options,
        query.shape[0],
        key.shape[0],
        shared,
        tuple(jnp.shape(x) for x in leaves),
        arrays.sinks is not None,
        sum(c is not None for c in differentiable(arrays.score_consts)),
    )


def fitted(formula: Formula, options: Pallas, query, key) -> Tiles:
    """The tiles for ``(T, N, H)`` queries and ``(S, K, H)`` keys.

    ``options``' sides, or for a short sequence the power of two ≥ 16 at or above its length.
    """
    (seq_q, heads, _), (seq_kv, kv_heads, _) = query.shape, key.shape
    block_q, block_kv = _side(seq_q, options.block_q), _side(seq_kv, options.block_kv)
    return Tiles(formula, block_q, block_kv, (kv_heads, heads // kv_heads))


def padded(tiles: Tiles, query, key, value, arrays: CallArrays, kv_offset=0) -> tuple:
    """``(query, key, value, arrays)`` padded to whole tiles and heads of a power of two ≥ 16.

    The padded keys are masked by a length rule (at global positions from ``kv_offset``); the
    padded queries are the caller's to drop; the heads' zeros change no product.
    """
    seq_kv = key.shape[0]
    rows_q = -(-query.shape[0] // tiles.block_q) * tiles.block_q
    rows_kv = -(-seq_kv // tiles.block_kv) * tiles.block_kv
    if rows_kv != seq_kv:
        padding = LengthMask(None, jnp.asarray(kv_offset + seq_kv, INDEX))
        arrays = dataclasses.replace(
            arrays, rule=padding if arrays.rule is None else arrays.rule & padding
        )
    if arrays.head is None:
        heads = jnp.arange(query.shape[1], dtype=INDEX)
        arrays = dataclasses.replace(arrays, head=heads)
    width = _power_of_two(query.shape[-1])
    return (
        _pad(query, rows_q, width),
        _pad(key, rows_kv, width),
        _pad(value, rows_kv, _power_of_two(value.shape[-1])),
        arrays,
    )


def _pad(x, rows: int, width: int):
    """``(r, heads, d)`` zero-padded to ``(rows, heads, width)``."""
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, width - x.shape[2])))
