"""Ring attention's tests need 8 devices, which XLA simulates on the CPU only if told before JAX
starts: they run in a process of their own, with x64 off and (in the x64 pass's profile) on,
and this test fails if any of them fails. With x64 on, the cases marked ``x64_sampled`` are left
out: each is one of a matrix whose other cases run (the memory test is about sizes)."""

import pytest

from tests.profile import X64_PASS_PROFILE
from tests.util import run_pytest

pytestmark = pytest.mark.slow  # end to end: -m "not slow" leaves it out


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
def test_ring_attention_on_8_simulated_devices(x64):
    if x64:
        env = {"JAX_SDPA_X64": "1", "JAX_SDPA_PROFILE": X64_PASS_PROFILE}
        run_pytest("tests/multidevice", "-m", "not x64_sampled", devices=8, env=env)
    else:
        run_pytest("tests/multidevice", devices=8, env={"JAX_SDPA_X64": "0"})
