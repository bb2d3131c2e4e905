"""The inner loop's behaviour tests pass with ``jax_enable_x64`` on too, in a process of their own.

Every implementation, mask, mod, block mask, decode, paged cache, the kernel and the random
sweep, with x64 on: no index may turn int64, and float32 inputs must stay float32. (The ring's
tests run with x64 on in ``tests/test_ring.py``; the tests marked ``x64_off`` are about the
default, and those marked ``x64_sampled`` are cases of a matrix of which the pass runs others.
The behaviour tests' decode, paged and kernel rows are slow, left to CI's x64-off run: their
own files and the sweep's columns run here.)
"""

import pytest

from tests.profile import X64, X64_PASS_PROFILE
from tests.util import run_pytest

pytestmark = pytest.mark.slow  # end to end: -m "not slow" leaves it out


@pytest.mark.skipif(X64, reason="this run is the x64 run")
def test_the_behaviour_tests_pass_with_x64_on():
    env = {"JAX_SDPA_X64": "1", "JAX_SDPA_PROFILE": X64_PASS_PROFILE}
    run_pytest("tests", "-m", "not slow and not x64_off and not x64_sampled", env=env)
