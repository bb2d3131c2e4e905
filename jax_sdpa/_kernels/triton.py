"""The Triton backend, on NVIDIA and AMD GPUs: its programs run at once, adding atomically.

Pallas's Triton backend is deprecated from JAX 0.11 for Mosaic GPU (JAX warns as it lowers it);
it is this library's GPU kernel until that port exists.
"""

import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from jax_sdpa._jax_compat import DECOMPOSITIONS, triton_atomic_add
from jax_sdpa._kernels.backend import Backend
from jax_sdpa._kernels.rewrites import REWRITES, round_of
from jax_sdpa._kernels.values import value


def _params(tunables):
    return pltriton.CompilerParams(num_warps=tunables.num_warps, num_stages=tunables.num_stages)


def atomic_add(ref, index, value) -> None:
    """``ref[index] += value`` by atomic adds, as programs that run at once must add."""
    triton_atomic_add(ref, index, value)


def _rewritten(eqn, operands):
    """What Pallas's Triton lowers no primitive for (``erf``, ``erfc``: ``jax.nn.gelu``'s).

    And JAX 0.12's ``polynomial`` (in ``erf``'s derivative), which it lowers with ``fmuladd``,
    which it lowers not; and the Bessel functions, as JAX's own decompositions. Not float64's:
    the rewrites' polynomials are float32's (Mosaic GPU's
    :func:`~jax_sdpa._kernels.positions.tile_positions` rewrite the same).
    """
    if any(v.aval.dtype == jnp.float64 for v in eqn.invars):  # (float32's polynomials)
        return None
    return REWRITES[eqn.primitive.name](*map(value, operands))


def _rounded(eqn, operands):  # (exact, float64 too)
    return round_of(value(operands[0]), eqn.params["rounding_method"])


TRITON = Backend(
    _params,
    atomic_add=atomic_add,
    rules={
        **dict.fromkeys(("erf", "erfc", "polynomial", *DECOMPOSITIONS), (_rewritten,)),
        "round": (_rounded,),
    },
)
