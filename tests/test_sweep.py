"""The random sweep (``tests/sweep.py``) on every single-device implementation.

The ring's part runs on 8 simulated devices (``tests/multidevice/test_ring_sweep.py``). Case
counts come from the profile (``tests/profile.py``); under ``JAX_SDPA_X64=1`` every case has x64
on, otherwise each structure draws it.
"""

import pytest

from tests import sweep
from tests.profile import DRAWS, STRUCTURES, X64


@pytest.mark.parametrize("structure", range(STRUCTURES))
@pytest.mark.parametrize("implementation", ["xla", "chunked", "decode", "paged", "pallas"])
def test_sweep(implementation, structure):
    for draw in range(DRAWS):
        sweep.check_case(implementation, structure, 1000 * structure + draw, x64=X64 or None)
