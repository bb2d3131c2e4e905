"""One process of a 2-process ring-attention job (started by tests/test_multihost.py).

Every process builds the same full inputs, hands JAX only its own block of them
(``jax.make_array_from_process_local_data``), runs the ring over the 8 devices of both processes
and gathers the result; it also runs single-device :func:`jax_sdpa.dot_product_attention` on
the full inputs, the oracle. Each check's numbers (errors, collectives in the compiled program,
error messages) go to ``--out``/process-<i>.json; the driver asserts on them.
"""

import functools
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_sdpa as js

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from multihost_ring import cluster_arguments, join  # noqa: E402

SEQ = P(None, "seq", None, None)


def meshes():
    """``seq8``: the sequence over all 8 devices; ``batch2xseq4``: each ring of 4 spans both
    processes (2 devices of each), the batch over the two rings."""
    devices = np.array(jax.devices())  # process 0's four, then process 1's
    by_process = devices.reshape(jax.process_count(), 2, -1)
    return {
        "seq8": jax.sharding.Mesh(devices, ("seq",)),
        "batch2xseq4": jax.sharding.Mesh(
            by_process.transpose(1, 0, 2).reshape(2, -1), ("batch", "seq")
        ),
    }


def spread(x, mesh, spec):
    """``x`` as one global array: this process passes only the block its devices hold."""
    sharding = NamedSharding(mesh, spec)
    held = list(sharding.addressable_devices_indices_map(x.shape).values())
    block = tuple(
        slice(min(i[d].indices(n)[0] for i in held), max(i[d].indices(n)[1] for i in held))
        for d, n in enumerate(x.shape)
    )
    return jax.make_array_from_process_local_data(sharding, x[block], x.shape)


def gather(tree):
    """Every process gets the whole of each global array, as NumPy."""
    return multihost_utils.process_allgather(tree, tiled=True)


def inputs(seed, b=2, t=64, n=4, k=2, h=8):
    gen = np.random.default_rng(seed)
    return (
        gen.normal(size=(b, t, n, h)).astype(np.float32),
        gen.normal(size=(b, t, k, h)).astype(np.float32),
        gen.normal(size=(b, t, k, h)).astype(np.float32),
    )


def rel(x, ref):
    return float(np.abs(x - ref).max() / np.abs(ref).max())


def compare(ring, dense, arrays, placed, *, order=None):
    """``ring`` on the global arrays ``placed`` against ``dense`` on ``arrays``, this process's.

    Forward and the gradients of every argument in one compiled program (its collectives are
    counted). ``order``: the sequence positions in the order ``ring`` holds them (striped), for
    arguments that are all ``(B, T, ·, ·)`` sequences; None: as they are.
    """
    arrays = [jnp.asarray(x) for x in arrays]
    d_out = np.random.default_rng(1).normal(size=jax.eval_shape(dense, *arrays).shape)
    d_out = d_out.astype(np.float32)

    def forward_and_grads(f, d_out):
        def run(*args):
            out, pullback = jax.vjp(f, *args)
            return out, pullback(d_out)

        return jax.jit(run)

    compiled = forward_and_grads(ring, d_out if order is None else d_out[:, order])
    compiled = compiled.lower(*placed).compile()
    out, grads = gather(compiled(*placed))
    if order is not None:
        back = np.argsort(order)
        out, grads = out[:, back], [g[:, back] for g in grads]
    expected, expected_grads = forward_and_grads(dense, d_out)(*arrays)
    text = compiled.as_text()
    return {
        "forward": float(np.abs(out - expected).max()),
        "grads": [rel(g, e) for g, e in zip(grads, expected_grads, strict=True)],
        "hlo": {op: text.count(op) for op in ("collective-permute", "all-gather", "all-reduce")},
    }


def ring_dpa(mesh_name, layout, is_causal, lengths):
    """``ring_dot_product_attention`` on global arrays: GQA (4 query, 2 key/value heads)."""
    mesh = meshes()[mesh_name]
    batch = {"batch_axis": "batch"} if "batch" in mesh.axis_names else {}
    lengths = {k: np.array(v, np.int32) for k, v in lengths.items()}
    options = dict(is_causal=is_causal, **lengths)
    ring = functools.partial(
        js.ring_dot_product_attention,
        mesh=mesh,
        seq_axis="seq",
        layout=layout,
        implementation=js.Ring(block_q=4, block_kv=4),
        **batch,
        **options,
    )
    dense = functools.partial(js.dot_product_attention, **options)
    arrays = inputs(0)
    spec = P(batch.get("batch_axis"), "seq", None, None)
    return compare(ring, dense, arrays, [spread(x, mesh, spec) for x in arrays])


def ring_in_shard_map(layout, is_causal):
    """``ring_attention`` in the user's ``shard_map``; each process holds its own (striped) rows."""
    mesh = meshes()["seq8"]
    ring = jax.shard_map(
        functools.partial(js.ring_attention, axis_name="seq", layout=layout, is_causal=is_causal),
        mesh=mesh,
        in_specs=(SEQ,) * 3,
        out_specs=SEQ,
    )
    arrays = inputs(4)
    order = np.arange(64)
    if layout == "striped":
        order = np.asarray(js.to_striped(order, 8, axis=0))
    placed = [spread(x[:, order], mesh, SEQ) for x in arrays]
    dense = functools.partial(js.dot_product_attention, is_causal=is_causal)
    return compare(ring, dense, arrays, placed, order=order)


def mods(layout):
    """ALiBi with learned slopes and a document mask, in global positions; sinks."""
    mesh = meshes()["seq8"]
    gen = np.random.default_rng(7)
    doc = np.sort(gen.integers(0, 4, size=(2, 64)), axis=1).astype(np.int32)
    slopes = gen.uniform(0.1, 1.0, size=4).astype(np.float32)
    sinks = gen.normal(size=4).astype(np.float32)

    def options(slopes, sinks):
        return dict(
            score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(s.dtype),
            mask_mod=lambda b, h, i, j: (
                (jnp.asarray(doc)[b, i] == jnp.asarray(doc)[b, j]) & (j <= i)
            ),
            sinks=sinks,
        )

    def ring(q, k, v, slopes, sinks):
        return js.ring_dot_product_attention(
            q, k, v, mesh=mesh, seq_axis="seq", layout=layout, **options(slopes, sinks)
        )

    def dense(q, k, v, slopes, sinks):
        return js.dot_product_attention(q, k, v, **options(slopes, sinks))

    arrays = (*inputs(6), slopes, sinks)
    specs = (SEQ,) * 3 + (P(),) * 2
    return compare(
        ring, dense, arrays, [spread(x, mesh, s) for x, s in zip(arrays, specs, strict=True)]
    )


def training(steps=4):
    """A tiny causal attention model trained with Optax, the sequence over both processes and
    the batch over devices, against the same steps on this process alone."""
    mesh = meshes()["batch2xseq4"]
    gen = np.random.default_rng(11)
    b, t, d, n, k, h = 2, 32, 16, 4, 2, 8
    x, y = (gen.normal(size=(b, t, d)).astype(np.float32) for _ in range(2))
    shapes = {"wq": (d, n * h), "wk": (d, k * h), "wv": (d, k * h), "wo": (n * h, d)}
    params = {
        name: (gen.normal(size=s) / np.sqrt(s[0])).astype(np.float32) for name, s in shapes.items()
    }
    optimizer = optax.sgd(0.1, momentum=0.9)

    def train(attention, params, x, y):
        def loss(params):
            heads = lambda w, m: (x @ w).reshape(b, t, m, h)  # noqa: E731
            out = attention(heads(params["wq"], n), heads(params["wk"], k), heads(params["wv"], k))
            return jnp.mean((out.reshape(b, t, n * h) @ params["wo"] - y) ** 2)

        def step(carry, _):
            params, state = carry
            value, grads = jax.value_and_grad(loss)(params)
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), value

        (params, _), losses = jax.lax.scan(step, (params, optimizer.init(params)), None, steps)
        return params, losses

    ring = functools.partial(
        js.ring_dot_product_attention,
        mesh=mesh,
        seq_axis="seq",
        batch_axis="batch",
        is_causal=True,
    )
    rows = P("batch", "seq", None)
    placed = [
        jax.tree.map(lambda w: spread(w, mesh, P()), params),
        spread(x, mesh, rows),
        spread(y, mesh, rows),
    ]
    got_params, got_losses = gather(jax.jit(functools.partial(train, ring))(*placed))
    dense = functools.partial(js.dot_product_attention, is_causal=True)
    want_params, want_losses = jax.jit(functools.partial(train, dense))(params, x, y)
    return {
        "losses": [float(v) for v in got_losses],
        "loss_rel": rel(got_losses, np.asarray(want_losses)),
        "params_rel": max(rel(got_params[w], np.asarray(want_params[w])) for w in shapes),
        "params_moved": min(rel(got_params[w], params[w]) for w in shapes),
    }


def mismatched_mesh():
    """Each bad call's exception, type and message, on this process."""
    mesh = meshes()["seq8"]
    q, k, v = inputs(8, t=72)
    bad = {
        "query length": lambda: js.ring_dot_product_attention(
            q[:, :60], k[:, :64], v[:, :64], mesh=mesh, seq_axis="seq"
        ),
        "key length": lambda: js.ring_dot_product_attention(
            q[:, :64], k[:, :60], v[:, :60], mesh=mesh, seq_axis="seq"
        ),
        "striped length": lambda: js.ring_dot_product_attention(
            q, k, v, mesh=mesh, seq_axis="seq", layout="striped"
        ),
        "seq_axis": lambda: js.ring_dot_product_attention(q, k, v, mesh=mesh, seq_axis="sequence"),
        "axis_name": lambda: jax.shard_map(
            functools.partial(js.ring_attention, axis_name="sequence"),
            mesh=mesh,
            in_specs=(SEQ,) * 3,
            out_specs=SEQ,
        )(*(spread(x[:, :64], mesh, SEQ) for x in (q, k, v))),
        "outside shard_map": lambda: js.ring_attention(q, k, v, axis_name="seq"),
    }
    raised = {}
    for case, call in bad.items():
        try:
            call()
            raised[case] = ["nothing", ""]
        except Exception as error:  # noqa: BLE001 - the type is what the driver checks
            raised[case] = [type(error).__name__, str(error)]
    return raised


CHECKS = {
    # One call of each kind across the processes (tests/multidevice checks every layout, mask
    # and mod on 8 devices of one process). The striped half-swap (`_restripe`) moves rows
    # between processes here: causal, the batch over the two rings, as the scaling-out guide's
    # example call.
    "ring_dot_product_attention striped causal, batch over devices, key lengths": lambda: ring_dpa(
        "batch2xseq4", "striped", True, {"key_value_seq_lengths": [40, 64]}
    ),
    "ring_attention in shard_map, contiguous": lambda: ring_in_shard_map("contiguous", False),
    "score_mod, mask_mod and sinks": lambda: mods("contiguous"),
    "training": training,
    "mismatched mesh": mismatched_mesh,
}


def main():
    parser = cluster_arguments()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    join(args)
    results, path = {}, args.out / f"process-{jax.process_index()}.json"
    for name, check in CHECKS.items():
        start = time.perf_counter()
        try:
            results[name] = check()
            results[name]["seconds"] = time.perf_counter() - start
        except Exception:  # noqa: BLE001 - reported to the driver, which fails that check
            results[name] = {"error": traceback.format_exc()}
        path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
