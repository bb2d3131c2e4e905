"""What a kernel backend is: how a ``pallas_call`` is compiled for it, and how its programs run.

The programs (:mod:`jax_sdpa._kernels.programs`) are the same on every backend; a backend says
only what its hardware needs: the compiler parameters, and whether its programs run at once
(a GPU's, which add into shared memory with atomic adds) or one after another (a TPU's, and
the interpreter's, where the first program zeroes what all of them add into).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from jax_sdpa._tunables import Pallas


@dataclasses.dataclass(frozen=True)
class Backend:
    """A Pallas backend: how a ``pallas_call`` is made for it, and how its programs run.

    ``compiler_params(tunables)`` and ``interpret`` as ``pallas_call`` takes them; whether its
    programs run at once (``concurrent``).
    """

    name: str
    compiler_params: Callable[[Pallas], Any]
    interpret: Any = False
    concurrent: bool = False
