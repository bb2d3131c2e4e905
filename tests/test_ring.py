"""Ring attention's tests need 8 devices, which XLA simulates on the CPU only if told before JAX
starts: they run in a process of their own, and this test fails if any of them fails."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_ring_attention_on_8_simulated_devices():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_SDPA_MULTIDEVICE="1"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(TESTS / "multidevice"),
        ],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
