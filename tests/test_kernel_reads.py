"""Reading captured arrays inside a kernel (``jax_sdpa._kernels.reads``): the values are the
function's own.

Each case runs a function of some arrays twice: directly, and inside a Pallas kernel (in the
interpreter) through :func:`~jax_sdpa._kernels.reads.evaluate`, which leaves the arrays in
memory and rewrites how they are read (slices as loads at indices, point gathers as loads at
vectors of indices, their transposes as one-hot sums, a mapped while loop's predicate per
element, booleans reduced as integers). Out-of-bounds reads must come out as ``lax`` defines
them: clamped, or filled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax import lax
from jax.experimental import pallas as pl

from jax_sdpa._jax_compat import DECOMPOSITIONS
from jax_sdpa._kernels.reads import evaluate
from jax_sdpa._kernels.triton import atomic_add
from tests.util import equations

# Under x64 the kernels' reads run in test_pallas.py and the pallas sweep.
pytestmark = pytest.mark.x64_sampled

X = jnp.arange(8, dtype=jnp.float32) * 1.5 - 2.0
TABLE = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) ** 2
IDX = jnp.array([[0, 3, 7], [-1, 9, 2]], jnp.int32)  # negative and past the end, too


def in_kernel(fn, *arrays):
    """``fn(*arrays)`` computed in a kernel, the arrays read through ``evaluate``."""
    shape = jax.eval_shape(fn, *arrays)

    def kernel(*refs):
        *inputs, out = refs
        out[...] = evaluate(fn, list(inputs))

    return pl.pallas_call(kernel, out_shape=shape, interpret=True)(*arrays)


CASES = {
    "dynamic slice, start clamped": (lambda x: lax.dynamic_slice(x, (7,), (3,)), (X,)),
    "scalar read": (lambda t: t[2, 1] * t[jnp.int32(1), jnp.int32(3)], (TABLE,)),
    "point gather, clipped": (lambda x, i: x[i], (X, IDX)),
    "point gather of a table": (lambda t, i: t[i % 3, i], (TABLE, IDX)),
    "fill gather, given fill": (lambda x, i: x.at[i].get(mode="fill", fill_value=-5.0), (X, IDX)),
    "fill gather, default fill": (lambda x, i: x.at[i].get(mode="fill"), (X, IDX)),
    "booleans all and any": (
        lambda x: jnp.stack([jnp.all(x > -3.0), jnp.any(x > 20.0), jnp.any(x > 3.0)]),
        (X,),
    ),
    "gradient of a scalar read": (
        lambda x: jax.grad(lambda x: x[jnp.int32(5)] * 3.0 + x[jnp.int32(9)])(x),
        (X,),
    ),
    "gradient of a point gather": (
        lambda x, i: jax.grad(lambda x: jnp.sum(jnp.cos(x[i]) * i.astype(x.dtype)))(x),
        (X, IDX),
    ),
    "gradient of a fill take of a one-entry row": (  # (a scatter-add of one update, not a point)
        lambda t: jax.grad(lambda t: jnp.take(t, jnp.int32(1), axis=0, mode="fill")[0] * 3.0)(t),
        (jnp.array([[0.1], [0.2]]),),
    ),
    "gradient of a clip gather at one point": (  # (one update, at a vector of one point)
        lambda x, i: jax.grad(lambda x: jnp.sum(x.at[i].get(mode="clip") * 3.0))(x),
        (X, jnp.array([11], jnp.int32)),
    ),
    "gradient of a fill gather": (
        lambda x, i: jax.grad(lambda x: jnp.sum(x.at[i].get(mode="fill", fill_value=0.0) ** 2))(x),
        (X, IDX),
    ),
    "mapped while loop": (
        lambda x: jax.vmap(
            lambda v: lax.while_loop(
                lambda c: c[0] < v, lambda c: (c[0] + 1.0, c[1] * 2.0), (0.0, 1.0)
            )[1]
        )(x),
        (X,),
    ),
    "cond on a read": (
        lambda x: lax.cond(x[jnp.int32(2)] > 0, lambda: x * 2.0, lambda: x - 1.0),
        (X,),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_kernel_reads_what_the_function_reads(case):
    fn, arrays = CASES[case]
    np.testing.assert_array_equal(in_kernel(fn, *arrays), fn(*arrays))


def _row(t, start):  # (``dynamic_slice`` of one row as a gather: JAX 0.12.1 batches it so)
    numbers = lax.GatherDimensionNumbers(
        offset_dims=(0, 1), collapsed_slice_dims=(), start_index_map=(0, 1)
    )
    return lax.gather(t, start, numbers, (1, 4), mode=lax.GatherScatterMode.CLIP)


def test_a_row_gathered_at_one_start_is_read_as_one_and_its_gradient_placed_as_one():
    # Read at points: the row a window of the ref, its gradient a scatter of those points placed
    # at the row's start (no scatter-add of a whole slice: Triton lowers none).
    start = jnp.array([5, 0], jnp.int32)  # (past the end: clamped to the last row)

    def read(t, start, idx):
        return _row(t, start)[0][idx % 4]

    def grad(t, start, idx):
        return jax.grad(lambda t: jnp.sum(read(t, start, idx) * idx.astype(t.dtype)))(t)

    np.testing.assert_array_equal(in_kernel(read, TABLE, start, IDX), read(TABLE, start, IDX))
    program = jax.make_jaxpr(lambda *a: in_kernel(grad, *a))(TABLE, start, IDX)
    assert "scatter" not in str(program)
    np.testing.assert_array_equal(in_kernel(grad, TABLE, start, IDX), grad(TABLE, start, IDX))


# --- positions: a run ``start + arange(n)`` is read as one contiguous load -------------------

DOCS = jnp.arange(40, dtype=jnp.int32) // 7
FLAGS = jnp.arange(40) % 3 == 0
SIGNS = jnp.where(jnp.arange(40) % 2 == 0, -0.0, jnp.arange(40.0) - 20.0).at[7].set(jnp.nan)


def at_positions(fn, array, start, count: int):
    """``fn(array, start + arange(count))`` computed in a kernel with ``start`` traced."""
    run = lambda a, s: fn(a, s + jnp.arange(count, dtype=jnp.int32))  # noqa: E731
    shape = jax.eval_shape(run, array, start)

    def kernel(start_ref, array_ref, out):
        out[...] = evaluate(run, [array_ref], start_ref[0])

    return pl.pallas_call(kernel, out_shape=shape, interpret=True)(jnp.atleast_1d(start), array)


ZERO = jnp.int32(0)  # a constant the function closes over, not a literal

RUNS = {
    "index": lambda a, i: a[i],
    "index less a constant": lambda a, i: a[i - 3],
    "index plus a traced scalar": lambda a, i: a[i + i[0] // 2],
    "fill gather": lambda a, i: a.at[i].get(mode="fill", fill_value=a.dtype.type(1)),
    "as a column and a row": lambda a, i: a[i][:, None] == a[i + 1][None, :],
    "own wrap against a constant": lambda a, i: a[jnp.where(i < ZERO, i + 40, i)],
}


@pytest.mark.parametrize(  # the inner loop reads ids; CI also booleans, −0 and NaN
    "array",
    [
        DOCS,
        pytest.param(FLAGS, marks=pytest.mark.slow),
        pytest.param(SIGNS, marks=pytest.mark.slow),
    ],
    ids=["ids", "booleans", "−0 and NaN"],
)
@pytest.mark.parametrize("start", [0, 9, 24, 30, 39, -6, -20], ids=lambda s: f"start {s}")
@pytest.mark.parametrize("case", RUNS)
def test_a_run_of_positions_reads_what_the_function_reads(case, start, array):
    # 16 positions from `start` in 40 entries: inside (0, 9, 24), past the end (30, 39), across
    # the start (−6, which a jnp index wraps): those read window by window; and wholly before
    # it (−20: wrapped whole, one window again).
    fn = RUNS[case]
    start = jnp.int32(start)
    want = fn(array, start + jnp.arange(16, dtype=jnp.int32))
    got = at_positions(fn, array, start, 16)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # −0 stays −0


@pytest.mark.parametrize("case", ["index", "fill gather"])
def test_a_run_longer_than_the_array_reads_what_the_function_reads(case):
    fn, start = RUNS[case], jnp.int32(-3)
    want = fn(DOCS, start + jnp.arange(48, dtype=jnp.int32))
    np.testing.assert_array_equal(at_positions(fn, DOCS, start, 48), want)


def test_a_run_inside_the_array_is_one_load_without_a_gather():
    def kernel(start_ref, array_ref, out):
        out[...] = evaluate(
            lambda a, s: a[s + jnp.arange(16, dtype=jnp.int32)], [array_ref], start_ref[0]
        )

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32), interpret=True)
    assert loads_at_vectors(call, jnp.zeros(1, jnp.int32), DOCS) == 0


def loads_at_vectors(call, *args) -> int:
    """How many loads of the kernel ``call`` read at a vector of indices, which Mosaic has not."""
    (pallas,) = jax.make_jaxpr(call)(*args).eqns
    loads = [e for e in pallas.params["jaxpr"].eqns if e.primitive.name == "get"]
    return sum(any(v.aval.ndim for v in e.invars[1:]) for e in loads)


ROWS = jnp.arange(3 * 40, dtype=jnp.int32).reshape(3, 40) // 7  # a document id per sequence


@pytest.mark.parametrize("mode", [None, "fill"])
@pytest.mark.parametrize("start", [9, 30], ids=lambda s: f"start {s}")
@pytest.mark.parametrize("row", [0, 2, 3, -1, -4], ids=lambda r: f"row {r}")
def test_a_row_read_at_positions_is_one_load_of_that_row(row, start, mode):
    # ``doc[b, q_idx]``: one index along the first axis, positions along the second. Row 3, and
    # −4 (−1 after jnp's wrap of negative indices; −1 wraps to row 2), lie past the rows:
    # clamped, or filled; positions from 30 run past the row's 40 entries. A TPU has no load at
    # a vector of indices.
    def fn(a, r, s):
        return a.at[r, s + jnp.arange(16, dtype=jnp.int32)].get(mode=mode, fill_value=-1)

    def kernel(scalars_ref, array_ref, out):
        out[...] = evaluate(fn, [array_ref], scalars_ref[0], scalars_ref[1])

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32), interpret=True)
    scalars = jnp.array([row, start], jnp.int32)
    np.testing.assert_array_equal(call(scalars, ROWS), fn(ROWS, *scalars))
    assert loads_at_vectors(call, scalars, ROWS) == 0


# --- a large array's gradient: its scatter is added into memory ------------------------------

BIG = jnp.linspace(-2.0, 2.0, 300, dtype=jnp.float32)  # more entries than one-hot sums take
UNIQUE = jnp.array([[5, 299, 0], [17, 150, 42]], jnp.int32)
REPEATED = jnp.array([[5, 5, 0], [-4, 320, 42]], jnp.int32)  # repeated, and clamped


def added_into_memory(fn, array, indices, atomics: bool):
    """``fn(array, indices)`` (an array's gradient) added into a zeroed output in a kernel."""

    def kernel(array_ref, indices_ref, zeros_ref, out):
        def add(a, i):
            if atomics:
                atomic_add(out, (0, 0), fn(a, i).astype(out.dtype))
            else:
                out[0, 0] += fn(a, i).astype(out.dtype)
            return jnp.zeros(())

        evaluate(add, [array_ref], indices_ref[...])

    zeros = jnp.zeros((1, 1, *array.shape), jnp.float32)
    call = pl.pallas_call(kernel, out_shape=zeros, input_output_aliases={2: 0}, interpret=True)
    return call(array, indices, zeros)[0, 0]


def _gradient_of_gather(a, i):
    return jax.grad(lambda a: jnp.sum(jnp.sin(a[i]) * i.astype(a.dtype)))(a)


def _gradient_of_fill_gather(a, i):
    return jax.grad(lambda a: jnp.sum(a.at[i].get(mode="fill", fill_value=0.0) ** 2))(a)


def _gradient_of_a_row_s_gather(a, i):  # ``table[h][i]``: a row, then points in it
    return jax.grad(lambda a: jnp.sum(jnp.cos(a.reshape(3, 100)[jnp.int32(1)][i % 100])))(a)


GRADIENTS = [_gradient_of_gather, _gradient_of_fill_gather, _gradient_of_a_row_s_gather]


@pytest.mark.parametrize("fn", GRADIENTS)
@pytest.mark.parametrize("indices", [UNIQUE, REPEATED], ids=["unique", "repeated"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_large_scatter_added_into_memory_is_the_gradient(fn, indices, dtype):
    # A bfloat16 array's gradient, added into float32, is summed in float32.
    array = BIG.astype(dtype)
    want = fn(array.astype(jnp.float32), indices)
    got = added_into_memory(fn, array, indices, atomics=False)
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == jnp.float32 else 2e-2, atol=1e-6)


@pytest.mark.parametrize("fn", GRADIENTS)
def test_a_large_scatter_is_atomic_adds_at_its_points(fn):
    # The interpreter's atomic add keeps one of repeated points (a GPU adds them all): unique
    # points check where each add lands.
    program = jax.make_jaxpr(lambda: added_into_memory(fn, BIG, UNIQUE, atomics=True))()
    assert "scatter" not in str(program)
    np.testing.assert_allclose(
        added_into_memory(fn, BIG, UNIQUE, atomics=True), fn(BIG, UNIQUE), rtol=1e-6
    )


def test_a_power_as_mosaic_gpu_computes_it_is_lax_pow():
    # 2 ** (y · log2 |x|), the sign and every edge as lax.pow's: negative bases, ±0, ±∞, NaN.
    from jax_sdpa._kernels.rewrites import power_of

    xs = [-np.inf, -3.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 3.7, np.inf, np.nan]
    ys = [-np.inf, -3.0, -2.0, -1.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 2.5, 3.0, 1e9]
    ys += [33554433.0, np.inf, np.nan]  # (an odd integer past 2^24 reads as an even one)
    x, y = (jnp.asarray(a, jnp.float32) for a in np.meshgrid(xs, ys))
    got, want = np.asarray(power_of(x, y)), np.asarray(lax.pow(x, y))
    np.testing.assert_allclose(got, want, rtol=1e-6)  # (NaN where NaN)
    numbers = ~np.isnan(want)
    assert np.array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))  # (−0 too)


EDGES = [-np.inf, -1e30, -100.0, -89.5, -8388609.0, -9.5, -3.5, -2.0, -1.0, -1 + 1e-7, -0.5]
EDGES += [-1e-4, -1e-30, -0.0, 0.0, 1e-30, 1e-8, 6.5e-8, 1e-4, 0.5, 0.999, 1.0, 1.001, 2.0, 2.42]
EDGES += [8.9, 9.2, 10.0, 88.7, 89.0, 89.4, 8388609.0, 1e30, np.inf, np.nan]


def _arguments(seed: int = 0):
    """The edges, normal draws and magnitudes from 1e-13 to 1e13 of both signs, as float32."""
    rng = np.random.default_rng(seed)
    magnitudes = np.exp(rng.uniform(-30, 30, 1000)) * rng.choice([-1.0, 1.0], 1000)
    return np.asarray(EDGES + list(rng.normal(size=1000) * 4) + list(magnitudes), np.float32)


@pytest.mark.parametrize("name", ["floor", "ceil", "is_finite"])
def test_what_mosaic_gpu_lowers_no_primitive_for_is_computed_exactly_as_lax_does(name):
    from jax_sdpa._kernels.rewrites import REWRITES

    x = jnp.asarray(_arguments())
    got, want = np.asarray(jax.jit(REWRITES[name])(x)), np.asarray(getattr(lax, name)(x))
    np.testing.assert_array_equal(got, want)
    numbers = ~np.isnan(want)
    assert np.array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))  # (−0 too)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", list(DECOMPOSITIONS))
def test_a_primitive_computed_as_jaxs_own_decomposition_is_laxs_bit_for_bit(name, dtype):
    # (The Bessel functions: the decomposition's four-case choices, polynomial and booleans
    # rewritten in turn, none left; ±0, ±∞ and NaN among the arguments.)
    from jax_sdpa._kernels.rewrites import REWRITES, for_mosaic_gpu

    x = jnp.asarray(_arguments()).astype(dtype)  # (16 bits: ±∞ beyond their range)
    got, want = (np.asarray(jax.jit(f)(x)) for f in (REWRITES[name], getattr(lax, name)))
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # (−0 too; NaN's sign as lax's)
    left = equations(jax.make_jaxpr(REWRITES[name])(x).jaxpr)
    assert [eqn.primitive.name for eqn in left if for_mosaic_gpu(eqn) is not None] == []


@pytest.mark.parametrize(
    "method", [lax.RoundingMethod.AWAY_FROM_ZERO, lax.RoundingMethod.TO_NEAREST_EVEN]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rounding_as_triton_computes_it_is_lax_round(method, dtype):
    from jax_sdpa._kernels.rewrites import round_of

    halves = np.arange(-6, 6) + 0.5  # (the ties, both ways)
    near = [0.49999997, -0.49999997, 2.5000002, 8388607.5, -8388607.5, 16777215.0]
    x = jnp.asarray(np.concatenate([_arguments(), halves, near]), dtype)
    got, want = jax.jit(round_of, static_argnums=1)(x, method), lax.round(x, method)
    np.testing.assert_array_equal(got, want)
    numbers = ~np.isnan(np.asarray(want, np.float32))
    assert np.array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))  # (−0 too)


def _ulps(got, want):
    """``got``'s distance from float64's ``want`` in float32's units in the last place.

    0 where both are NaN, where ``got`` is ``want`` rounded (±∞ too), and where both are below
    float32's least normal number (XLA flushes those to 0).
    """
    rounded, tiny = want.astype(np.float32), np.finfo(np.float32).smallest_normal
    with np.errstate(invalid="ignore"):
        distance = np.abs(got - want) / np.spacing(np.abs(rounded)).astype(np.float64)
    same = (got == rounded) | (np.isnan(got) & np.isnan(want))
    return np.where(same | ((np.abs(want) < tiny) & (np.abs(got) < tiny)), 0.0, distance)


APPROXIMATED = {  # (lax's name: float64's function, its bound in float32 ulps)
    "log1p": (np.log1p, 3),
    "expm1": (np.expm1, 4),  # (e^88.7's own 3.8)
    "erf": (scipy.special.erf, 3),
    "erfc": (scipy.special.erfc, 9),  # (1 − erf below 1: erf's 2 ulp, each 4 of erfc's at 1)
    "sinh": (np.sinh, 3),
    "cosh": (np.cosh, 3),
    "atan": (np.arctan, 3),
    "cbrt": (np.cbrt, 3),
    "atan2": (np.arctan2, 3),
    "asin": (np.arcsin, 4),
    "acos": (np.arccos, 4),
    "asinh": (np.arcsinh, 3),
    "acosh": (np.arccosh, 3),
    "atanh": (np.arctanh, 4),
    "tan": (np.tan, 2),
    # (XLA's own within 7.5; −0 kept as lax keeps it, where scipy's is +0)
    "erf_inv": (lambda x: np.where(x == 0, x, scipy.special.erfinv(x)), 3),
}


@pytest.mark.parametrize("name", APPROXIMATED)
def test_what_mosaic_gpu_lowers_no_primitive_for_is_within_a_few_ulps_of_float64(name):
    # Compiled (as the interpreters compile a kernel's body: XLA's folds of log eˣ and eᵃ eᵇ
    # cost Kahan's expm1 and a split e^(−x²) their accuracy), against float64, NaN where NaN,
    # the sign of ±0 and ±∞ kept; and in 16 bits, float64's rounded.
    from jax_sdpa._kernels.rewrites import REWRITES

    function, bound = APPROXIMATED[name]
    xs = [_arguments()] if name != "atan2" else [_arguments(), np.roll(_arguments(1), 7)]
    if name == "erf_inv":  # (NaN beyond ±1)
        xs = [np.concatenate([xs[0], np.linspace(-1, 1, 2001, dtype=np.float32)])]
    got = np.asarray(jax.jit(REWRITES[name])(*xs)).astype(np.float64)
    with np.errstate(all="ignore"):
        want = function(*(x.astype(np.float64) for x in xs))
        ulps = _ulps(got, want)
    assert ulps.max() <= bound, (ulps.max(), xs[0][np.argmax(ulps)])
    numbers = ~np.isnan(want)
    assert np.array_equal(np.isnan(got), ~numbers)
    assert np.array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))
    for dtype in (jnp.bfloat16, jnp.float16):
        narrow = [jnp.asarray(x[np.abs(x) < 10], dtype)[:500] for x in xs]
        got = REWRITES[name](*narrow)
        with np.errstate(all="ignore"):  # (float64's, rounded: lax's float16 log1p is not)
            want = jnp.asarray(function(*(np.asarray(x, np.float64) for x in narrow)), dtype)
        assert got.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(want, np.float32),
            rtol=float(jnp.finfo(dtype).eps),  # (one unit in the last place)
            atol=float(jnp.finfo(dtype).smallest_normal),  # (XLA flushes what is below)
        )


@pytest.mark.parametrize(
    "name, function, bound",
    [("lgamma", scipy.special.gammaln, 27), ("digamma", scipy.special.digamma, 9)],
)
def test_lgamma_and_digamma_as_mosaic_gpu_computes_them_are_as_accurate_as_xlas(
    name, function, bound
):
    # Lanczos' approximation, as XLA's: within ``bound`` units of float32's ε of
    # max(1, |f(x)|) of float64's (XLA's own reach 25 and 9: not relative to the value near
    # its zeros); NaN and ±∞ (the poles, ±0) where float64's are (JAX 0.10's digamma has NaN
    # at ±0).
    from jax_sdpa._kernels.rewrites import REWRITES

    near_overflow = [4.05e36, 4.07e36]  # (lgamma's (y − ½) log t alone would overflow there)
    x = np.concatenate([_arguments(), np.linspace(-10, 10, 4001), near_overflow])
    x = x.astype(np.float32)
    got = np.asarray(jax.jit(REWRITES[name])(x))
    with np.errstate(all="ignore"):
        want = function(x.astype(np.float64))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    # (lgamma(−∞): lax's and this +∞, scipy's −∞)
    infinite = np.isinf(want) & (x > -np.inf)
    finite = np.abs(want) <= np.finfo(np.float32).max
    assert np.array_equal(got[infinite], want[infinite])
    error = np.abs(got[finite] - want[finite]) / np.maximum(1, np.abs(want[finite]))
    assert error.max() <= bound * np.finfo(np.float32).eps, x[finite][np.argmax(error)]


def test_a_choice_of_more_than_two_cases_as_mosaic_gpu_computes_it_is_laxs():
    # (select_n of three cases: JAX 0.12's ndtri's; Mosaic GPU lowers two)
    from jax_sdpa._kernels.rewrites import choice_of

    which = jnp.asarray([0, 1, 2, 3, 2, 1, 0], jnp.int32)
    cases = [jnp.arange(7.0) + 10 * k for k in range(4)]
    np.testing.assert_array_equal(choice_of(which, *cases), lax.select_n(which, *cases))


def test_nextafter_as_mosaic_gpu_computes_it_is_ieees_bit_for_bit():
    # (by its bits, as XLA's: ±0, subnormals, ±∞, NaN (as NaN) and the largest numbers of each
    # dtype, every pair). Against NumPy's: XLA on an x86 CPU flushes subnormals in its float
    # comparisons, lax.nextafter's too (−tiny toward +0 gives +0 there, −0 on a GPU and here).
    from jax_sdpa._kernels.rewrites import nextafter_of

    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        tiny, big = (float(getattr(jnp.finfo(dtype), e)) for e in ("smallest_subnormal", "max"))
        special = [0.0, -0.0, 1.0, -1.0, 3.5, -2.25, tiny, -tiny, big, -big, np.inf, -np.inf]
        with np.errstate(over="ignore"):  # (float32's large arguments: ±∞ in 16 bits)
            special = jnp.asarray([*special, np.nan, *_arguments()[::997]], dtype)
        x, y = (z.ravel() for z in jnp.meshgrid(special, special))
        got = np.asarray(jax.jit(nextafter_of)(x, y))
        x, y = np.asarray(x), np.asarray(y)
        with np.errstate(over="ignore", under="ignore"):  # (to ±∞, to subnormals: as they are)
            want = np.where(x == y, y, np.nextafter(x, y))  # (y at ±0, as C's; NumPy 2.4: x)
        bits = np.dtype(f"int{8 * got.itemsize}")
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(got.view(bits)[~nan], want.view(bits)[~nan])
    assert nextafter_of(jnp.float32(1), jnp.float32(2)) == np.nextafter(np.float32(1), 2)


def test_conversions_to_and_from_booleans_as_mosaic_gpu_computes_them_are_laxs():
    # (jnp.signbit's, jnp.copysign's, ndtri's: Mosaic GPU converts no vector of booleans)
    from jax_sdpa._kernels.rewrites import for_mosaic_gpu

    x = jnp.asarray([0.0, -0.0, 1.5, -2.0, np.nan, np.inf, 1e-45], jnp.float32)
    i = jnp.asarray([0, -3, 7, 0, 1, -1, 2], jnp.int32)
    b = jnp.asarray([True, False, True, False, False, True, True])
    conversions = (
        lambda x, i, b: x.astype(bool),
        lambda x, i, b: i.astype(bool),
        lambda x, i, b: b.astype(jnp.float32),
        lambda x, i, b: b.astype(jnp.int32),
        lambda x, i, b: b.astype(jnp.bfloat16),
        lambda x, i, b: ~b,
    )
    for conversion in conversions:
        closed = jax.make_jaxpr(conversion)(x, i, b)
        (eqn,) = closed.jaxpr.eqns
        inputs = dict(zip(closed.jaxpr.invars, (x, i, b), strict=True))
        got = for_mosaic_gpu(eqn)(*(inputs[v] for v in eqn.invars))
        want = conversion(x, i, b)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    own = (  # (Mosaic GPU's: an integer not, numbers' conversions, a scalar boolean's)
        lambda x, i, b: ~i,
        lambda x, i, b: x.astype(jnp.int32),
        lambda x, i, b: b[0].astype(jnp.int32),
        lambda x, i, b: ~b[0],
    )
    for same in own:
        eqn = jax.make_jaxpr(same)(x, i, b).jaxpr.eqns[-1]
        assert eqn.primitive.name in ("not", "convert_element_type")
        assert for_mosaic_gpu(eqn) is None


def test_a_polynomial_as_mosaic_gpu_computes_it_is_numpys():
    # (JAX 0.12's lax.polynomial, lowest degree first, in its erf derivative's e^(−x²))
    from jax_sdpa._kernels.rewrites import polynomial_of

    x, coefficients = np.linspace(-3, 3, 101, dtype=np.float32), [1.0, -0.5, 0.25, 2.0]
    got = polynomial_of(jnp.asarray(x), *(jnp.float32(c) for c in coefficients))
    want = np.polynomial.polynomial.polyval(x.astype(np.float64), coefficients)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
