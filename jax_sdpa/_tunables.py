"""The implementations' tunables: ``implementation=Chunked(block_q=256)``, ``Pallas(...)``.

Each is a frozen configuration object, checked when made, that ``implementation=`` takes in place
of the implementation's name (``implementation="chunked"`` is ``Chunked()``). They live apart from
the implementations, so that the front end, the table and the ring (whose steps may run on the
kernel) name them without importing the code they configure.
"""

import dataclasses
from typing import Any

import jax
from jax.experimental.pallas import tpu as pltpu

from jax_sdpa import _checks
from jax_sdpa._jax_compat import GPU_SIMULATOR, MOSAIC_GPU_KERNEL

# The fastest tile measured on a 2-core CPU, causal or not, forward and backward (BENCHMARKS.md):
# smaller tiles pay more per-iteration overhead than they save in cache misses.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 512


def check_sizes(tunables, names: tuple[str, ...] | None = None) -> None:
    """The fields ``names`` of an implementation's tunables (all by default) are positive ints.

    Each is a size: a tile's side, a count of warps.
    """
    names = [f.name for f in dataclasses.fields(tunables)] if names is None else names
    for name in names:
        _checks.check_positive_int(f"{type(tunables).__name__}.{name}", getattr(tunables, name))


@dataclasses.dataclass(frozen=True)
class Chunked:
    """The chunked implementation and its tile: ``implementation=Chunked(block_q=256)``.

    Attributes:
        block_q: Queries per tile (at most the sequence's; a last partial tile is padded).
        block_kv: Keys per tile.

    Examples:
        >>> Chunked(block_kv=256)
        Chunked(block_q=512, block_kv=256)
    """

    block_q: int = DEFAULT_BLOCK_Q
    block_kv: int = DEFAULT_BLOCK_KV

    def __post_init__(self):
        check_sizes(self)


@dataclasses.dataclass(frozen=True)
class Decode:
    """The split-key decoding implementation and its chunk: ``implementation=Decode(block_kv=…)``.

    Attributes:
        block_kv: Keys per chunk; the chunks are attended independently and merged.
    """

    block_kv: int = DEFAULT_BLOCK_KV

    def __post_init__(self):
        check_sizes(self)


@dataclasses.dataclass(frozen=True)
class Paged:
    """:func:`~jax_sdpa.paged_attention`'s chunk: ``implementation=Paged(block_kv=…)``.

    Attributes:
        block_kv: Keys per chunk, rounded down to whole pages (at least one page).
        kernel: If given, the fused kernel attends, one program per sequence, key/value head
            and chunk of keys, of a plain or quantized cache, or a shared latent's that the
            Mosaic GPU kernel reads as it is (the XLA path reads any other). For pages of a
            power of two of at least 16 positions and heads 64, 128 or 256 wide, the Mosaic GPU
            kernel copies each block of keys from its pages and the others gather each chunk's;
            others gather each sequence's pages first. With a kernel the call has no
            forward-mode or second derivatives (whatever the cache).
    """

    block_kv: int = DEFAULT_BLOCK_KV
    kernel: "Pallas | None" = None

    def __post_init__(self):
        check_sizes(self, ("block_kv",))
        if not isinstance(self.kernel, (Pallas, type(None))):
            raise TypeError(f"`Paged.kernel` must be None or a Pallas(...); got {self.kernel!r}.")


@dataclasses.dataclass(frozen=True)
class Selected:
    """The selected-keys path's tunable: ``implementation=Selected(block_q=…)``.

    Attributes:
        block_q: Queries attended together (their gathered keys held at once).
    """

    block_q: int = 16

    def __post_init__(self):
        check_sizes(self)


# The smallest side of a tile and of a head: Triton's matrix product takes no less.
MIN_SIDE = 16
GPU_BACKENDS = (None, "triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class Pallas:
    """The fused kernel and its tunables: ``implementation=Pallas(block_q=128)``.

    The default tiles, 64 × 64, were the fastest of ten measured on an H200 (bfloat16, d = 128,
    causal, forward and backward; BENCHMARKS.md).

    Attributes:
        block_q: Queries per program, a power of two ≥ 16 (a shorter sequence takes the next
            power of two at or above its length).
        block_kv: Keys per step of a program's loop, a power of two ≥ 16.
        num_warps: Triton's warps per program (GPU).
        num_stages: Triton's software-pipelining stages (GPU).
        interpret: ``True`` runs the Pallas interpreter on any backend; a
            ``jax.experimental.pallas.tpu.InterpretParams`` the TPU simulator; a
            ``jax.experimental.pallas.mosaic_gpu.InterpretGPUParams`` the Mosaic GPU kernel on
            the GPU simulator.
        backend: The GPU kernel: ``"triton"``, ``"mosaic_gpu"`` (Hopper's warp-specialized
            kernel, JAX 0.11 or later; its tiles are its own), or None: Triton (the Mosaic
            GPU kernel is not yet the default anywhere; see the kernels guide).

    Examples:
        >>> Pallas(block_kv=32)
        Pallas(block_q=64, block_kv=32, num_warps=4, num_stages=2, interpret=False, backend=None)
    """

    block_q: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    interpret: Any = False
    backend: str | None = None

    def __post_init__(self):
        check_sizes(self, ("block_q", "block_kv", "num_warps", "num_stages"))
        for name, least in (("block_q", MIN_SIDE), ("block_kv", MIN_SIDE), ("num_warps", 1)):
            size = getattr(self, name)
            if size < least or size & (size - 1):
                raise ValueError(
                    f"`Pallas.{name}` must be a power of two ≥ {least} (as Triton takes it); "
                    f"got {size}."
                )
        if not isinstance(self.interpret, (bool, pltpu.InterpretParams, *GPU_SIMULATOR)):
            raise TypeError(
                "`Pallas.interpret` must be a bool, a pltpu.InterpretParams or a "
                f"plgpu.InterpretGPUParams; got {self.interpret!r}."
            )
        if self.backend not in GPU_BACKENDS:
            raise ValueError(
                f"`Pallas.backend` must be one of {GPU_BACKENDS}; got {self.backend!r}."
            )
        if self.backend == "mosaic_gpu" and not MOSAIC_GPU_KERNEL:
            raise ValueError(
                '`Pallas.backend="mosaic_gpu"` needs JAX 0.11 or later (Mosaic GPU\'s Warpgroup '
                f"semantics); this is JAX {jax.__version__}."
            )


@dataclasses.dataclass(frozen=True)
class Ring:
    """Ring attention's tile: ``ring_attention(..., implementation=Ring(block_q=256))``.

    Attributes:
        block_q: Queries per tile, at most: each run of a shard is cut into the largest tiles
            that divide it (shards are never padded; unused with ``kernel``).
        block_kv: Keys per tile, likewise.
        kernel: If given, each step's tiles are computed by the fused kernel, with its own
            tiles, each run padded to them (``ring_attention(..., implementation="pallas")`` or
            ``Pallas(...)`` gives it).
    """

    block_q: int = DEFAULT_BLOCK_Q
    block_kv: int = DEFAULT_BLOCK_KV
    kernel: Pallas | None = None

    def __post_init__(self):
        check_sizes(self, ("block_q", "block_kv"))
        if not isinstance(self.kernel, (Pallas, type(None))):
            raise TypeError(f"`Ring.kernel` must be None or a Pallas(...); got {self.kernel!r}.")
