"""Ring attention on simulated CPU devices: per-device memory against the ring size, and accuracy.

    python benchmarks/bench_ring.py [--seq 131072] [--out benchmarks/results]

The devices share this machine's cores, so times say nothing about speed; what the table shows
is memory. For each ring size P it compiles forward and forward+backward of causal ring
attention (one head, d = 64, float32) and reports XLA's per-device ahead-of-time figures: the
arguments each device holds and the temporaries it needs. Then it checks, on 8 devices, the
output and gradients against single-device ``dot_product_attention``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_sdpa  # noqa: E402

MIB = 2**20


def ring_on(shards: int, layout: str = "contiguous"):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:shards]), ("seq",))
    spec = P(None, "seq", None, None)
    local = functools.partial(
        jax_sdpa.ring_attention, axis_name="seq", is_causal=True, layout=layout
    )
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


def memory_row(shards: int, seq: int) -> dict:
    ring = ring_on(shards)
    shape = jax.ShapeDtypeStruct((1, seq, 1, 64), jnp.float32)
    forward = jax.jit(ring).lower(shape, shape, shape).compile().memory_analysis()
    grad = jax.grad(lambda *a: ring(*a).sum(), argnums=(0, 1, 2))
    both = jax.jit(grad).lower(shape, shape, shape).compile().memory_analysis()
    return {
        "shards": shards,
        "args_mib": forward.argument_size_in_bytes / MIB,
        "fwd_temp_mib": forward.temp_size_in_bytes / MIB,
        "fwdbwd_temp_mib": both.temp_size_in_bytes / MIB,
    }


def accuracy(seq: int, layout: str) -> dict:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, seq, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, seq, 2, 64)), jnp.float32) for _ in range(2))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("seq",))
    ring = functools.partial(
        jax_sdpa.ring_dot_product_attention,
        mesh=mesh,
        seq_axis="seq",
        is_causal=True,
        layout=layout,
    )
    dense = functools.partial(jax_sdpa.dot_product_attention, is_causal=True)
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    grads = [
        jax.grad(lambda *a, f=f: jnp.sum(f(*a) * d_out), argnums=(0, 1, 2))(q, k, v)
        for f in (ring, dense)
    ]
    rel = [float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(*grads, strict=True)]
    return {
        "layout": layout,
        "fwd_max_abs": float(jnp.abs(ring(q, k, v) - dense(q, k, v)).max()),
        "grad_max_rel": max(rel),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    print(f"# causal ring attention, B1 H1 d64 f32, T = {args.seq}; per-device MiB (XLA AOT)\n")
    print("| devices P | local T | arguments | forward temp | fwd+bwd temp | fwd+bwd temp × P |")
    print("|---|---|---|---|---|---|")
    rows = []
    for shards in (1, 2, 4, 8):
        row = memory_row(shards, args.seq)
        rows.append(row)
        print(
            f"| {shards} | {args.seq // shards} | {row['args_mib']:.0f} | {row['fwd_temp_mib']:.1f} | "
            f"{row['fwdbwd_temp_mib']:.1f} | {row['fwdbwd_temp_mib'] * shards:.0f} |",
            flush=True,
        )
    print("\n# 8 devices vs single-device dot_product_attention: B2 T2048 N4 K2 d64, causal, f32\n")
    checks = [accuracy(2048, layout) for layout in ("contiguous", "striped")]
    for c in checks:
        print(
            f"{c['layout']:10s}: forward max |Δ| = {c['fwd_max_abs']:.1e}, gradients max relative error = {c['grad_max_rel']:.1e}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ring.json").write_text(json.dumps({"memory": rows, "accuracy": checks}, indent=1))


if __name__ == "__main__":
    main()
