"""The Mosaic backend, on TPUs: its programs run one after another on a core.

Mosaic loads contiguous windows only (no load at a vector of indices) and keeps a program's
blocks in VMEM; blocks end in two whole axes (or multiples of 8 and 128).
"""

from jax.experimental.pallas import tpu as pltpu

from jax_sdpa._kernels.backend import Backend

MOSAIC_TPU = Backend(lambda tunables: pltpu.CompilerParams(), heads_first=True)
