"""Input builders and version shims shared by the tests."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

# ``jax.hessian`` of a ring in ``shard_map``: JAX 0.6's check of varying axes fails inside its own
# transpose there (turned off, the ring's gradients come out wrong: the sweep), from JAX 0.7 not.
RING_SECOND_ORDER = jax.__version_info__ >= (0, 7)


def qkv(rng, b, t, s, n, k, h, hv=None, dtype=jnp.float32):
    """Unit-normal query (B,T,N,H), key (B,S,K,H), value (B,S,K,HV); B=None drops the batch."""
    lead = () if b is None else (b,)
    q = rng.normal(size=(*lead, t, n, h))
    key = rng.normal(size=(*lead, s, k, h))
    v = rng.normal(size=(*lead, s, k, hv or h))
    return tuple(jnp.asarray(x, dtype) for x in (q, key, v))


def equations(jaxpr):
    """A jaxpr's equations, and those of every jaxpr its equations hold (calls, loops' bodies,
    a cond's branches), in order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in jax.tree.leaves(eqn.params, is_leaf=lambda x: hasattr(x, "eqns")):
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from equations(inner)


def paged_pool(rng, batch, seq, page, heads, width, dtype=jnp.float32):
    """``(key_pages, value_pages, table)``: ``batch`` sequences of ``seq`` keys in pages.

    Shuffled pages of a pool one page larger, that spare page NaN (in no table).
    """
    per_sequence = seq // page
    count = batch * per_sequence + 1
    pools = [
        jnp.asarray(rng.normal(size=(count, page, heads, width)), dtype).at[-1].set(jnp.nan)
        for _ in "kv"
    ]
    table = rng.permutation(batch * per_sequence).reshape(batch, per_sequence)
    return (*pools, jnp.asarray(table, jnp.int32))


def broadcast_shape(full, pattern):
    """The trailing ``len(pattern)`` axes of ``full``, each kept (True) or set to 1 (False)."""
    tail = full[len(full) - len(pattern) :]
    return tuple(d if keep else 1 for d, keep in zip(tail, pattern, strict=True))


_NN_ATTENTION = jax.nn.dot_product_attention  # as imported, whatever a test patches later


def nn_attention(*args, **kwargs):
    """``jax.nn.dot_product_attention``, with standard promotion, not the tests' strict one.

    Its own code promotes implicitly: under x64, its int64 positions meet int32 lengths.
    """
    with jax.numpy_dtype_promotion("standard"):
        return _NN_ATTENTION(*args, **kwargs)


@contextlib.contextmanager
def enable_x64():
    """float64 inside the block (``jax.enable_x64`` where it exists, the config flag before)."""
    if hasattr(jax, "enable_x64"):
        with jax.enable_x64(True):
            yield
        return
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def run_pytest(*args: str, devices: int | None = None, env: dict | None = None) -> None:
    """Runs pytest on ``args`` in a process of its own; fails with its output if any test fails.

    ``devices``: how many CPU devices XLA simulates there (which it reads before JAX starts:
    the tests of ``tests/multidevice`` are collected only then).
    """
    env = dict(os.environ, **(env or {}))
    if devices is not None:
        flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
        env.update(XLA_FLAGS=flags, JAX_SDPA_MULTIDEVICE="1")
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *args]
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]


# The chip each platform's lowering asks for, which a CPU host cannot name: an abstract one
# stands in (TPU lowering asks on every JAX; Triton's from JAX 0.11).
ABSTRACT_DEVICES = {"tpu": ("TPU v5 lite", 1), "cuda": ("NVIDIA H100", None)}


def abstract_mesh(platform: str, sizes: tuple = (1,), names: tuple = ("x",)):
    """A mesh of ``platform``'s abstract chips, to lower over on a CPU: a shard_map's, or none's.

    None before JAX 0.7, which has no abstract chips (and lowers without).
    """
    from jax._src import mesh

    if not hasattr(mesh, "AbstractDevice"):
        return None
    AbstractDevice, AbstractMesh = mesh.AbstractDevice, mesh.AbstractMesh  # noqa: N806

    kind, cores = ABSTRACT_DEVICES[platform]
    device = AbstractDevice(kind, cores, "gpu" if platform == "cuda" else platform)
    auto = (jax.sharding.AxisType.Auto,) * len(sizes)  # (arrays made outside keep their own)
    return AbstractMesh(sizes, names, axis_types=auto, abstract_device=device)


def abstract_devices(mesh):
    """A context in which lowering finds ``mesh``'s abstract chips.

    JAX 0.7 and later ask for them; earlier JAX lowers for a GPU's default, sm_90, without.
    """
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh)
