"""The Pallas interpreter, on any backend: exact and slow, the tests' oracle.

``Pallas(interpret=True)`` runs it everywhere (and a program lowered for a CPU runs it);
``Pallas(interpret=pltpu.InterpretParams())`` runs the TPU simulator, which raises on the
out-of-bounds and uninitialised reads the interpreter clamps. Its programs run one after
another.
"""

from jax.experimental.pallas import tpu as pltpu

from jax_sdpa._kernels.backend import Backend

INTERPRETER = Backend(lambda tunables: None, interpret=True)


def tpu_simulator(params: pltpu.InterpretParams) -> Backend:
    """The TPU simulator with ``params``."""
    return Backend(lambda tunables: pltpu.CompilerParams(), interpret=params, heads_first=True)
