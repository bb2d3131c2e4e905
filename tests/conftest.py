import os

import jax
import numpy as np
import pytest

# tests/multidevice needs 8 simulated devices, set up before JAX starts: tests/test_ring.py runs
# it in a subprocess with JAX_SDPA_MULTIDEVICE=1.
collect_ignore = [] if os.environ.get("JAX_SDPA_MULTIDEVICE") else ["multidevice"]

# JAX_SDPA_X64=1 runs the suite with float64 enabled, as many scientific users run JAX: every
# index must stay int32 and float32 inputs float32 (CI runs the behaviour tests both ways).
X64 = os.environ.get("JAX_SDPA_X64", "0") == "1"
jax.config.update("jax_enable_x64", X64)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng():
    """A NumPy generator with a fixed seed: inputs are reproducible, test by test."""
    return np.random.default_rng(0)
