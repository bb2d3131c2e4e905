"""What a kernel backend is: how a ``pallas_call`` is made for it, and how its programs add up.

The programs (:mod:`jax_sdpa._kernels.programs`) are the same on every backend; a backend says
only what its hardware needs: the compiler parameters, and how programs add into one output
(a GPU's run at once and add atomically; a TPU's, and the interpreter's, run one after another,
the first zeroing what all of them add into). A new backend is one more module beside
``triton``, ``mosaic_tpu`` and ``interpreter``, and a line of ``calls.PLATFORMS``.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jax_sdpa._tunables import Pallas


@dataclasses.dataclass(frozen=True)
class Backend:
    """A Pallas backend: how a ``pallas_call`` is made for it, and how its programs add up.

    ``compiler_params(tunables)`` and ``interpret`` as ``pallas_call`` takes them;
    ``atomic_add(ref, index, value)`` where its programs run at once (None where they run one
    after another); ``heads_first`` where a head of a ``(T, N, d)`` array is not a block it
    loads (Mosaic TPU's blocks end in two whole axes): its calls take and give such arrays as
    ``(N, T, d)``, transposed around the call. The others read and write them in place.
    ``rules``: its own rewrites of a program's body (:func:`jax_sdpa._kernels.reads.evaluate`).
    """

    compiler_params: Callable[[Pallas], Any]
    interpret: Any = False
    atomic_add: Callable | None = None
    heads_first: bool = False
    rules: Mapping | None = None

    @property
    def concurrent(self) -> bool:
        """Whether its programs run at once (and so add into memory atomically)."""
        return self.atomic_add is not None
