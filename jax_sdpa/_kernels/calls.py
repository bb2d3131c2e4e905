r"""The engine's kernels as functions of arrays: layouts, block specs, padding.

:func:`forward` and :func:`backward` call the kernels of :mod:`jax_sdpa._kernels` on
``(T, N, ·)`` queries and ``(S, K, ·)`` keys and values (one program per head and block, each
reading its head's rows in place: no transposes around the call, but on a backend whose blocks
must be whole rows of a head), for queries and keys at any global position, as
:mod:`jax_sdpa._kernels.fitting` fits them.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_sdpa._block_mask import BlockMask
from jax_sdpa._formula import CallArrays
from jax_sdpa._indices import at_start
from jax_sdpa._jax_compat import GPU_SIMULATOR, shaped_like
from jax_sdpa._kernels import mosaic_gpu
from jax_sdpa._kernels.atomics import GradientAtPoints
from jax_sdpa._kernels.backend import Backend
from jax_sdpa._kernels.fitting import on_mosaic_gpu
from jax_sdpa._kernels.interpreter import INTERPRETER, tpu_simulator
from jax_sdpa._kernels.mosaic_tpu import MOSAIC_TPU
from jax_sdpa._kernels.programs import (
    BackwardIn,
    BlockLists,
    ForwardIn,
    ForwardOut,
    KeysOut,
    Plan,
    forward_program,
    keys_program,
    queries_program,
    shared_arrays,
)
from jax_sdpa._kernels.scatters import ONE_HOT_MAX
from jax_sdpa._kernels.triton import TRITON
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._tiles import BackwardRows, Tiles, differentiable
from jax_sdpa._tunables import Pallas
from jax_sdpa._user_functions import vary, varying_axes


def _whole(x):
    """A spec reading all of ``x`` in every program."""
    return pl.BlockSpec(x.shape, lambda n, m: (0,) * x.ndim)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Rows of one head of a ``(T, heads, d)`` array, read or written by program ``(n, m)``.

    Head ``n // groups``'s block ``m`` of ``rows`` rows, or (``block`` False) its first ``rows``.
    Its ``BlockSpec`` reads them in place, or from the array made ``(heads, T, d)`` for a backend
    whose blocks must be whole rows of a head (``heads_first``).
    """

    rows: int
    width: int
    groups: int = 1
    block: bool = True

    def spec(self, heads_first: bool) -> pl.BlockSpec:
        def index(n, m):
            row, head = (m if self.block else 0), n // self.groups
            return (head, row, 0) if heads_first else (row, head, 0)

        shape = (None, self.rows, self.width) if heads_first else (self.rows, None, self.width)
        return pl.BlockSpec(shape, index)


def _lse(rows: int, block: bool = True) -> _Rows:
    """Row statistics ``(T, heads, 1)``: a column, not a row (TPU blocks end in (8k, whole))."""
    return _Rows(rows, 1, block=block)


def _gradient(shape: tuple, shared: bool):
    """A spec of ``(programs…, 1, 1, *shape)`` gradients: program ``(n, m)``'s, or the one shared.

    Two axes of 1 before the array's: TPU blocks end in two whole axes.
    """
    return pl.BlockSpec(
        (None, None, 1, 1, *shape),
        lambda n, m: ((0, 0) if shared else (n, m)) + (0,) * (2 + len(shape)),
    )


def _specs(tree, heads_first: bool):
    """``tree`` of :class:`_Rows` and ``BlockSpec``s as ``BlockSpec``s for a layout."""
    return jax.tree.map(lambda d: d.spec(heads_first) if isinstance(d, _Rows) else d, tree)


def _heads_first(specs, tree):
    """The ``(T, heads, d)`` arrays (or their shapes) of ``tree`` as ``(heads, T, d)``, or back."""

    def swapped(spec, x):
        if not isinstance(spec, _Rows):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return x.update(shape=(x.shape[1], x.shape[0], *x.shape[2:]))
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(swapped, specs, tree)


def _as_rows(x):
    """``(T, heads)`` row statistics as ``(T, heads, 1)``."""
    return x[:, :, None]


def forward(
    tiles: Tiles,
    tunables: Pallas,
    query,
    key,
    value,
    arrays: CallArrays,
    offsets=(0, 0),
    out_dtype=None,
    lists: "BlockLists | None" = None,
):
    """``(out, lse, max_scores)`` of ``(T, N, ·)`` queries against ``(S, K, ·)`` keys.

    The arrays come from :func:`padded`.

    ``offsets``: the global positions of the first query and the first key. With sinks in
    ``arrays``, the rows start from them. ``out`` is in ``out_dtype`` (the values' by default).
    ``lists``: those of the call's block mask (its tiles the kernel's), to visit only its blocks.
    """
    plan = plan_for(tiles, tunables, query, key.shape[0], arrays, lists)
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    inputs = ForwardIn(query, key, value, plan.inputs(arrays, offsets, lists))
    specs = ForwardIn(
        _Rows(tiles.block_q, width),
        _Rows(plan.seq_kv, width, plan.group, block=False),
        _Rows(plan.seq_kv, value_width, plan.group, block=False),
        jax.tree.map(_whole, inputs.shared),
    )
    rows = shaped_like((seq_q, heads, 1), accumulation_dtype(query.dtype), query)

    masked = block_mask_arrays(arrays, offsets)

    def on_mosaic_gpu(inputs: ForwardIn) -> ForwardOut:
        out, lse, top = mosaic_gpu.forward(
            plan,
            inputs.query,
            inputs.key,
            inputs.value,
            inputs.shared,
            out_dtype or value.dtype,
            masked,
        )
        return ForwardOut(out, _as_rows(lse), _as_rows(top))

    outs = _compiled(
        plan,
        forward_program,
        grid=(heads, seq_q // tiles.block_q),
        in_specs=specs,
        out_specs=ForwardOut(
            _Rows(tiles.block_q, value_width), _lse(tiles.block_q), _lse(tiles.block_q)
        ),
        out_shape=ForwardOut(
            shaped_like((seq_q, heads, value_width), out_dtype or value.dtype, query), rows, rows
        ),
        name="jax_sdpa_forward",
        mosaic_gpu=on_mosaic_gpu,
    )(inputs)
    return outs.out, outs.lse[:, :, 0], outs.top[:, :, 0]


def backward(
    tiles: Tiles,
    tunables: Pallas,
    query,
    key,
    value,
    arrays: CallArrays,
    rows: BackwardRows,
    offsets=(0, 0),
    lists: "BlockLists | None" = None,
) -> tuple:
    """``(dq, dk, dv, d_consts)`` of :func:`forward`'s call, from the rows' backward terms.

    ``rows`` are the queries' :class:`~jax_sdpa._tiles.BackwardRows` (over all the keys the
    rows meet, wherever they are); ``d_consts`` the ``score_mod``'s floating-point arrays'
    gradients (None for the others). All in the accumulation dtype; the sinks' gradient is the
    caller's.
    """
    plan = plan_for(tiles, tunables, query, key.shape[0], arrays, lists)
    (seq_q, heads, _), value_width = query.shape, value.shape[-1]
    # (in the values' dtype, which the products cast it to: half the bytes of 16-bit values)
    d_out = rows.d_out.reshape(seq_q, heads, value_width).astype(value.dtype)
    inputs = BackwardIn(
        query,
        key,
        value,
        BackwardRows(d_out, _as_rows(rows.delta), _as_rows(rows.shift)),
        plan.inputs(arrays, offsets, lists),
    )
    consts = [c for c in differentiable(arrays) if c is not None]
    masked = block_mask_arrays(arrays, offsets)
    dq = _query_gradients(plan, inputs, masked)
    dk, dv, d_consts = _key_gradients(plan, inputs, consts, masked)

    def per_kv_head(d):  # (S, N, d) → (S, K, d), summed over the heads that share one
        return d.reshape(d.shape[0], heads // plan.group, plan.group, d.shape[-1]).sum(2)

    sums = iter(d.sum(axis=(0, 1, 2, 3)) for d in d_consts)
    d_consts = tuple(None if c is None else next(sums) for c in differentiable(arrays))
    return dq, per_kv_head(dk), per_kv_head(dv), d_consts


def _on_mosaic_gpu_backward(kernel, plan: Plan, masked):
    """The Mosaic GPU backward ``kernel`` as a function of the :class:`BackwardIn` inputs.

    :func:`~jax_sdpa._kernels.mosaic_gpu.query_gradients` or ``key_gradients``: the rows'
    terms ``(N, T)``, the gradients in the accumulation dtype, as the programs give them.
    """

    def call(inputs: BackwardIn):
        rows = inputs.rows
        rows = BackwardRows(rows.d_out, rows.delta[:, :, 0].T, rows.shift[:, :, 0].T)
        query, key, value = inputs.query, inputs.key, inputs.value
        grads = kernel(plan, query, key, value, rows, inputs.shared, masked)
        return jax.tree.map(lambda x: x.astype(accumulation_dtype(x.dtype)), grads)

    return call


def _query_gradients(plan: Plan, inputs: BackwardIn, masked):
    """The queries' gradients, ``(T, N, H)``: a program per head and query block."""
    (seq_q, heads, width), value_width = inputs.query.shape, inputs.value.shape[-1]
    tiles = plan.tiles
    specs = BackwardIn(
        _Rows(tiles.block_q, width),
        _Rows(plan.seq_kv, width, plan.group, block=False),
        _Rows(plan.seq_kv, value_width, plan.group, block=False),
        BackwardRows(_Rows(tiles.block_q, value_width), *[_lse(tiles.block_q)] * 2),
        jax.tree.map(_whole, inputs.shared),
    )
    d_query = shaped_like(
        (seq_q, heads, width), accumulation_dtype(inputs.query.dtype), inputs.query
    )
    return _compiled(
        plan,
        queries_program,
        grid=(heads, seq_q // tiles.block_q),
        in_specs=specs,
        out_specs=_Rows(tiles.block_q, width),
        out_shape=d_query,
        name="jax_sdpa_backward_queries",
        mosaic_gpu=_on_mosaic_gpu_backward(mosaic_gpu.query_gradients, plan, masked),
    )(inputs)


def _key_gradients(plan: Plan, inputs: BackwardIn, consts: list, masked):
    """Each query head's key and value gradients ``(S, N, ·)``; per program, ``consts``'.

    ``consts`` are the ``score_mod``'s arrays with gradients; a program per query head and key
    block. ``masked``: the call's arrays where the Mosaic GPU kernels list a block mask's blocks.
    """
    query, key, value = inputs.query, inputs.key, inputs.value
    (seq_q, heads, width), value_width = query.shape, value.shape[-1]
    tiles = plan.tiles
    kv_blocks = plan.seq_kv // tiles.block_kv
    # A gradient per program, or one that all programs add to where it is summed in memory
    # (starting as zeros: an output aliased to an input).
    in_memory = plan.in_memory
    d_specs = tuple(_gradient(c.shape, one) for c, one in zip(consts, in_memory, strict=True))
    d_shapes = tuple(
        shaped_like(
            ((1, 1) if one else (heads, kv_blocks)) + (1, 1, *c.shape),
            accumulation_dtype(c.dtype),
            query,
        )
        for c, one in zip(consts, in_memory, strict=True)
    )
    summed = [n for n, one in enumerate(in_memory) if one]
    # (inside shard_map, varying as the inputs do: their outputs, aliased to them, must)
    axes = varying_axes(inputs)
    inputs = dataclasses.replace(
        inputs,
        sums=tuple(vary(jnp.zeros(d_shapes[n].shape, d_shapes[n].dtype), axes) for n in summed),
    )
    specs = BackwardIn(
        _Rows(seq_q, width, block=False),
        _Rows(tiles.block_kv, width, plan.group),
        _Rows(tiles.block_kv, value_width, plan.group),
        BackwardRows(_Rows(seq_q, value_width, block=False), *[_lse(seq_q, block=False)] * 2),
        jax.tree.map(_whole, inputs.shared),
        tuple(d_specs[n] for n in summed),
    )
    first_sum = len(jax.tree.leaves(inputs)) - len(summed)  # (the sums come last)
    shapes = tuple(c.shape for c in consts)

    def keys_kernel(in_memory: bool):
        kernel = functools.partial(mosaic_gpu.key_gradients, consts=shapes, in_memory=in_memory)
        return _on_mosaic_gpu_backward(kernel, plan, masked)

    # (where the Mosaic GPU keys' kernel sums the arrays' gradients, if it runs)
    sums_at = _in_memory(consts, inputs, keys_kernel) if on_mosaic_gpu(plan.tunables) else None

    def on_mosaic_gpu_keys(inputs: BackwardIn) -> KeysOut:
        d_key, d_value, *parts = keys_kernel(sums_at)(inputs)
        # Each array's gradient summed, where the Triton programs' first part would be.
        sums = [
            x.reshape(-1, x.shape[-1]).sum(0)[: c.size].reshape(c.shape)
            for x, c in zip(parts, consts, strict=True)
        ]
        d_consts = tuple(
            jnp.zeros(d.shape, d.dtype).at[0, 0, 0, 0].set(x.astype(d.dtype))
            for d, x in zip(d_shapes, sums, strict=True)
        )
        return KeysOut(d_key, d_value, d_consts)

    outs = _compiled(
        plan,
        keys_program,
        grid=(heads, kv_blocks),
        in_specs=specs,
        out_specs=KeysOut(
            _Rows(tiles.block_kv, width), _Rows(tiles.block_kv, value_width), d_specs
        ),
        out_shape=KeysOut(
            shaped_like((plan.seq_kv, heads, width), accumulation_dtype(key.dtype), query),
            shaped_like((plan.seq_kv, heads, value_width), accumulation_dtype(value.dtype), query),
            d_shapes,
        ),
        # each sum's zeros become its output (KeysOut's leaves: key, value, then the consts)
        aliases={first_sum + k: 2 + n for k, n in enumerate(summed)},
        name="jax_sdpa_backward_keys",
        mosaic_gpu=None if sums_at is None else on_mosaic_gpu_keys,
    )(inputs)
    return outs.key, outs.value, outs.consts


def _in_memory(consts: list, inputs: BackwardIn, keys_kernel) -> "bool | None":
    """Where the Mosaic GPU keys' kernel sums the captured arrays' gradients, if it does.

    In registers (False) for arrays of up to ``ONE_HOT_MAX`` entries each read at one index
    (``slopes[h]``); in memory (True) for arrays read at tiles of points (a table at
    ``q_idx − kv_idx``) or along an axis (``bias[kv_idx]``). Tracing ``keys_kernel(in_memory)``
    refuses the others, whose gradients (and the keys') are the Triton programs' (None).
    """
    if not consts:
        return False
    small = all(c.size <= ONE_HOT_MAX for c in consts)
    for in_memory in (False, True) if small else (True,):
        try:
            jax.eval_shape(keys_kernel(in_memory), inputs)
        except GradientAtPoints:
            continue
        return in_memory
    return None


# The backend for each platform a program may be lowered for; any other runs the interpreter.
PLATFORMS = {"cuda": TRITON, "rocm": TRITON, "tpu": MOSAIC_TPU}


def _compiled(
    plan: Plan,
    program,
    grid,
    in_specs,
    out_specs,
    out_shape,
    name: str,
    aliases=None,
    mosaic_gpu=None,
):
    """``program`` as a ``pallas_call`` of one pytree of inputs, for the backend that runs it.

    That is the platform's the program is lowered for (:func:`jax.lax.platform_dependent`):
    Triton on ``cuda``/``rocm``, Mosaic on ``tpu``, the interpreter on any other (a CPU); or the
    interpreter, or the TPU simulator, where ``Pallas.interpret`` asks for it. ``aliases``:
    ``pallas_call``'s ``input_output_aliases`` (outputs that start as inputs). The specs are
    ``BlockSpec``s and :class:`_Rows` of ``(T, heads, d)`` arrays, read and written in place,
    or head-first for a backend that needs them so (the transposes only in its branch).
    ``mosaic_gpu(inputs)``: the same outputs by the Mosaic GPU kernel, which
    runs on ``cuda`` in Triton's place where the tunables ask for it (:func:`_on_mosaic_gpu`),
    and on the GPU simulator.
    """

    def on(backend: Backend):
        heads_first = backend.heads_first
        call = pl.pallas_call(
            functools.partial(program, dataclasses.replace(plan, backend=backend)),
            grid=grid,
            in_specs=(_specs(in_specs, heads_first),),
            out_specs=_specs(out_specs, heads_first),
            out_shape=_heads_first(out_specs, out_shape) if heads_first else out_shape,
            interpret=backend.interpret,
            compiler_params=backend.compiler_params(plan.tunables),
            name=name,
            input_output_aliases=aliases or {},
        )
        if not heads_first:
            return call
        return lambda inputs: _heads_first(out_specs, call(_heads_first(in_specs, inputs)))

    interpret = plan.tunables.interpret
    if isinstance(interpret, GPU_SIMULATOR):  # (Triton's programs where Mosaic GPU has none)
        return on(INTERPRETER) if mosaic_gpu is None else mosaic_gpu
    if isinstance(interpret, pltpu.InterpretParams):
        return on(tpu_simulator(interpret))
    if interpret:
        return on(INTERPRETER)
    # One branch a backend: lax.platform_dependent traces each distinct branch once (Triton's
    # for cuda and rocm alike).
    branches = {id(backend): on(backend) for backend in PLATFORMS.values()}
    calls = {platform: branches[id(backend)] for platform, backend in PLATFORMS.items()}
    if mosaic_gpu is not None and on_mosaic_gpu(plan.tunables):
        calls["cuda"] = varying_as_inputs(mosaic_gpu)
    return lambda inputs: lax.platform_dependent(inputs, **calls, default=on(INTERPRETER))


def varying_as_inputs(kernel):
    """``kernel`` (a Mosaic GPU kernel's call), its outputs varying as its inputs do.

    Inside ``jax.shard_map`` (its default ``check_vma=True``), over the mesh axes its inputs
    vary over. A ``pallas_call``'s outputs are typed so, a ``plgpu.kernel``'s not: the branches of
    :func:`jax.lax.platform_dependent` must agree.
    """

    def typed(inputs):
        axes = varying_axes(inputs)
        return jax.tree.map(lambda x: vary(x, axes), kernel(inputs))

    return typed


def plan_for(tiles: Tiles, tunables: Pallas, query, seq_kv: int, arrays: CallArrays, lists) -> Plan:
    leaves, shared = jax.tree.flatten(shared_arrays(arrays, (0, 0), lists))
    return Plan(
        tiles,
        tunables,
        query.shape[0],
        seq_kv,
        shared,
        tuple(jnp.shape(x) for x in leaves),
        tuple(jnp.result_type(x) for x in leaves),
        tuple(not _one_hot(c) for c in differentiable(arrays) if c is not None),
        arrays.fixed_consts,
    )


def _one_hot(array) -> bool:
    """Whether an array's gradient is summed by one-hot products, in its programs' own block.

    Up to ``ONE_HOT_MAX`` entries, of sides that are powers of two (Triton's blocks' sides; one
    plan serves every platform, so all sum so); any other is added into memory at its points.
    """
    return array.size <= ONE_HOT_MAX and all(n & (n - 1) == 0 for n in array.shape)


def block_mask_arrays(arrays: CallArrays, offsets):
    """The call's arrays where the Mosaic GPU kernels list a block mask's blocks, or None.

    Where its rule is a :class:`~jax_sdpa.BlockMask` and both axes start at position 0.
    """
    return arrays if isinstance(arrays.rule, BlockMask) and at_start(offsets) else None
