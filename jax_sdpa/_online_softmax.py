r"""The online softmax: attention over keys that arrive a block at a time.

For each query row it keeps a running max :math:`m`, a running denominator :math:`\ell` and an
un-normalised output :math:`\tilde o` (Milakov & Gimelshein 2018; Rabe & Staats 2021;
FlashAttention-2, Dao 2023)::

    state  = init(...)                                   # m = fill (no key yet), ℓ = 0, õ = 0
    state  = SOFTMAX.update(state, s_j, allowed_j, v_j)  # once per key block j:
             #   m_new = max(m, rowmax(s_j)),  p = exp(s_j − m_new)  (masked → 0)
             #   ℓ = e^{m − m_new} ℓ + rowsum(p),  õ = e^{m − m_new} õ + p v_j
    out, lse = SOFTMAX.finish(state, dtype)              # õ / ℓ,  m + log ℓ

The normaliser is an object a formula holds (``Formula.normalizer``): :data:`SOFTMAX`, or
:data:`SIGMOID` for sigmoid attention, which keeps the same state with no running max: its
weights :math:`\sigma(s + b)` need no normalisation, so a block's weighted values and weights
just add (:math:`\ell` is then the row's total weight, and the max stays at the fill, which
makes every correction :math:`e^{0} = 1`); it finishes as :math:`(\tilde o, \log \ell)`. Each
has the same methods (``block``, ``update``, ``recompute``, ``score_gradient``, ``delta``,
``finish``, ``from_result``), so no caller asks which it has. An update is two halves: a
block's weights on the rows' new max (``block``, a :class:`Block`), then their sum and product
with the values added to the shifted state (:func:`add`); a kernel whose consumers share one
block's weights (each for its own part of the values) runs them apart.

Two states over disjoint sets of keys :func:`merge` into the state over their union, and a
finished ``(out, lse)`` is itself a state (max ``lse``, denominator 1, output ``out``), so
:func:`merge_attention` combines results computed separately: split keys in decoding, a cached
prefix, or the shards of a ring. The arithmetic is the dense softmax's own
(:func:`jax_sdpa._steps.masked_scores`, :func:`~jax_sdpa._steps.exp_scores`, …), run block by
block.
"""

from typing import Any, Literal, NamedTuple

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float

from jax_sdpa import _checks
from jax_sdpa._steps import (
    accumulation_dtype,
    exp_scores,
    folded_exp_scores,
    has_key,
    large_negative,
    log_of_sum,
    log_total,
    logsumexp,
    masked_scores,
    normalize,
    sigmoid_parts,
    softmax_with_logsumexp,
    weighted_sum,
)

__all__ = ["merge_attention"]


class State(NamedTuple):
    """The online softmax of some rows after some keys, in the accumulation dtype.

    ``row_max`` and ``denom`` have one entry per row, ``(..., r)``; ``acc`` adds the value
    features, ``(..., r, V)`` (or, in a loop over whole sequences, holds them flattened into the
    rows: ``(T, N·V)`` for ``(T, N)`` rows). ``top`` is the largest allowed score a row has met
    (the fill before any): the max of ``row_max`` without the sink, and the sigmoid's too.
    """

    row_max: Array
    denom: Array
    acc: Array
    top: Array


def zeros_from(x: Array, dtype, shape: tuple | None = None) -> Array:
    """Zeros of ``shape`` (``x``'s by default) computed from ``x``, whatever it holds (−∞ biases).

    Under ``jax.shard_map`` a loop carry must vary over devices as its updates do
    (``check_vma``); zeros computed from a varying array vary too, on every JAX version. One
    element of ``x`` is enough for that, and its broadcast costs no pass over ``x`` (a kernel,
    which cannot slice, gives a scalar).
    """
    first = jnp.isnan(x if x.ndim == 0 else x.reshape(-1)[0]).astype(dtype) * 0
    return jnp.broadcast_to(first, x.shape if shape is None else shape)


def init(query: Array, shape: tuple, output: tuple, sink: Array | None = None) -> State:
    """The state before any key: ``(row max = fill, denominator = 0, output = 0)``.

    Of shapes ``shape``, ``shape`` and ``output``, computed from the queries (:func:`zeros_from`).
    With a ``sink`` logit (broadcast to ``shape``), the state has already met the sink, a key
    without a value: ``(sink, 1, 0)``.
    """
    dtype = accumulation_dtype(query.dtype)
    zeros = zeros_from(query, dtype, shape)
    output = zeros_from(query, dtype, output)
    fill = zeros + large_negative(dtype)
    if sink is None:
        return State(fill, zeros, output, fill)
    return State(zeros + jnp.broadcast_to(sink.astype(dtype), shape), zeros + 1, output, fill)


class Block(NamedTuple):
    """One block of keys as a state meets it (a normaliser's ``block``).

    ``row_max``: the rows' running max with the block (the shift of its weights); ``weights``:
    the block's, ``(..., r, kv)``, un-normalised (a kernel's may be a tile in its shared
    memory); ``total``: their sum per row; ``top``: the rows' largest scores with the block's.
    """

    row_max: Array
    weights: Any
    total: Array
    top: Array


def add(
    state: State,
    block: Block,
    value: Any,
    *,
    precision=None,
    drop=lambda p: p,
    product=weighted_sum,
    onto=None,
) -> State:
    """The state after ``block``: its sums shifted to the block's max, its weights meet ``value``.

    ``drop`` is applied to the block's weights before they meet the values (dropout: the
    denominator counts every weight, as the dense softmax does); ``product`` is how they meet
    them, :func:`~jax_sdpa._steps.weighted_sum` or the same sum formed otherwise (``value`` is
    what ``product`` reads: an array, or a :class:`~jax_sdpa.Quantized` cache). ``onto``, where
    given, forms ``acc + product(weights, value)`` itself, ``onto(acc, weights, value)`` (a
    kernel's product that adds into its accumulator).
    """
    denom, acc = _shifted(state, block.row_max)
    weights = drop(block.weights)
    if onto is None:
        acc = acc + product(weights, value, precision=precision)
    else:
        acc = onto(acc, weights, value)
    return State(block.row_max, denom + block.total, acc, block.top)


class Normalizer:
    """What :data:`SOFTMAX` and :data:`SIGMOID` share: a block's update, from its ``block``."""

    def update(
        self,
        state: State,
        scores: Float[Array, "*q kv"],
        allowed: Bool[Array, "*#q #kv"] | None,
        value: Any,
        *,
        bias=None,
        top_first: bool = False,
        **adding,
    ) -> State:
        """The state of ``(..., q)`` rows after one more block of keys: their scores and values.

        ``bias`` and ``top_first`` are the sigmoid's (``block``); ``adding``, :func:`add`'s.
        """
        block = self.block(state, scores, allowed, bias=bias, top_first=top_first)
        return add(state, block, value, **adding)


class Softmax(Normalizer):
    r"""The softmax normaliser: each row's weights :math:`e^{s}` over their sum, the online way.

    The state keeps a running max, by which every block's weights are shifted, and a running
    denominator; its residual is the log-sum-exp. One instance, :data:`SOFTMAX`.
    """

    def __repr__(self) -> str:
        return "Softmax()"

    def weights(self, scores, allowed, bias, sinks) -> tuple[Array, Array]:
        """A dense block's ``(weights, lse)``, every key of its rows at once."""
        return softmax_with_logsumexp(scores, allowed, sinks)

    def block(
        self,
        state: State,
        scores: Float[Array, "*q kv"],
        allowed: Bool[Array, "*#q #kv"] | None,
        *,
        bias=None,
        top_first: bool = False,
        scale: float | None = None,
    ) -> Block:
        """One more block of keys for ``(..., q)`` rows: its weights on the rows' new max.

        With a ``scale``, the logits are ``scale · scores`` (a kernel's products and a positive
        scale): its weights fold the scale into base 2 (:func:`~jax_sdpa._steps.folded_exp_scores`).
        """
        masked = masked_scores(scores, allowed)
        tile_max = masked.max(axis=-1)
        if scale is not None:
            tile_max = jnp.where(has_key(tile_max), tile_max * scale, tile_max)
        top = jnp.maximum(state.top, tile_max)  # dead, and dropped by XLA, unless it is returned
        # max(row max, top), as top is at least the fill, without reading top (so that it can
        # drop).
        new_max = jnp.maximum(state.row_max, jnp.maximum(tile_max, large_negative(tile_max.dtype)))
        # Until a row meets its first allowed key, its max stays at the fill and p counts masked
        # entries as 1 (0 with the scale folded); the correction e^{fill − real max} = 0 erases
        # them when it does (finish reads no key from the max, not from the denominator).
        if scale is None:
            p = exp_scores(masked, new_max)
        else:
            p = folded_exp_scores(scores, allowed, new_max, scale)
        return Block(new_max, p, p.sum(axis=-1), top)

    def recompute(self, scores, allowed, lse, bias, scale=None) -> Array:
        """A block's normalised weights from its rows' final log-sum-exp: :math:`P = e^{S - lse}`.

        ``lse`` must be finite (0 for a row with no key, whose weights then come out 0); ``bias``
        is the sigmoid's; ``scale`` as :meth:`block`'s.
        """
        if scale is None:
            return exp_scores(masked_scores(scores, allowed), lse)
        return folded_exp_scores(scores, allowed, lse, scale)

    def score_gradient(self, p: Array, d_p: Array, delta: Array) -> Array:
        r"""The scores' cotangent: :math:`dS = P \circ (dP - \delta)`.

        :math:`\delta_i = \sum_j P_{ij} dP_{ij}` less the log-sum-exp's cotangent (:meth:`delta`).
        """
        return p * (d_p - delta[:, None])

    def delta(self, rows: Array, out: Array, d_lse: Array, shift: Array, seen: Array) -> Array:
        r"""The rows' :math:`\delta`: :math:`\mathrm{rowsum}(dO \circ O)` less ``d_lse``.

        As :math:`\partial\,\mathrm{lse}_i / \partial s_{ij} = P_{ij}`, the log-sum-exp's
        cotangent joins the scores' gradient through it. ``rows`` are the output's cotangent
        ``(T, N, V)``, ``out`` the output.
        """
        return jnp.sum(rows * out.astype(rows.dtype), axis=-1) - d_lse

    def finish(self, state: State, dtype) -> tuple[Array, Array]:
        """``(out, lse)``, ``(..., r, V)`` and ``(..., r)``, from a final state of ``r`` rows.

        A row that met no key gives 0 and −∞.
        """
        flat = state.acc.reshape(-1, state.acc.shape[-1])
        out = normalize(flat, state.denom.reshape(-1), state.row_max.reshape(-1))
        lse = logsumexp(state.row_max, state.denom)
        return out.reshape(state.acc.shape).astype(dtype), lse

    def from_result(self, out: Array, lse: Array, top: Array | None = None) -> State:
        """The state that :meth:`finish` turns back into ``(out, lse)``: max lse, denominator 1.

        ``top``: the rows' largest scores (:func:`max_scores`), if known.
        """
        dtype, lse, top = _result_parts(out, lse, top)
        row_max = jnp.where(jnp.isfinite(lse), lse, large_negative(dtype))
        return State(row_max, jnp.ones_like(lse), out.astype(dtype), top)


class Sigmoid(Normalizer):
    r"""The sigmoid normaliser: each weight :math:`\sigma(s + b)` on its own, rows not normalised.

    The state keeps no running max (it stays at the fill, so every correction is
    :math:`e^0 = 1`): a block's weighted values and weights just add, the denominator becoming
    the row's total weight, whose log is the residual. ``b`` is the call's per-head bias. One
    instance, :data:`SIGMOID`.
    """

    def __repr__(self) -> str:
        return "Sigmoid()"

    def weights(self, scores, allowed, bias, sinks) -> tuple[Array, Array]:
        """A dense block's ``(weights, log of each row's total weight)``."""
        weights = sigmoid_parts(scores, allowed, bias)
        return weights, log_total(weights)

    def block(
        self,
        state: State,
        scores: Float[Array, "*q kv"],
        allowed: Bool[Array, "*#q #kv"] | None,
        *,
        bias,
        top_first: bool = False,
    ) -> Block:
        r"""As :meth:`Softmax.block`, the weights :math:`\sigma(s + b)` on no max.

        With ``top_first``, XLA takes the block's largest score (if it is used) before the
        weights.
        """
        # The weights need no row max: the top is a pass of its own over the tile (dead, and
        # dropped by XLA, unless it is returned), made before the weights while the tile is in
        # cache: XLA otherwise runs it after them, where it costs twice as much (BENCHMARKS.md).
        tile_max = masked_scores(scores, allowed).max(axis=-1)
        if top_first:  # not in a Pallas kernel, which has no barrier
            scores, tile_max = lax.optimization_barrier((scores, tile_max))
        w = sigmoid_parts(scores, allowed, bias)
        return Block(state.row_max, w, w.sum(axis=-1), jnp.maximum(state.top, tile_max))

    def recompute(self, scores, allowed, lse, bias) -> Array:
        """A block's weights, which need no row statistic."""
        return sigmoid_parts(scores, allowed, bias)

    def score_gradient(self, p: Array, d_p: Array, delta: Array) -> Array:
        r""":math:`dS = P(1 - P) \circ (dP - \delta)` (:meth:`delta`)."""
        return p * (1 - p) * (d_p - delta[:, None])

    def delta(self, rows: Array, out: Array, d_lse: Array, shift: Array, seen: Array) -> Array:
        r"""The rows' :math:`\delta`: the log total weight's cotangent over :math:`-e^{lse}`.

        The log of the total weight :math:`\ell_i` has :math:`\partial \log \ell_i / \partial
        s_{ij} = P_{ij}(1 - P_{ij}) / \ell_i`; the rows are not normalised, so no
        :math:`\mathrm{rowsum}(dO \circ O)`. 0 for a row that met no key (``seen`` False).
        """
        return jnp.where(seen, -d_lse * jnp.exp(-shift), 0)

    def finish(self, state: State, dtype) -> tuple[Array, Array]:
        """``(out, log of the total weight)``: the state is already the output."""
        return state.acc.astype(dtype), log_of_sum(state.denom)

    def from_result(self, out: Array, lse: Array, top: Array | None = None) -> State:
        """The state of a result: the fill for its max, the total weight :math:`e^{lse}`."""
        dtype, lse, top = _result_parts(out, lse, top)
        fill = jnp.full_like(lse, large_negative(dtype))
        return State(fill, jnp.exp(lse), out.astype(dtype), top)


SOFTMAX, SIGMOID = Softmax(), Sigmoid()
NORMALIZERS = {"softmax": SOFTMAX, "sigmoid": SIGMOID}
Normalization = Softmax | Sigmoid


def _shifted(state: State, row_max: Array) -> tuple[Array, Array]:
    r"""The denominator and output of ``state`` re-based on a larger max: :math:`e^{m - m'}`.

    As they are where the max is the state's own (the sigmoid's, which keeps none).
    """
    if row_max is state.row_max:
        return state.denom, state.acc
    correction = jnp.exp(state.row_max - row_max)
    return correction * state.denom, correction[..., None] * state.acc


def _result_parts(out: Array, lse: Array, top: Array | None) -> tuple:
    """A result's accumulation dtype, its lse in it, and its rows' top (the fill if unknown)."""
    dtype = accumulation_dtype(out.dtype)
    lse = lse.astype(dtype)
    fill = jnp.full_like(lse, large_negative(dtype))
    return dtype, lse, fill if top is None else jnp.maximum(top.astype(dtype), fill)


def max_scores(state: State) -> Array:
    """Each row's largest allowed score, −∞ for a row that met none (not differentiated)."""
    return lax.stop_gradient(top_scores(state))


def top_scores(state: State) -> Array:
    """:func:`max_scores` for a kernel, which nothing differentiates.

    (Pallas TPU lowers no ``stop_gradient`` before JAX 0.7.)
    """
    return jnp.where(has_key(state.top), state.top, -jnp.inf)


def merge(a: State, b: State) -> State:
    r"""The state over the union of two disjoint sets of keys, rows ``(..., r)``, ``(..., r, V)``.

    .. math:: m = \max(m_a, m_b), \quad \ell = e^{m_a - m} \ell_a + e^{m_b - m} \ell_b, \quad
        \tilde o = e^{m_a - m} \tilde o_a + e^{m_b - m} \tilde o_b
    """
    return combine(State(*(jnp.stack(pair) for pair in zip(a, b, strict=True))))


def combine(states: State) -> State:
    """The state over the union of disjoint sets of keys, stacked along the leading axis."""
    # The shift does not change the result (as the softmax's row max): no gradient through it.
    row_max = lax.stop_gradient(states.row_max.max(axis=0))
    denom, acc = _shifted(states, row_max[None])
    return State(row_max, denom.sum(axis=0), acc.sum(axis=0), states.top.max(axis=0))


def merge_attention(
    a: tuple[ArrayLike, ArrayLike],
    b: tuple[ArrayLike, ArrayLike],
    *,
    normalizer: Literal["softmax", "sigmoid"] = "softmax",
) -> tuple[Array, Array]:
    r"""Attention over the union of two sets of keys, from the attention over each set.

    ``a = (out_a, lse_a)`` is what :func:`jax_sdpa.dot_product_attention` returns with
    ``return_residual=True`` for the keys of one set, ``b`` the same for the other set (same
    queries): the result is, up to rounding, that call over both sets of keys at once.

    .. math:: \mathrm{lse} = \log(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}), \qquad
        \mathrm{out} = e^{\mathrm{lse}_a - \mathrm{lse}}\, \mathrm{out}_a
        + e^{\mathrm{lse}_b - \mathrm{lse}}\, \mathrm{out}_b

    With ``normalizer="sigmoid"`` (results of sigmoid attention, whose residual is the log of a
    row's total weight) the outputs simply add, and so do the total weights:
    :math:`\mathrm{out} = \mathrm{out}_a + \mathrm{out}_b`, the same ``lse``.

    A row with no key in either set (``lse = −∞`` in both) stays 0 with ``lse = −∞``, with zero
    gradients. Differentiable in all four arrays. Decoding with keys split over several calls,
    attention over a cached prefix plus new tokens, and ring attention all combine results so.

    Args:
        a: ``(out, lse)``: outputs ``(..., V)`` and log-sum-exp ``(...)``, e.g. ``(B, T, N, V)``
            and ``(B, T, N)``.
        b: The same for the other set of keys, same shapes and dtypes.
        normalizer: The normaliser both were computed with (``"softmax"`` or ``"sigmoid"``).

    Returns:
        ``(out, lse)``: the output in ``out_a``'s dtype and the log-sum-exp in at least float32.

    Raises:
        ValueError: If the shapes do not fit together.
        TypeError: If the outputs' dtypes differ or are not floating point.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax_sdpa import dot_product_attention
        >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 4, 2, 8))
        >>> left = dot_product_attention(q, k[:, :3], v[:, :3], return_residual=True)
        >>> right = dot_product_attention(q, k[:, 3:], v[:, 3:], return_residual=True)
        >>> out, lse = merge_attention(left, right)
        >>> bool(jnp.abs(out - dot_product_attention(q, k, v)).max() < 1e-6)
        True

    References:
        Milakov & Gimelshein, Online normalizer calculation for softmax, 2018.
    """
    (out_a, lse_a), (out_b, lse_b) = (tuple(map(jnp.asarray, x)) for x in (a, b))
    _checks.check_float("out_a", out_a)
    _checks.check_same_dtype(("out_a", "out_b"), (out_a, out_b))
    _checks.check_equal("shape", ("out_a", "out_b"), (out_a.shape, out_b.shape))
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        _checks.check_float(name, lse)
        _checks.check_shape(name, lse, out_a.shape[:-1], "out.shape[:-1]")
    _checks.check_choice("normalizer", normalizer, tuple(NORMALIZERS))
    normalizer = NORMALIZERS[normalizer]
    states = (normalizer.from_result(out, lse) for out, lse in ((out_a, lse_a), (out_b, lse_b)))
    return normalizer.finish(merge(*states), out_a.dtype)
