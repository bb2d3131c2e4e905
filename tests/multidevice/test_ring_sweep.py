"""The random sweep (``tests/sweep.py``) on ring attention over meshes of 2 to 8 devices."""

import pytest

from tests import sweep
from tests.profile import DRAWS, STRUCTURES, X64


@pytest.mark.parametrize("structure", range(STRUCTURES))
def test_ring_sweep(structure):
    for draw in range(DRAWS):
        sweep.check_case("ring", structure, 1000 * structure + draw, x64=X64 or None)
