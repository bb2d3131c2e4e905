"""Speed of attention on this machine: jax_sdpa (chunked, dense) vs jax.nn vs naive einsum.

    python benchmarks/bench_speed.py [--reps 7] [--sizes all|core|quick] [--out benchmarks/results]

Every configuration times all implementations interleaved in one loop, in a fresh random order
each round (the machine drifts: only ratios taken in the same loop are compared), for ``--reps``
rounds and at least 3 s, each timed call right after an untimed one of the same step (so that no
call pays for freeing another's memory). It reports medians and converts them to GFLOP/s from the
analytic count: 4·B·N·T·S·d for the forward, ×3.5 with the backward, ×½ when causal. An f32
GEMM of 2048² timed in the same loop is the yardstick for "% of GEMM". The "auto" column names
the implementation ``implementation=None`` compiles to (its program is compared with the
others'), and how its time compares with the faster of chunked and dense. A last table times the
chunked path causal and not, interleaved, for the speed-up that skipping blocks above the
diagonal gives.
"""

import argparse
import functools
import itertools
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa


def naive(query, key, value, *, is_causal):
    """The textbook einsum-softmax-einsum, materialising (B, N, T, S)."""
    scores = jnp.einsum("btnh,bsnh->bnts", query, key) / np.sqrt(query.shape[-1])
    if is_causal:
        t, s = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((t, s), bool)), scores, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), value)


def implementations(is_causal: bool) -> dict:
    sdpa = functools.partial(jax_sdpa.dot_product_attention, is_causal=is_causal)
    return {
        "chunked": functools.partial(sdpa, implementation="chunked"),
        "dense": functools.partial(sdpa, implementation="xla"),
        "jax.nn": functools.partial(
            jax.nn.dot_product_attention, is_causal=is_causal, implementation="xla"
        ),
        "naive": functools.partial(naive, is_causal=is_causal),
    }


def automatic_choice(is_causal: bool, args) -> str:
    """Which implementation ``implementation=None`` compiles to here: same program, same name."""
    sdpa = functools.partial(jax_sdpa.dot_product_attention, is_causal=is_causal)
    program = lambda **kw: str(jax.make_jaxpr(lambda *a: sdpa(*a, **kw))(*args))  # noqa: E731
    auto = program()
    return next(
        name
        for name, impl in (("chunked", "chunked"), ("dense", "xla"))
        if program(implementation=impl) == auto
    )


def compiled(fn, mode: str, args):
    """A jitted forward, or forward+backward (gradient of the output's sum w.r.t. q, k, v).

    Whatever else the call returns (its max scores) is an output of the program too, beside the
    gradients, as in a training step that records them: a result nobody reads, XLA does not
    compute.
    """
    if mode == "fwd":
        step = jax.jit(fn)
    else:

        def loss(q, k, v):
            out, *rest = jax.tree.leaves(fn(q, k, v))
            return out.sum(), rest

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return step, time.perf_counter() - start


MIN_SECONDS = 3.0


def interleaved(steps: dict, args, reps: int) -> dict:
    """Seconds per call of each step, each round in a fresh random order.

    ``reps`` rounds, or more while they take less than ``MIN_SECONDS`` in all: a millisecond call
    varies by a fifth from one call to the next here, and its median needs more samples.

    Each timed call follows an untimed call of the same step. XLA frees a call's buffers after
    its result is ready, and unmapping the dense paths' hundreds of MiB of scores runs into the
    next call: at T = 4096 it made a chunked forward that followed `jax.nn` 17 % slower (309
    against 265 ms). So each step pays for freeing its own memory, not another's.
    """
    order = np.random.default_rng(0)
    times = {name: [] for name in steps}
    start_all = time.perf_counter()
    for rounds in itertools.count():
        if rounds >= reps and time.perf_counter() - start_all >= MIN_SECONDS:
            return times
        for name in order.permutation(list(steps)):
            jax.block_until_ready(steps[name](*args))
            start = time.perf_counter()
            jax.block_until_ready(steps[name](*args))
            times[name].append(time.perf_counter() - start)


def inputs(batch, heads, seq, dim):
    rng = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(r, (batch, seq, heads, dim), jnp.float32) for r in rng]


def flops(batch, heads, seq, dim, is_causal, mode) -> float:
    """The analytic count: 4·B·N·T·S·d for the forward, ×3.5 with the backward, ×½ when causal."""
    return (
        4
        * batch
        * heads
        * seq
        * seq
        * dim
        * (3.5 if mode == "fwdbwd" else 1)
        * (0.5 if is_causal else 1)
    )


def measure(batch, heads, seq, dim, is_causal, mode, reps, gemm):
    args = inputs(batch, heads, seq, dim)
    steps, compile_s = {}, {}
    for name, fn in implementations(is_causal).items():
        steps[name], compile_s[name] = compiled(fn, mode, args)
    steps["gemm"] = lambda *_: gemm()
    times = interleaved(steps, args, reps)
    work = flops(batch, heads, seq, dim, is_causal, mode)
    gemm_gflops = 2 * 2048**3 / np.median(times["gemm"]) / 1e9
    rows = {}
    for name in compile_s:
        median = float(np.median(times[name]))
        rows[name] = {
            "ms": 1e3 * median,
            "gflops": work / median / 1e9,
            "pct_gemm": 100 * work / median / 1e9 / gemm_gflops,
            "compile_s": compile_s[name],
        }
    return rows, gemm_gflops


SIZES = {
    "quick": [(1, 8, 1024, 64)],
    "core": [(1, 8, t, 64) for t in (512, 1024, 2048, 4096)],
    "all": [(1, 8, t, 64) for t in (512, 1024, 2048, 4096)] + [(8, 8, 256, 64)],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--sizes", choices=SIZES, default="all")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    a = jax.random.normal(jax.random.key(1), (2048, 2048), jnp.float32)
    gemm = functools.partial(jax.jit(jnp.matmul), a, a)
    jax.block_until_ready(gemm())
    print(
        f"# {platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
    )
    print(
        "# median ms (analytic GFLOP/s, % of the same-loop f32 GEMM); speed-up = jax.nn time / chunked time"
    )
    results = []
    for mode in args.modes.split(","):
        print(f"\n## {'forward' if mode == 'fwd' else 'forward + backward'}\n")
        header = "| config | causal | chunked | dense | jax.nn | naive | chunked vs jax.nn | auto: picks, vs best | GEMM GF/s |"
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for batch, heads, seq, dim in SIZES[args.sizes]:
            for is_causal in (False, True):
                rows, gemm_gflops = measure(
                    batch, heads, seq, dim, is_causal, mode, args.reps, gemm
                )
                best = min(rows["chunked"]["ms"], rows["dense"]["ms"])
                auto = automatic_choice(is_causal, inputs(batch, heads, seq, dim))
                cells = [
                    f"{rows[n]['ms']:.1f} ({rows[n]['gflops']:.0f}, {rows[n]['pct_gemm']:.0f}%)"
                    for n in ("chunked", "dense", "jax.nn", "naive")
                ]
                print(
                    f"| B{batch} H{heads} T{seq} d{dim} | {'yes' if is_causal else 'no'} | "
                    + " | ".join(cells)
                    + f" | {rows['jax.nn']['ms'] / rows['chunked']['ms']:.2f}× | {auto}, {rows[auto]['ms'] / best:.2f} | {gemm_gflops:.0f} |",
                    flush=True,
                )
                results.append(
                    {
                        "mode": mode,
                        "batch": batch,
                        "heads": heads,
                        "seq": seq,
                        "dim": dim,
                        "causal": is_causal,
                        "gemm_gflops": gemm_gflops,
                        "auto": auto,
                        "rows": rows,
                    }
                )
    print("\n## causal speed-up of the chunked path (forward, interleaved)\n")
    print("| config | non-causal ms | causal ms | speed-up |")
    print("|---|---|---|---|")
    for batch, heads, seq, dim in SIZES[args.sizes]:
        sdpa = functools.partial(jax_sdpa.dot_product_attention, implementation="chunked")
        steps = {c: jax.jit(functools.partial(sdpa, is_causal=c)) for c in (False, True)}
        data = inputs(batch, heads, seq, dim)
        for step in steps.values():
            jax.block_until_ready(step(*data))
        times = {c: float(np.median(t)) for c, t in interleaved(steps, data, args.reps).items()}
        print(
            f"| B{batch} H{heads} T{seq} d{dim} | {1e3 * times[False]:.1f} | {1e3 * times[True]:.1f} | "
            f"{times[False] / times[True]:.2f}× |",
            flush=True,
        )
        results.append(
            {
                "mode": "causal_speedup",
                "batch": batch,
                "heads": heads,
                "seq": seq,
                "dim": dim,
                "seconds": times,
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speed.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
