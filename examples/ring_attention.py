"""One sequence over many devices with ring attention.

    python examples/ring_attention.py

On this CPU machine XLA simulates 8 devices (set before JAX starts). On a real cluster, drop
that line and call ``jax.distributed.initialize()`` on every host first: ``jax.devices()`` then
lists the devices of all hosts, the mesh spans them, and the same code runs unchanged.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_sdpa  # noqa: E402

devices = np.array(jax.devices())  # 8 here; every host's devices after jax.distributed
mesh = jax.sharding.Mesh(devices.reshape(2, 4), ("batch", "seq"))  # 2-way data × 4-way sequence

rng_q, rng_k, rng_v = jax.random.split(jax.random.key(0), 3)
batch, seq, heads, kv_heads, dim = 2, 4096, 8, 2, 64
query = jax.random.normal(rng_q, (batch, seq, heads, dim))
key = jax.random.normal(rng_k, (batch, seq, kv_heads, dim))
value = jax.random.normal(rng_v, (batch, seq, kv_heads, dim))

out = jax_sdpa.ring_dot_product_attention(
    query,
    key,
    value,
    mesh=mesh,
    seq_axis="seq",
    batch_axis="batch",
    is_causal=True,
    layout="striped",  # balances the causal work across the ring
)
print("output", out.shape, "sharded as", out.sharding.spec)
print("each device holds", out.addressable_shards[0].data.shape)

reference = jax_sdpa.dot_product_attention(query, key, value, is_causal=True)
print("max |ring − single device| =", float(abs(out - reference).max()))
