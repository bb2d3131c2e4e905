"""What Mosaic GPU lowers no primitive for, computed by what it lowers (:data:`REWRITES`).

Each as ``lax`` defines it, its edges (±0, ±∞, NaN) and signs too: exact where the function
allows (``floor``), else within a few units in the last place of float32 (each function says
its bound; the tests measure them against float64). 16-bit inputs are computed in float32 and
rounded, as XLA computes them. Choices are made one comparison at a time (Mosaic GPU combines
no vectors of booleans) and scalars broadcast explicitly (it broadcasts none implicitly).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_sdpa._jax_compat import DECOMPOSITIONS, bind
from jax_sdpa._jaxpr import Rules, interpret


def _in_float32(function):
    """``function`` of float32 inputs, its result rounded back to a 16-bit input's dtype."""

    @functools.wraps(function)
    def computed(*xs):
        dtype = jnp.result_type(*xs)
        if jnp.finfo(dtype).bits >= 32:
            return function(*xs)
        return function(*(jnp.asarray(x, jnp.float32) for x in xs)).astype(dtype)

    return computed


def _polynomial(x, coefficients):
    """``c₀ xⁿ + … + cₙ`` by Horner's rule."""
    value = jnp.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        value = value * x + c
    return value


def polynomial_of(x, *coefficients):
    """``lax.polynomial(x, coefficients)`` (lowest degree first; JAX 0.12's) by Horner's rule."""
    x, *coefficients = jnp.broadcast_arrays(x, *coefficients)
    return _polynomial(x, coefficients[::-1])


def _signed(x, magnitude):
    """``magnitude`` with ``x``'s sign: negated where ``x < 0``, and ``x`` itself at ±0."""
    return jnp.where(x == 0, x, jnp.where(x < 0, -magnitude, magnitude))


def _negative(x):
    """Whether ``x`` has its sign bit set (−0 and −∞ too), NaN not."""
    return jnp.minimum(x, 1 / x) < 0


def power_of(x, y):
    """``lax.pow(x, y)`` as ``2 ** (y · log2 |x|)``: Mosaic GPU lowers no ``pow``.

    Its sign and edges as ``lax.pow``'s: a negative ``x`` (or −0) to an odd integer power is
    negative, a finite one to a power not an integer NaN, and ``x ** 0``, ``1 ** y`` and
    ``(−1) ** ±∞`` are 1.
    """
    x, y = jnp.broadcast_arrays(x, y)
    magnitude = jnp.exp2(y * jnp.log2(jnp.abs(x)))
    whole = jnp.where(jnp.abs(y) == jnp.inf, jnp.zeros_like(y), y - floor_of(y))
    odd = y - 2 * floor_of(y / 2) == 1
    value = jnp.where(_negative(x), jnp.where(odd, -magnitude, magnitude), magnitude)
    finite = jnp.where(x > -jnp.inf, jnp.where(whole == 0, value, jnp.nan), value)
    value = jnp.where(x < 0, finite, value)
    one = jnp.ones_like(value)
    value = jnp.where(x == -1, jnp.where(jnp.abs(y) == jnp.inf, one, value), value)
    return jnp.where(y == 0, one, jnp.where(x == 1, one, value))


def floor_of(x):
    """``lax.floor(x)`` by a conversion to ``int32`` and back (exact).

    Numbers too large to have a fraction, ±∞, NaN and ±0 as they are.
    """
    whole = x.astype(jnp.int32).astype(x.dtype)  # (toward 0)
    down = jnp.where(whole > x, whole - 1, whole)
    down = jnp.where(x == 0, x, down)
    return jnp.where(jnp.abs(x) < 2.0 ** jnp.finfo(x.dtype).nmant, down, x)


def round_of(x, rounding_method=lax.RoundingMethod.AWAY_FROM_ZERO):
    """``lax.round(x, rounding_method)`` from ``floor |x|`` and the fraction left (exact).

    (Pallas's Triton lowers no ``round``.)
    """
    a = jnp.abs(x)
    whole = floor_of(a)
    fraction = a - whole  # (exact)
    if rounding_method == lax.RoundingMethod.TO_NEAREST_EVEN:
        half = whole + (whole - 2 * floor_of(whole / 2))  # (up where odd)
    else:
        half = whole + 1
    return _signed(x, jnp.where(fraction == 0.5, half, jnp.where(fraction > 0.5, whole + 1, whole)))


@_in_float32
def log1p_of(x):
    """``lax.log1p(x)``: ``2 atanh(x / (2 + x))``'s series on ``(−1/2, 1)``, else ``log(1 + x)``.

    (Within 3 ulp. Not Goldberg's ``log(1 + x) · x / ((1 + x) − 1)``: XLA folds
    ``(1 + x) − 1`` to ``x`` where it compiles a kernel's body, in the interpreters.)
    """
    s = x / (2 + x)
    series = 2 * s * _polynomial(s * s, [1 / n for n in range(19, 0, -2)])
    return jnp.where(x > -0.5, jnp.where(x < 1, series, jnp.log(1 + x)), jnp.log(1 + x))


@_in_float32
def expm1_of(x):
    """``lax.expm1(x)``: ``eˣ − 1`` where ``|x| ≥ log 2``, its Taylor series below.

    Within 2 ulp (4 near ``eˣ``'s overflow: its own). (Not Kahan's ``(eˣ − 1) · x / log eˣ``:
    XLA folds ``log eˣ`` to ``x`` where it compiles a kernel's body, in the interpreters.)
    """
    series = _polynomial(x, [1 / math.factorial(n) for n in range(12, 0, -1)]) * x
    return jnp.where(jnp.abs(x) < math.log(2), series, jnp.exp(x) - 1)


# Cephes' single-precision erf (x T(x²) below 1) and erfc (e^(−x²) P(1/x²) / x below 2,
# e^(−x²) R(1/x²) / x above).
_ERF_T = (7.853861353153693e-5, -8.010193625184903e-4, 5.188327685732524e-3)
_ERF_T += (-2.685381193529856e-2, 1.128358514861418e-1, -3.761262582423300e-1, 1.1283791657267)
_ERFC_P = (2.326819970068386e-2, -1.387039388740657e-1, 3.687424674597105e-1)
_ERFC_P += (-5.824733027278666e-1, 6.210004621745983e-1, -4.944515323274145e-1)
_ERFC_P += (3.404879937665872e-1, -2.741127028184656e-1, 5.638259427386472e-1)
_ERFC_R = (-1.047766399936249e1, 1.297719955372516e1, -7.495518717768503e0)
_ERFC_R += (2.921019019210786e0, -1.015265279202700e0, 4.218463358204948e-1)
_ERFC_R += (-2.820767439740514e-1, 5.641895067754075e-1)


def _erfc_beyond_one(a):
    """``erfc(a)`` for ``a ≥ 1`` (or NaN); ``e^(−a²)`` as ``e^(−h²) e^(−(a − h)(a + h))``.

    ``h``, ``a`` to 8 bits after the point, has an exact square: ``a²`` rounded would cost
    ``erfc(9)`` 40 units in the last place.
    """
    clipped = jnp.minimum(a, 16.0)  # (erfc(10) is below float32's least number)
    head = (clipped * 256).astype(jnp.int32).astype(a.dtype) / 256
    tail = (clipped - head) * (clipped + head)
    q = 1 / a
    ratio = jnp.where(a < 2, _polynomial(q * q, _ERFC_P), _polynomial(q * q, _ERFC_R))
    near = jnp.exp(-head * head)  # (e^(−tail) as 1 + expm1: XLA folds a product of exps)
    return (near + near * expm1_of(-tail)) * q * ratio


@_in_float32
def erf_of(x):
    """``lax.erf(x)`` (Cephes' polynomials; within 3 ulp)."""
    a = jnp.abs(x)
    beyond = 1 - _erfc_beyond_one(a)
    return jnp.where(a < 1, x * _polynomial(x * x, _ERF_T), jnp.where(x < 0, -beyond, beyond))


@_in_float32
def erfc_of(x):
    """``lax.erfc(x)`` (Cephes' polynomials; within 3 ulp beyond 1, 9 below: ``1 − erf``)."""
    beyond = _erfc_beyond_one(jnp.abs(x))
    below = 1 - x * _polynomial(x * x, _ERF_T)
    return jnp.where(jnp.abs(x) < 1, below, jnp.where(x < 0, 2 - beyond, beyond))


def _half_exp_and_its_inverse(a):
    """``eᵃ / 2`` and ``e⁻ᵃ / 2`` from ``e^(a/2)``: finite wherever ``cosh a`` is."""
    e = jnp.exp(a / 2)
    return (0.5 * e) * e, 0.5 / (e * e)


@_in_float32
def sinh_of(x):
    """``lax.sinh(x)``: ``(eˣ − 1 + (eˣ − 1) / eˣ) / 2`` below 1 (within 3 ulp)."""
    a = jnp.abs(x)
    em1 = expm1_of(a)
    up, down = _half_exp_and_its_inverse(a)
    return _signed(x, jnp.where(a < 1, 0.5 * (em1 + em1 / (em1 + 1)), up - down))


@_in_float32
def cosh_of(x):
    """``lax.cosh(x)`` (within 3 ulp)."""
    up, down = _half_exp_and_its_inverse(jnp.abs(x))
    return up + down


@_in_float32
def atan_of(x):
    """``lax.atan(x)`` (Cephes' single precision: its range reduced to ``|x| ≤ tan(π/8)``)."""
    a = jnp.abs(x)
    beyond = a > 2.414213562373095  # (tan(3π/8))
    middle = a > 0.4142135623730950  # (tan(π/8))
    t = jnp.where(beyond, -1 / a, jnp.where(middle, (a - 1) / (a + 1), a))
    base = jnp.where(beyond, math.pi / 2, jnp.where(middle, math.pi / 4, 0.0))
    z = t * t
    odd = (8.05374449538e-2, -1.38776856032e-1, 1.99777106478e-1, -3.33329491539e-1)
    return _signed(x, base + (_polynomial(z, odd) * z * t + t))


@_in_float32
def atan2_of(y, x):
    """``lax.atan2(y, x)``: ``atan(|y| / |x|)`` placed in its quadrant, ±0 and ±∞ as lax's."""
    y, x = jnp.broadcast_arrays(y, x)
    ay, ax = jnp.abs(y), jnp.abs(x)
    ratio = jnp.where(ay == ax, jnp.where(ax == 0, ax, jnp.ones_like(ax)), ay / ax)
    angle = atan_of(ratio)
    angle = jnp.where(_negative(x), math.pi - angle, angle)
    return jnp.where(_negative(y), -angle, angle)


@_in_float32
def asin_of(x):
    """``lax.asin(x)`` as ``atan2(x, √((1 − x)(1 + x)))`` (within 4 ulp; NaN beyond ±1)."""
    return atan2_of(x, jnp.sqrt((1 - x) * (1 + x)))


@_in_float32
def acos_of(x):
    """``lax.acos(x)`` as ``atan2(√((1 − x)(1 + x)), x)`` (within 4 ulp; NaN beyond ±1)."""
    return atan2_of(jnp.sqrt((1 - x) * (1 + x)), x)


_LARGE = 2.0**12  # (beyond it, 1 + x² is x²: asinh x and acosh x are log 2x)


@_in_float32
def asinh_of(x):
    """``lax.asinh(x)``: ``log1p(a + a² / (1 + √(1 + a²)))`` of ``a = |x|`` (within 3 ulp)."""
    a = jnp.abs(x)
    near = log1p_of(a + a * a / (1 + jnp.sqrt(1 + a * a)))
    return _signed(x, jnp.where(a < _LARGE, near, jnp.log(a) + math.log(2)))


@_in_float32
def acosh_of(x):
    """``lax.acosh(x)``: ``log1p(t + √(2t + t²))`` of ``t = x − 1`` (within 3 ulp; NaN below 1)."""
    t = x - 1
    near = log1p_of(t + jnp.sqrt(2 * t + t * t))
    value = jnp.where(x < _LARGE, near, jnp.log(x) + math.log(2))
    return jnp.where(x < 1, jnp.nan, value)


@_in_float32
def atanh_of(x):
    """``lax.atanh(x)``: ``log1p(2a / (1 − a)) / 2`` of ``a = |x|`` (within 4 ulp; ±∞ at ±1)."""
    a = jnp.abs(x)
    return _signed(x, 0.5 * log1p_of(2 * a / (1 - a)))


@_in_float32
def cbrt_of(x):
    """``lax.cbrt(x)``: ``2 ** (log2 |x| / 3)`` and one step of Newton's method (within 3 ulp)."""
    a = jnp.abs(x)
    guess = jnp.exp2(jnp.log2(a) / 3)
    root = (2 * guess + a / (guess * guess)) / 3  # (∞ / ∞ at ∞; 0 / 0 at 0: _signed's)
    return _signed(x, jnp.where(a == jnp.inf, a, root))


@_in_float32
def tan_of(x):
    """``lax.tan(x)`` as ``sin x / cos x`` (within 2 ulp, of exact sine and cosine)."""
    return jnp.sin(x) / jnp.cos(x)


# Giles' single-precision erf⁻¹ (XLA's: a polynomial in w − 2.5 below w = 5, in √w − 3 above).
_ERF_INV_NEAR = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06)
_ERF_INV_NEAR += (0.00021858087, -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERF_INV_FAR = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844)
_ERF_INV_FAR += (0.00573950773, -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


@_in_float32
def erf_inv_of(x):
    """``lax.erf_inv(x)``: Giles' polynomials in ``w = −log((1 − x)(1 + x))``, ±∞ at ±1."""
    w = -jnp.log((1 - x) * (1 + x))
    near = _polynomial(w - 2.5, _ERF_INV_NEAR)
    far = _polynomial(jnp.sqrt(w) - 3, _ERF_INV_FAR)
    value = jnp.where(w < 5, near, far) * x
    return jnp.where(jnp.abs(x) == 1, x * jnp.inf, value)


# Lanczos' approximation (g = 7, nine terms; XLA's) of Γ and its log, for x ≥ 1/2.
_LANCZOS_G = 7.0
_LANCZOS = (676.520368121885098567009190444019, -1259.13921672240287047156078755283)
_LANCZOS += (771.3234287776530788486528258894, -176.61502916214059906584551354)
_LANCZOS += (12.507343278686904814458936853, -0.13857109526572011689554707)
_LANCZOS += (9.984369578019570859563e-6, 1.50563273514931155834e-7)


def _lanczos(z):
    """``(A, A′, t, log t)`` at ``z = x − 1``: Lanczos' sum, its derivative and ``z + g + ½``."""
    terms = [(c, z + (k + 1)) for k, c in enumerate(_LANCZOS)]
    sum_ = 0.99999999999980993227684700473478 + sum(c / d for c, d in terms)
    derivative = -sum(c / (d * d) for c, d in terms)
    t = z + (_LANCZOS_G + 0.5)
    log_t = math.log(_LANCZOS_G + 0.5) + log1p_of(z / (_LANCZOS_G + 0.5))
    return sum_, derivative, t, log_t


def _reflected(x):
    """``(1 − x where x < ½ else x, fraction)``: the reflection's argument, and a fraction.

    How far ``x`` is from its nearest integer, in ``[0, ½]`` (exact: ``|sin πx|`` is
    ``sin π·fraction``).
    """
    a = jnp.abs(x)
    fraction = a - floor_of(a)
    fraction = jnp.where(fraction > 0.5, 1 - fraction, fraction)
    return jnp.where(x < 0.5, 1 - x, x), fraction


@_in_float32
def lgamma_of(x):
    """``lax.lgamma(x)``: Lanczos' approximation, reflected below ½; ``+∞`` at its poles.

    (Within a few units of float32's ε of ``max(1, |lgamma x|)``, as XLA's: relative to the
    value, not near its zeros at 1 and 2.)
    """
    y, fraction = _reflected(x)
    sum_, _, t, log_t = _lanczos(y - 1)
    # ((y − ½) log t − t as (y − ½ − t / log t) log t: finite wherever the value is, as XLA's)
    lgamma = 0.5 * math.log(2 * math.pi) + (y - 0.5 - t / log_t) * log_t + jnp.log(sum_)
    reflected = math.log(math.pi) - jnp.log(jnp.sin(math.pi * fraction)) - lgamma
    value = jnp.where(x < 0.5, reflected, lgamma)
    value = jnp.where(jnp.abs(x) == jnp.inf, jnp.inf, value)
    return jnp.where(x < 0.5, jnp.where(fraction == 0, jnp.inf, value), value)


@_in_float32
def digamma_of(x):
    """``lax.digamma(x)``: Lanczos' derivative, reflected below ½ (``ψ(1 − x) − π / tan πx``).

    NaN at its poles but ±0 (``∓∞``), ``+∞`` at ``+∞`` (within a few units of float32's ε of
    ``max(1, |ψ(x)|)``, as XLA's).
    """
    y, fraction = _reflected(x)
    sum_, derivative, t, log_t = _lanczos(y - 1)
    digamma = log_t + derivative / sum_ - _LANCZOS_G / t
    near = x - floor_of(x + 0.5)  # (x less its nearest integer, exact where x has a fraction)
    value = jnp.where(x < 0.5, digamma - math.pi / tan_of(math.pi * near), digamma)
    value = jnp.where(x == jnp.inf, x, value)
    value = jnp.where(x < 0.5, jnp.where(fraction == 0, jnp.nan, value), value)
    return jnp.where(x == 0, -1 / x, value)  # (∓∞ at ±0, as ψ(x) ≈ −1/x there)


def choice_of(which, *cases):
    """``lax.select_n(which, *cases)`` of more than two cases, one comparison at a time."""
    value = cases[-1]
    for k in range(len(cases) - 2, -1, -1):
        value = jnp.where(which == k, cases[k], value)
    return value


def nextafter_of(x, y):
    """``lax.nextafter(x, y)``: the number after ``x`` toward ``y``, by its bits (as XLA's).

    ``y`` where ``x == y``, the least subnormal of ``y``'s sign after ±0, NaN where either is.
    Every comparison and choice is of the bits: XLA's on a CPU with AVX-512 BF16 flushes
    bfloat16 subnormals in float comparisons and choices.
    """
    x, y = jnp.broadcast_arrays(x, y)  # (Mosaic GPU bit-casts no scalar)
    bits = jnp.dtype(f"int{8 * x.dtype.itemsize}")
    x_bits, y_bits = (lax.bitcast_convert_type(z, bits) for z in (x, y))
    sign = bits.type(jnp.iinfo(bits).min)  # (the sign bit alone)
    infinity = bits.type(np.array(np.inf, x.dtype).view(bits))  # (above it: NaN)
    x_abs, y_abs = x_bits & ~sign, y_bits & ~sign
    away = jnp.where((x_bits & sign) == (y_bits & sign), bits.type(1), bits.type(-1))
    after = x_bits + jnp.where(x_abs > y_abs, bits.type(-1), away)  # (toward 0: one less)
    after = jnp.where(x_abs == 0, (y_bits & sign) | bits.type(1), after)
    equal = (x_bits == y_bits) | ((x_abs == 0) & (y_abs == 0))  # (±0 equal)
    after = jnp.where(equal | (y_abs > infinity), y_bits, after)
    after = jnp.where(x_abs > infinity, x_bits, after)  # (NaN where either is)
    return lax.bitcast_convert_type(after, x.dtype)


def _of_booleans(eqn):
    """A vector's conversion to or from booleans, or their ``not``, as a comparison or a choice.

    Else None. (Mosaic GPU converts no vector of ``i1``: "Register bitwidth … must be divisible
    by 8"; ``jnp.signbit``'s and ``jnp.copysign``'s conversions, ``ndtri``'s and its ``not``.)
    """
    source = eqn.invars[0].aval.dtype
    if eqn.invars[0].aval.ndim == 0:  # (a scalar's, Mosaic GPU's own)
        return None
    if eqn.primitive.name == "not":
        return (lambda x: jnp.where(x, False, True)) if source == jnp.bool_ else None
    target = eqn.params["new_dtype"]
    if (source == jnp.bool_) == (target == jnp.bool_):
        return None
    if target == jnp.bool_:
        return lambda x: x != 0
    return lambda x: jnp.where(x, target.type(1), target.type(0))


def _float_remainder(x, y):
    """A float ``rem`` (``jnp.mod``, ``jnp.fmod``, ``%``): refused by name.

    Mosaic GPU's is of integers, and ``x − y · trunc(x / y)`` is not ``fmod`` (its product
    rounds: a whole ``y`` off where the quotient is near a whole number).
    """
    raise NotImplementedError(
        "The Mosaic GPU kernel computes no remainder of floats (`jnp.mod`, `jnp.fmod` or `%` of "
        "a float in a score_mod or mask_mod): take it of integer positions, or use "
        '`Pallas(backend="triton")`.'
    )


def _decomposed(decomposition):
    """A primitive as JAX's own ``decomposition`` computes it, each equation :func:`bound`.

    (The Bessel functions: their choices of four cases, polynomials and booleans rewritten.)
    """

    def computed(*args):
        closed = jax.make_jaxpr(decomposition)(*args)
        return interpret(closed.jaxpr, closed.consts, args, Rules(bind=bound))[0]

    return computed


# (``erf`` and ``atan2`` Mosaic GPU lowers, but its layout inference has no rule for them.)
REWRITES = {
    "pow": power_of,
    "floor": floor_of,
    "ceil": lambda x: -floor_of(-x),
    "log1p": log1p_of,
    "expm1": expm1_of,
    "is_finite": lambda x: x - x == 0,  # (∞ − ∞ and NaN − NaN are NaN)
    "erf": erf_of,
    "erfc": erfc_of,
    "sinh": sinh_of,
    "cosh": cosh_of,
    "atan": atan_of,
    "atan2": atan2_of,
    "cbrt": cbrt_of,
    "asin": asin_of,
    "acos": acos_of,
    "asinh": asinh_of,
    "acosh": acosh_of,
    "atanh": atanh_of,
    "polynomial": polynomial_of,
    "tan": tan_of,
    "erf_inv": erf_inv_of,
    "lgamma": lgamma_of,
    "digamma": digamma_of,
    "nextafter": nextafter_of,
    "stop_gradient": lambda x: x,  # (nothing differentiates a kernel's body)
    "reshard": lambda x: x,  # (JAX 0.12's jnp.hypot's constants: a kernel's are not sharded)
    **{name: _decomposed(function) for name, function in DECOMPOSITIONS.items()},
}


def bound(eqn, args):
    """The equation on ``args``, rewritten where Mosaic GPU lowers it no way."""
    computed = for_mosaic_gpu(eqn)
    return bind(eqn, args) if computed is None else computed(*args)


def for_mosaic_gpu(eqn):
    """What computes the equation where Mosaic GPU lowers it no way (:data:`REWRITES`), or None.

    A float ``rem`` refused by name (Mosaic GPU's is of integers); booleans converted and
    negated as comparisons and choices (:func:`_of_booleans`); a choice of more than two
    cases one at a time (:func:`choice_of`: ``jax.scipy.special.ndtri``'s); an integer power
    below −1 (a quotient's derivative, ``y ** −2``) as one over the power;
    a function asked for an accuracy (JAX 0.12's ``erf`` derivative's ``exp``) as Mosaic GPU
    computes it, which takes none.
    """
    name = eqn.primitive.name
    if name == "rem" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return _float_remainder
    if name in ("convert_element_type", "not"):
        return _of_booleans(eqn)
    if name == "select_n" and len(eqn.invars) > 3:
        return choice_of
    if name == "integer_pow" and eqn.params["y"] < -1:
        return lambda x: 1 / lax.integer_pow(x, -eqn.params["y"])
    if name not in REWRITES and eqn.params.get("accuracy") is not None:
        return lambda *args: bind(eqn, list(args), params={"accuracy": None})
    return REWRITES.get(name)
