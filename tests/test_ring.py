"""Ring attention's tests need 8 devices, which XLA simulates on the CPU only if told before JAX
starts: they run in a process of their own, and this test fails if any of them fails. (x64 on:
the ring's random sweep draws it at random, for some of its structures.)"""

import pytest

from tests.util import run_pytest

pytestmark = pytest.mark.slow  # end to end: -m "not slow" leaves it out


def test_ring_attention_on_8_simulated_devices():
    run_pytest("tests/multidevice", devices=8, env={"JAX_SDPA_X64": "0"})
