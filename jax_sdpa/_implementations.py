"""The implementations, in one table: each computes a checked call, or says why it cannot.

=========  ==================================================================================
``xla``    the dense composition per head: materialises the ``(T, S)`` scores and weights
``chunked`` the online softmax over key tiles, its own backward, memory linear in ``T``
``decode`` few queries against many keys: split keys, one pass over the cache in its layout
``selected`` each query's listed keys (``key_indices``) gathered and attended as one chunk
``ring``   the chunked tiles with the keys passed round a ring of devices (``ring_attention``)
``cudnn``  ``jax.nn``'s fused cuDNN kernel on a GPU, for the calls that ``jax.nn`` accepts
``pallas`` the chunked tiles as one fused Pallas kernel: Triton on GPUs, Mosaic on TPUs
=========  ==================================================================================

Every implementation takes the same :class:`~jax_sdpa._call.Inputs` (a pytree of arrays: the
batched query, key, value and :class:`~jax_sdpa._formula.CallArrays`) and
:class:`~jax_sdpa._call.Config` (static: the formula, what to return, the tiling and the ring)
and returns a :class:`~jax_sdpa._heads.Result`, batched.
``unsupported`` returns ``None`` or the message that a user who asked for that implementation
sees; ``implementation=None`` takes the first in order of preference that supports the call.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jax_sdpa._attention import dense_sequence
from jax_sdpa._call import Config, Inputs
from jax_sdpa._chunked import chunked_sequence
from jax_sdpa._cudnn import cudnn_by_default, cudnn_unsupported, run_cudnn
from jax_sdpa._decode import (
    BLOCK_DIAGONAL_COLUMNS,
    decode_sequence,
    paged_sequence,
    selected_sequence,
)
from jax_sdpa._formula import read_by_mod
from jax_sdpa._heads import Result, over_batch
from jax_sdpa._jax_compat import PALLAS_UNDER_SHARD_MAP, differentiated_twice, under_jvp_of
from jax_sdpa._latent import LatentValues
from jax_sdpa._pallas import (
    pallas_paged_sequence,
    pallas_sequence,
    reads_latent_pools,
    whole_tiles,
)
from jax_sdpa._ring import ring_sequence
from jax_sdpa._steps import accumulation_dtype
from jax_sdpa._tunables import Chunked, Decode, Paged, Pallas, Ring, Selected

#: The implementations :func:`~jax_sdpa.dot_product_attention` takes by name: the table's entries
#: but those of the ring and paged functions (tests/test_signatures.py holds the two together).
Implementation = Literal["xla", "chunked", "decode", "selected", "cudnn", "pallas"]
# implementation=None: on CPU the chunked path was measured at least as fast as the dense one at
# every benchmark size, forward and backward (BENCHMARKS.md), so it is the default there. On a
# GPU, cuDNN for the calls whose result is ours (_cudnn.cudnn_by_default): on an H200 the
# fastest measured where it runs (issues 43, 44), and only where the call does not show a
# second derivative (which its backward, as the kernel's, lacks). Then, on accelerators, fused
# dense kernels are fast while the scores of the call, B·N·T·S floats, stay small: dense up to
# this many, chunked above (not measured). The Pallas kernel, measured 3.4x the dense path on an
# H200 in bfloat16 but half of cuDNN, is not chosen.
_DENSE_MAX_SCORES = 2**24
# Decoding shapes (a few new queries against a cache): the split-key pass, measured faster than
# the others while every query row of every head, N·T, fits its block-diagonal product
# (``_decode.BLOCK_DIAGONAL_COLUMNS``), from this many keys on (BENCHMARKS.md).
_DECODE_MIN_KEYS = 1024


@dataclasses.dataclass(frozen=True)
class Entry:
    """One way to compute attention: ``run`` a call, or say why it cannot (``unsupported``).

    ``jvp(tunables)``: whether it has a forward-mode derivative. Without one (a
    ``jax.custom_vjp``), it still has forward over reverse (``jax.hessian``, ``jax.jvp`` of a
    ``jax.grad``): forward mode of its own backward pass, if that pass is differentiable
    (``second_order(tunables)``; the fused kernel's is not, nor cuDNN's, nor a ring's or a paged
    call's whose tunables give it to the kernel).
    ``asked_as``: how a user asks for it, for messages (``implementation=...`` by default).
    ``tunables``: the class of its tunables (``Chunked``), whose instance the call's ``run``
    finds in ``config.tunables``; ``None`` where it has none.
    ``quantized``: whether it reads quantized caches (:class:`~jax_sdpa.Quantized`; the others
    refuse them). ``latent``: whether it reads :class:`~jax_sdpa.LatentValues` as they are (the
    others attend to the keys' slice).
    """

    run: Callable[[Inputs, Config], Result]
    unsupported: Callable[[Inputs, Config], str | None] = lambda inputs, config: None
    jvp: Callable[[Any], bool] = lambda tunables: False
    second_order: Callable[[Any], bool] = lambda tunables: True
    asked_as: str | None = None
    tunables: type | None = None
    quantized: bool = False
    latent: bool = False

    def refuses(self, name: str, inputs: Inputs, config: Config) -> str | None:
        """Why this entry (``name`` in the table) cannot run the call, or None."""
        if inputs.key_indices is not None and name != "selected":
            how = self.asked_as or f"`implementation={name!r}`"
            return (
                f"{how} attends to every key; `key_indices` are read by implementation=None "
                "or 'selected'."
            )
        if inputs.quantized and not self.quantized:
            how = self.asked_as or f"`implementation={name!r}`"
            return (
                f"{how} reads float caches, not quantized ones (jax_sdpa.quantize): "
                "implementation=None, 'decode', 'selected' or 'pallas' read those (or "
                "`paged_attention`)."
            )
        return self.unsupported(inputs, config)


def _run_dense(inputs: Inputs, config: Config) -> Result:
    dropped_weights = config.output == "weights"  # flax: the weights returned after dropout
    return inputs.over_batch(
        functools.partial(dense_sequence, config.formula, dropped_weights=dropped_weights)
    )


def _tiled(sequence_fn: Callable) -> Callable[[Inputs, Config], Result]:
    """The ``run`` of a tiled implementation, ``sequence_fn(formula, tunables, ...)`` a sequence.

    Mapped over the batch, or sequence by sequence where its tiles' classes depend on data
    (:func:`_classified`), so that each sequence's empty tiles are still skipped.
    """

    def run(inputs: Inputs, config: Config) -> Result:
        sequence = functools.partial(sequence_fn, config.formula, config.tunables)
        return inputs.over_batch(sequence, sequential=_classified(inputs))

    return run


def _classified(inputs: Inputs) -> bool:
    """Whether the tiled paths read each tile's class of the rule (which depends on data)."""
    return inputs.arrays.rule is not None and inputs.arrays.rule.opaque


def _no_weights(name: str, config: Config) -> str | None:
    """The message of an implementation that never forms the weights, if the call needs them."""
    if config.output != "attention":
        return (
            f"`implementation={name!r}` never forms the attention weights, which `module` (sown "
            "weights) needs; use implementation=None or 'xla'."
        )
    return None


def _chunked_unsupported(inputs: Inputs, config: Config) -> str | None:
    return _no_weights("chunked", config)


def _run_decode(inputs: Inputs, config: Config) -> Result:
    return inputs.over_batch(functools.partial(decode_sequence, config.formula, config.tunables))


def _decode_unsupported(inputs: Inputs, config: Config) -> str | None:
    no_weights = _no_weights("decode", config)
    if no_weights is not None:
        return no_weights
    if inputs.arrays.dropout_rng is not None:
        instead = "a float cache and 'chunked'" if inputs.quantized else "'chunked'"
        return f"`implementation='decode'` has no dropout (decoding is inference); use {instead}."
    return None


def _run_selected(inputs: Inputs, config: Config) -> Result:
    sequence = functools.partial(selected_sequence, config.formula, config.tunables)
    args = (inputs.query, inputs.key, inputs.value, inputs.arrays, inputs.key_indices)
    return over_batch(sequence, inputs.query.shape[:-3], *args)


def _selected_unsupported(inputs: Inputs, config: Config) -> str | None:
    if inputs.key_indices is None:
        return "`implementation='selected'` attends to listed keys: pass `key_indices`."
    lacks = _kernel_lacks(inputs, "`key_indices`", "a mask array without `key_indices`")
    return lacks or _no_weights("selected", config)


def _run_paged(inputs: Inputs, config: Config) -> Result:
    kernel = config.tunables.kernel
    if isinstance(inputs.value, LatentValues) and kernel is not None:
        pools = (inputs.query, inputs.key, inputs.value)
        kernel = kernel if reads_latent_pools(kernel, *pools) else None
    if kernel is None:  # one sequence after the other: each gathers its own pages, not the batch's
        sequence = functools.partial(paged_sequence, config.formula, config.tunables)
    else:  # all sequences in one kernel
        sequence = functools.partial(pallas_paged_sequence, config.formula, kernel)
    args = (inputs.query, inputs.key, inputs.value, inputs.page_table, inputs.arrays)
    return over_batch(sequence, inputs.query.shape[:-3], *args, sequential=kernel is None)


def _paged_unsupported(inputs: Inputs, config: Config) -> str | None:
    if inputs.page_table is None:
        return "`implementation='paged'` reads a paged cache: call `paged_attention`."
    return _no_weights("paged", config)


def _run_ring(inputs: Inputs, config: Config) -> Result:
    sequence = functools.partial(ring_sequence, config.formula, config.tunables, config.ring)
    return inputs.over_batch(sequence, sequential=_classified(inputs))


def _kernel_lacks(inputs: Inputs, asked: str, instead: str, arrays: bool = True) -> str | None:
    """The message of a call the fused kernel cannot take (``asked``: how it was asked for).

    ``arrays``: whether the bias and mask arrays are refused too (a ring's kernel).
    """
    dense = [
        name
        for name, x in (("bias", inputs.arrays.bias), ("mask", inputs.arrays.mask))
        if arrays and x is not None
    ]
    if dense:
        return (
            f"{asked} takes no {' or '.join(dense)} array (a dense array of all the keys): use "
            f"a mask rule or mask_mod, a score_mod, or {instead}."
        )
    if inputs.arrays.dropout_rng is not None:
        return f"{asked} takes no dropout_rate (random bits per tile): use {instead}."
    return None


def _run_pallas(inputs: Inputs, config: Config) -> Result:
    """The kernel's call, its bias and mask arrays read as a ``score_mod``'s."""
    batch = inputs.query.shape[:-3]
    whole = whole_tiles(config.tunables)
    formula, arrays = read_by_mod(config.formula, inputs.arrays, batch, whole)
    inputs = dataclasses.replace(inputs, arrays=arrays)
    return _tiled(pallas_sequence)(inputs, dataclasses.replace(config, formula=formula))


def _pallas_unsupported(inputs: Inputs, config: Config) -> str | None:
    lacks = _kernel_lacks(inputs, "`implementation='pallas'`", "'chunked'", arrays=False)
    return lacks or _no_weights("pallas", config)


def _ring_unsupported(inputs: Inputs, config: Config) -> str | None:
    if config.tunables.kernel is None:
        return None
    asked, instead = "`ring_attention(implementation='pallas')`", "the ring's own tiles"
    lacks = _kernel_lacks(inputs, asked, f"{instead} (implementation=None)")
    if lacks is None and not PALLAS_UNDER_SHARD_MAP:
        return (
            f"{asked} needs JAX 0.7 or later (Pallas kernels inside shard_map); JAX is "
            f"{jax.__version__}. Use {instead}: implementation=None."
        )
    return lacks


IMPLEMENTATIONS: dict[str, Entry] = {
    "xla": Entry(_run_dense, jvp=lambda tunables: True),
    "chunked": Entry(_tiled(chunked_sequence), _chunked_unsupported, tunables=Chunked),
    "decode": Entry(_run_decode, _decode_unsupported, tunables=Decode, quantized=True, latent=True),
    "selected": Entry(
        _run_selected, _selected_unsupported, tunables=Selected, quantized=True, latent=True
    ),
    "paged": Entry(
        _run_paged,
        _paged_unsupported,
        jvp=lambda paged: paged.kernel is None,
        second_order=lambda paged: paged.kernel is None,
        asked_as="`paged_attention`",
        tunables=Paged,
        quantized=True,
        latent=True,
    ),
    "cudnn": Entry(run_cudnn, cudnn_unsupported, second_order=lambda tunables: False),
    "ring": Entry(
        _run_ring,
        _ring_unsupported,
        second_order=lambda ring: ring.kernel is None,
        asked_as="`ring_attention`",
        tunables=Ring,
    ),
    "pallas": Entry(
        _run_pallas,
        _pallas_unsupported,
        second_order=lambda pallas: False,
        tunables=Pallas,
        quantized=True,
        latent=True,
    ),
}


def _preference(inputs: Inputs, config: Config) -> tuple[str, ...]:
    """The order ``implementation=None`` tries: the faster first, where it was measured."""
    batch_heads = math.prod(inputs.query.shape[:-3]) * inputs.query.shape[-2]
    seq_q, seq_kv = inputs.query.shape[-3], inputs.key.shape[-3]
    scores = batch_heads * seq_q * seq_kv
    query_rows = seq_q * inputs.query.shape[-2]
    if inputs.key_indices is not None:
        return ("selected",)
    if inputs.quantized:
        return ("decode",)
    # On a GPU, cuDNN first where its result is ours, decoding shapes included (on an H200,
    # issue 44: 0.30 ms against our decode path's 1.17).
    by_cudnn = cudnn_unsupported(inputs, config) is None and cudnn_by_default(inputs, config)
    cudnn = ("cudnn",) if by_cudnn else ()
    if query_rows <= BLOCK_DIAGONAL_COLUMNS and seq_kv >= _DECODE_MIN_KEYS:
        return (*cudnn, "decode", "chunked", "xla")
    if jax.default_backend() == "cpu":
        return ("chunked", "xla")
    return (*cudnn, *(("chunked", "xla") if scores > _DENSE_MAX_SCORES else ("xla", "chunked")))


def check_implementation(implementation, names: tuple[str, ...], *, by_name: bool = True) -> None:
    """``implementation`` must be None, one of ``names`` (if ``by_name``) or their tunables.

    Raises:
        ValueError: On another name. TypeError: On another kind of value.
    """
    classes = tuple(IMPLEMENTATIONS[name].tunables for name in names)
    classes = tuple(cls for cls in classes if cls is not None)
    choices = [repr(name) for name in names if by_name] + [f"{c.__name__}(...)" for c in classes]
    if implementation is None or isinstance(implementation, classes):
        return
    if by_name and implementation in names:
        return
    error = ValueError if isinstance(implementation, str) else TypeError
    raise error(
        f"`implementation` must be one of None, {', '.join(choices)}; got {implementation!r}."
    )


def tunables(name: str, implementation) -> Any:
    """The tunables ``name`` runs with: ``implementation`` if those are its, else its defaults."""
    cls = IMPLEMENTATIONS[name].tunables
    if cls is None or isinstance(implementation, cls):
        return None if cls is None else implementation
    return cls()


def requested(implementation) -> str | None:
    """The entry a call asks for: by name, by its tunables (``Chunked(...)``), or None."""
    if implementation is None or isinstance(implementation, str):
        return implementation
    return next(
        n for n, e in IMPLEMENTATIONS.items() if isinstance(implementation, e.tunables or ())
    )


def choose(inputs: Inputs, config: Config, implementation) -> Config:
    """``config`` with the implementation that runs the call and its tunables.

    That is the one ``implementation`` asks for (a name or tunables; :func:`requested`), or
    with ``None`` the first that supports the call. Each is asked with its own tunables.

    Raises:
        ValueError: With the implementation's own message, if the one asked for cannot run it.
        TypeError: If the one asked for has no forward mode and ``jax.jvp`` differentiates the
            call, or no second derivatives and two derivatives enclose it.
    """
    under_jvp, twice = under_jvp_of(inputs), differentiated_twice(inputs)
    asked = requested(implementation)

    def takes(name: str) -> bool:
        entry, own = IMPLEMENTATIONS[name], tunables(name, implementation)
        return (entry.jvp(own) or not under_jvp) and (entry.second_order(own) or not twice)

    if asked is not None and not takes(asked):
        entry = IMPLEMENTATIONS[asked]
        how = entry.asked_as or f"`implementation={asked!r}`"
        without = {"ring": "a Ring without `kernel`", "paged": "a Paged without `kernel`"}
        if under_jvp and not entry.jvp(tunables(asked, implementation)):
            has = (
                without[asked]
                if asked == "paged"
                else "dot_product_attention(implementation='xla')"
            )
            raise TypeError(
                f"{how} has no forward-mode derivative (jax.jvp, jax.jacfwd): its backward pass "
                f"is its own (jax.custom_vjp); {has} has one."
            )
        instead = without.get(asked, "implementation='chunked'")
        raise TypeError(
            f"{how} has no second derivatives (jax.hessian, a jvp or grad of a jax.grad): its "
            f"backward pass is {'cuDNN' if asked == 'cudnn' else 'Pallas'} kernels, which JAX does "
            f"not differentiate; {instead} has them."
        )
    names = _preference(inputs, config) if asked is None else (asked,)
    configs = [
        dataclasses.replace(config, implementation=name, tunables=tunables(name, implementation))
        for name in names
        if takes(name)
    ]
    reasons = [
        IMPLEMENTATIONS[c.implementation].refuses(c.implementation, inputs, c) for c in configs
    ]
    for chosen, reason in zip(configs, reasons, strict=True):
        if reason is None:
            return chosen
    raise ValueError(reasons[0])


def without_positions(inputs: Inputs) -> Result:
    """``T = 0`` or ``S = 0``: no query, or no key to attend to — rows of 0.

    A row's log-sum-exp is then its head's sink (the only logit it has), or −∞ without sinks.
    """
    *batch, seq_q, heads, _ = inputs.query.shape
    dtype = accumulation_dtype(inputs.query.dtype)
    weights = jnp.zeros((*batch, heads, seq_q, inputs.seq_kv), dtype)
    value = inputs.values_like
    out = jnp.zeros((*batch, seq_q, heads, value.shape[-1]), value.dtype)
    sinks = inputs.arrays.sinks
    per_head = jnp.full((heads,), -jnp.inf, dtype) if sinks is None else sinks.astype(dtype)
    lse = jnp.broadcast_to(per_head[..., None, :], (*batch, seq_q, heads))
    return Result(out, lse, weights, jnp.full(lse.shape, -jnp.inf, dtype))


@functools.partial(jax.jit, static_argnames=("config",))
def run(inputs: Inputs, *, config: Config) -> Result:
    """The jitted batched computation of a bound call; the weights only where asked for."""
    entry = IMPLEMENTATIONS[config.implementation]
    if isinstance(inputs.value, LatentValues) and not entry.latent:
        inputs = dataclasses.replace(inputs, value=inputs.value.of(inputs.key))
    if 0 in (inputs.query.shape[-3], inputs.seq_kv):
        result = without_positions(inputs)
    else:
        result = entry.run(inputs, config)
    weights = None if config.output == "attention" else result.weights
    return result._replace(weights=weights)
