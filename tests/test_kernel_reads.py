"""Reading captured arrays inside a kernel (``jax_sdpa._kernel_reads``): the values are the
function's own.

Each case runs a function of some arrays twice: directly, and inside a Pallas kernel (in the
interpreter) through :func:`~jax_sdpa._kernel_reads.evaluate`, which leaves the arrays in
memory and rewrites how they are read (slices as loads at indices, point gathers as loads at
vectors of indices, their transposes as one-hot sums, a mapped while loop's predicate per
element, booleans reduced as integers). Out-of-bounds reads must come out as ``lax`` defines
them: clamped, or filled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from jax_sdpa._kernel_reads import evaluate

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
