r"""Fused attention: the engine's tiles as one Pallas kernel, Triton on GPUs, Mosaic on TPUs.

The kernels are the chunked implementation's sweeps, with the loop over query blocks (and, in
the backward pass, over key blocks) turned into a grid of programs, one per head and block::

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

from jax_sdpa import _checks
from jax_sdpa import _online_softmax as online_softmax
from jax_sdpa._block_mask import blocked
from jax_sdpa._formula import CallArrays, Formula
from jax_sdpa._heads import Result
from jax_sdpa._kernel_reads import evaluate
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._tiles import (
    BackwardRows,
    Tiles,
    classified,
    differentiable,
    pad_keys,
    sweep,
    tile_class,
)
from jax_sdpa._tiles_backward import backward_rows, sinks_grad

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
        for name in ("block_q", "block_kv", "num_warps", "num_stages"):
            _checks.check_positive_int(f"Pallas.{name}", getattr(self, name))
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
    arrays), each with two leading axes of 1.
    """

    tiles: Tiles
    options: Pallas
    seq_q: int  # padded to whole tiles
    seq_kv: int
    shared: Any  # the treedef of (rule, batch, score_consts)
    shapes: tuple  # the shapes of its leaves
    sinks: bool
    gradients: int  # how many of the ``score_mod``'s arrays have one (floating point)

    @property
    def groups(self) -> int:
        return self.tiles.groups[1]

    def inputs(self, arrays: CallArrays) -> list:
        """The arrays every program reads, in the order :meth:`arrays` takes their refs."""
        leaves = jax.tree.leaves((arrays.rule, arrays.batch, arrays.score_consts))
        shapes = zip(leaves, self.shapes, strict=True)
        # Two axes of 1 first: under vmap a batch axis joins them, and TPU blocks end in two
        # whole axes.
        shared = [jnp.reshape(x, (1, 1, *shape)) for x, shape in shapes]
        return [arrays.head, *([arrays.sinks] if self.sinks else []), *shared]

    def run(self, body, refs: list, n):
        """``body(arrays, sink)`` with head ``n``'s arrays, from the refs of :meth:`inputs`.

        The shared arrays stay in memory, read where ``body`` reads them
        (:func:`jax_sdpa._kernel_reads.evaluate`).
        """
        head, *refs = refs
        sink = refs.pop(0)[n] if self.sinks else None
        head = head[n]

        def with_values(*shared):
            shared = [x.reshape(shape) for x, shape in zip(shared, self.shapes, strict=True)]
            rule, batch, consts = jax.tree.unflatten(self.shared, shared)
            return body(CallArrays(rule=rule, batch=batch, head=head, score_consts=consts), sink)

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

    def sweep(self, arrays: CallArrays, step, axis: str, start, carry):
        """``carry = step(m, carry, rule)`` over the ``axis`` blocks ``m`` the rule may allow.

        ``start`` is the first position of the program's block of the other axis.

        The others are skipped: by the rule's ranges (the loop's bounds) or, for an opaque
        rule, by each tile's class.
        """
        tiles = self.tiles
        forward = axis == "kv"
        this, other = (
            (tiles.block_q, tiles.block_kv) if forward else (tiles.block_kv, tiles.block_q)
        )
        count = (self.seq_kv if forward else self.seq_q) // other

        def classify(m, rule):
            blocks = ((start, this), (m * other, other))
            return tile_class(rule, arrays, *(blocks if forward else blocks[::-1]))

        guarded = classified(step, classify, skip=lambda m, carry: carry)
        return sweep(guarded, arrays.rule, axis, (start, start + this), 0, other, count, carry)


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
    """A spec of ``(heads, 1, T)`` row statistics: block ``m`` of head ``n``, or all of it."""
    return pl.BlockSpec((None, 1, rows), lambda n, m: (n, 0, m if block else 0))


def _forward_kernel(kernel: _Kernel, q_ref, k_ref, v_ref, *refs):
    *inputs, o_ref, lse_ref = refs
    tiles = kernel.tiles
    n, i = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]

    def body(arrays: CallArrays, sink):
        like = jnp.zeros((), q.dtype)  # in a kernel the state's zeros need not vary (shard_map)
        shape = (tiles.block_q,)
        state = online_softmax.init(like, shape, (tiles.block_q, v_ref.shape[-1]), sink)

        def step(j, state, rule):
            keys = pl.ds(j * tiles.block_kv, tiles.block_kv)
            tile = dataclasses.replace(arrays, rule=rule)
            k_j, v_j = k_ref[keys, :], v_ref[keys, :]
            return tiles.forward_tile(
                state, q, k_j, v_j, tile, i * tiles.block_q, j * tiles.block_kv
            )

        state = kernel.sweep(arrays, step, "kv", i * tiles.block_q, state)
        return online_softmax.finish(state, o_ref.dtype)

    out, lse = kernel.run(body, inputs, n)
    o_ref[...] = out
    lse_ref[...] = lse[None, :]


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
    terms = BackwardRows(_wide(d_out_ref[...]), delta_ref[0, :], shift_ref[0, :])

    def body(arrays: CallArrays, _):
        def step(j, dq, rule):
            keys = pl.ds(j * tiles.block_kv, tiles.block_kv)
            tile = dataclasses.replace(arrays, rule=rule)
            k_j, v_j = _wide(k_ref[keys, :]), _wide(v_ref[keys, :])
            offsets = (i * tiles.block_q, j * tiles.block_kv)
            return dq + tiles.backward_tile(q, k_j, v_j, tile, terms, *offsets)[0]

        return kernel.sweep(arrays, step, "kv", i * tiles.block_q, jnp.zeros_like(q))

    dq_ref[...] = kernel.run(body, inputs, n).astype(dq_ref.dtype)


def _dkv_kernel(kernel: _Kernel, q_ref, k_ref, v_ref, d_out_ref, delta_ref, shift_ref, *refs):
    *inputs, dk_ref, dv_ref = refs[: len(refs) - kernel.gradients]
    d_const_refs = refs[len(refs) - kernel.gradients :]
    tiles = kernel.tiles
    n, j = pl.program_id(0), pl.program_id(1)
    k, v = _wide(k_ref[...]), _wide(v_ref[...])

    def body(arrays: CallArrays, _):
        def step(i, grads, rule):
            rows = pl.ds(i * tiles.block_q, tiles.block_q)
            terms = BackwardRows(_wide(d_out_ref[rows, :]), delta_ref[0, rows], shift_ref[0, rows])
            tile = dataclasses.replace(arrays, rule=rule)
            offsets = (i * tiles.block_q, j * tiles.block_kv)
            _, dk, dv, _, d_consts = tiles.backward_tile(
                _wide(q_ref[rows, :]), k, v, tile, terms, *offsets
            )
            d_consts = [d for d in d_consts if d is not None]
            return jax.tree.map(jnp.add, grads, (dk, dv, d_consts))

        zeros = (
            jnp.zeros_like(k),
            jnp.zeros_like(v),
            [jnp.zeros(r.shape[2:], r.dtype) for r in d_const_refs],
        )
        return kernel.sweep(arrays, step, "q", j * tiles.block_kv, zeros)

    dk, dv, d_consts = kernel.run(body, inputs, n)
    dk_ref[...] = dk
    dv_ref[...] = dv
    for ref, d in zip(d_const_refs, d_consts, strict=True):
        ref[0, 0] = d


def _heads_first(x, rows: int | None = None):
    """``(T, heads, d)`` → ``(heads, T, d)``; ``(T, heads)`` → ``(heads, 1, T)``."""
    return jnp.swapaxes(x, 0, 1) if x.ndim == 3 else x.T[:, None, :]


def _forward(kernel: _Kernel, query, key, value, arrays: CallArrays):
    """``(out, lse)`` of ``(T, N, ·)`` queries against ``(S, K, ·)`` keys, padded to tiles."""
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    tiles, groups = kernel.tiles, kernel.groups
    inputs = kernel.inputs(arrays)
    call = kernel.call(
        _forward_kernel,
        grid=(heads, seq_q // tiles.block_q),
        in_specs=[
            _block(tiles.block_q, width),
            _head(kernel.seq_kv, width, groups),
            _head(kernel.seq_kv, value_width, groups),
            *map(_whole, inputs),
        ],
        out_specs=[_block(tiles.block_q, value_width), _lse(tiles.block_q)],
        out_shape=[
            jax.ShapeDtypeStruct((heads, seq_q, value_width), value.dtype),
            jax.ShapeDtypeStruct((heads, 1, seq_q), accumulation_dtype(query.dtype)),
        ],
        name="jax_sdpa_forward",
    )
    out, lse = call(*map(_heads_first, (query, key, value)), *inputs)
    return jnp.swapaxes(out, 0, 1), lse[:, 0, :].T


def _backward(kernel: _Kernel, residuals: tuple, cotangents: tuple) -> tuple:
    query, key, value, arrays, out, lse = residuals
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    tiles, groups = kernel.tiles, kernel.groups
    rows = backward_rows(out, lse, cotangents)
    d_out = rows.d_out.reshape(seq_q, heads, value_width)
    operands = [*map(_heads_first, (query, key, value, d_out, rows.delta, rows.shift))]
    inputs = kernel.inputs(arrays)
    (dq,) = kernel.call(
        _dq_kernel,
        grid=(heads, seq_q // tiles.block_q),
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
        out_shape=[jax.ShapeDtypeStruct((heads, seq_q, width), query.dtype)],
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
            jax.ShapeDtypeStruct((heads, kernel.seq_kv, width), accumulation_dtype(key.dtype)),
            jax.ShapeDtypeStruct(
                (heads, kernel.seq_kv, value_width), accumulation_dtype(value.dtype)
            ),
            # Two axes of 1 before each array's: TPU blocks end in two whole axes.
            *(
                jax.ShapeDtypeStruct(
                    (heads, kv_blocks, 1, 1, *c.shape), accumulation_dtype(c.dtype)
                )
                for c in consts
            ),
        ],
        name="jax_sdpa_backward_keys",
    )(*operands, *inputs)

    def per_kv_head(d, like):  # (N, S, d) → (S, K, d), summed over the heads that share one
        kv_heads = heads // groups
        return jnp.swapaxes(d.reshape(kv_heads, groups, *d.shape[1:]).sum(1), 0, 1).astype(like)

    sums = iter(d.sum(axis=(0, 1, 2, 3)) for d in d_consts)
    d_score_consts = tuple(
        None if c is None else next(sums).astype(c.dtype)
        for c in differentiable(arrays.score_consts)
    )
    d_arrays = CallArrays(score_consts=d_score_consts, sinks=sinks_grad(arrays.sinks, lse, rows))
    return (
        jnp.swapaxes(dq, 0, 1),
        per_kv_head(dk, key.dtype),
        per_kv_head(dv, value.dtype),
        d_arrays,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(kernel: _Kernel, query, key, value, arrays: CallArrays):
    return _forward(kernel, query, key, value, arrays)


def _fused_fwd(kernel: _Kernel, query, key, value, arrays: CallArrays):
    out, lse = _forward(kernel, query, key, value, arrays)
    return (out, lse), (query, key, value, arrays, out, lse)


_fused.defvjp(_fused_fwd, _backward)


def _pad(x, rows: int, width: int):
    """``(r, heads, d)`` zero-padded to ``(rows, heads, width)``."""
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, width - x.shape[2])))


def pallas_sequence(
    formula: Formula, options: Pallas, query, key, value, arrays: CallArrays
) -> Result:
    """The fused kernels on one sequence, all heads: ``(out, lse, None)`` in jax.nn's layout.

    ``(T, N, H)`` queries and ``(S, K, ·)`` keys and values. Sequences are padded to whole
    tiles (the padded keys masked by a length rule, the padded queries dropped) and heads to a
    power of two ≥ 16 with zeros, which change no product.
    """
    (seq_q, heads, width), (seq_kv, kv_heads, value_width) = query.shape, value.shape
    block_q, block_kv = _side(seq_q, options.block_q), _side(seq_kv, options.block_kv)
    tiles = Tiles(formula, block_q, block_kv, (kv_heads, heads // kv_heads))
    padded_q, padded_kv = -(-seq_q // block_q) * block_q, -(-seq_kv // block_kv) * block_kv
    if padded_kv != seq_kv:
        _, _, arrays = pad_keys(key, value, arrays, block_kv)
    if arrays.rule is not None and arrays.rule.opaque:
        arrays = dataclasses.replace(arrays, rule=blocked(tiles, arrays, seq_q, padded_kv))
    if arrays.head is None:
        arrays = dataclasses.replace(arrays, head=jnp.arange(heads, dtype=jnp.int32))
    width_p = _power_of_two(width)
    query = _pad(query, padded_q, width_p)
    key = _pad(key, padded_kv, width_p)
    value = _pad(value, padded_kv, _power_of_two(value_width))
    leaves, shared = jax.tree.flatten((arrays.rule, arrays.batch, arrays.score_consts))
    shapes = tuple(jnp.shape(x) for x in leaves)
    gradients = sum(c is not None for c in differentiable(arrays.score_consts))
    sinks = arrays.sinks is not None
    kernel = _Kernel(tiles, options, padded_q, padded_kv, shared, shapes, sinks, gradients)
    out, lse = _fused(kernel, query, key, value, arrays)
    return Result(out[:seq_q, :, :value_width], lse[:seq_q], None)
