import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng():
    """A NumPy generator with a fixed seed: inputs are reproducible, test by test."""
    return np.random.default_rng(0)
